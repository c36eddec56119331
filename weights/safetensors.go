package weights

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/expertd/expertd/moe"
)

// A .safetensors file is an 8-byte little-endian header length, a JSON
// header naming each tensor's dtype, shape and [begin, end) byte offsets
// into the data that follows, then the data. Only what expert weights use
// is decoded: F8_E4M3 weights and F32, BF16 or F16 scales.

// maxSafetensorsHeader bounds the JSON header. Real checkpoints' headers
// are far smaller (a DeepSeek-V3 shard of ~1,000 tensors has ~150 KB); the
// bound caps what one load may make the daemon hold while it parses:
// the header's bytes once, plus the entries decoded from them (parse
// keeps no second copy, and of __metadata__ only the one key it uses).
const maxSafetensorsHeader = 16 << 20

// stTensor is one header entry.
type stTensor struct {
	Dtype       string   `json:"dtype"`
	Shape       []int64  `json:"shape"`
	DataOffsets [2]int64 `json:"data_offsets"`
}

// stFile is a parsed safetensors file.
type stFile struct {
	r io.ReaderAt
	// base is the file offset of the data section.
	base    int64
	tensors map[string]stTensor
	meta    stMeta
}

// stMeta is what the loader reads of __metadata__ (a string-to-string
// map); decoding into a struct skips the other keys without copying them.
type stMeta struct {
	NumExpertsPerTok string `json:"num_experts_per_tok"`
}

// stEntry is one header value, kept as the slice of the header it spans:
// json.Unmarshal hands an Unmarshaler its bytes without a copy, where a
// json.RawMessage would copy each.
type stEntry []byte

func (e *stEntry) UnmarshalJSON(b []byte) error {
	*e = b
	return nil
}

// parseSafetensors reads and checks the header of a file of the given size.
// Offsets are checked against the data section for every tensor, so later
// reads never run past the file.
func parseSafetensors(r io.ReaderAt, size int64) (*stFile, error) {
	var lenb [8]byte
	if _, err := r.ReadAt(lenb[:], 0); err != nil {
		return nil, fmt.Errorf("reading header length: %w", err)
	}
	n := binary.LittleEndian.Uint64(lenb[:])
	if n > maxSafetensorsHeader || int64(n) > size-8 {
		return nil, fmt.Errorf("header length %d exceeds the file (%d bytes) or the %d MiB header limit", n, size, maxSafetensorsHeader>>20)
	}
	hdr := make([]byte, n)
	if _, err := r.ReadAt(hdr, 8); err != nil {
		return nil, fmt.Errorf("reading header: %w", err)
	}
	var raw map[string]stEntry
	if err := json.Unmarshal(hdr, &raw); err != nil {
		return nil, fmt.Errorf("header is not a JSON object: %w", err)
	}
	f := &stFile{r: r, base: 8 + int64(n), tensors: make(map[string]stTensor, len(raw))}
	dataLen := size - f.base
	for name, v := range raw {
		if name == "__metadata__" {
			if err := json.Unmarshal(v, &f.meta); err != nil {
				return nil, fmt.Errorf("__metadata__: %w", err)
			}
			continue
		}
		var t stTensor
		if err := json.Unmarshal(v, &t); err != nil {
			return nil, fmt.Errorf("tensor %s: %w", quote(name), err)
		}
		if b, e := t.DataOffsets[0], t.DataOffsets[1]; b < 0 || e < b || e > dataLen {
			return nil, fmt.Errorf("tensor %s: data_offsets [%d, %d) outside the %d data bytes", quote(name), b, e, dataLen)
		}
		f.tensors[name] = t
	}
	return f, nil
}

// stItemSize is the element size of the dtypes expert weights use.
var stItemSize = map[string]int64{"F8_E4M3": 1, "F32": 4, "BF16": 2, "F16": 2}

// check returns the named tensor after checking its dtype is one of
// dtypes and its byte length matches its shape.
func (f *stFile) check(name string, dtypes ...string) (stTensor, int64, error) {
	t, ok := f.tensors[name]
	if !ok {
		return t, 0, fmt.Errorf("no tensor named %s", quote(name))
	}
	if !slices.Contains(dtypes, t.Dtype) {
		return t, 0, fmt.Errorf("tensor %s has dtype %s, want one of %v", quote(name), quote(t.Dtype), dtypes)
	}
	n := int64(1)
	for _, d := range t.Shape {
		if d < 0 || (d != 0 && n > moe.MaxElements/d) {
			return t, 0, fmt.Errorf("tensor %s: bad shape %v", quote(name), t.Shape)
		}
		n *= d
	}
	size := n * stItemSize[t.Dtype]
	if t.DataOffsets[1]-t.DataOffsets[0] != size {
		return t, 0, fmt.Errorf("tensor %s: shape %v %s needs %d bytes, data_offsets span %d", quote(name), t.Shape, t.Dtype, size, t.DataOffsets[1]-t.DataOffsets[0])
	}
	return t, size, nil
}

