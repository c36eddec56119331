package cuda

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// selfTestTol is MOE_SPEC.md's FP8 correctness bar (kerneltest.FP8Tol),
// restated so the daemon links no test helper.
const selfTestTol = 2e-2

// selfTest runs one small random case and compares it with the CPU
// backend: a library that loads but computes garbage must not serve.
func (b *Backend) selfTest() error { return selfCheck(context.Background(), b) }

// selfCheck runs a fresh random case on b and on the CPU backend and
// compares the outputs by relative L2 error. The intermediate is 256 wide
// and 16 tokens average over 32 routed pairs, so an intermediate element
// at an E4M3 rounding midpoint, which Hopper's FP8 accumulation may round
// either way (kerneltest.ReferenceTol), moves the error a few times less
// than at 64 wide and a few tokens, where one such flip can fail a correct
// library.
func selfCheck(ctx context.Context, b kernels.Backend) error {
	const e, k, n, m = 8, 96, 256, 16
	rng := rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	randn := func(cnt int, scale float64) []float32 {
		v := make([]float32, cnt)
		for i := range v {
			v[i] = float32(rng.NormFloat64() * scale)
		}
		return v
	}
	set := &moe.ExpertSet{Activation: moe.SiluGated, E: e, K: k, N: n}
	set.W13, set.W13Scale = scaling.QuantizeWeights(randn(e*2*n*k, 1), e, 2*n, k, scaling.PerExpert, [2]int{})
	set.W2, set.W2Scale = scaling.QuantizeWeights(randn(e*k*n, 1), e, k, n, scaling.PerExpert, [2]int{})
	hidden := make([]byte, 2*m*k)
	for i, x := range randn(m*k, 0.1) {
		binary.LittleEndian.PutUint16(hidden[2*i:], scaling.Float32ToBF16(x))
	}
	logits := make([]byte, 4*m*e)
	for i, x := range randn(m*e, 1) {
		binary.LittleEndian.PutUint32(logits[4*i:], math.Float32bits(x))
	}
	req := &moe.Request{
		Hidden:   moe.Tensor{DType: moe.BFloat16, Shape: []int{m, k}, Data: hidden},
		Logits:   moe.Tensor{DType: moe.Float32, Shape: []int{m, e}, Data: logits},
		Routing:  moe.Routing{TopK: 2, Renormalize: true, Scoring: moe.Softmax, ScalingFactor: 1},
		OutDType: moe.BFloat16,
	}
	got, err := kernels.Run(ctx, b, set, req)
	if err != nil {
		return err
	}
	want, err := kernels.Run(ctx, cpu.New(kernels.Config{Threads: 1}), set, req)
	if err != nil {
		return fmt.Errorf("cpu reference: %w", err)
	}
	var num, den float64
	for i := range m * k {
		g := float64(scaling.BF16ToFloat32(binary.LittleEndian.Uint16(got.Output[2*i:])))
		w := float64(scaling.BF16ToFloat32(binary.LittleEndian.Uint16(want.Output[2*i:])))
		num += (g - w) * (g - w)
		den += w * w
	}
	if e := math.Sqrt(num / den); !(e <= selfTestTol) {
		return fmt.Errorf("rel-L2 %.3g against the CPU backend, want <= %g", e, selfTestTol)
	}
	return nil
}
