package weights

import (
	"context"
	"fmt"
	"slices"

	"github.com/expertd/expertd/moe"
)

// fileError names src's file in a request's errors.
func fileError(src *Source) func(error) error {
	return func(err error) error { return invalidf("safetensors", "%s: %v", quote(src.Path), err) }
}

// reserveLayer completes d with what the file's layout adds (layoutExtras:
// biases, activation parameters), its errors named by wrap, then reserves
// the set (reserveSet).
func reserveLayer(f *stFile, src *Source, lay func(e int) stLayout, numE, rows, k int, d *moe.SetDecl, b Budget,
	wrap func(error) error) (*moe.Layout, *Set, error) {
	if err := layoutExtras(f, src, lay, numE, rows, k, d); err != nil {
		return nil, nil, wrap(err)
	}
	return reserveSet(d, b)
}

// reserveSet validates the set d declares, as a client's would be, and
// reserves its bytes in b, with its weight buffers allocated for the
// reads to fill and the bytes of its inline tensors in place.
func reserveSet(d *moe.SetDecl, b Budget) (*moe.Layout, *Set, error) {
	l, err := moe.CheckLayout("safetensors", d)
	if err != nil {
		return nil, nil, err
	}
	a := &Set{Bytes: l.TotalBytes(), budget: b}
	if err := b.Reserve("safetensors", a.Bytes); err != nil {
		return nil, nil, err
	}
	a.bufs[moe.SetW13] = make([]byte, l.Tensors[moe.SetW13].Bytes)
	a.bufs[moe.SetW2] = make([]byte, l.Tensors[moe.SetW2].Bytes)
	for i, t := range d.Tensors {
		if i != moe.SetW13 && i != moe.SetW2 && t != nil {
			a.bufs[i] = t.Data
		}
	}
	return l, a, nil
}

// scaleDecl declares a Float32 tensor (a scale or a bias) of the given
// shape holding v (nil for no values yet).
func scaleDecl(v []float32, shape ...int) *moe.Tensor {
	t := &moe.Tensor{DType: moe.Float32, Shape: shape}
	if v != nil {
		t.Data = moe.Float32Bytes(v)
	}
	return t
}

// fp8Decl declares an FP8 E4M3FN weight tensor of the given shape.
func fp8Decl(shape ...int) *moe.Tensor {
	return &moe.Tensor{DType: moe.Float8E4M3FN, Shape: shape}
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
func matrixScales(f *stFile, names func(e int) []projection, numE int, rows []int, cols int, block [2]int) ([]int, []float32, bool, error) {
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
				return nil, nil, false, fmt.Errorf("no weight scale for %s (looked for %s)", quote(pr.weight), quoteAll(pr.scales))
			}
			fm, ok := classify(shape, rows[p], cols, block)
			if !ok {
				return nil, nil, false, fmt.Errorf("scale of %s has shape %v: want a scalar, [%d] per channel or [%d, %d] blocks of %v",
					quote(pr.weight), shape, rows[p], ceilDiv(rows[p], block[0]), ceilDiv(cols, block[1]), block)
			}
			if form != 0 && fm != form {
				return nil, nil, false, fmt.Errorf("scale of %s is laid out unlike the others", quote(pr.weight))
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
			return []int{numE}, out, false, nil
		}
		// Gate and up scaled differently: exact as one scale per row.
		for e := range vals {
			for p, v := range vals[e] {
				for range rows[p] {
					out = append(out, v[0])
				}
			}
		}
		return []int{numE, totalRows}, out, false, nil
	case formChannel:
		for e := range vals {
			for _, v := range vals[e] {
				out = append(out, v...)
			}
		}
		return []int{numE, totalRows}, out, false, nil
	}
	// Stacked parts keep their tiles only if each part but the last ends on
	// a block boundary.
	for p := range len(rows) - 1 {
		if rows[p]%block[0] != 0 {
			return nil, nil, false, fmt.Errorf("block scales: %d rows of %s are not a multiple of Bn = %d, so stacking would split a tile", rows[p], quote(names(0)[p].weight), block[0])
		}
	}
	for e := range vals {
		for _, v := range vals[e] {
			out = append(out, v...)
		}
	}
	return []int{numE, ceilDiv(totalRows, block[0]), ceilDiv(cols, block[1])}, out, true, nil
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
				return nil, fmt.Errorf("input scale %s has %d values, want one", quote(pr.input), len(v))
			}
			out[e] = max(out[e], v[0])
		}
	}
	return out, nil
}

