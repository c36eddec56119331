package kerneltest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// FP8Tol is MOE_SPEC.md's correctness bar: relative L2 error against
// Reference with FP8 activations and weights.
const FP8Tol = 2e-2

// Case is one entry of CheckBackend's table.
type Case struct {
	Name  string
	Shape Shape
	M     int
	Opts  []Option
	// Tol is the relative-L2 bound; 0 means ReferenceTol's.
	Tol float64
	// EmptyExperts requires that some expert receives no token, so the case
	// really exercises that edge.
	EmptyExperts bool
}

// New generates the case's problem as NewCase does, except that the expert
// weights are shared process-wide between cases of the same shape and
// granularity (generated once from a seed derived from them; callers must
// not modify them). Hidden states, logits and biases come fresh from rng.
// Weight quantization is most of a case's cost, so tables run several times
// faster this way, under -race especially.
func (c Case) New(rng *rand.Rand) (*moe.ExpertSet, *moe.Request) {
	return newCase(rng, c.Shape, c.M, sharedWeights, c.Opts...)
}

// Cases is the default table: each reference shape scaled down so the whole
// table runs in seconds under -race (E, top-k, routing and block shape
// kept; K and N often not multiples of 16 or 128), and the edge cases of
// MOE_SPEC.md: M=1, experts with no tokens, all tokens to one expert,
// top_k = E, odd K and N, K smaller than one block, plus every option:
// granularities, static scales, FP8/BF16/FP32 hidden input, BF16 logits,
// precomputed routing, FP32 output.
func Cases() []Case {
	// Sizes are set by the weight generation (E·(Rows1+N)·K FP8 encodes per
	// case), which dominates the table's time under -race.
	nemo := Nemotron.Scaled(136, 72)
	qwen := Qwen3.Scaled(128, 48)
	mix := Mixtral.Scaled(200, 344)
	dsv3 := DeepSeekV3.Scaled(136, 40) // two K blocks (128+8)
	topKE := Mixtral.Scaled(80, 40)
	topKE.Name, topKE.TopK = "Mixtral/top_k=E", 8
	sigE := Shape{Name: "sigmoid/top_k=E", Activation: moe.Relu2, E: 8, TopK: 8, K: 48, N: 40,
		Scoring: moe.Sigmoid, Renormalize: true, Bias: true, NumGroups: 2, TopKGroups: 2, ScalingFactor: 2.5}
	// K and N multiples of 16, which the Hopper kernels need: the one-token
	// FP8 cases at the end take the CUDA backend's decode path, where GEMM1
	// routes the token itself. New cases go last: a case's data comes from
	// its place in the table.
	nemo16 := Nemotron.Scaled(128, 64)
	odd := Shape{Name: "odd/K=77,N=45", Activation: moe.SiluGated, E: 6, TopK: 3, K: 77, N: 45,
		Scoring: moe.Sigmoid, Bias: true, NumGroups: 3, TopKGroups: 2, ScalingFactor: 1.5}
	return []Case{
		{Name: "Nemotron/M=16", Shape: nemo, M: 16, EmptyExperts: true},
		{Name: "Nemotron/M=1", Shape: nemo, M: 1, EmptyExperts: true},
		{Name: "Nemotron/M=40/per-channel/fp32-out", Shape: nemo, M: 40,
			Opts: []Option{WithGranularity(scaling.PerChannel), WithOutput(moe.Float32)}},
		{Name: "Nemotron/M=8/static/fp8-in", Shape: nemo, M: 8,
			Opts: []Option{WithStaticScales(), WithHidden(moe.Float8E4M3FN)}},
		{Name: "Qwen3/M=16/per-expert", Shape: qwen, M: 16, Opts: []Option{WithGranularity(scaling.PerExpert)}},
		{Name: "Qwen3/M=12/block/bf16-logits", Shape: qwen, M: 12,
			Opts: []Option{WithBlock(128, 128), WithLogits(moe.BFloat16)}},
		{Name: "Qwen3/M=32/all-to-one", Shape: qwen, M: 32, Opts: []Option{WithAllTokensTo(5)}, EmptyExperts: true},
		{Name: "Qwen3/M=7/fp8-in-per-tensor", Shape: qwen, M: 7,
			Opts: []Option{WithHidden(moe.Float8E4M3FN), WithHiddenScale(scaling.PerTensor)}},
		{Name: "Mixtral/M=48/fp8-in", Shape: mix, M: 48, Opts: []Option{WithHidden(moe.Float8E4M3FN)}},
		{Name: "Mixtral/M=1", Shape: mix, M: 1, EmptyExperts: true},
		{Name: "Mixtral/M=20/static/fp32-in", Shape: mix, M: 20,
			Opts: []Option{WithStaticScales(), WithHidden(moe.Float32), WithGranularity(scaling.PerChannel)}},
		{Name: "Mixtral/M=9/precomputed/all-to-one", Shape: mix, M: 9,
			Opts: []Option{WithPrecomputedRouting(), WithAllTokensTo(7), WithOutput(moe.Float32)}},
		{Name: "DeepSeekV3/M=16", Shape: dsv3, M: 16, EmptyExperts: true},
		{Name: "DeepSeekV3/M=1/fp8-in-per-group", Shape: dsv3, M: 1,
			Opts: []Option{WithHidden(moe.Float8E4M3FN), WithHiddenScale(scaling.Block)}, EmptyExperts: true},
		{Name: "DeepSeekV3/M=6/fp8-in-per-tensor/static", Shape: dsv3, M: 6,
			Opts: []Option{WithHidden(moe.Float8E4M3FN), WithStaticScales()}},
		// Enough tokens that the CUDA backend quantizes each token once
		// before the gather instead of once per routed pair in it.
		{Name: "Qwen3/M=300/bf16-in", Shape: qwen, M: 300},
		{Name: "Nemotron/M=420/static/fp32-in", Shape: nemo, M: 420,
			Opts: []Option{WithStaticScales(), WithHidden(moe.Float32)}},
		{Name: "DeepSeekV3/M=300/bf16-in-per-group", Shape: dsv3, M: 300},
		{Name: "top_k=E/softmax", Shape: topKE, M: 5},
		// Enough routed pairs (8192 and more) that the CUDA backend aligns
		// them over many blocks.
		{Name: "top_k=E/M=1030", Shape: topKE, M: 1030},
		{Name: "Qwen3/M=1024", Shape: qwen, M: 1024},
		{Name: "top_k=E/sigmoid-groups", Shape: sigE, M: 7, Opts: []Option{WithOutput(moe.Float32)}},
		{Name: "odd/block-wider-than-K", Shape: odd, M: 11, Opts: []Option{WithBlock(32, 128)}},
		{Name: "odd/block-16x24/fp8-per-group", Shape: odd, M: 13,
			Opts: []Option{WithBlock(16, 24), WithHidden(moe.Float8E4M3FN), WithHiddenScale(scaling.Block)}},
		{Name: "odd/per-channel/precomputed", Shape: odd, M: 3,
			Opts: []Option{WithGranularity(scaling.PerChannel), WithPrecomputedRouting()}},
		{Name: "Nemotron/M=1/fp8-in", Shape: nemo16, M: 1, Opts: []Option{WithHidden(moe.Float8E4M3FN)}},
		{Name: "Nemotron/M=1/fp8-in/static/per-channel/bf16-logits", Shape: nemo16, M: 1,
			Opts: []Option{WithHidden(moe.Float8E4M3FN), WithStaticScales(), WithGranularity(scaling.PerChannel),
				WithLogits(moe.BFloat16)}},
		{Name: "Qwen3/M=1/fp8-in-per-tensor/per-channel/fp32-out", Shape: qwen, M: 1,
			Opts: []Option{WithHidden(moe.Float8E4M3FN), WithHiddenScale(scaling.PerTensor),
				WithGranularity(scaling.PerChannel), WithOutput(moe.Float32)}},
		{Name: "Qwen3/M=1/fp8-in/static/precomputed", Shape: qwen, M: 1,
			Opts: []Option{WithHidden(moe.Float8E4M3FN), WithStaticScales(), WithPrecomputedRouting()}},
	}
}

