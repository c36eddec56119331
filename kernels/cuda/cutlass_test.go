package cuda

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// The CUTLASS GEMM2 (csrc/gemm_cutlass.h) runs a call's GEMM2 on the Hopper
// path by the library's default rule when the set has static activation
// scales and one weight scale per expert (per-tensor or per-expert), K and
// N are multiples of 16, and the call routes at least 192 rows per expert
// on average; EXPERTD_SM90_CUTLASS=1 takes it wherever the set allows,
// =0 never. The cases here meet the default rule with small E, so the
// float64 reference stays cheap; every GEMM path runs them, the portable
// ones beside it.

// logCutlass2 says whether this library and card run the CUTLASS GEMM2.
// Under EXPERTD_CUDA_REQUIRE=1 (scripts/device-check.sh) a Hopper library
// built without it fails the test: the cases would check only the other
// kernels.
func logCutlass2(t *testing.T, b *Backend) {
	t.Helper()
	switch {
	case strings.Contains(b.info, "gemm2=cutlass"):
		t.Logf("GEMM2 on CUTLASS where the rule allows (EXPERTD_SM90_CUTLASS=%q): %s", os.Getenv("EXPERTD_SM90_CUTLASS"), b.info)
	case strings.Contains(b.info, "gemm=sm90") && os.Getenv("EXPERTD_CUDA_REQUIRE") == "1":
		t.Fatalf("%s: a Hopper library without the CUTLASS GEMM2 (built with EXPERTD_CUTLASS=0?)", b.info)
	default:
		t.Logf("no CUTLASS GEMM2 on this card or library (%s): the cases check the other kernels", b.info)
	}
}

// cutlassCases: SiLU-gated and ReLU² layers at 192 rows per expert or more
// with static scales; BF16 and FP32 outputs, per-expert weight scales, FP8
// hidden states, all tokens to one expert first, and expert biases (GEMM2's
// added in the combine). K = 400 and N = 208 leave CUTLASS's last 256-wide
// output tile and 128-deep K tile partial.
func cutlassCases() []kerneltest.Case {
	silu := kerneltest.Shape{Name: "cutlass-silu", Activation: moe.SiluGated, E: 8, TopK: 2, K: 512, N: 256,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1}
	relu := kerneltest.Shape{Name: "cutlass-relu2-bias", Activation: moe.Relu2, E: 8, TopK: 2, K: 400, N: 208,
		Scoring: moe.Sigmoid, Renormalize: true, Bias: true, NumGroups: 1, TopKGroups: 1, ScalingFactor: 2.5,
		ExpertBias: true}
	static := kerneltest.WithStaticScales()
	type opts = []kerneltest.Option
	return []kerneltest.Case{
		{Name: "cutlass/silu/K=512,N=256/M=800/static", Shape: silu, M: 800, Opts: opts{static}},
		{Name: "cutlass/silu/K=512,N=256/M=780/static/per-expert/fp32-out", Shape: silu, M: 780,
			Opts: opts{static, kerneltest.WithGranularity(scaling.PerExpert), kerneltest.WithOutput(moe.Float32)}},
		{Name: "cutlass/silu/K=512,N=256/M=900/static/all-to-one", Shape: silu, M: 900,
			Opts: opts{static, kerneltest.WithAllTokensTo(3)}},
		{Name: "cutlass/relu2-bias/K=400,N=208/M=800/static", Shape: relu, M: 800, Opts: opts{static}},
		{Name: "cutlass/relu2-bias/K=400,N=208/M=840/static/fp8-in/fp32-out", Shape: relu, M: 840,
			Opts: opts{static, kerneltest.WithHidden(moe.Float8E4M3FN), kerneltest.WithOutput(moe.Float32)}},
	}
}

// TestCutlassGemm2 runs cutlassCases through checkCase.
func TestCutlassGemm2(t *testing.T) {
	b := gpuBackend(t)
	logCutlass2(t, b)
	checkCases(t, b, cpu.New(kernels.Config{}), cutlassCases())
}

// TestCutlassGemm2Dropped sends precomputed ids that route every token to
// experts 0-9 of 16, so six experts have no rows, and give every fifth pair
// an id out of range (-1 or E), which the library drops: the output must be
// the reference's with those pairs' weights 0, in BF16 and FP32, with
// expert biases (a dropped pair adds no GEMM2 bias either).
func TestCutlassGemm2Dropped(t *testing.T) {
	b := gpuBackend(t)
	logCutlass2(t, b)
	ref := cpu.New(kernels.Config{})
	shape := kerneltest.Shape{Name: "cutlass-dropped", Activation: moe.SiluGated, E: 16, TopK: 2, K: 512, N: 256,
		Scoring: moe.Softmax, ScalingFactor: 1, ExpertBias: true}
	const m, used = 1600, 10
	for _, out := range []moe.DType{moe.BFloat16, moe.Float32} {
		seed := caseSeed(t)
		rng := rand.New(rand.NewPCG(seed, 3))
		set, req := kerneltest.NewCase(rng, shape, m, kerneltest.WithStaticScales(), kerneltest.WithPrecomputedRouting(),
			kerneltest.WithOutput(out))
		k := shape.TopK
		refReq, gpuReq := *req, *req
		refReq.TopKIDs, refReq.TopKWeights = make([]int32, m*k), slices.Clone(req.TopKWeights)
		gpuReq.TopKIDs = make([]int32, m*k)
		for tok := range m {
			for j, e := range rng.Perm(used)[:k] {
				i := tok*k + j
				refReq.TopKIDs[i], gpuReq.TopKIDs[i] = int32(e), int32(e)
				if i%5 == 4 {
					refReq.TopKWeights[i] = 0
					gpuReq.TopKIDs[i] = -1
					if i%10 == 9 {
						gpuReq.TopKIDs[i] = int32(shape.E)
					}
				}
			}
		}
		want, _, _, tol := kerneltest.ReferenceTol(set, &refReq)
		cres, err := ref.FusedMoE(t.Context(), mustLoad(t, ref, set), &refReq)
		if err != nil {
			t.Fatalf("cpu backend: %v", err)
		}
		l := mustLoad(t, b, set)
		name := fmt.Sprintf("cutlass-dropped/K=512,N=256/M=%d/static/%v (seed %d)", m, out, seed)
		checkPaths(t, b, l, name, set, &gpuReq, expected{out: want, cpu: decode64(out, cres.Output),
			ids: gpuReq.TopKIDs, weights: gpuReq.TopKWeights, tol: tol})
	}
}