// read returns the named tensor's bytes (see check).
func (f *stFile) read(name string, dtypes ...string) (stTensor, []byte, error) {
	t, size, err := f.check(name, dtypes...)
	if err != nil {
		return t, nil, err
	}
	b := make([]byte, size)
	if _, err := f.r.ReadAt(b, f.base+t.DataOffsets[0]); err != nil {
		return t, nil, fmt.Errorf("tensor %s: %w", quote(name), err)
	}
	return t, b, nil
}

// readInto reads the named tensor of dtype dt into dst, which must be its
// exact size: weights go straight into the set's buffer or a staging one.
func (f *stFile) readInto(name, dt string, dst []byte) error {
	t, size, err := f.check(name, dt)
	if err != nil {
		return err
	}
	if size != int64(len(dst)) {
		return fmt.Errorf("tensor %s holds %d bytes, want %d", quote(name), size, len(dst))
	}
	if _, err := f.r.ReadAt(dst, f.base+t.DataOffsets[0]); err != nil {
		return fmt.Errorf("tensor %s: %w", quote(name), err)
	}
	return nil
}

// floats reads a scale tensor as float32 values, refusing one of more
// than most values before reading it: the header alone says how large a
// tensor is, and a scale never needs more values than the weight it
// scales.
func (f *stFile) floats(name string, most int64) (stTensor, []float32, error) {
	dtypes := []string{"F32", "BF16", "F16"}
	t, size, err := f.check(name, dtypes...)
	if err != nil {
		return t, nil, err
	}
	if n := size / stItemSize[t.Dtype]; n > most {
		return t, nil, fmt.Errorf("tensor %s has %d values, want at most %d", quote(name), n, most)
	}
	t, b, err := f.read(name, dtypes...)
	if err != nil {
		return t, nil, err
	}
	v := make([]float32, len(b)/int(stItemSize[t.Dtype]))
	if dt, half := halfDtypes[t.Dtype]; half {
		decodeHalf(v, b, dt)
		return t, v, nil
	}
	for i := range v {
		v[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return t, v, nil
}

// maxPathBytes bounds safetensors.path and the naming templates: PATH_MAX.
const maxPathBytes = 4096

// Dir is the configured weights directory ("" for none), the one place a
// load opens files from.
type Dir string

// open opens rel inside the weights directory. Paths
// with "..", absolute paths and symlinks that resolve outside the directory
// are refused; os.Root then opens it without following anything out of
// the root, which also closes the race between the check and the open.
// Anything but a regular file is refused before it is read: the open is
// non-blocking, so a FIFO (or a device) cannot stall the call, and fstat
// on the open descriptor decides. Messages name rel, never the directory.
func (d Dir) open(rel string) (*os.File, error) {
	return d.openPath(rel, false)
}

// openPath is open that also takes a directory when dirOK (a checkpoint
// directory); what it refuses is the same.
func (d Dir) openPath(rel string, dirOK bool) (*os.File, error) {
	const field = "safetensors.path"
	if d == "" {
		return nil, errorf(NoDir, field, "this server has no weights directory configured")
	}
	if err := checkLen(field, rel, maxPathBytes); err != nil {
		return nil, err
	}
	if rel == "" || filepath.IsAbs(rel) || strings.HasPrefix(rel, "/") {
		return nil, invalidf(field, "%s: want a path relative to the weights directory", quote(rel))
	}
	for _, el := range strings.Split(filepath.ToSlash(rel), "/") {
		if el == ".." {
			return nil, invalidf(field, "%s: may not contain \"..\"", quote(rel))
		}
	}
	root, err := filepath.EvalSymlinks(string(d))
	if err != nil {
		return nil, fmt.Errorf("weights directory: %w", err)
	}
	full, err := filepath.EvalSymlinks(filepath.Join(root, filepath.Clean(rel)))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, errorf(NotFound, field, "%s: no such file in the weights directory", quote(rel))
	}
	if err != nil {
		return nil, invalidf(field, "%s: %v", quote(rel), pathless(err))
	}
	inside, err := filepath.Rel(root, full)
	if err != nil || inside == ".." || strings.HasPrefix(inside, ".."+string(filepath.Separator)) {
		return nil, invalidf(field, "%s resolves outside the weights directory", quote(rel))
	}
	dir, err := os.OpenRoot(root)
	if err != nil {
		return nil, fmt.Errorf("weights directory: %w", err)
	}
	defer dir.Close()
	f, err := dir.OpenFile(inside, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, invalidf(field, "%s: %v", quote(rel), pathless(err))
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, invalidf(field, "%s: %v", quote(rel), pathless(err))
	}
	if !st.Mode().IsRegular() && !(dirOK && st.IsDir()) {
		f.Close()
		return nil, invalidf(field, "%s is not a regular file (%v); want a .safetensors file or a checkpoint directory", quote(rel), st.Mode().Type())
	}
	return f, nil
}

// pathless is err without the path an *fs.PathError carries, which is
// absolute here: messages name the caller's relative path instead.
func pathless(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// projection names one weight matrix of an expert and its scales.
type projection struct {
	weight string
	// scales are candidate weight-scale names, first found wins; none found
	// is an error unless unitScale.
	scales    []string
	unitScale bool
	// input is the static input-scale name, "" for none.
	input string
}

// stLayout maps a preset to per-expert names: w13 is the stack of its
// projections (gate then up for gated presets).
type stLayout struct {
	act moe.Activation
	w13 []projection
	w2  projection
	// bias13 and bias2 name the expert's GEMM biases, "" for none.
	bias13, bias2 string
}

func expand(tmpl string, layer, e int) string {
	return strings.NewReplacer("{L}", strconv.Itoa(layer), "{e}", strconv.Itoa(e)).Replace(tmpl)
}

// presetLayout returns the names of expert e of the source's layer.
func presetLayout(src *Source, e int) (stLayout, error) {
	if l, ok, err := checkpointLayout(src, e); ok {
		return l, err
	}
	layer := int(src.Layer)
	proj := stdProjection
	switch src.Preset {
	case NemotronH:
		p := expand("backbone.layers.{L}.mixer.experts.{e}.", layer, e)
		return stLayout{act: moe.Relu2, w13: []projection{proj(p + "up_proj")}, w2: proj(p + "down_proj")}, nil
	case Qwen3MoE:
		p := expand("model.layers.{L}.mlp.experts.{e}.", layer, e)
		return stLayout{act: moe.SiluGated, w13: []projection{proj(p + "gate_proj"), proj(p + "up_proj")}, w2: proj(p + "down_proj")}, nil
	case Custom:
		if src.Activation == 0 {
			return stLayout{}, invalidf("safetensors.activation", "is required with NAMING_PRESET_CUSTOM")
		}
		if src.W13Template == "" || src.W2Template == "" {
			return stLayout{}, invalidf("safetensors.w13_template", "w13_template and w2_template are required with NAMING_PRESET_CUSTOM")
		}
		custom := func(w, sc string) projection {
			p := projection{weight: expand(w, layer, e), unitScale: sc == ""}
			if sc != "" {
				p.scales = []string{expand(sc, layer, e)}
			}
			return p
		}
		return stLayout{
			act: src.Activation,
			w13: []projection{custom(src.W13Template, src.W13ScaleTemplate)},
			w2:  custom(src.W2Template, src.W2ScaleTemplate),
		}, nil
	}
	return stLayout{}, invalidf("safetensors.preset", "%v: want NEMOTRON_H, QWEN3_MOE, DEEPSEEK_V3, MIXTRAL, GPT_OSS, AUTO or CUSTOM", src.Preset)
}

// Load reads the layer src names from a file or a checkpoint directory in
// the weights directory, reserving its bytes in l.Budget before it reads
// the weights. A non-nil subset loads only the experts it picks; nil loads
// every expert of the layer (or the first src.NumExperts). Errors of the
// request's making are *Error, or *moe.FieldError from the set's layout
// rules; the budget's own errors pass through.
func (l *Loader) Load(ctx context.Context, src *Source, subset ExpertSubset) (*Set, error) {
	for _, t := range [][2]string{{"safetensors.w13_template", src.W13Template}, {"safetensors.w2_template", src.W2Template},
		{"safetensors.w13_scale_template", src.W13ScaleTemplate}, {"safetensors.w2_scale_template", src.W2ScaleTemplate}} {
		if err := checkLen(t[0], t[1], maxPathBytes); err != nil {
			return nil, err
		}
	}
	fh, err := l.Dir.openPath(src.Path, true)
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	st, err := fh.Stat()
	if err != nil {
		return nil, fmt.Errorf("stat weights path: %w", err)
	}
	if st.IsDir() {
		return l.loadCheckpoint(ctx, src, subset)
	}
	if _, err := presetLayout(src, 0); err != nil {
		return nil, err
	}
	f, err := parseSafetensors(fh, st.Size())
	if err != nil {
		return nil, invalidf("safetensors.path", "%s: %v", quote(src.Path), err)
	}
	if f, err = gptossView(f, src); err != nil {
		return nil, err
	}
	if src.NumExperts == 0 && subset == nil {
		if src, err = l.wholeLayer(f, src); err != nil {
			return nil, err
		}
	}
	hint, _ := strconv.Atoi(f.meta.NumExpertsPerTok)
	return l.read(ctx, f, src, subset, nil, hint)
}
