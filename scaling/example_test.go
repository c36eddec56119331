package scaling_test

import (
	"fmt"

	"github.com/expertd/expertd/scaling"
)

func ExampleFloat32ToE4M3() {
	for _, x := range []float32{1, 0.3, 464, 1e9, 1.0 / 1024} {
		q := scaling.Float32ToE4M3(x)
		fmt.Printf("%g -> %#02x -> %g\n", x, q, scaling.E4M3ToFloat32(q))
	}
	// Output:
	// 1 -> 0x38 -> 1
	// 0.3 -> 0x2a -> 0.3125
	// 464 -> 0x7e -> 448
	// 1e+09 -> 0x7e -> 448
	// 0.0009765625 -> 0x00 -> 0
}

func ExampleQuantizeDynamic() {
	// Two tokens of 4 values, one scale per token (group == cols): each
	// token's largest value maps to 448 and comes back exactly; the
	// second token's small values pick up rounding error.
	src := []float32{0.5, -1, 2, 4, 100, 1, -50, 0.25}
	q := make([]uint8, len(src))
	scales := make([]float32, 2)
	scaling.QuantizeDynamic(q, scales, src, 2, 4, 4)
	back := make([]float32, len(src))
	scaling.Dequantize(back, q, scales, 2, 4, 4)
	fmt.Println(scales)
	fmt.Println(back)
	// Output:
	// [0.008928572 0.22321428]
	// [0.5 -1 2 4 100 1.0044643 -50 0.25111607]
}

func ExampleNewWeightScale() {
	// w13 of 8 experts, 256 rows, 300 columns, in [128, 128] blocks.
	_, err := scaling.NewWeightScale([]int{8, 2, 2}, make([]float32, 32), 8, 256, 300, [2]int{128, 128})
	fmt.Println(err)
	// Output:
	// bad scale shape [8 2 2] for weights [8 256 300]: want [] or [1] (per-tensor), [8] (per-expert), [8 256] (per-channel) or [8 2 3] (block [128 128])
}

func ExampleFold() {
	w13, _ := scaling.NewWeightScale([]int{2}, []float32{0.5, 0.25}, 2, 4, 4, [2]int{})
	w2, _ := scaling.NewWeightScale(nil, []float32{0.125}, 2, 4, 4, [2]int{})
	f, _ := scaling.Fold(w13, w2, 2, 4)
	fmt.Printf("%+v\n", f)
	// Output:
	// {G1Alphas:[1 0.5] A2GScale:0.25 G2Alphas:[0.5 0.5]}
}
