package scaling

import "fmt"

// PerTensorScale is the dynamic per-tensor scale of src: amax/448, clamped
// to MinScale, so the largest element maps to E4M3Max.
func PerTensorScale(src []float32) float32 { return amaxScale(absMax(src)) }

// QuantizeStatic quantizes src with one scale: dst[i] = E4M3(src[i]/scale).
// Values beyond ±448·scale saturate. It panics if dst is shorter than src.
func QuantizeStatic(dst []uint8, src []float32, scale float32) {
	dst = dst[:len(src)]
	for i, x := range src {
		dst[i] = Float32ToE4M3(x / scale)
	}
}

// QuantizeDynamic quantizes the row-major [rows, cols] src to E4M3 with one
// scale per row and group of group columns: group == cols is per-token
// quantization, group == Bk is DeepSeek-style per-token-group quantization
// (the last group of a row may be short). scales receives rows·ceil(cols/
// group) values, each amax/448 of its group clamped to MinScale, so every
// group's largest element maps to ±448. A NaN in a group makes its scale
// NaN. It panics if a slice is too short or group < 1.
func QuantizeDynamic(dst []uint8, scales []float32, src []float32, rows, cols, group int) {
	ng := checkGroups(len(dst), len(scales), len(src), rows, cols, group)
	for r := range rows {
		for g := range ng {
			lo, hi := r*cols+g*group, r*cols+min((g+1)*group, cols)
			s := amaxScale(absMax(src[lo:hi]))
			scales[r*ng+g] = s
			for i := lo; i < hi; i++ {
				dst[i] = Float32ToE4M3(src[i] / s)
			}
		}
	}
}

// Dequantize is the inverse of QuantizeDynamic (and of QuantizeStatic, with
// rows = 1, group = cols = len(src) and one scale):
// dst[r·cols+c] = E4M3Table[src[r·cols+c]] · scales[r·ceil(cols/group)+c/group].
// It panics if a slice is too short or group < 1.
func Dequantize(dst []float32, src []uint8, scales []float32, rows, cols, group int) {
	ng := checkGroups(len(src), len(scales), len(dst), rows, cols, group)
	for r := range rows {
		for c := range cols {
			i := r*cols + c
			dst[i] = E4M3Table[src[i]] * scales[r*ng+c/group]
		}
	}
}

// checkGroups panics unless the slices hold [rows, cols] values and codes
// and rows·ceil(cols/group) scales; it returns the groups per row.
func checkGroups(codes, scales, vals, rows, cols, group int) int {
	if group < 1 || rows < 0 || cols < 0 {
		panic(fmt.Sprintf("scaling: rows %d, cols %d, group %d", rows, cols, group))
	}
	ng := ceilDiv(cols, group)
	if codes < rows*cols || vals < rows*cols || scales < rows*ng {
		panic(fmt.Sprintf("scaling: [%d, %d] in groups of %d needs %d values, codes and %d scales; have %d, %d and %d",
			rows, cols, group, rows*cols, rows*ng, vals, codes, scales))
	}
	return ng
}

// QuantizeWeights quantizes the row-major [e, rows, cols] weights src to
// E4M3 with amax-based scales (amax/448, clamped to MinScale) at
// granularity g: one for the tensor, one per expert, one per row of each
// expert, or one per [Bn, Bk] tile with block = [Bn, Bk]. Tests and test
// data generators use it; the returned scale has E, Rows and Cols set. It
// panics on a length mismatch or an unknown granularity.
func QuantizeWeights(src []float32, e, rows, cols int, g Granularity, block [2]int) ([]uint8, WeightScale) {
	q := make([]uint8, len(src))
	return q, QuantizeWeightsInto(q, src, e, rows, cols, g, block)
}

// QuantizeWeightsInto is QuantizeWeights writing the codes into dst, which
// must hold len(src) bytes: a loader quantizes each expert's matrix
// straight into the expert set's buffer. It panics like QuantizeWeights,
// and if dst is shorter than src.
func QuantizeWeightsInto(dst []uint8, src []float32, e, rows, cols int, g Granularity, block [2]int) WeightScale {
	if len(src) != e*rows*cols || len(dst) < len(src) {
		panic(fmt.Sprintf("scaling: QuantizeWeights: %d values and %d codes for [%d %d %d]", len(src), len(dst), e, rows, cols))
	}
	ws := WeightScale{Granularity: g, E: e, Rows: rows, Cols: cols}
	switch g {
	case PerTensor:
		ws.Values = []float32{amaxScale(absMax(src))}
	case PerExpert:
		ws.Values = make([]float32, e)
		for i := range e {
			ws.Values[i] = amaxScale(absMax(src[i*rows*cols : (i+1)*rows*cols]))
		}
	case PerChannel:
		ws.Values = make([]float32, e*rows)
		for i := range ws.Values {
			ws.Values[i] = amaxScale(absMax(src[i*cols : (i+1)*cols]))
		}
	case Block:
		if block[0] < 1 || block[1] < 1 {
			panic(fmt.Sprintf("scaling: QuantizeWeights: block %v", block))
		}
		ws.Block = block
		nb, kb := ceilDiv(rows, block[0]), ceilDiv(cols, block[1])
		amax := make([]float32, e*nb*kb)
		for ex := range e {
			for row := range rows {
				tiles := amax[(ex*nb+row/block[0])*kb:][:kb]
				for tc := range kb {
					lo := (ex*rows+row)*cols + tc*block[1]
					a := absMax(src[lo : lo+min(block[1], cols-tc*block[1])])
					if a > tiles[tc] || a != a {
						tiles[tc] = a
					}
				}
			}
		}
		for j, a := range amax {
			amax[j] = amaxScale(a)
		}
		ws.Values = amax
	default:
		panic(fmt.Sprintf("scaling: QuantizeWeights: granularity %v", g))
	}
	// The scale is constant along a row, or along a tile's Bk columns of
	// it: one lookup per run, not per element.
	run := cols
	if g == Block {
		run = block[1]
	}
	for ex := range e {
		for row := range rows {
			base := (ex*rows + row) * cols
			for c0 := 0; c0 < cols; c0 += run {
				s := ws.At(ex, row, c0)
				for i := base + c0; i < base+min(c0+run, cols); i++ {
					dst[i] = Float32ToE4M3(src[i] / s)
				}
			}
		}
	}
	return ws
}