// assemble reads an expert set per src from f, reserving its bytes in b
// before reading the weights; BF16 and F16 weights are quantized with hq
// (nil: on the host).
func assemble(ctx context.Context, f *stFile, src *Source, subset ExpertSubset, block [2]int, b Budget, hq HalfQuantizer) (*Set, error) {
	wrap := fileError(src)
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
	numE := int(src.NumExperts)
	if numE < 0 || numE > moe.MaxExperts {
		return nil, invalidf("safetensors.num_experts", "%d: want in [0, %d]", numE, moe.MaxExperts)
	}
	if numE == 0 {
		for numE < moe.MaxExperts {
			if _, ok := f.tensors[lay(numE).w13[0].weight]; !ok {
				break
			}
			numE++
		}
		if numE == 0 {
			return nil, wrap(fmt.Errorf("no tensor named %s for layer %d", quote(lay(0).w13[0].weight), src.Layer))
		}
	}
	// Static input scales reduce to their max over the layer (as
	// moe.Layout.Build does with an [E] scale), so a subset takes the
	// whole file's max and quantizes exactly as a set of every expert
	// would.
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
			return nil, fmt.Errorf("no tensor named %s", quote(name))
		}
		if t.Dtype != wdt {
			return nil, fmt.Errorf("tensor %s has dtype %s, want %s as the layer's first weight has", quote(name), quote(t.Dtype), wdt)
		}
		if len(t.Shape) != 2 || t.Shape[0] < 1 || t.Shape[1] < 1 {
			return nil, fmt.Errorf("tensor %s has shape %v, want [rows, cols]", quote(name), t.Shape)
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
				return nil, wrap(fmt.Errorf("tensor %s has shape %v, expert 0 has [%d %d]", quote(pr.weight), s, rows[p], k))
			}
		}
		s, err := shapeOf(lay(e).w2.weight)
		if err != nil {
			return nil, wrap(err)
		}
		if int(s[0]) != k {
			return nil, wrap(fmt.Errorf("tensor %s has shape %v, want [%d, N]", quote(lay(e).w2.weight), s, k))
		}
	}
	w2s, _ := shapeOf(l0.w2.weight)
	n := int(w2s[1])
	if wdt != "F8_E4M3" {
		return assembleHalf(ctx, f, src, lay, numE, rows, k, n, wdt, block, b, hq, wrap)
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
	d := &moe.SetDecl{Activation: l0.act}
	d.Tensors[moe.SetW13] = fp8Decl(numE, r, k)
	d.Tensors[moe.SetW2] = fp8Decl(numE, k, n)
	d.Tensors[moe.SetW13Scale] = scaleDecl(s13, s13Shape...)
	d.Tensors[moe.SetW2Scale] = scaleDecl(s2, s2Shape...)
	if a13 != nil {
		d.Tensors[moe.SetA13Scale] = scaleDecl(a13, numE)
	}
	if a2 != nil {
		d.Tensors[moe.SetA2Scale] = scaleDecl(a2, numE)
	}
	if b13 || b2 {
		d.BlockShape = block[:]
	}
	l, a, err := reserveLayer(f, src, lay, numE, r, k, d, b, wrap)
	if err != nil {
		return nil, err
	}
	for e := range numE {
		// A load of many experts reads for a long time: its deadline, its
		// cancellation and the drain (which cancels it) stop it between
		// experts.
		if err := ctx.Err(); err != nil {
			a.Release()
			return nil, err
		}
		at := e * r * k
		for p, pr := range lay(e).w13 {
			if err := f.readInto(pr.weight, "F8_E4M3", a.bufs[moe.SetW13][at:at+rows[p]*k]); err != nil {
				a.Release()
				return nil, wrap(err)
			}
			at += rows[p] * k
		}
		if err := f.readInto(lay(e).w2.weight, "F8_E4M3", a.bufs[moe.SetW2][e*k*n:(e+1)*k*n]); err != nil {
			a.Release()
			return nil, wrap(err)
		}
	}
	if a.Set, err = l.Build("safetensors", a.bufs); err != nil {
		a.Release()
		return nil, err
	}
	return a, nil
}
