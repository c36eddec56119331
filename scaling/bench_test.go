package scaling

import "testing"

// The CPU backend quantizes every intermediate activation with these, so
// their cost shows in its GEMM-bound numbers; run with -bench=. to see it.

func BenchmarkFloat32ToE4M3(b *testing.B) {
	src := randn(newRNG(), 4096, 10)
	var sink uint8
	for b.Loop() {
		for _, x := range src {
			sink ^= Float32ToE4M3(x)
		}
	}
	b.SetBytes(int64(4 * len(src)))
	_ = sink
}

func BenchmarkQuantizeDynamicGroup128(b *testing.B) {
	const rows, cols = 16, 2048
	src := randn(newRNG(), rows*cols, 0.1)
	dst := make([]uint8, len(src))
	scales := make([]float32, rows*cols/128)
	for b.Loop() {
		QuantizeDynamic(dst, scales, src, rows, cols, 128)
	}
	b.SetBytes(int64(4 * len(src)))
}
