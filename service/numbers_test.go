package service_test

import (
	"encoding/binary"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	_ "github.com/expertd/expertd/kernels/cuda" // registers "cuda" for the GPU variant
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// weightsProto is the wire form of a kernels expert set, as a client
// would send it.
func weightsProto(s *moe.ExpertSet) *pb.ExpertWeights {
	fp8 := pb.DataType_DATA_TYPE_FLOAT8_E4M3FN
	scale := func(ws scaling.WeightScale, rows, cols int) *pb.Tensor {
		var shape []int64
		switch ws.Granularity {
		case scaling.PerExpert:
			shape = []int64{int64(s.E)}
		case scaling.PerChannel:
			shape = []int64{int64(s.E), int64(rows)}
		case scaling.Block:
			shape = []int64{int64(s.E), int64((rows + ws.Block[0] - 1) / ws.Block[0]), int64((cols + ws.Block[1] - 1) / ws.Block[1])}
		}
		return f32Tensor(ws.Values, shape...)
	}
	w := &pb.ExpertWeights{
		Activation: pb.Activation(s.Activation),
		W13:        &pb.Tensor{Dtype: fp8, Shape: []int64{int64(s.E), int64(s.Rows1()), int64(s.K)}, Source: &pb.Tensor_Data{Data: s.W13}},
		W2:         &pb.Tensor{Dtype: fp8, Shape: []int64{int64(s.E), int64(s.K), int64(s.N)}, Source: &pb.Tensor_Data{Data: s.W2}},
		W13Scale:   scale(s.W13Scale, s.Rows1(), s.K),
		W2Scale:    scale(s.W2Scale, s.K, s.N),
	}
	if s.A13Scale != nil {
		w.A13Scale = f32Tensor([]float32{*s.A13Scale})
	}
	if s.A2Scale != nil {
		w.A2Scale = f32Tensor([]float32{*s.A2Scale})
	}
	if s.Block != [2]int{} {
		w.WeightBlockShape = []int32{int32(s.Block[0]), int32(s.Block[1])}
	}
	// The defaults travel as 0, as a gpt-oss client leaves them.
	if s.SwigluLimit != moe.DefaultSwigluLimit {
		w.SwigluLimit = s.SwigluLimit
	}
	if s.SwigluAlpha != moe.DefaultSwigluAlpha {
		w.SwigluAlpha = s.SwigluAlpha
	}
	// GEMM1's bias goes as FP32 and GEMM2's as BF16, which must then hold
	// BF16 values (roundBiasBF16), so both dtypes are exercised.
	if s.W13Bias != nil {
		w.W13Bias = f32Tensor(s.W13Bias, int64(s.E), int64(s.Rows1()))
	}
	if s.W2Bias != nil {
		b := make([]byte, 2*len(s.W2Bias))
		for i, v := range s.W2Bias {
			binary.LittleEndian.PutUint16(b[2*i:], scaling.Float32ToBF16(v))
		}
		w.W2Bias = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_BFLOAT16, Shape: []int64{int64(s.E), int64(s.K)}, Source: &pb.Tensor_Data{Data: b}}
	}
	return w
}

// roundBiasBF16 rounds the set's GEMM2 bias to BF16, the dtype
// weightsProto sends it in, so the reference sees what the server gets.
func roundBiasBF16(s *moe.ExpertSet) {
	for i, v := range s.W2Bias {
		s.W2Bias[i] = scaling.BF16ToFloat32(scaling.Float32ToBF16(v))
	}
}

// requestProto is the wire form of a kernels request on the set "layer".
func requestProto(r *moe.Request, e int) *pb.FusedMoERequest {
	m := int64(r.M())
	p := &pb.FusedMoERequest{
		Experts:       &pb.FusedMoERequest_ExpertSet{ExpertSet: "layer"},
		HiddenStates:  &pb.Tensor{Dtype: pb.DataType(r.Hidden.DType), Shape: []int64{m, int64(r.Hidden.Shape[1])}, Source: &pb.Tensor_Data{Data: r.Hidden.Data}},
		OutputDtype:   pb.DataType(r.OutDType),
		ReturnRouting: true,
	}
	switch n := int64(len(r.HiddenScale)); {
	case n == 0:
	case n == 1:
		p.HiddenStatesScale = f32Tensor(r.HiddenScale)
	case n == m:
		p.HiddenStatesScale = f32Tensor(r.HiddenScale, m)
	default:
		p.HiddenStatesScale = f32Tensor(r.HiddenScale, m, n/m)
	}
	if r.TopKIDs != nil {
		k := int64(r.Routing.TopK)
		p.TopkIds = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_INT32, Shape: []int64{m, k}, Source: &pb.Tensor_Data{Data: i32Bytes(r.TopKIDs)}}
		p.TopkWeights = f32Tensor(r.TopKWeights, m, k)
		return p
	}
	p.RouterLogits = &pb.Tensor{Dtype: pb.DataType(r.Logits.DType), Shape: []int64{m, int64(e)}, Source: &pb.Tensor_Data{Data: r.Logits.Data}}
	p.Routing = &pb.Routing{
		TopK: int32(r.Routing.TopK), Renormalize: r.Routing.Renormalize, Scoring: pb.Scoring(r.Routing.Scoring),
		NumExpertGroups: int32(r.Routing.NumGroups), TopkGroups: int32(r.Routing.TopKGroups),
		RoutedScalingFactor: r.Routing.ScalingFactor,
	}
	if r.Routing.CorrectionBias != nil {
		p.Routing.CorrectionBias = f32Tensor(r.Routing.CorrectionBias, int64(e))
	}
	return p
}

