//go:build goexperiment.simd && amd64

package cpu

import "simd/archsimd"

// With GOEXPERIMENT=simd the decoded-tile dot products use AVX-512 FMAs
// when the CPU has them (about four times the scalar kernel on one core of
// the machine in docs/perf-notes.md), which makes decoding a tile first pay
// off from two tokens on.
var haveAVX512 = archsimd.X86.AVX512()

// decodeMinRows: see dot_scalar.go.
var decodeMinRows = func() int {
	if haveAVX512 {
		return 2
	}
	return 5
}()

// simdKernel names the dot4 in use, for Capabilities.
var simdKernel = func() string {
	if haveAVX512 {
		return "avx512"
	}
	return "scalar"
}()

// dot4 is four dot products sharing one activation row. FP8×FP8 products
// are exact in float32, so the fused multiply-adds round exactly as
// multiply-then-add would; only the summation order differs from the
// scalar kernel (16 lanes, then a horizontal sum).
func dot4(a, w0, w1, w2, w3 []float32) (s0, s1, s2, s3 float32) {
	n := len(a)
	w0, w1, w2, w3 = w0[:n], w1[:n], w2[:n], w3[:n]
	k := 0
	if haveAVX512 {
		var c0, c1, c2, c3 archsimd.Float32x16
		for ; k+16 <= n; k += 16 {
			x := archsimd.LoadFloat32x16Slice(a[k:])
			c0 = x.MulAdd(archsimd.LoadFloat32x16Slice(w0[k:]), c0)
			c1 = x.MulAdd(archsimd.LoadFloat32x16Slice(w1[k:]), c1)
			c2 = x.MulAdd(archsimd.LoadFloat32x16Slice(w2[k:]), c2)
			c3 = x.MulAdd(archsimd.LoadFloat32x16Slice(w3[k:]), c3)
		}
		s0, s1, s2, s3 = hsum(c0), hsum(c1), hsum(c2), hsum(c3)
	}
	for ; k < n; k++ {
		x := a[k]
		s0 += x * w0[k]
		s1 += x * w1[k]
		s2 += x * w2[k]
		s3 += x * w3[k]
	}
	return
}

func hsum(v archsimd.Float32x16) float32 {
	var t [16]float32
	v.Store(&t)
	var s float32
	for _, x := range t {
		s += x
	}
	return s
}