// ActivationCases is the table of the gated activations beyond SiluGated
// and of expert biases: gpt-oss's clamped SwiGLU (at its own limit and at a
// small one that clamps most gates and ups), both GeGLUs, biases with
// every activation, Qwen3-Next's E = 512 and a top_k of 16, and E = 512
// with top_k = 16 under sigmoid scores ranked with a correction bias
// (GLM-4.5's and MiniMax-M2's routing) for a gated and a ReLU² layer. Each
// shape is scaled down like Cases'; K and N are multiples of 16 so the
// Hopper kernels can take every case.
func ActivationCases() []Case {
	oai := GptOss.Scaled(96, 64)
	clamp := Shape{Name: "SwigluOAI/limit=0.5", Activation: moe.SwigluOAI, E: 16, TopK: 4, K: 64, N: 48,
		Scoring: moe.Softmax, Renormalize: true, ExpertBias: true, ScalingFactor: 1, SwigluLimit: 0.5, SwigluAlpha: 1}
	geluTanh := Shape{Name: "GeluTanhGated", Activation: moe.GeluTanhGated, E: 12, TopK: 3, K: 80, N: 48,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1}
	gelu := Shape{Name: "GeluGated", Activation: moe.GeluGated, E: 12, TopK: 3, K: 80, N: 48,
		Scoring: moe.Sigmoid, Bias: true, Renormalize: true, ScalingFactor: 2.5, ExpertBias: true}
	relu2 := Nemotron.Scaled(64, 48)
	relu2.Name, relu2.ExpertBias = "Nemotron/bias", true
	next := Qwen3Next.Scaled(32, 32)
	top16 := next
	top16.Name, top16.TopK = "Qwen3Next/top_k=16", 16
	sigBias := Shape{Name: "sigmoid-bias/E=512/top_k=16", Activation: moe.SiluGated, E: 512, TopK: 16, K: 48, N: 32,
		Scoring: moe.Sigmoid, Bias: true, Renormalize: true, ScalingFactor: 2.5}
	relu512 := Shape{Name: "Relu2/E=512/top_k=16", Activation: moe.Relu2, E: 512, TopK: 16, K: 64, N: 48,
		Scoring: moe.Sigmoid, Bias: true, Renormalize: true, NumGroups: 1, TopKGroups: 1, ScalingFactor: 2.5}
	return []Case{
		{Name: "GptOss/M=16", Shape: oai, M: 16, EmptyExperts: true},
		{Name: "GptOss/M=1/fp8-in", Shape: oai, M: 1, Opts: []Option{WithHidden(moe.Float8E4M3FN)}},
		{Name: "GptOss/M=24/per-channel/static", Shape: oai, M: 24,
			Opts: []Option{WithGranularity(scaling.PerChannel), WithStaticScales()}},
		{Name: "GptOss/M=9/block", Shape: oai, M: 9, Opts: []Option{WithBlock(32, 32), WithOutput(moe.Float32)}},
		{Name: "SwigluOAI/limit=0.5/M=20/per-channel", Shape: clamp, M: 20,
			Opts: []Option{WithGranularity(scaling.PerChannel)}},
		{Name: "GeluTanhGated/M=10", Shape: geluTanh, M: 10},
		{Name: "GeluTanhGated/M=1/fp8-in/per-channel", Shape: geluTanh, M: 1,
			Opts: []Option{WithHidden(moe.Float8E4M3FN), WithGranularity(scaling.PerChannel)}},
		{Name: "GeluGated/M=14/bias/per-expert", Shape: gelu, M: 14, Opts: []Option{WithGranularity(scaling.PerExpert)}},
		{Name: "GeluGated/M=5/bias/precomputed", Shape: gelu, M: 5, Opts: []Option{WithPrecomputedRouting()}},
		{Name: "Nemotron/M=12/bias", Shape: relu2, M: 12},
		{Name: "Qwen3Next/M=40", Shape: next, M: 40, EmptyExperts: true},
		{Name: "Qwen3Next/M=1", Shape: next, M: 1, EmptyExperts: true},
		{Name: "Qwen3Next/top_k=16/M=33/per-channel", Shape: top16, M: 33,
			Opts: []Option{WithGranularity(scaling.PerChannel)}},
		{Name: "sigmoid-bias/E=512/top_k=16/M=40", Shape: sigBias, M: 40, EmptyExperts: true},
		{Name: "sigmoid-bias/E=512/top_k=16/M=1/fp8-in", Shape: sigBias, M: 1,
			Opts: []Option{WithHidden(moe.Float8E4M3FN)}, EmptyExperts: true},
		{Name: "Relu2/E=512/top_k=16/M=24/per-channel/bf16-logits", Shape: relu512, M: 24,
			Opts: []Option{WithGranularity(scaling.PerChannel), WithLogits(moe.BFloat16)}},
	}
}

