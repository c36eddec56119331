package cuda

import (
	"math/rand/v2"
	"testing"

	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// TestBlockScales checks that a block set's weight scales, whatever their
// granularity, reach the library in its block layout with every weight
// element seeing the scale its granularity gives it.
func TestBlockScales(t *testing.T) {
	shape := kerneltest.Shape{Name: "s", Activation: moe.SiluGated, E: 3, TopK: 1, K: 40, N: 20,
		Scoring: moe.Softmax, ScalingFactor: 1}
	block := [2]int{8, 16}
	for _, tt := range []struct {
		g      scaling.Granularity
		opt    kerneltest.Option
		wantBn int
	}{
		{scaling.PerTensor, kerneltest.WithGranularity(scaling.PerTensor), block[0]},
		{scaling.PerExpert, kerneltest.WithGranularity(scaling.PerExpert), block[0]},
		{scaling.PerChannel, kerneltest.WithGranularity(scaling.PerChannel), 1},
		{scaling.Block, kerneltest.WithBlock(block[0], block[1]), block[0]},
	} {
		t.Run(tt.g.String(), func(t *testing.T) {
			set, _ := kerneltest.NewCase(rand.New(rand.NewPCG(1, 2)), shape, 1, tt.opt)
			set.Block = block
			s13, s2, bn := blockScales(set)
			if bn != tt.wantBn {
				t.Fatalf("bn = %d, want %d", bn, tt.wantBn)
			}
			for _, w := range []struct {
				name       string
				got        []float32
				ws         scaling.WeightScale
				rows, cols int
			}{{"w13", s13, set.W13Scale, set.Rows1(), set.K}, {"w2", s2, set.W2Scale, set.K, set.N}} {
				nr, nc := (w.rows+bn-1)/bn, (w.cols+block[1]-1)/block[1]
				if len(w.got) != set.E*nr*nc {
					t.Fatalf("%s: %d scales, want %d", w.name, len(w.got), set.E*nr*nc)
				}
				for e := range set.E {
					for r := range w.rows {
						for c := range w.cols {
							got, want := w.got[(e*nr+r/bn)*nc+c/block[1]], w.ws.At(e, r, c)
							if got != want {
								t.Fatalf("%s: element (%d, %d, %d) scaled by %v, want %v", w.name, e, r, c, got, want)
							}
						}
					}
				}
			}
		})
	}
}
