package cpu

import (
	"encoding/binary"

	"github.com/expertd/expertd/scaling"
)

// The expert GEMMs: C[i, r] = Σ_s aS[i, s]·wS[r, s]·Σ_{k∈s} A[i, k]·W[r, k],
// where s runs over the K segments that share one scale (one segment of
// length K outside block mode, segments of Bk in block mode), A holds the
// activations' FP8 values decoded (unscaled), and W the weights' FP8 codes.
//
// Every FP8×FP8 product is exact in float32 (4-bit by 4-bit significands),
// so the only rounding is float32 accumulation, as on the GPU's tensor cores.

// tileBytes bounds the decoded weight tile so it stays in a core's L2
// (1 MiB on this machine) next to the activation rows streaming through L1.
const tileBytes = 192 << 10

// tileRows is how many weight rows of length k to decode at once: a multiple
// of 4 (the register block of dot4), at least 4.
func tileRows(k int) int {
	r := tileBytes / (4 * k) &^ 3
	return max(r, 4)
}

// decodeFP8 writes the FP8 E4M3FN values of src into dst (len(dst) >=
// len(src)), eight codes per 64-bit load.
func decodeFP8(dst []float32, src []uint8) {
	lut := &scaling.E4M3Table
	dst = dst[:len(src)]
	i := 0
	for ; i+8 <= len(src); i += 8 {
		v := binary.LittleEndian.Uint64(src[i:])
		d := dst[i : i+8 : i+8]
		d[0] = lut[uint8(v)]
		d[1] = lut[uint8(v>>8)]
		d[2] = lut[uint8(v>>16)]
		d[3] = lut[uint8(v>>24)]
		d[4] = lut[uint8(v>>32)]
		d[5] = lut[uint8(v>>40)]
		d[6] = lut[uint8(v>>48)]
		d[7] = lut[uint8(v>>56)]
	}
	for ; i < len(src); i++ {
		dst[i] = lut[src[i]]
	}
}

// gemmArgs is one expert's tile of work.
type gemmArgs struct {
	// a are the decoded activation rows; rows[i] selects the row (of length
	// k) that is token i of this expert; aS[rows[i]*nseg+s] its scales.
	a    []float32
	rows []int32
	aS   []float32
	// w are the rt decoded weight rows [rt, k] (nil when wq is used), wq
	// the same rows as FP8 codes; wS[r*nseg+s] are their scales.
	w  []float32
	wq []uint8
	wS []float32
	rt int
	// k is the reduction length, seg the scale segment length (k outside
	// block mode), nseg = ceil(k/seg).
	k, seg, nseg int
	// c receives row i of the output at c[out[i]*ldc + col0 : +rt].
	c    []float32
	out  []int32
	ldc  int
	col0 int
}

// gemmTile computes one tile: every token row against the rt weight rows,
// four weight rows at a time. Four accumulator chains match the two FP add
// and two FP multiply pipes of a core for scalar code; more chains spill
// registers (Go's amd64 ABI leaves 15 vector registers) and run slower.
func gemmTile(g *gemmArgs) {
	k, seg, nseg := g.k, g.seg, g.nseg
	for i, row := range g.rows {
		a := g.a[int(row)*k : int(row)*k+k]
		aS := g.aS[int(row)*nseg : int(row)*nseg+nseg]
		c := g.c[int(g.out[i])*g.ldc+g.col0 : int(g.out[i])*g.ldc+g.col0+g.rt]
		r := 0
		for ; r+4 <= g.rt; r += 4 {
			var c0, c1, c2, c3 float32
			for s := range nseg {
				lo, hi := s*seg, min((s+1)*seg, k)
				var d0, d1, d2, d3 float32
				if g.w != nil {
					d0, d1, d2, d3 = dot4(a[lo:hi], g.w[r*k+lo:r*k+hi], g.w[(r+1)*k+lo:(r+1)*k+hi],
						g.w[(r+2)*k+lo:(r+2)*k+hi], g.w[(r+3)*k+lo:(r+3)*k+hi])
				} else {
					d0, d1, d2, d3 = dot4q(a[lo:hi], g.wq[r*k+lo:r*k+hi], g.wq[(r+1)*k+lo:(r+1)*k+hi],
						g.wq[(r+2)*k+lo:(r+2)*k+hi], g.wq[(r+3)*k+lo:(r+3)*k+hi])
				}
				as := aS[s]
				c0 += d0 * (as * g.wS[(r+0)*nseg+s])
				c1 += d1 * (as * g.wS[(r+1)*nseg+s])
				c2 += d2 * (as * g.wS[(r+2)*nseg+s])
				c3 += d3 * (as * g.wS[(r+3)*nseg+s])
			}
			c[r], c[r+1], c[r+2], c[r+3] = c0, c1, c2, c3
		}
		for ; r < g.rt; r++ {
			var c0 float32
			for s := range nseg {
				lo, hi := s*seg, min((s+1)*seg, k)
				var d float32
				if g.w != nil {
					d = dot1(a[lo:hi], g.w[r*k+lo:r*k+hi])
				} else {
					d = dot1q(a[lo:hi], g.wq[r*k+lo:r*k+hi])
				}
				c0 += d * (aS[s] * g.wS[r*nseg+s])
			}
			c[r] = c0
		}
	}
}

// dot4q is dot4 over FP8 weight codes, decoded through the table in the loop.
func dot4q(a []float32, w0, w1, w2, w3 []uint8) (s0, s1, s2, s3 float32) {
	lut := &scaling.E4M3Table
	n := len(a)
	w0, w1, w2, w3 = w0[:n], w1[:n], w2[:n], w3[:n]
	for k, x := range a {
		s0 += x * lut[w0[k]]
		s1 += x * lut[w1[k]]
		s2 += x * lut[w2[k]]
		s3 += x * lut[w3[k]]
	}
	return
}

// dot1q is dot1 over FP8 weight codes, with dot1's two chains: whether a
// tile is decoded first depends on how many tokens its expert has, so the
// two must sum in the same order for a token's result not to depend on the
// other tokens of its call (dynamic batching in the service relies on it).
func dot1q(a []float32, w []uint8) float32 {
	lut := &scaling.E4M3Table
	w = w[:len(a)]
	var s0, s1 float32
	k := 0
	for ; k+2 <= len(a); k += 2 {
		s0 += a[k] * lut[w[k]]
		s1 += a[k+1] * lut[w[k+1]]
	}
	if k < len(a) {
		s0 += a[k] * lut[w[k]]
	}
	return s0 + s1
}

// dot1 is a plain dot product with two accumulator chains.
func dot1(a, w []float32) float32 {
	w = w[:len(a)]
	var s0, s1 float32
	k := 0
	for ; k+2 <= len(a); k += 2 {
		s0 += a[k] * w[k]
		s1 += a[k+1] * w[k+1]
	}
	if k < len(a) {
		s0 += a[k] * w[k]
	}
	return s0 + s1
}