// TB is the part of testing.TB that CheckBackend uses. Declaring it here
// keeps the package free of an import of testing, so the CUDA backend's
// start-up self-test can build cases with it inside the daemon.
type TB interface {
	Helper()
	Errorf(format string, args ...any)
	Logf(format string, args ...any)
}

// CheckBackend runs b through cases (Cases() when none are given), each on
// fresh random hidden states, logits and biases from a seeded generator
// (expert weights are generated once per process for each shape and
// granularity and shared between cases: they must not be modified), and fails t with the relative
// L2 error against Reference for each case over its tolerance. It also
// requires the routing the backend reports to match the reference's ids
// (exactly, except where Expected.For accepts a float32 router's choice
// among tied experts, whose output and weights it then expects) and its
// weights to 1e-5, and every output element to be finite.
func CheckBackend(t TB, b kernels.Backend, cases ...Case) {
	t.Helper()
	if len(cases) == 0 {
		cases = Cases()
	}
	ctx := context.Background()
	for i, c := range cases {
		rng := rand.New(rand.NewPCG(uint64(i)+1, 0x5eed))
		set, req := c.New(rng)
		got, err := RunCase(ctx, b, set, req)
		if err != nil {
			t.Errorf("%s: %v", c.Name, err)
			continue
		}
		ref := Expect(set, req)
		want, flipped, err := ref.For(got.TopKIDs)
		if err != nil {
			t.Errorf("%s: %v", c.Name, err)
		}
		tol := want.Tol
		if c.Tol != 0 {
			tol = c.Tol
		}
		out := DecodeOutput(req.OutDType, got.Output)
		if e := RelL2(out, want.Out); !(e <= tol) {
			t.Errorf("%s: rel-L2 %.3g, want <= %.3g", c.Name, e, tol)
		} else {
			t.Logf("%s: rel-L2 %.3g", c.Name, e)
		}
		if len(flipped) > 0 {
			t.Logf("%s: tokens %v routed among experts tied at float32 precision otherwise than the reference", c.Name, flipped)
		}
		if e := RelL2(got.TopKWeights, Widen(want.Weights)); !(e <= 1e-5) {
			t.Errorf("%s: topk weights rel-L2 %.3g, want <= 1e-5", c.Name, e)
		}
		if c.EmptyExperts {
			hit := make([]bool, set.E)
			for _, e := range ref.IDs {
				hit[e] = true
			}
			if !slices.Contains(hit, false) {
				t.Errorf("%s: every expert got a token; the case does not test empty experts", c.Name)
			}
		}
	}
}

