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
// =0 never. The CUTLASS GEMM1 takes a ReLU² layer's GEMM1 under the same
// conditions, with no expert bias and one activation scale for the call;
// it is off unless EXPERTD_SM90_CUTLASS1=1 (scripts/device-check.sh runs
// these tests that way too). The cases here meet the default rule with
// small E, so the float64 reference stays cheap; every GEMM path runs them,
// the portable ones beside it.

// logCutlass says whether this library and card run the CUTLASS GEMMs.
// Under EXPERTD_CUDA_REQUIRE=1 (scripts/device-check.sh) a Hopper library
// built without them fails the test: the cases would check only the other
// kernels.
func logCutlass(t *testing.T, b *Backend) {
	t.Helper()
	switch {
	case strings.Contains(b.info, "gemm2=cutlass"):
		t.Logf("GEMMs on CUTLASS where the rules allow (EXPERTD_SM90_CUTLASS=%q, EXPERTD_SM90_CUTLASS1=%q): %s",
			os.Getenv("EXPERTD_SM90_CUTLASS"), os.Getenv("EXPERTD_SM90_CUTLASS1"), b.info)
	case strings.Contains(b.info, "gemm=sm90") && os.Getenv("EXPERTD_CUDA_REQUIRE") == "1":
		t.Fatalf("%s: a Hopper library without the CUTLASS GEMMs (built with EXPERTD_CUTLASS=0?)", b.info)
	default:
		t.Logf("no CUTLASS GEMMs on this card or library (%s): the cases check the other kernels", b.info)
	}
}

// cutlassCases: SiLU-gated and ReLU² layers at 192 rows per expert or more
// with static scales; BF16 and FP32 outputs, per-expert weight scales, FP8
// and BF16 hidden states, all tokens to one expert first, and expert
// biases (GEMM2's added in the combine). The ReLU² layer without biases is
// the CUTLASS GEMM1's. K = 400 and N = 208 leave CUTLASS's last 256-wide
// output tile and 128-deep K tile partial (for GEMM1 too: N = 208 output
// channels, K = 400 deep).
func cutlassCases() []kerneltest.Case {
	silu := kerneltest.Shape{Name: "cutlass-silu", Activation: moe.SiluGated, E: 8, TopK: 2, K: 512, N: 256,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1}
	reluBias := kerneltest.Shape{Name: "cutlass-relu2-bias", Activation: moe.Relu2, E: 8, TopK: 2, K: 400, N: 208,
		Scoring: moe.Sigmoid, Renormalize: true, Bias: true, NumGroups: 1, TopKGroups: 1, ScalingFactor: 2.5,
		ExpertBias: true}
	relu := kerneltest.Shape{Name: "cutlass-relu2", Activation: moe.Relu2, E: 8, TopK: 2, K: 400, N: 208,
		Scoring: moe.Sigmoid, Renormalize: true, Bias: true, NumGroups: 1, TopKGroups: 1, ScalingFactor: 2.5}
	static := kerneltest.WithStaticScales()
	fp8 := kerneltest.WithHidden(moe.Float8E4M3FN)
	type opts = []kerneltest.Option
	return []kerneltest.Case{
		{Name: "cutlass/silu/K=512,N=256/M=800/static", Shape: silu, M: 800, Opts: opts{static}},
		{Name: "cutlass/silu/K=512,N=256/M=780/static/per-expert/fp32-out", Shape: silu, M: 780,
			Opts: opts{static, kerneltest.WithGranularity(scaling.PerExpert), kerneltest.WithOutput(moe.Float32)}},
		{Name: "cutlass/silu/K=512,N=256/M=900/static/all-to-one", Shape: silu, M: 900,
			Opts: opts{static, kerneltest.WithAllTokensTo(3)}},
		{Name: "cutlass/relu2-bias/K=400,N=208/M=800/static", Shape: reluBias, M: 800, Opts: opts{static}},
		{Name: "cutlass/relu2-bias/K=400,N=208/M=840/static/fp8-in/fp32-out", Shape: reluBias, M: 840,
			Opts: opts{static, fp8, kerneltest.WithOutput(moe.Float32)}},
		{Name: "cutlass/relu2/K=400,N=208/M=768/static", Shape: relu, M: 768, Opts: opts{static}},
		{Name: "cutlass/relu2/K=400,N=208/M=790/static/fp8-in", Shape: relu, M: 790, Opts: opts{static, fp8}},
		{Name: "cutlass/relu2/K=400,N=208/M=820/static/fp8-in/per-expert/fp32-out", Shape: relu, M: 820,
			Opts: opts{static, fp8, kerneltest.WithGranularity(scaling.PerExpert), kerneltest.WithOutput(moe.Float32)}},
		{Name: "cutlass/relu2/K=400,N=208/M=900/static/all-to-one", Shape: relu, M: 900,
			Opts: opts{static, kerneltest.WithAllTokensTo(5)}},
	}
}

