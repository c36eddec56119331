package weights

import (
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"

	"github.com/expertd/expertd/moe"
)

// gpt-oss checkpoints hold a layer's experts stacked, as transformers'
// GptOssExperts holds them: gate_up_proj [E, K, 2N] (the input dimension
// first, gate and up interleaved in the last), gate_up_proj_bias [E, 2N],
// down_proj [E, N, K] and down_proj_bias [E, K]. The assembler reads one
// [rows, cols] matrix per expert and projection, output rows first, as
// every other preset stores them; gptossView presents the stacked tensors
// that way, so that the shape checks, expert subsets, the partial-layer
// check and quantize-on-load are the ones every preset goes through:
// expert e's w13 is a tensor "….experts.{e}.gate_up_proj" of shape
// [2N, K], the transpose of gate_up_proj[e], whose rows keep the
// interleaving SwigluOAI takes; its w2 "….experts.{e}.down_proj" [K, N];
// its biases the rows of the stacked biases, read where they lie.

// gptossLayout is the names gptossView gives expert e of the layer.
func gptossLayout(prefix string, layer, e int) stLayout {
	p := expand(prefix+"layers.{L}.mlp.experts.{e}.", layer, e)
	return stLayout{act: moe.SwigluOAI,
		w13: []projection{{weight: p + "gate_up_proj"}}, w2: projection{weight: p + "down_proj"},
		bias13: p + "gate_up_proj_bias", bias2: p + "down_proj_bias"}
}

// gptossView is f with the GptOss layer's stacked expert tensors replaced
// by per-expert ones (see above); f itself for the other presets, and for
// a checkpoint's selection without the layer's experts (a dense layer).
func gptossView(f *stFile, src *Source) (*stFile, error) {
	if src.Preset != GptOss {
		return f, nil
	}
	prefix := src.TensorPrefix
	if prefix == "" {
		prefix = defaultPrefix(src.Preset)
	}
	base := expand(prefix+"layers.{L}.mlp.experts.", src.Layer, 0)
	gu, down := base+"gate_up_proj", base+"down_proj"
	wrap := fileError(src)
	if _, ok := f.tensors[gu]; !ok {
		if _, mx := f.tensors[gu+"_blocks"]; mx {
			return nil, wrap(fmt.Errorf("%s is MXFP4 (gpt-oss's own release), which does not load; load a BF16 release of the model", quote(gu+"_blocks")))
		}
		if len(f.tensors) == 0 {
			return f, nil
		}
		return nil, wrap(fmt.Errorf("no tensor named %s for layer %d", quote(gu), src.Layer))
	}
	tGU, _, err := f.check(gu, "BF16", "F16")
	if err != nil {
		return nil, wrap(fmt.Errorf("%w (gpt-oss's stacked experts load from BF16 or F16)", err))
	}
	s := tGU.Shape
	if len(s) != 3 || s[0] < 1 || s[0] > moe.MaxExperts || s[1] < 1 || s[1] > moe.MaxDim || s[2] < 2 || s[2]%2 != 0 || s[2]/2 > moe.MaxDim {
		return nil, wrap(fmt.Errorf("tensor %s has shape %v, want [E, K, 2N] with E <= %d and K, N in [1, %d]", quote(gu), s, moe.MaxExperts, moe.MaxDim))
	}
	e, k, n := s[0], s[1], s[2]/2
	want := []struct {
		name  string
		shape []int64
		dt    []string
	}{
		{down, []int64{e, n, k}, []string{tGU.Dtype}},
		{gu + "_bias", []int64{e, 2 * n}, []string{"F32", "BF16", "F16"}},
		{down + "_bias", []int64{e, k}, []string{"F32", "BF16", "F16"}},
	}
	ts := make([]stTensor, len(want))
	for i, w := range want {
		if ts[i], _, err = f.check(w.name, w.dt...); err != nil {
			return nil, wrap(err)
		}
		if !slices.Equal(ts[i].Shape, w.shape) {
			return nil, wrap(fmt.Errorf("tensor %s has shape %v, want %v as %s [E, K, 2N] = %v gives", quote(w.name), ts[i].Shape, w.shape, quote(gu), s))
		}
	}
	tDown, tGUBias, tDownBias := ts[0], ts[1], ts[2]

	v := &stFile{base: f.base, meta: f.meta, tensors: make(map[string]stTensor, len(f.tensors)+4*int(e))}
	var end int64 // the virtual tensors lie past every stored one
	for name, t := range f.tensors {
		end = max(end, t.DataOffsets[1])
		if name != gu && name != down && name != gu+"_bias" && name != down+"_bias" {
			v.tensors[name] = t
		}
	}
	tr := &transposedView{r: f.r, start: f.base + end, at: f.base + end, band: transposeBand}
	const item = halfBytes
	row := func(t stTensor, x, width int64) stTensor {
		at := t.DataOffsets[0] + x*width*stItemSize[t.Dtype]
		return stTensor{Dtype: t.Dtype, Shape: []int64{width}, DataOffsets: [2]int64{at, at + width*stItemSize[t.Dtype]}}
	}
	for x := range e {
		p := base + strconv.FormatInt(x, 10) + "."
		v.tensors[p+"gate_up_proj"] = tr.add(f.base, tGU.Dtype, f.base+tGU.DataOffsets[0]+x*k*2*n*item, k, 2*n)
		v.tensors[p+"down_proj"] = tr.add(f.base, tDown.Dtype, f.base+tDown.DataOffsets[0]+x*n*k*item, n, k)
		v.tensors[p+"gate_up_proj_bias"] = row(tGUBias, x, 2*n)
		v.tensors[p+"down_proj_bias"] = row(tDownBias, x, k)
	}
	v.r = tr
	return v, nil
}

