package weights

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path"
	"slices"
	"strings"
	"time"

	"github.com/expertd/expertd/internal/capfile"
	"github.com/expertd/expertd/internal/clip"
	"github.com/expertd/expertd/moe"
)

// A checkpoint directory is what Hugging Face writes: config.json, and
// either one model.safetensors or shards listed by
// model.safetensors.index.json ({"weight_map": {tensor: shard file}}). A
// layer's experts are read from the shards that hold them, each tensor by
// itself; the other shards are never opened.

const (
	checkpointIndex  = "model.safetensors.index.json"
	checkpointSingle = "model.safetensors"
	checkpointConfig = "config.json"
	// maxJSONFile bounds config.json and the index: real ones are a few
	// hundred KB (DeepSeek-V3's index lists ~92k tensors in ~9 MB).
	maxJSONFile = 64 << 20
	// maxShards bounds how many shards one layer may span.
	maxShards = 4096
)

// readJSON reads a JSON file of the checkpoint directory, at most
// maxJSONFile bytes; a missing file is (nil, nil).
func (l *Loader) readJSON(rel string) ([]byte, error) {
	f, err := l.Dir.open(rel)
	var we *Error
	if errors.As(err, &we) && we.Kind == NotFound {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := capfile.ReadOpened(f, maxJSONFile)
	if err != nil {
		return nil, invalidf("safetensors.path", "%s: %v", quote(rel), err)
	}
	return b, nil
}

// readConfig reads dir's config.json; found is false without one.
func (l *Loader) readConfig(dir string) (c moeConfig, found bool, err error) {
	rel := path.Join(dir, checkpointConfig)
	b, err := l.readJSON(rel)
	if b == nil || err != nil {
		return c, false, err
	}
	if err := decodeConfig(b, &c); err != nil {
		return c, false, invalidf("safetensors.path", "%s: %v", quote(rel), err)
	}
	return c, true, nil
}

// defaultPrefix is what precedes "layers.{L}" in a preset's names.
func defaultPrefix(p Preset) string {
	if p == NemotronH {
		return "backbone."
	}
	return "model."
}

// stdProjection names a projection's weight and its scales as ModelOpt,
// compressed-tensors and the DeepSeek/Qwen block checkpoints write them.
func stdProjection(prefix string) projection {
	return projection{
		weight: prefix + ".weight",
		// ModelOpt and compressed-tensors write weight_scale; DeepSeek and
		// Qwen block checkpoints write weight_scale_inv, which despite its
		// name multiplies, as a dequantization scale does.
		scales: []string{prefix + ".weight_scale", prefix + ".weight_scale_inv"},
		input:  prefix + ".input_scale",
	}
}

// checkpointLayout returns the layout of the presets and template forms
// presetLayout does not know; ok is false for the ones it does.
func checkpointLayout(src *Source, e int) (l stLayout, ok bool, err error) {
	layer := int(src.Layer)
	prefix := src.TensorPrefix
	if prefix == "" {
		prefix = defaultPrefix(src.Preset)
	}
	gated := func(base, gate, up, down string) stLayout {
		p := expand(prefix+base, layer, e)
		return stLayout{act: moe.SiluGated,
			w13: []projection{stdProjection(p + gate), stdProjection(p + up)}, w2: stdProjection(p + down)}
	}
	switch src.Preset {
	case DeepSeekV3:
		return gated("layers.{L}.mlp.experts.{e}.", "gate_proj", "up_proj", "down_proj"), true, nil
	case Mixtral:
		return gated("layers.{L}.block_sparse_moe.experts.{e}.", "w1", "w3", "w2"), true, nil
	case GptOss:
		return gptossLayout(prefix, layer, e), true, nil
	case Qwen3MoE:
		if src.TensorPrefix == "" {
			return l, false, nil
		}
		return gated("layers.{L}.mlp.experts.{e}.", "gate_proj", "up_proj", "down_proj"), true, nil
	case NemotronH:
		if src.TensorPrefix == "" {
			return l, false, nil
		}
		p := expand(prefix+"layers.{L}.mixer.experts.{e}.", layer, e)
		return stLayout{act: moe.Relu2, w13: []projection{stdProjection(p + "up_proj")}, w2: stdProjection(p + "down_proj")}, true, nil
	case Auto:
		return l, true, invalidf("safetensors.preset", "NAMING_PRESET_AUTO needs path to name a checkpoint directory with a config.json")
	case Custom:
		return customLayout(src, e)
	}
	return l, false, nil
}

// customLayout is the template form with one template per projection
// (gate_template, up_template) or with static input scales; plain w13/w2
// templates stay presetLayout's.
func customLayout(src *Source, e int) (stLayout, bool, error) {
	split := src.GateTemplate != "" || src.UpTemplate != ""
	if !split && src.W13InputScaleTemplate == "" && src.W2InputScaleTemplate == "" {
		return stLayout{}, false, nil
	}
	if src.Activation == 0 {
		return stLayout{}, true, invalidf("safetensors.activation", "is required with NAMING_PRESET_CUSTOM")
	}
	layer := int(src.Layer)
	proj := func(w, sc, in string) projection {
		p := projection{weight: expand(w, layer, e), unitScale: sc == ""}
		if sc != "" {
			p.scales = []string{expand(sc, layer, e)}
		}
		if in != "" {
			p.input = expand(in, layer, e)
		}
		return p
	}
	in13 := src.W13InputScaleTemplate
	l := stLayout{act: src.Activation, w2: proj(src.W2Template, src.W2ScaleTemplate, src.W2InputScaleTemplate)}
	switch {
	case split && (src.GateTemplate == "" || src.UpTemplate == "" || src.W13Template != ""):
		return l, true, invalidf("safetensors.gate_template", "gate_template and up_template go together, instead of w13_template")
	case split && src.Activation != moe.SiluGated:
		return l, true, invalidf("safetensors.gate_template", "separate gate and up projections need ACTIVATION_SILU_GATED")
	case split:
		l.w13 = []projection{proj(src.GateTemplate, src.GateScaleTemplate, in13), proj(src.UpTemplate, src.UpScaleTemplate, in13)}
	case src.W13Template == "":
		return l, true, invalidf("safetensors.w13_template", "w13_template (or gate_template and up_template) is required with NAMING_PRESET_CUSTOM")
	default:
		l.w13 = []projection{proj(src.W13Template, src.W13ScaleTemplate, in13)}
	}
	if src.W2Template == "" {
		return l, true, invalidf("safetensors.w2_template", "is required with NAMING_PRESET_CUSTOM")
	}
	return l, true, nil
}

// biasName is the routing correction bias of a preset's layer, "" for
// presets without one.
func biasName(src *Source, prefix string) string {
	switch src.Preset {
	case DeepSeekV3:
		return expand(prefix+"layers.{L}.mlp.gate.e_score_correction_bias", int(src.Layer), 0)
	case NemotronH:
		return expand(prefix+"layers.{L}.mixer.gate.e_score_correction_bias", int(src.Layer), 0)
	}
	return ""
}

// multiReaderAt reads the shards as one address space: shard i occupies
// [starts[i], starts[i]+sizes[i]).
type multiReaderAt struct {
	parts  []io.ReaderAt
	starts []int64
	sizes  []int64
}

func (m *multiReaderAt) ReadAt(p []byte, off int64) (int, error) {
	n := 0
	for len(p) > 0 {
		i, _ := slices.BinarySearch(m.starts, off+1)
		i--
		if i < 0 || off >= m.starts[i]+m.sizes[i] {
			return n, io.EOF
		}
		local := off - m.starts[i]
		k := min(int64(len(p)), m.sizes[i]-local)
		got, err := m.parts[i].ReadAt(p[:k], local)
		n += got
		if err != nil && !(errors.Is(err, io.EOF) && int64(got) == k) {
			return n, err
		}
		p, off = p[k:], off+k
	}
	return n, nil
}

// decodeIndex returns the weight_map of model.safetensors.index.json. An
// index without one is refused: it would read as a checkpoint without the
// layer's experts, which callers take for a dense layer and skip.
func decodeIndex(b []byte) (map[string]string, error) {
	var index struct {
		WeightMap map[string]string `json:"weight_map"`
	}
	if err := json.Unmarshal(b, &index); err != nil {
		return nil, err
	}
	if len(index.WeightMap) == 0 {
		return nil, errors.New("weight_map is missing or empty; want an object naming the shard of every tensor")
	}
	return index.WeightMap, nil
}

// openCheckpoint opens the shards of dir that hold the tensors wanted
// selects and returns them as one stFile (base 0, offsets rebased into the
// shards' joint address space), and a closer for the shard files.
func (l *Loader) openCheckpoint(dir string, wanted func(name string) bool) (*stFile, func(), error) {
	indexRel := path.Join(dir, checkpointIndex)
	b, err := l.readJSON(indexRel)
	if err != nil {
		return nil, nil, err
	}
	found := b != nil
	var weightMap map[string]string
	if found {
		if weightMap, err = decodeIndex(b); err != nil {
			return nil, nil, invalidf("safetensors.path", "%s: %v", quote(indexRel), err)
		}
	}
	var shards []string
	owner := map[string]string{}
	if found {
		for name, shard := range weightMap {
			if wanted(name) {
				owner[name] = shard
				if !slices.Contains(shards, shard) {
					shards = append(shards, shard)
				}
			}
		}
		if len(shards) > maxShards {
			return nil, nil, invalidf("safetensors.path", "%s: the layer spans %d shards, more than %d", quote(dir), len(shards), maxShards)
		}
		slices.Sort(shards)
	} else {
		shards = []string{checkpointSingle}
	}
	var files []*os.File
	closeAll := func() {
		for _, f := range files {
			f.Close()
		}
	}
	merged := &stFile{tensors: map[string]stTensor{}}
	mr := &multiReaderAt{}
	var at int64
	for _, shard := range shards {
		if strings.Contains(shard, "/") || shard == ".." {
			closeAll()
			return nil, nil, invalidf("safetensors.path", "%s: shard %s: want a file name in the checkpoint directory", quote(dir), quote(shard))
		}
		rel := path.Join(dir, shard)
		fh, err := l.Dir.open(rel)
		if err != nil {
			closeAll()
			return nil, nil, err
		}
		files = append(files, fh)
		st, err := fh.Stat()
		if err != nil {
			closeAll()
			return nil, nil, fmt.Errorf("stat shard: %w", err)
		}
		if !st.Mode().IsRegular() {
			closeAll()
			return nil, nil, invalidf("safetensors.path", "%s: not a regular file", quote(rel))
		}
		f, err := parseSafetensors(fh, st.Size())
		if err != nil {
			closeAll()
			return nil, nil, invalidf("safetensors.path", "%s: %v", quote(rel), err)
		}
		for name, t := range f.tensors {
			if !wanted(name) || (found && owner[name] != shard) {
				continue
			}
			t.DataOffsets = [2]int64{at + f.base + t.DataOffsets[0], at + f.base + t.DataOffsets[1]}
			merged.tensors[name] = t
		}
		mr.parts, mr.starts, mr.sizes = append(mr.parts, fh), append(mr.starts, at), append(mr.sizes, st.Size())
		at += st.Size()
	}
	for name, shard := range owner {
		if _, ok := merged.tensors[name]; !ok {
			closeAll()
			return nil, nil, invalidf("safetensors.path", "%s: the index puts %s in %s, which does not hold it", quote(dir), quote(name), quote(shard))
		}
	}
	merged.r = mr
	return merged, closeAll, nil
}

// loadCheckpoint reads one layer's experts from a checkpoint directory.
func (l *Loader) loadCheckpoint(ctx context.Context, src *Source, subset ExpertSubset) (*Set, error) {
	dir := src.Path
	cfgRel := path.Join(dir, checkpointConfig)
	cfg, haveCfg, err := l.readConfig(dir)
	if err != nil {
		return nil, err
	}
	tc := cfg.text()
	kp := cfg.textKeys()
	badConfig := func(err error) error { return invalidf("safetensors.path", "%s: %v", quote(cfgRel), err) }
	src = src.clone()
	if src.Preset == Auto {
		// A multimodal wrapper's own model_type names the layout
		// (qwen3_vl_moe), not its text_config's.
		p, ok := modelTypes[cfg.ModelType]
		if !ok {
			p, ok = modelTypes[tc.ModelType]
		}
		if !haveCfg || !ok {
			return nil, invalidf("safetensors.preset", "NAMING_PRESET_AUTO: %s model_type %s is not one of %s",
				quote(cfgRel), quote(cfg.ModelType), strings.Join(slices.Sorted(maps.Keys(modelTypes)), ", "))
		}
		src.Preset = p.preset
		if src.TensorPrefix == "" {
			src.TensorPrefix = p.prefix
		}
	}
	numE, err := tc.experts(kp)
	if err != nil {
		return nil, badConfig(err)
	}
	whole := src.NumExperts == 0 && subset == nil
	if src.NumExperts == 0 {
		src.NumExperts = numE
	}
	bs, err := tc.blockSize()
	if err != nil {
		return nil, badConfig(err)
	}
	if len(src.WeightBlockShape) == 0 {
		src.WeightBlockShape = bs
	}
	lay0, err := presetLayout(src, 0)
	if err != nil {
		return nil, err
	}
	if err := tc.activation(kp, lay0.act); err != nil {
		return nil, badConfig(err)
	}
	if err := tc.swiglu(kp, lay0.act, src); err != nil {
		return nil, badConfig(err)
	}
	prefix := src.TensorPrefix
	if prefix == "" {
		prefix = defaultPrefix(src.Preset)
	}
	// Every name of the layer's experts starts where experts 0 and 1 part.
	lay1, _ := presetLayout(src, 1)
	common := lay0.w13[0].weight[:commonPrefix(lay0.w13[0].weight, lay1.w13[0].weight)]
	bias := biasName(src, prefix)
	f, closeAll, err := l.openCheckpoint(dir, func(name string) bool { return strings.HasPrefix(name, common) || name == bias })
	if err != nil {
		return nil, err
	}
	defer closeAll()
	shards := len(f.r.(*multiReaderAt).parts)
	if f, err = gptossView(f, src); err != nil {
		return nil, err
	}
	if len(f.tensors) == 0 {
		// NotFound, not InvalidArgument: a dense layer of a MoE model has
		// no experts, which a caller loading every layer skips.
		return nil, errorf(NotFound, "safetensors.layer", "%s: no tensor of layer %d starts with %s", quote(dir), src.Layer, quote(common))
	}
	if numE > 0 && whole {
		if err := partialLayer(f, src, numE, cfgRel); err != nil {
			return nil, err
		}
	}
	_, hasBias := f.tensors[bias]
	hasBias = hasBias && bias != ""
	rt, err := tc.routing(routerOf([]string{cfg.ModelType, tc.ModelType}, src.Preset), kp, numE, bias, hasBias)
	if err != nil {
		return nil, badConfig(err)
	}
	if hasBias && rt != nil {
		_, v, err := f.floats(bias, moe.MaxExperts)
		if err != nil {
			return nil, invalidf("safetensors", "%s: %v", quote(dir), err)
		}
		rt.CorrectionBias = &moe.Tensor{DType: moe.Float32, Shape: []int{len(v)}, Data: moe.Float32Bytes(v)}
	}
	topK := 0
	if tc.TopK != nil {
		topK = *tc.TopK
	}
	// A layer of a large checkpoint takes seconds to read; the log shows
	// each one start and end (with "expert set loaded").
	began := time.Now()
	l.log().InfoContext(ctx, "reading expert set from checkpoint", slog.String("name", src.Name), slog.String("path", clip.To(dir, clip.Quoted)),
		slog.Int("layer", src.Layer), slog.Int("shards", shards), slog.Int("tensors", len(f.tensors)))
	set, err := l.read(ctx, f, src, subset, rt, topK)
	if err == nil {
		l.log().InfoContext(ctx, "checkpoint layer read", slog.String("name", src.Name), slog.Duration("took", time.Since(began)))
	}
	return set, err
}

// wholeLayer is src with num_experts set from the config.json beside a
// single .safetensors file, if there is one that gives it, and refuses a
// file that holds only some of the layer's experts: a shard of a
// checkpoint loaded by itself would otherwise load as a smaller set
// without a word.
func (l *Loader) wholeLayer(f *stFile, src *Source) (*Source, error) {
	dir := path.Dir(src.Path)
	cfg, found, err := l.readConfig(dir)
	if err != nil || !found {
		return src, err
	}
	tc := cfg.text()
	cfgRel := path.Join(dir, checkpointConfig)
	numE, err := tc.experts(cfg.textKeys())
	if err != nil {
		return nil, invalidf("safetensors.path", "%s: %v", quote(cfgRel), err)
	}
	if numE == 0 {
		return src, nil
	}
	if err := partialLayer(f, src, numE, cfgRel); err != nil {
		return nil, err
	}
	src = src.clone()
	src.NumExperts = numE
	return src, nil
}

// partialLayer refuses f unless it holds every one of the layer's numE
// experts (as config cfgRel says). Part of a layer loads only when the
// caller asks for it: with num_experts, or an expert subset.
func partialLayer(f *stFile, src *Source, numE int, cfgRel string) error {
	for e := range numE {
		l, err := presetLayout(src, e)
		if err != nil {
			return err
		}
		if _, ok := f.tensors[l.w13[0].weight]; !ok {
			return invalidf("safetensors.num_experts", "%s holds %d of layer %d's %d experts (%s), not %s; load the whole checkpoint directory, or set num_experts to load the first ones only",
				quote(src.Path), e, src.Layer, numE, quote(cfgRel), quote(l.w13[0].weight))
		}
	}
	return nil
}

func commonPrefix(a, b string) int {
	i := 0
	for i < len(a) && i < len(b) && a[i] == b[i] {
		i++
	}
	return i
}

// read reads the set src names from f, with the checkpoint's routing (nil
// for none) checked against it and the checkpoint's top-k hint.
func (l *Loader) read(ctx context.Context, f *stFile, src *Source, subset ExpertSubset, rt *moe.RoutingInput, hint int) (*Set, error) {
	block := [2]int{128, 128}
	if bs := src.WeightBlockShape; len(bs) != 0 {
		if len(bs) != 2 || bs[0] < 1 || bs[1] < 1 {
			return nil, invalidf("safetensors.weight_block_shape", "%v: want [Bn, Bk] with both >= 1", bs)
		}
		block = [2]int{bs[0], bs[1]}
	}
	a, err := assemble(ctx, f, src, subset, block, l.Budget, l.Quantizer)
	if err != nil {
		return nil, err
	}
	if rt != nil {
		if _, err := moe.ValidateRouting(rt, a.Set.E); err != nil {
			a.Release()
			return nil, invalidf("safetensors.path", "%s/config.json gives a routing the set cannot take: %v", quote(src.Path), err)
		}
	}
	a.Fingerprint, a.TopKHint, a.Routing = moe.Fingerprint(a.bufs), hint, rt
	return a, nil
}

// clone is a copy of src that the loader may fill in.
func (src *Source) clone() *Source {
	c := *src
	return &c
}