// RunCase loads set into b, runs req, checks the result's sizes, and
// closes the set (kernels.Run).
func RunCase(ctx context.Context, b kernels.Backend, set *moe.ExpertSet, req *moe.Request) (*moe.Result, error) {
	res, err := kernels.Run(ctx, b, set, req)
	if err != nil {
		return nil, fmt.Errorf("kerneltest: %w", err)
	}
	return res, nil
}

// SubRequest is req cut down to the tokens toks, in that order: their
// hidden states and scales, and their logits or precomputed routing.
func SubRequest(req *moe.Request, toks []int) *moe.Request {
	sub := *req
	m, n := req.M(), len(toks)
	cut := func(t moe.Tensor) moe.Tensor {
		if t.Data == nil {
			return t
		}
		row := len(t.Data) / m
		out := moe.Tensor{DType: t.DType, Shape: append([]int{n}, t.Shape[1:]...), Data: make([]byte, 0, n*row)}
		for _, tk := range toks {
			out.Data = append(out.Data, t.Data[tk*row:(tk+1)*row]...)
		}
		return out
	}
	sub.Hidden, sub.Logits = cut(req.Hidden), cut(req.Logits)
	if hs := req.HiddenScale; len(hs) > 1 { // per token, or per token and group; one value is for all
		ng := len(hs) / m
		sub.HiddenScale = nil
		for _, tk := range toks {
			sub.HiddenScale = append(sub.HiddenScale, hs[tk*ng:(tk+1)*ng]...)
		}
	}
	k := req.Routing.TopK
	if req.TopKIDs != nil {
		sub.TopKIDs, sub.TopKWeights = nil, nil
		for _, tk := range toks {
			sub.TopKIDs = append(sub.TopKIDs, req.TopKIDs[tk*k:(tk+1)*k]...)
			sub.TopKWeights = append(sub.TopKWeights, req.TopKWeights[tk*k:(tk+1)*k]...)
		}
	}
	sub.Out, sub.OutDev = nil, 0
	return &sub
}

// Widen is v in float64.
func Widen(v []float32) []float64 {
	w := make([]float64, len(v))
	for i, x := range v {
		w[i] = float64(x)
	}
	return w
}