// transposeBand bounds the stored rows a transposed read holds at once.
const transposeBand = 1 << 20

// transposeTile is the columns a transposed read moves at once.
const transposeTile = 32

// transposedView reads r, and past start the transposes of stored
// row-major matrices, each at its own virtual offset: a read of one of
// them must cover it whole, as the loader reads tensors.
type transposedView struct {
	r io.ReaderAt
	// start is where the virtual matrices begin; at where the next goes.
	start, at int64
	// band bounds the bytes of stored rows a read holds at once.
	band int64
	mats []transposed
}

// halfBytes is the element size of the dtypes a transposedView reads
// (BF16, F16).
const halfBytes = 2

// transposed is one virtual matrix: the stored [rows, cols] one at src,
// read as its [cols, rows] transpose at at.
type transposed struct {
	at, src    int64
	rows, cols int64
}

// add places the transpose of the [rows, cols] matrix of dtype dt (BF16
// or F16) stored at absolute offset src, and returns its tensor, whose
// offsets are relative to base (the data section's).
func (v *transposedView) add(base int64, dt string, src, rows, cols int64) stTensor {
	m := transposed{at: v.at, src: src, rows: rows, cols: cols}
	v.mats = append(v.mats, m)
	size := rows * cols * halfBytes
	v.at += size
	return stTensor{Dtype: dt, Shape: []int64{cols, rows}, DataOffsets: [2]int64{m.at - base, m.at - base + size}}
}

func (v *transposedView) ReadAt(p []byte, off int64) (int, error) {
	if off < v.start {
		if off+int64(len(p)) > v.start {
			return 0, errors.New("a read across the stored tensors' end")
		}
		return v.r.ReadAt(p, off)
	}
	i, ok := slices.BinarySearchFunc(v.mats, off, func(m transposed, off int64) int {
		switch {
		case m.at < off:
			return -1
		case m.at > off:
			return 1
		}
		return 0
	})
	if !ok || int64(len(p)) != v.mats[i].rows*v.mats[i].cols*halfBytes {
		return 0, errors.New("a read of part of a transposed tensor")
	}
	m := v.mats[i]
	rowBytes := m.cols * halfBytes
	band := min(m.rows, max(1, v.band/rowBytes))
	buf := make([]byte, band*rowBytes)
	for r0 := int64(0); r0 < m.rows; r0 += band {
		nr := min(band, m.rows-r0)
		b := buf[:nr*rowBytes]
		if _, err := v.r.ReadAt(b, m.src+r0*rowBytes); err != nil {
			return 0, err
		}
		// Stored element (r0+r, c) is element (c, r0+r) of the transpose.
		// A tile of transposeTile columns at a time keeps the lines it
		// writes (one per column) in the L1 cache while the rows pass.
		for c0 := int64(0); c0 < m.cols; c0 += transposeTile {
			c1 := min(c0+transposeTile, m.cols)
			for r := range nr {
				src := b[r*rowBytes+c0*halfBytes : r*rowBytes+c1*halfBytes]
				at := (c0*m.rows + r0 + r) * halfBytes
				for i := 0; i < len(src); i, at = i+halfBytes, at+halfBytes*m.rows {
					p[at], p[at+1] = src[i], src[i+1]
				}
			}
		}
	}
	return len(p), nil
}

// layoutExtras declares on d what a layout adds to its weights: the
// experts' GEMM biases it names (read inline, [numE, rows] and [numE, k])
// and src's SwigluOAI parameters.
func layoutExtras(f *stFile, src *Source, lay func(e int) stLayout, numE, rows, k int, d *moe.SetDecl) error {
	d.SwigluLimit, d.SwigluAlpha = src.SwigluLimit, src.SwigluAlpha
	var err error
	if lay(0).bias13 != "" {
		if d.Tensors[moe.SetW13Bias], err = stackBias(f, numE, rows, func(e int) string { return lay(e).bias13 }); err != nil {
			return err
		}
	}
	if lay(0).bias2 != "" {
		if d.Tensors[moe.SetW2Bias], err = stackBias(f, numE, k, func(e int) string { return lay(e).bias2 }); err != nil {
			return err
		}
	}
	return nil
}

// stackBias reads each of numE experts' bias vector of width values.
func stackBias(f *stFile, numE, width int, name func(e int) string) (*moe.Tensor, error) {
	v := make([]float32, 0, numE*width)
	for e := range numE {
		t, x, err := f.floats(name(e), int64(width))
		if err != nil {
			return nil, err
		}
		if len(x) != width {
			return nil, fmt.Errorf("bias %s has shape %v, want [%d]", quote(name(e)), t.Shape, width)
		}
		v = append(v, x...)
	}
	return scaleDecl(v, numE, width), nil
}

// swiglu sets src's SwigluOAI parameters that it leaves 0 from
// config.json's swiglu_limit and swiglu_alpha (GptOssConfig's keys) for
// a layout of that activation; the keys mean nothing to the others.
func (c *moeConfig) swiglu(kp string, act moe.Activation, src *Source) error {
	if act != moe.SwigluOAI {
		return nil
	}
	for _, p := range []struct {
		key string
		v   *float64
		dst *float32
	}{{"swiglu_limit", c.SwigluLimit, &src.SwigluLimit}, {"swiglu_alpha", c.SwigluAlpha, &src.SwigluAlpha}} {
		if p.v == nil {
			continue
		}
		x := *p.v
		if math.IsNaN(x) || x <= 0 || x > math.MaxFloat32 || float32(x) == 0 {
			return fmt.Errorf("%s%s %v: want finite and > 0", kp, p.key, x)
		}
		if *p.dst == 0 {
			*p.dst = float32(x)
		}
	}
	return nil
}