// TestCutlassGemm2 runs cutlassCases through checkCase.
func TestCutlassGemm2(t *testing.T) {
	b := gpuBackend(t)
	logCutlass(t, b)
	checkCases(t, b, cpu.New(kernels.Config{}), cutlassCases())
}

// TestCutlassDropped sends precomputed ids that route every token to
// experts 0-9 of 16, so six experts have no rows, and give every fifth pair
// an id out of range (-1 or E), which the library drops: the output must be
// the reference's with those pairs' weights 0, in BF16 and FP32, for a
// SiLU-gated layer with expert biases (a dropped pair adds no GEMM2 bias
// either) and a ReLU² layer without (the CUTLASS GEMM1's).
func TestCutlassDropped(t *testing.T) {
	b := gpuBackend(t)
	logCutlass(t, b)
	ref := cpu.New(kernels.Config{})
	shapes := []kerneltest.Shape{
		{Name: "cutlass-dropped-silu", Activation: moe.SiluGated, E: 16, TopK: 2, K: 512, N: 256,
			Scoring: moe.Softmax, ScalingFactor: 1, ExpertBias: true},
		{Name: "cutlass-dropped-relu2", Activation: moe.Relu2, E: 16, TopK: 2, K: 400, N: 208,
			Scoring: moe.Softmax, ScalingFactor: 1},
	}
	const m, used = 1600, 10
	for _, shape := range shapes {
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
			want := kerneltest.Expect(set, &refReq)
			cres, err := ref.FusedMoE(t.Context(), mustLoad(t, ref, set), &refReq)
			if err != nil {
				t.Fatalf("cpu backend: %v", err)
			}
			l := mustLoad(t, b, set)
			name := fmt.Sprintf("%s/K=%d,N=%d/M=%d/static/%v (seed %d)", shape.Name, shape.K, shape.N, m, out, seed)
			checkPaths(t, b, l, name, set, &gpuReq, expected{ref: want, cpu: decode64(out, cres.Output),
				ids: gpuReq.TopKIDs, weights: gpuReq.TopKWeights})
		}
	}
}

// TestCutlassGemm1HiddenScales gives a ReLU² layer with a static a13
// scale FP8 hidden states with no scale of their own (the a13 scale
// applies, which the CUTLASS GEMM1 folds into its alpha) and with a scale
// per token (half the tokens at half the scale): the CUTLASS GEMM1's alpha
// is one per expert, so its rule must leave the second call to the
// hand-written kernels, which read each row's scale, even under
// EXPERTD_SM90_CUTLASS1=1.
func TestCutlassGemm1HiddenScales(t *testing.T) {
	b := gpuBackend(t)
	logCutlass(t, b)
	ref := cpu.New(kernels.Config{})
	shape := kerneltest.Shape{Name: "cutlass-relu2-hidden-scales", Activation: moe.Relu2, E: 8, TopK: 2, K: 400,
		N: 208, Scoring: moe.Softmax, ScalingFactor: 1}
	const m = 800
	for _, perToken := range []bool{false, true} {
		seed := caseSeed(t)
		set, req := kerneltest.NewCase(rand.New(rand.NewPCG(seed, 5)), shape, m, kerneltest.WithStaticScales(),
			kerneltest.WithHidden(moe.Float8E4M3FN))
		what := "no hidden scale"
		sc := req.HiddenScale[0]
		req.HiddenScale = nil
		if perToken {
			what = "a scale per token"
			req.HiddenScale = make([]float32, m)
			for tok := range m {
				req.HiddenScale[tok] = sc / float32(1+tok%2)
			}
		}
		checkCase(t, b, ref, fmt.Sprintf("%s/K=400,N=208/M=%d/fp8-in, %s (seed %d)", shape.Name, m, what, seed),
			set, req)
	}
}
