package service

import (
	"context"
	"fmt"
	"slices"

	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// maxExperts bounds expert counting in a file.
const maxExperts = 1 << 16

// assembled is an expert set read from a safetensors file, holding a
// reservation of bytes until release (a no-op once committed).
type assembled struct {
	set       *moe.ExpertSet
	bufs      [numTensors][]byte
	bytes     int64
	reg       *registry
	committed bool
}

func (a *assembled) release() {
	if !a.committed {
		a.reg.release(a.bytes)
	}
}

// reserveSet validates the set w declares, as a client's would be, and
// reserves its bytes in reg, with its weight buffers allocated for the
// reads to fill.
func reserveSet(w *pb.ExpertWeights, reg *registry) (*layout, *assembled, error) {
	l, err := checkLayout("safetensors", w)
	if err != nil {
		return nil, nil, err
	}
	a := &assembled{bytes: l.totalBytes(), reg: reg}
	if err := reg.reserve("safetensors", a.bytes); err != nil {
		return nil, nil, err
	}
	a.bufs[tW13] = make([]byte, l.metas[tW13].bytes)
	a.bufs[tW2] = make([]byte, l.metas[tW2].bytes)
	return l, a, nil
}

// scaleForm is how one projection's per-expert weight scale is laid out.
type scaleForm int

const (
	formScalar  scaleForm = iota + 1 // one value per expert
	formChannel                      // one per output row: [rows] or [rows, 1]
	formBlock                        // [ceil(rows/Bn), ceil(cols/Bk)]
)

func ceilDiv(a, b int) int { return (a + b - 1) / b }

// classify names the form of a scale of shape for a rows x cols matrix.
func classify(shape []int64, rows, cols int, block [2]int) (scaleForm, bool) {
	n := int64(1)
	for _, d := range shape {
		n *= d
	}
	switch {
	case n == 1:
		return formScalar, true
	case slices.Equal(shape, []int64{int64(rows)}) || slices.Equal(shape, []int64{int64(rows), 1}):
		return formChannel, true
	case slices.Equal(shape, []int64{int64(ceilDiv(rows, block[0])), int64(ceilDiv(cols, block[1]))}):
		return formBlock, true
	}
	return 0, false
}

// matrixScales gathers one weight matrix's scales over all experts: parts
// are stacked row-wise (gate then up), each of parts[p] rows and cols
// columns. It returns the combined scale's shape (with the expert
// dimension) and values.
func matrixScales(f *stFile, names func(e int) []projection, numE int, rows []int, cols int, block [2]int) ([]int64, []float32, bool, error) {
	var form scaleForm
	vals := make([][][]float32, numE) // [expert][part]
	for e := range numE {
		for p, pr := range names(e) {
			v := []float32{1}
			shape := []int64{}
			found := false
			for _, name := range pr.scales {
				if _, ok := f.tensors[name]; !ok {
					continue
				}
				most := max(int64(rows[p]), int64(ceilDiv(rows[p], block[0]))*int64(ceilDiv(cols, block[1])))
				t, x, err := f.floats(name, most)
				if err != nil {
					return nil, nil, false, err
				}
				v, shape, found = x, t.Shape, true
				break
			}
			if !found && !pr.unitScale {
				return nil, nil, false, fmt.Errorf("no weight scale for %s (looked for %s)", Quote(pr.weight), quoteAll(pr.scales))
			}
			fm, ok := classify(shape, rows[p], cols, block)
			if !ok {
				return nil, nil, false, fmt.Errorf("scale of %s has shape %v: want a scalar, [%d] per channel or [%d, %d] blocks of %v",
					Quote(pr.weight), shape, rows[p], ceilDiv(rows[p], block[0]), ceilDiv(cols, block[1]), block)
			}
			if form != 0 && fm != form {
				return nil, nil, false, fmt.Errorf("scale of %s is laid out unlike the others", Quote(pr.weight))
			}
			form = fm
			vals[e] = append(vals[e], v)
		}
	}
	totalRows := 0
	for _, r := range rows {
		totalRows += r
	}
	var out []float32
	switch form {
	case formScalar:
		same := true
		for e := range vals {
			for _, v := range vals[e] {
				same = same && v[0] == vals[e][0][0]
			}
		}
		if same {
			for e := range vals {
				out = append(out, vals[e][0][0])
			}
			return []int64{int64(numE)}, out, false, nil
		}
		// Gate and up scaled differently: exact as one scale per row.
		for e := range vals {
			for p, v := range vals[e] {
				for range rows[p] {
					out = append(out, v[0])
				}
			}
		}
		return []int64{int64(numE), int64(totalRows)}, out, false, nil
	case formChannel:
		for e := range vals {
			for _, v := range vals[e] {
				out = append(out, v...)
			}
		}
		return []int64{int64(numE), int64(totalRows)}, out, false, nil
	}
	// Stacked parts keep their tiles only if each part but the last ends on
	// a block boundary.
	for p := range len(rows) - 1 {
		if rows[p]%block[0] != 0 {
			return nil, nil, false, fmt.Errorf("block scales: %d rows of %s are not a multiple of Bn = %d, so stacking would split a tile", rows[p], Quote(names(0)[p].weight), block[0])
		}
	}
	for e := range vals {
		for _, v := range vals[e] {
			out = append(out, v...)
		}
	}
	return []int64{int64(numE), int64(ceilDiv(totalRows, block[0])), int64(ceilDiv(cols, block[1]))}, out, true, nil
}

// inputScales gathers static input scales of the given projections: one
// per expert, the max over the projections (gate and up read the same
// input). None present means dynamic quantization.
func inputScales(f *stFile, names func(e int) []projection, numE int) ([]float32, error) {
	if first := names(0)[0].input; first == "" {
		return nil, nil
	} else if _, ok := f.tensors[first]; !ok {
		return nil, nil
	}
	out := make([]float32, numE)
	for e := range numE {
		for _, pr := range names(e) {
			_, v, err := f.floats(pr.input, 1)
			if err != nil {
				return nil, err
			}
			if len(v) != 1 {
				return nil, fmt.Errorf("input scale %s has %d values, want one", Quote(pr.input), len(v))
			}
			out[e] = max(out[e], v[0])
		}
	}
	return out, nil
}

// assemble reads an expert set per src from f, reserving its bytes in reg
// before reading the weights; BF16 and F16 weights are quantized with hq
// (nil: on the host).
func assemble(ctx context.Context, f *stFile, src *pb.LoadExpertsRequest_SafetensorsSource, subset ExpertSubset, block [2]int, reg *registry, hq HalfQuantizer) (*assembled, error) {
	wrap := func(err error) error { return invalidf("safetensors", "%s: %v", Quote(src.GetPath()), err) }
	// ids[e] is the file's expert that the set serves as expert e.
	var ids []int
	lay := func(e int) stLayout {
		if ids != nil {
			e = ids[e]
		}
		l, _ := presetLayout(src, e)
		return l
	}
	// Refused whatever the weights' dtype, though only 16-bit ones use it.
	if _, err := weightGranularity(src); err != nil {
		return nil, err
	}
	numE := int(src.GetNumExperts())
	if numE < 0 || numE > maxExperts {
		return nil, invalidf("safetensors.num_experts", "%d: want in [0, %d]", numE, maxExperts)
	}
	if numE == 0 {
		for numE < maxExperts {
			if _, ok := f.tensors[lay(numE).w13[0].weight]; !ok {
				break
			}
			numE++
		}
		if numE == 0 {
			return nil, wrap(fmt.Errorf("no tensor named %s for layer %d", Quote(lay(0).w13[0].weight), src.GetLayer()))
		}
	}
	// Static input scales reduce to their max over the layer (as the
	// service does with an [E] scale), so a subset takes the whole file's
	// max and quantizes exactly as a set of every expert would.
	var a13All, a2All []float32
	if subset != nil {
		var err error
		if a13All, err = inputScales(f, func(e int) []projection { return lay(e).w13 }, numE); err != nil {
			return nil, wrap(err)
		}
		if a2All, err = inputScales(f, func(e int) []projection { return []projection{lay(e).w2} }, numE); err != nil {
			return nil, wrap(err)
		}
		if ids, err = subset.pick(numE); err != nil {
			return nil, err
		}
		numE = len(ids)
	}
	l0 := lay(0)
	// F8_E4M3 weights, or BF16 or F16 ones to quantize on load.
	wdt := "F8_E4M3"
	if _, half := halfDtypes[f.tensors[l0.w13[0].weight].Dtype]; half {
		wdt = f.tensors[l0.w13[0].weight].Dtype
	}
	shapeOf := func(name string) ([]int64, error) {
		t, ok := f.tensors[name]
		if !ok {
			return nil, fmt.Errorf("no tensor named %s", Quote(name))
		}
		if t.Dtype != wdt {
			return nil, fmt.Errorf("tensor %s has dtype %s, want %s as the layer's first weight has", Quote(name), Quote(t.Dtype), wdt)
		}
		if len(t.Shape) != 2 || t.Shape[0] < 1 || t.Shape[1] < 1 {
			return nil, fmt.Errorf("tensor %s has shape %v, want [rows, cols]", Quote(name), t.Shape)
		}
		// The shape must match the bytes the file holds: the scales' sizes
		// are bounded by it before they are read.
		if _, _, err := f.check(name, t.Dtype); err != nil {
			return nil, err
		}
		return t.Shape, nil
	}
	// Every expert's matrices must match expert 0's.
	var rows []int
	k := 0
	for e := range numE {
		for p, pr := range lay(e).w13 {
			s, err := shapeOf(pr.weight)
			if err != nil {
				return nil, wrap(err)
			}
			if e == 0 {
				rows = append(rows, int(s[0]))
				k = int(s[1])
			} else if int(s[0]) != rows[p] || int(s[1]) != k {
				return nil, wrap(fmt.Errorf("tensor %s has shape %v, expert 0 has [%d %d]", Quote(pr.weight), s, rows[p], k))
			}
		}
		s, err := shapeOf(lay(e).w2.weight)
		if err != nil {
			return nil, wrap(err)
		}
		if int(s[0]) != k {
			return nil, wrap(fmt.Errorf("tensor %s has shape %v, want [%d, N]", Quote(lay(e).w2.weight), s, k))
		}
	}
	w2s, _ := shapeOf(l0.w2.weight)
	n := int(w2s[1])
	if wdt != "F8_E4M3" {
		return assembleHalf(ctx, f, src, lay, numE, rows, k, n, wdt, block, reg, hq, wrap)
	}
	r := 0
	for _, x := range rows {
		r += x
	}

	w13Names := func(e int) []projection { return lay(e).w13 }
	w2Names := func(e int) []projection { return []projection{lay(e).w2} }
	s13Shape, s13, b13, err := matrixScales(f, w13Names, numE, rows, k, block)
	if err != nil {
		return nil, wrap(err)
	}
	s2Shape, s2, b2, err := matrixScales(f, w2Names, numE, []int{k}, n, block)
	if err != nil {
		return nil, wrap(err)
	}
	a13, err := inputScales(f, w13Names, numE)
	if err != nil {
		return nil, wrap(err)
	}
	a2, err := inputScales(f, w2Names, numE)
	if err != nil {
		return nil, wrap(err)
	}
	if subset != nil {
		a13, a2 = fillMax(a13, a13All), fillMax(a2, a2All)
	}

	// Declare the set as a client would and validate it the one way.
	fp8 := func(shape ...int64) *pb.Tensor {
		return &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT8_E4M3FN, Shape: shape}
	}
	f32 := func(v []float32, shape ...int64) *pb.Tensor {
		if v == nil {
			return nil
		}
		return &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT32, Shape: shape, Source: &pb.Tensor_Data{Data: float32Bytes(v)}}
	}
	w := &pb.ExpertWeights{
		Activation: l0.act,
		W13:        fp8(int64(numE), int64(r), int64(k)),
		W2:         fp8(int64(numE), int64(k), int64(n)),
		W13Scale:   f32(s13, s13Shape...),
		W2Scale:    f32(s2, s2Shape...),
		A13Scale:   f32(a13, int64(numE)),
		A2Scale:    f32(a2, int64(numE)),
	}
	if b13 || b2 {
		w.WeightBlockShape = []int32{int32(block[0]), int32(block[1])}
	}
	l, a, err := reserveSet(w, reg)
	if err != nil {
		return nil, err
	}
	for e := range numE {
		// A load of many experts reads for a long time: its deadline, its
		// cancellation and the drain (which cancels it) stop it between
		// experts.
		if err := ctx.Err(); err != nil {
			a.release()
			return nil, err
		}
		at := e * r * k
		for p, pr := range lay(e).w13 {
			if err := f.readInto(pr.weight, "F8_E4M3", a.bufs[tW13][at:at+rows[p]*k]); err != nil {
				a.release()
				return nil, wrap(err)
			}
			at += rows[p] * k
		}
		if err := f.readInto(lay(e).w2.weight, "F8_E4M3", a.bufs[tW2][e*k*n:(e+1)*k*n]); err != nil {
			a.release()
			return nil, wrap(err)
		}
	}
	for i, t := range weightTensors(w) {
		if i != tW13 && i != tW2 && t != nil {
			a.bufs[i] = t.GetData()
		}
	}
	if a.set, err = buildSet("safetensors", l, a.bufs); err != nil {
		a.release()
		return nil, err
	}
	return a, nil
}