// referenceCases are the kerneltest cases the service runs end to end: every
// granularity, static scales, FP8 input with each scale layout, BF16 logits,
// precomputed routing, grouped sigmoid routing and odd sizes, every
// activation, expert biases and E = 512 with top_k = 16 under softmax and
// under sigmoid with a correction bias.
func referenceCases(t *testing.T) []kerneltest.Case {
	want := []string{
		"Nemotron/M=16", "Nemotron/M=8/static/fp8-in", "Qwen3/M=16/per-expert", "Qwen3/M=12/block/bf16-logits",
		"Mixtral/M=9/precomputed/all-to-one", "DeepSeekV3/M=1/fp8-in-per-group", "top_k=E/sigmoid-groups",
		"odd/block-16x24/fp8-per-group", "odd/per-channel/precomputed",
		"GptOss/M=16", "GptOss/M=24/per-channel/static", "SwigluOAI/limit=0.5/M=20/per-channel",
		"GeluTanhGated/M=10", "GeluGated/M=5/bias/precomputed", "Nemotron/M=12/bias",
		"Qwen3Next/top_k=16/M=33/per-channel", "sigmoid-bias/E=512/top_k=16/M=40",
		"Relu2/E=512/top_k=16/M=24/per-channel/bf16-logits",
	}
	var cases []kerneltest.Case
	for _, c := range append(kerneltest.Cases(), kerneltest.ActivationCases()...) {
		if slices.Contains(want, c.Name) {
			cases = append(cases, c)
		}
	}
	if len(cases) != len(want) {
		t.Fatalf("found %d of the %d kerneltest cases %v", len(cases), len(want), want)
	}
	return cases
}

// TestFusedMoEMatchesReference is the real numbers check: random sets of
// the kerneltest cases go through the chunked LoadExperts stream and
// FusedMoE on the CPU backend, and must meet the spec's bar against the
// float64 reference, return the reference's routing, and equal the
// backend's own output bit for bit (the service must not change numerics).
func TestFusedMoEMatchesReference(t *testing.T) {
	checkAgainstReference(t, cpu.New(kernels.Config{Threads: 2}), true)
}

// TestFusedMoEMatchesReferenceCUDA is the same check on the CUDA backend;
// it skips where the library or a GPU is missing (CI, this laptop).
func TestFusedMoEMatchesReferenceCUDA(t *testing.T) {
	b, err := kernels.Open("cuda", kernels.Config{LibraryPath: os.Getenv("EXPERTD_LIBRARY_PATH")})
	if err != nil {
		t.Skipf("no CUDA backend: %v", err)
	}
	defer b.Close()
	checkAgainstReference(t, b, false)
}

func checkAgainstReference(t *testing.T, backend kernels.Backend, exact bool) {
	rng := newRand(t)
	for _, tc := range referenceCases(t) {
		t.Run(strings.ReplaceAll(tc.Name, "/", "_"), func(t *testing.T) {
			ctx := testContext(t)
			set, req := kerneltest.NewCase(rand.New(rand.NewPCG(rng.Uint64(), rng.Uint64())), tc.Shape, tc.M, tc.Opts...)
			roundBiasBF16(set)
			c, _, _ := servicetest.StartServerConfig(t, service.Config{}, backend)
			w := weightsProto(set)
			h := servicetest.Header("layer", w, false)
			h.Sha256 = fingerprintOf(w)
			if _, err := servicetest.Upload(ctx, c, h, servicetest.Chunks(w, 256<<10)); err != nil {
				t.Fatalf("LoadExperts: %v", err)
			}
			resp, err := c.FusedMoE(ctx, requestProto(req, set.E))
			if err != nil {
				t.Fatalf("FusedMoE: %v", err)
			}
			if resp.GetBackend() != backend.Name() {
				t.Errorf("ran on %q, want %q", resp.GetBackend(), backend.Name())
			}

			// The reference routes in float64; a backend's float32 routing may
			// take the other side of a near-tie, and the expectation then
			// follows its choice on that token (kerneltest.Expected.For).
			want := kerneltest.Expect(set, req)
			gotIDs := make([]int32, len(want.IDs))
			for i := range gotIDs {
				gotIDs[i] = int32(binary.LittleEndian.Uint32(resp.GetTopkIds().GetData()[4*i:]))
			}
			want, _, err = want.For(gotIDs)
			if err != nil {
				t.Errorf("returned topk ids: %v", err)
			}
			ref := want.Out
			got := kerneltest.DecodeOutput(req.OutDType, resp.GetOutput().GetData())
			tol := tc.Tol
			if tol == 0 {
				tol = kerneltest.FP8Tol
			}
			if e := kerneltest.RelL2(got, ref); !(e <= tol) {
				t.Errorf("rel-L2 vs reference %.3g, want <= %.3g", e, tol)
			} else {
				t.Logf("rel-L2 vs reference %.3g", e)
			}
			if !exact {
				return
			}
			direct, err := kerneltest.RunCase(ctx, backend, set, req)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(direct.Output, resp.GetOutput().GetData()) {
				t.Errorf("service output differs from the backend called directly")
			}
		})
	}
}
