package service_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// layerBytes is the size of the set "layer" every bad-input server holds:
// w13 [6, 48, 40] and w2 [6, 40, 24] FP8, two per-expert FP32 scales.
const layerBytes = testE*2*testN*testK + testE*testK*testN + 2*4*testE

// badCall is one malformed call and the answer it must get.
type badCall struct {
	name string
	// cfg overrides the suite server's Config (limits).
	cfg      service.Config
	call     func(ctx context.Context, c pb.ExpertServiceClient) error
	wantCode codes.Code
	wantMsg  string
}

// serverState is what a refused call must leave as it was.
type serverState struct {
	List        *pb.ListExpertsResponse
	Info        *pb.ServerInfo
	LoadedBytes int64
	// BackendCalls and BackendLoads count the fake backend's FusedMoE and
	// Load calls: a bad request must never reach it.
	BackendCalls, BackendLoads int
}

func stateOf(t *testing.T, c pb.ExpertServiceClient, srv *service.Server, b *fakeBackend) serverState {
	t.Helper()
	ctx := testContext(t)
	// A refused call's status can reach the client before the call's
	// clean-up has run (Server.WaitIdle).
	if err := srv.WaitIdle(ctx); err != nil {
		t.Fatalf("waiting for the server's calls to end: %v", err)
	}
	list, err := c.ListExperts(ctx, &pb.ListExpertsRequest{})
	if err != nil {
		t.Fatalf("ListExperts: %v", err)
	}
	info, err := c.GetServerInfo(ctx, &pb.GetServerInfoRequest{})
	if err != nil {
		t.Fatalf("GetServerInfo: %v", err)
	}
	loads, _ := b.counts()
	return serverState{List: list, Info: info, LoadedBytes: srv.LoadedBytes(), BackendCalls: b.numCalls(), BackendLoads: loads}
}

// TestBadInput sends each malformed FusedMoE and LoadExperts call to a
// server holding one set and checks the status code, that the message names
// the field, that nothing changed (sets, limits, loaded bytes including
// reservations, backend untouched), and that a good call still succeeds.
func TestBadInput(t *testing.T) {
	rng := newRand(t)
	var cases []badCall
	for _, tt := range fusedMoEBadInput(rng) {
		cases = append(cases, badCall{"FusedMoE/" + tt.name, tt.cfg, func(ctx context.Context, c pb.ExpertServiceClient) error {
			req := request(rng, badM)
			tt.edit(req)
			_, err := c.FusedMoE(ctx, req)
			return err
		}, tt.wantCode, tt.wantMsg})
	}
	lw, loads := loadBadInput(rng)
	for _, tt := range loads {
		cases = append(cases, badCall{"LoadExperts/" + tt.name, tt.cfg, func(ctx context.Context, c pb.ExpertServiceClient) error {
			h, ch := servicetest.Header("set", lw, false), servicetest.Chunks(lw, 100)
			// Chunks alias w's bytes: copy before editing.
			for i := range ch {
				ch[i] = proto.Clone(ch[i]).(*pb.LoadExpertsRequest_Chunk)
			}
			ch = tt.edit(h, ch)
			_, err := servicetest.Upload(ctx, c, h, ch)
			return err
		}, tt.wantCode, tt.wantMsg})
	}
	cases = append(cases, oversized(rng)...)
	cases = append(cases, shmBadInput(rng)...)
	cases = append(cases, checkpointBadInput(t, rng)...)
	if len(cases) < 40 {
		t.Fatalf("the suite has %d cases, want at least 40", len(cases))
	}
	for _, tt := range cases {
		t.Run(tt.name, func(t *testing.T) {
			ctx := testContext(t)
			b := &fakeBackend{}
			c, srv, _ := servicetest.StartServerConfig(t, tt.cfg, b)
			w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)
			if _, err := servicetest.Upload(ctx, c, servicetest.Header("layer", w, false), servicetest.Chunks(w, 1000)); err != nil {
				t.Fatalf("LoadExperts: %v", err)
			}
			before := stateOf(t, c, srv, b)
			err := tt.call(ctx, c)
			msg := status.Convert(err).Message()
			if got := status.Code(err); got != tt.wantCode || !strings.Contains(msg, tt.wantMsg) {
				t.Errorf("got %v %s, want %v containing %s", got, service.Quote(msg), tt.wantCode, service.Quote(tt.wantMsg))
			}
			// Whatever the request holds, the answer is short (issue 14).
			if len(msg) > maxStatusBytes {
				t.Errorf("status message is %d bytes, want at most %d", len(msg), maxStatusBytes)
			}
			if diff := cmp.Diff(before, stateOf(t, c, srv, b), protocmp.Transform()); diff != "" {
				t.Errorf("server state changed (-before +after):\n%s", diff)
			}
			// Still serving: a good call on the resident set.
			resp, err := c.FusedMoE(ctx, request(rng, 1))
			if err != nil {
				t.Fatalf("good call afterwards: %v", err)
			}
			if got := resp.GetOutput().GetShape(); !cmp.Equal(got, []int64{1, testK}) {
				t.Errorf("good call afterwards returned shape %v, want [1 %d]", got, testK)
			}
		})
	}
}

// maxStatusBytes bounds every bad-input answer's message: client strings
// are cut to 128 bytes before they are echoed.
const maxStatusBytes = 1024

// mib is a 1 MiB client string, the issue 14 probe's.
var mib = strings.Repeat("a", 1<<20)

// quotedMiB is how a status message shows mib.
var quotedMiB = `"` + mib[:128] + `"... (1048576 bytes)`

// badM is the token count of the bad FusedMoE requests.
const badM = 3

type fusedBad struct {
	name     string
	edit     func(r *pb.FusedMoERequest)
	cfg      service.Config
	wantCode codes.Code
	wantMsg  string
}

// fusedMoEBadInput edits a valid request of badM tokens on "layer" into a
// malformed one.
func fusedMoEBadInput(rng *rand.Rand) []fusedBad {
	const m = badM
	fp8Hidden := func(r *pb.FusedMoERequest) {
		r.HiddenStates = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT8_E4M3FN, Shape: []int64{m, testK}, Source: &pb.Tensor_Data{Data: fp8Bytes(rng, m*testK)}}
	}
	// inline sends fresh random weights of act, edited, in the request.
	inline := func(act pb.Activation, edit func(w *pb.ExpertWeights)) func(*pb.FusedMoERequest) {
		return func(r *pb.FusedMoERequest) {
			w := randomWeights(rng, act, testE, testK, testN)
			edit(w)
			r.Experts = &pb.FusedMoERequest_Weights{Weights: w}
		}
	}
	precomputed := func(r *pb.FusedMoERequest) {
		r.RouterLogits, r.Routing = nil, nil
		r.TopkIds = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_INT32, Shape: []int64{m, 2}, Source: &pb.Tensor_Data{Data: i32Bytes([]int32{0, 1, 2, 3, 4, 5})}}
		r.TopkWeights = f32Tensor([]float32{.5, .5, .5, .5, .5, .5}, m, 2)
	}
	return []fusedBad{
		{"no experts", func(r *pb.FusedMoERequest) { r.Experts = nil }, service.Config{}, codes.InvalidArgument, "experts: set expert_set"},
		{"unknown set", func(r *pb.FusedMoERequest) { r.Experts = &pb.FusedMoERequest_ExpertSet{ExpertSet: "nope"} }, service.Config{}, codes.NotFound, `expert_set: no expert set "nope"`},
		{"no hidden", func(r *pb.FusedMoERequest) { r.HiddenStates = nil }, service.Config{}, codes.InvalidArgument, "hidden_states: is required"},
		{"short hidden", func(r *pb.FusedMoERequest) {
			d := r.HiddenStates.GetData()
			r.HiddenStates.Source = &pb.Tensor_Data{Data: d[:len(d)-1]}
		}, service.Config{}, codes.InvalidArgument, "hidden_states: shape [3 40] needs 480 bytes, got 479"},
		{"hidden no data", func(r *pb.FusedMoERequest) { r.HiddenStates.Source = nil }, service.Config{}, codes.InvalidArgument, "hidden_states.data: is required"},
		{"hidden shm", func(r *pb.FusedMoERequest) {
			r.HiddenStates.Source = &pb.Tensor_Shm{Shm: &pb.SharedMemoryRef{RegionName: "r", ByteSize: 480}}
		}, service.Config{}, codes.InvalidArgument, "hidden_states.shm"},
		{"hidden wrong K", func(r *pb.FusedMoERequest) { r.HiddenStates.Shape = []int64{4, 30} }, service.Config{}, codes.InvalidArgument, "hidden_states: shape [4 30]: want [M, 40]"},
		{"hidden rank", func(r *pb.FusedMoERequest) { r.HiddenStates.Shape = []int64{3 * testK} }, service.Config{}, codes.InvalidArgument, "want [M, 40]"},
		{"hidden int32", func(r *pb.FusedMoERequest) { r.HiddenStates.Dtype = pb.DataType_DATA_TYPE_INT32 }, service.Config{}, codes.InvalidArgument, "hidden_states: dtype DATA_TYPE_INT32"},
		{"hidden unspecified", func(r *pb.FusedMoERequest) { r.HiddenStates.Dtype = pb.DataType_DATA_TYPE_UNSPECIFIED }, service.Config{}, codes.InvalidArgument, "hidden_states: dtype"},
		{"zero tokens", func(r *pb.FusedMoERequest) {
			r.HiddenStates = f32Tensor(nil, 0, testK)
			r.RouterLogits = f32Tensor(nil, 0, testE)
		}, service.Config{}, codes.InvalidArgument, "want M >= 1"},
		{"over max tokens", func(r *pb.FusedMoERequest) {}, service.Config{MaxTokens: 2}, codes.ResourceExhausted, "M = 3 tokens exceeds"},
		{"fp8 without scale", fp8Hidden, service.Config{}, codes.InvalidArgument, "hidden_states_scale: is required"},
		{"fp8 bad scale shape", func(r *pb.FusedMoERequest) {
			fp8Hidden(r)
			r.HiddenStatesScale = f32Tensor([]float32{1, 1}, 2)
		}, service.Config{}, codes.InvalidArgument, "hidden_states_scale: shape [2]: want [] or [1] (per-tensor) or [3] (per-token)"},
		{"fp8 group scale without blocks", func(r *pb.FusedMoERequest) {
			fp8Hidden(r)
			r.HiddenStatesScale = f32Tensor(make([]float32, 3), 3, 1)
		}, service.Config{}, codes.InvalidArgument, "hidden_states_scale: shape [3 1]"},
		{"fp8 nan scale", func(r *pb.FusedMoERequest) {
			fp8Hidden(r)
			r.HiddenStatesScale = f32Tensor([]float32{float32(math.NaN())})
		}, service.Config{}, codes.InvalidArgument, "hidden_states_scale: element 0 is NaN"},
		{"scale on bf16", func(r *pb.FusedMoERequest) { r.HiddenStatesScale = f32Tensor([]float32{1}) }, service.Config{}, codes.InvalidArgument, "hidden_states_scale: only FLOAT8_E4M3FN"},
		{"no logits", func(r *pb.FusedMoERequest) { r.RouterLogits = nil }, service.Config{}, codes.InvalidArgument, "router_logits: is required"},
		{"logits shape", func(r *pb.FusedMoERequest) { r.RouterLogits.Shape = []int64{testE, 3} }, service.Config{}, codes.InvalidArgument, "router_logits: shape [6 3]: want [3 6]"},
		{"logits nan", func(r *pb.FusedMoERequest) {
			v := bytesF32(r.RouterLogits.GetData())
			v[7] = float32(math.NaN())
			r.RouterLogits.Source = &pb.Tensor_Data{Data: f32Bytes(v)}
		}, service.Config{}, codes.InvalidArgument, "router_logits: element 7 is NaN: want finite or -Inf"},
		{"logits +inf", func(r *pb.FusedMoERequest) {
			v := bytesF32(r.RouterLogits.GetData())
			v[4] = float32(math.Inf(1))
			r.RouterLogits.Source = &pb.Tensor_Data{Data: f32Bytes(v)}
		}, service.Config{}, codes.InvalidArgument, "router_logits: element 4 is +Inf: want finite or -Inf"},
		{"logits row all -Inf", func(r *pb.FusedMoERequest) {
			v := bytesF32(r.RouterLogits.GetData())
			for i := range testE {
				v[testE+i] = float32(math.Inf(-1))
			}
			r.RouterLogits.Source = &pb.Tensor_Data{Data: f32Bytes(v)}
		}, service.Config{}, codes.InvalidArgument, "router_logits: row 1 is all -Inf; softmax routing needs at least one finite logit"},
		{"bf16 logits row all -Inf, renormalized", func(r *pb.FusedMoERequest) {
			b := make([]byte, 2*m*testE)
			for i := range testE {
				binary.LittleEndian.PutUint16(b[2*i:], scaling.Float32ToBF16(float32(math.Inf(-1))))
			}
			r.RouterLogits = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_BFLOAT16, Shape: []int64{m, testE}, Source: &pb.Tensor_Data{Data: b}}
			r.Routing.Renormalize = true
		}, service.Config{}, codes.InvalidArgument, "router_logits: row 0 is all -Inf"},
		{"no routing", func(r *pb.FusedMoERequest) { r.Routing = nil }, service.Config{}, codes.InvalidArgument, "routing: is required"},
		{"top_k 0", func(r *pb.FusedMoERequest) { r.Routing.TopK = 0 }, service.Config{}, codes.InvalidArgument, "routing.top_k: 0: want in [1, 6]"},
		{"top_k > E", func(r *pb.FusedMoERequest) { r.Routing.TopK = 7 }, service.Config{}, codes.InvalidArgument, "routing.top_k: 7"},
		{"bad scoring", func(r *pb.FusedMoERequest) { r.Routing.Scoring = 9 }, service.Config{}, codes.InvalidArgument, "routing.scoring"},
		{"bias with softmax", func(r *pb.FusedMoERequest) { r.Routing.CorrectionBias = f32Tensor(make([]float32, testE), testE) }, service.Config{}, codes.InvalidArgument, "routing.correction_bias: only valid with SCORING_SIGMOID"},
		{"bias shape", func(r *pb.FusedMoERequest) {
			r.Routing.Scoring = pb.Scoring_SCORING_SIGMOID
			r.Routing.CorrectionBias = f32Tensor(make([]float32, 5), 5)
		}, service.Config{}, codes.InvalidArgument, "routing.correction_bias: shape [5]: want [6]"},
		{"bias inf", func(r *pb.FusedMoERequest) {
			r.Routing.Scoring = pb.Scoring_SCORING_SIGMOID
			r.Routing.CorrectionBias = f32Tensor([]float32{0, 0, float32(math.Inf(1)), 0, 0, 0}, testE)
		}, service.Config{}, codes.InvalidArgument, "routing.correction_bias: element 2 is +Inf"},
		{"groups do not divide", func(r *pb.FusedMoERequest) { r.Routing.NumExpertGroups = 4 }, service.Config{}, codes.InvalidArgument, "routing.num_expert_groups: 4 does not divide E = 6"},
		{"topk_groups > groups", func(r *pb.FusedMoERequest) { r.Routing.NumExpertGroups, r.Routing.TopkGroups = 3, 4 }, service.Config{}, codes.InvalidArgument, "routing.topk_groups: 4: want in [1, 3]"},
		{"topk_groups 0", func(r *pb.FusedMoERequest) { r.Routing.NumExpertGroups = 3 }, service.Config{}, codes.InvalidArgument, "routing.topk_groups: 0"},
		{"groups too few experts", func(r *pb.FusedMoERequest) {
			r.Routing.NumExpertGroups, r.Routing.TopkGroups, r.Routing.TopK = 3, 1, 3
		}, service.Config{}, codes.InvalidArgument, "1 groups of 2 experts cannot supply top_k = 3"},
		{"negative scaling factor", func(r *pb.FusedMoERequest) { r.Routing.RoutedScalingFactor = -1 }, service.Config{}, codes.InvalidArgument, "routing.routed_scaling_factor"},
		{"nan scaling factor", func(r *pb.FusedMoERequest) { r.Routing.RoutedScalingFactor = float32(math.NaN()) }, service.Config{}, codes.InvalidArgument, "routing.routed_scaling_factor"},
		{"output fp8", func(r *pb.FusedMoERequest) { r.OutputDtype = pb.DataType_DATA_TYPE_FLOAT8_E4M3FN }, service.Config{}, codes.InvalidArgument, "output_dtype: DATA_TYPE_FLOAT8_E4M3FN: want DATA_TYPE_BFLOAT16 (default) or DATA_TYPE_FLOAT32"},
		{"topk ids alone", func(r *pb.FusedMoERequest) { precomputed(r); r.TopkWeights = nil }, service.Config{}, codes.InvalidArgument, "topk_weights: is required"},
		{"topk id out of range", func(r *pb.FusedMoERequest) {
			precomputed(r)
			r.TopkIds.Source = &pb.Tensor_Data{Data: i32Bytes([]int32{0, 1, 2, 6, 4, 5})}
		}, service.Config{}, codes.InvalidArgument, "topk_ids: element 3 is 6: want an expert id in [0, 6)"},
		{"topk id negative", func(r *pb.FusedMoERequest) {
			precomputed(r)
			r.TopkIds.Source = &pb.Tensor_Data{Data: i32Bytes([]int32{0, -1, 2, 3, 4, 5})}
		}, service.Config{}, codes.InvalidArgument, "topk_ids: element 1 is -1"},
		{"topk id repeated", func(r *pb.FusedMoERequest) {
			precomputed(r)
			r.TopkIds.Source = &pb.Tensor_Data{Data: i32Bytes([]int32{0, 1, 2, 3, 5, 5})}
		}, service.Config{}, codes.InvalidArgument, "topk_ids: element 5 repeats expert 5 of token 2: want distinct ids per token"},
		{"topk weights nan", func(r *pb.FusedMoERequest) {
			precomputed(r)
			r.TopkWeights = f32Tensor([]float32{.5, .5, .5, .5, .5, float32(math.NaN())}, m, 2)
		}, service.Config{}, codes.InvalidArgument, "topk_weights: element 5 is NaN"},
		{"topk shapes disagree", func(r *pb.FusedMoERequest) {
			precomputed(r)
			r.TopkWeights = f32Tensor([]float32{.5, .5, .5}, m, 1)
		}, service.Config{}, codes.InvalidArgument, "topk_weights: shape [3 1]: want [3 2]"},
		{"topk k vs routing", func(r *pb.FusedMoERequest) {
			precomputed(r)
			r.Routing = &pb.Routing{TopK: 3}
		}, service.Config{}, codes.InvalidArgument, "routing.top_k: 3 disagrees with topk_ids' k = 2"},
		{"topk ids wrong M", func(r *pb.FusedMoERequest) {
			precomputed(r)
			r.TopkIds.Shape = []int64{2, 3}
		}, service.Config{}, codes.InvalidArgument, "topk_ids: shape [2 3]: want [3, k]"},
		{"inline bad", func(r *pb.FusedMoERequest) {
			r.Experts = &pb.FusedMoERequest_Weights{Weights: &pb.ExpertWeights{Activation: pb.Activation_ACTIVATION_RELU2}}
		}, service.Config{}, codes.InvalidArgument, "weights.w13: is required"},
		// Added with the suite (issue 6).
		{"hidden huge shape tiny data", func(r *pb.FusedMoERequest) { r.HiddenStates.Shape = []int64{1 << 30, testK} }, service.Config{}, codes.InvalidArgument, "hidden_states: shape [1073741824 40] needs 171798691840 bytes, got 480"},
		{"hidden shape overflows int64", func(r *pb.FusedMoERequest) { r.HiddenStates.Shape = []int64{math.MaxInt64, math.MaxInt64} }, service.Config{}, codes.InvalidArgument, "hidden_states: shape [9223372036854775807 9223372036854775807]: more than 2^40 elements"},
		{"hidden negative dim", func(r *pb.FusedMoERequest) { r.HiddenStates.Shape = []int64{-3, testK} }, service.Config{}, codes.InvalidArgument, "hidden_states: shape [-3 40]: dimension 0 is negative"},
		{"hidden dtype disagrees with bytes", func(r *pb.FusedMoERequest) { r.HiddenStates.Dtype = pb.DataType_DATA_TYPE_BFLOAT16 }, service.Config{}, codes.InvalidArgument, "hidden_states: shape [3 40] needs 240 bytes, got 480"},
		{"hidden one byte long", func(r *pb.FusedMoERequest) {
			r.HiddenStates.Source = &pb.Tensor_Data{Data: append(r.HiddenStates.GetData(), 7)}
		}, service.Config{}, codes.InvalidArgument, "hidden_states: shape [3 40] needs 480 bytes, got 481"},
		{"fp8 inf scale", func(r *pb.FusedMoERequest) {
			fp8Hidden(r)
			r.HiddenStatesScale = f32Tensor([]float32{float32(math.Inf(1))})
		}, service.Config{}, codes.InvalidArgument, "hidden_states_scale: element 0 is +Inf: scales must be finite and > 0"},
		{"fp8 negative scale", func(r *pb.FusedMoERequest) {
			fp8Hidden(r)
			r.HiddenStatesScale = f32Tensor([]float32{0.5, -0.25, 0.5}, m)
		}, service.Config{}, codes.InvalidArgument, "hidden_states_scale: element 1 is -0.25"},
		{"fp8 zero scale", func(r *pb.FusedMoERequest) {
			fp8Hidden(r)
			r.HiddenStatesScale = f32Tensor([]float32{0})
		}, service.Config{}, codes.InvalidArgument, "hidden_states_scale: element 0 is 0"},
		{"logits bf16 short by one", func(r *pb.FusedMoERequest) {
			r.RouterLogits = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_BFLOAT16, Shape: []int64{m, testE}, Source: &pb.Tensor_Data{Data: make([]byte, 2*m*testE-1)}}
		}, service.Config{}, codes.InvalidArgument, "router_logits: shape [3 6] needs 36 bytes, got 35"},
		{"logits rank 3", func(r *pb.FusedMoERequest) { r.RouterLogits.Shape = []int64{m, testE, 1} }, service.Config{}, codes.InvalidArgument, "router_logits: shape [3 6 1]: want [3 6]"},
		{"logits int32", func(r *pb.FusedMoERequest) { r.RouterLogits.Dtype = pb.DataType_DATA_TYPE_INT32 }, service.Config{}, codes.InvalidArgument, "router_logits: dtype DATA_TYPE_INT32"},
		{"top_k negative", func(r *pb.FusedMoERequest) { r.Routing.TopK = -1 }, service.Config{}, codes.InvalidArgument, "routing.top_k: -1: want in [1, 6]"},
		{"groups negative", func(r *pb.FusedMoERequest) { r.Routing.NumExpertGroups = -2 }, service.Config{}, codes.InvalidArgument, "routing.num_expert_groups: -2: want >= 0"},
		{"inf scaling factor", func(r *pb.FusedMoERequest) { r.Routing.RoutedScalingFactor = float32(math.Inf(1)) }, service.Config{}, codes.InvalidArgument, "routing.routed_scaling_factor: +Inf"},
		{"topk ids float32", func(r *pb.FusedMoERequest) {
			precomputed(r)
			r.TopkIds.Dtype = pb.DataType_DATA_TYPE_FLOAT32
		}, service.Config{}, codes.InvalidArgument, "topk_ids: dtype DATA_TYPE_FLOAT32: want one of [DATA_TYPE_INT32]"},
		{"topk k > E", func(r *pb.FusedMoERequest) {
			precomputed(r)
			r.TopkIds = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_INT32, Shape: []int64{m, 7}, Source: &pb.Tensor_Data{Data: make([]byte, 4*m*7)}}
			r.TopkWeights = f32Tensor(make([]float32, m*7), m, 7)
		}, service.Config{}, codes.InvalidArgument, "topk_ids: shape [3 7]: want [3, k] with k in [1, 6]"},
		{"topk weights inf", func(r *pb.FusedMoERequest) {
			precomputed(r)
			r.TopkWeights = f32Tensor([]float32{float32(math.Inf(-1)), .5, .5, .5, .5, .5}, m, 2)
		}, service.Config{}, codes.InvalidArgument, "topk_weights: element 0 is -Inf: want finite"},
		{"topk ids truncated", func(r *pb.FusedMoERequest) {
			precomputed(r)
			r.TopkIds.Source = &pb.Tensor_Data{Data: r.TopkIds.GetData()[:23]}
		}, service.Config{}, codes.InvalidArgument, "topk_ids: shape [3 2] needs 24 bytes, got 23"},
		{"empty set name", func(r *pb.FusedMoERequest) { r.Experts = &pb.FusedMoERequest_ExpertSet{} }, service.Config{}, codes.NotFound, `expert_set: no expert set ""`},
		{"inline w2 short by one", func(r *pb.FusedMoERequest) {
			w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)
			w.W2.Source = &pb.Tensor_Data{Data: w.W2.GetData()[1:]}
			r.Experts = &pb.FusedMoERequest_Weights{Weights: w}
		}, service.Config{}, codes.InvalidArgument, "weights.w2: shape [6 40 24] needs 5760 bytes, got 5759"},
		{"inline nan weight scale", func(r *pb.FusedMoERequest) {
			w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)
			s := bytesF32(w.W13Scale.GetData())
			s[4] = float32(math.NaN())
			w.W13Scale.Source = &pb.Tensor_Data{Data: f32Bytes(s)}
			r.Experts = &pb.FusedMoERequest_Weights{Weights: w}
		}, service.Config{}, codes.InvalidArgument, "weights.w13_scale: element 4 is NaN"},
		{"inline unknown activation", inline(pb.Activation_ACTIVATION_SILU_GATED, func(w *pb.ExpertWeights) {
			w.Activation = 9
		}), service.Config{}, codes.InvalidArgument, "weights.activation: 9: want one of [ACTIVATION_SILU_GATED ACTIVATION_RELU2 " +
			"ACTIVATION_SWIGLU_OAI ACTIVATION_GELU_TANH_GATED ACTIVATION_GELU_GATED]"},
		{"inline swiglu_oai odd rows", func(r *pb.FusedMoERequest) {
			w := randomWeights(rng, pb.Activation_ACTIVATION_RELU2, testE, testK, 2*testN+1)
			w.Activation = pb.Activation_ACTIVATION_SWIGLU_OAI
			r.Experts = &pb.FusedMoERequest_Weights{Weights: w}
		}, service.Config{}, codes.InvalidArgument, "weights.w13: shape [6 49 40]: ACTIVATION_SWIGLU_OAI needs [E, 2N, K] with an even middle dimension"},
		{"inline w13_bias of N rows on a gated set", inline(pb.Activation_ACTIVATION_GELU_GATED, func(w *pb.ExpertWeights) {
			w.W13Bias = f32Tensor(make([]float32, testE*testN), testE, testN)
		}), service.Config{}, codes.InvalidArgument, "weights.w13_bias: shape [6 24]: want [6 48]"},
		{"inline w2_bias flat", inline(pb.Activation_ACTIVATION_SWIGLU_OAI, func(w *pb.ExpertWeights) {
			w.W2Bias = f32Tensor(make([]float32, testE*testK), testE*testK)
		}), service.Config{}, codes.InvalidArgument, "weights.w2_bias: shape [240]: want [6 40]"},
		{"inline w2_bias fp8", inline(pb.Activation_ACTIVATION_RELU2, func(w *pb.ExpertWeights) {
			w.W2Bias = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT8_E4M3FN, Shape: []int64{testE, testK},
				Source: &pb.Tensor_Data{Data: make([]byte, testE*testK)}}
		}), service.Config{}, codes.InvalidArgument, "weights.w2_bias: dtype DATA_TYPE_FLOAT8_E4M3FN: want one of [DATA_TYPE_FLOAT32 DATA_TYPE_BFLOAT16]"},
		{"inline w13_bias short", inline(pb.Activation_ACTIVATION_SWIGLU_OAI, func(w *pb.ExpertWeights) {
			w.W13Bias = f32Tensor(make([]float32, testE*2*testN-1), testE, 2*testN)
		}), service.Config{}, codes.InvalidArgument, "weights.w13_bias: shape [6 48] needs 1152 bytes, got 1148"},
		{"inline w2_bias inf", inline(pb.Activation_ACTIVATION_SILU_GATED, func(w *pb.ExpertWeights) {
			b := make([]float32, testE*testK)
			b[7] = float32(math.Inf(-1))
			w.W2Bias = f32Tensor(b, testE, testK)
		}), service.Config{}, codes.InvalidArgument, "weights.w2_bias: element 7 is -Inf: want finite"},
		{"inline swiglu_limit on silu", inline(pb.Activation_ACTIVATION_SILU_GATED, func(w *pb.ExpertWeights) {
			w.SwigluLimit = 7
		}), service.Config{}, codes.InvalidArgument, "weights.swiglu_limit: 7: only valid with ACTIVATION_SWIGLU_OAI"},
		{"inline swiglu_alpha negative", inline(pb.Activation_ACTIVATION_SWIGLU_OAI, func(w *pb.ExpertWeights) {
			w.SwigluAlpha = -1
		}), service.Config{}, codes.InvalidArgument, "weights.swiglu_alpha: -1: want finite and >= 0 (0 means 1.702)"},
		{"inline swiglu_limit nan", inline(pb.Activation_ACTIVATION_SWIGLU_OAI, func(w *pb.ExpertWeights) {
			w.SwigluLimit = float32(math.NaN())
		}), service.Config{}, codes.InvalidArgument, "weights.swiglu_limit: NaN: want finite and >= 0 (0 means 7)"},
		{"inline over max loaded bytes", func(r *pb.FusedMoERequest) {
			r.Experts = &pb.FusedMoERequest_Weights{Weights: randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)}
		}, service.Config{MaxLoadedBytes: layerBytes + 1000}, codes.ResourceExhausted, "weights: 17328 bytes would exceed the server's max loaded bytes (17328 of 18328 in use)"},
		// Issue 14: client strings are bounded before they are looked up
		// or echoed.
		{"1 MiB set name", func(r *pb.FusedMoERequest) { r.Experts = &pb.FusedMoERequest_ExpertSet{ExpertSet: mib} }, service.Config{},
			codes.InvalidArgument, "expert_set: " + quotedMiB + ": 1048576 bytes, want at most 256"},
		{"257-byte set name", func(r *pb.FusedMoERequest) {
			r.Experts = &pb.FusedMoERequest_ExpertSet{ExpertSet: strings.Repeat("b", 257)}
		}, service.Config{},
			codes.InvalidArgument, "257 bytes, want at most 256"},
		{"unknown set with a newline", func(r *pb.FusedMoERequest) { r.Experts = &pb.FusedMoERequest_ExpertSet{ExpertSet: "a\nlevel=ERROR"} }, service.Config{},
			codes.NotFound, `expert_set: no expert set "a\nlevel=ERROR" is loaded`},
		{"inline weights wrong K", func(r *pb.FusedMoERequest) {
			r.Experts = &pb.FusedMoERequest_Weights{Weights: randomWeights(rng, pb.Activation_ACTIVATION_RELU2, 2, 16, 8)}
		}, service.Config{}, codes.InvalidArgument, "hidden_states: shape [3 40]: want [M, 16] (K of the expert set)"},
	}
}

type loadBad struct {
	name     string
	edit     func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk
	cfg      service.Config
	wantCode codes.Code
	wantMsg  string
}

// loadBadInput edits a valid chunked upload of a ReLU² set E=3, K=32, N=16
// (w13 and w2 1536 bytes each, in chunks of 100: 16 per tensor) into a
// malformed one.
// It returns the set, uploaded as "set" in chunks of 100 bytes, and the
// edits.
func loadBadInput(rng *rand.Rand) (*pb.ExpertWeights, []loadBad) {
	w := randomWeights(rng, pb.Activation_ACTIVATION_RELU2, 3, 32, 16)
	return w, []loadBad{
		{"bad name", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Name = "a b"
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.name"},
		{"no activation", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.Activation = pb.Activation_ACTIVATION_UNSPECIFIED
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.activation"},
		{"missing w2", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.W2 = nil
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.w2: is required"},
		{"w13 not fp8", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.W13.Dtype = pb.DataType_DATA_TYPE_BFLOAT16
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.w13: dtype DATA_TYPE_BFLOAT16"},
		{"w2 shape disagrees", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.W2.Shape = []int64{3, 32, 17}
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.w2: shape [3 32 17]: want [3 32 16]"},
		{"gated odd rows", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.Activation = pb.Activation_ACTIVATION_SILU_GATED
			h.Weights.W13.Shape = []int64{3, 15, 32}
			return ch
		}, service.Config{}, codes.InvalidArgument, "even middle dimension"},
		{"huge shape", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.W13.Shape = []int64{1 << 30, 1 << 30, 1 << 30}
			return ch
		}, service.Config{}, codes.InvalidArgument, "more than 2^40 elements"},
		{"too many experts", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.W13.Shape = []int64{1 << 17, 16, 2}
			h.Weights.W2.Shape = []int64{1 << 17, 2, 16}
			return ch
		}, service.Config{}, codes.InvalidArgument, "want E <= 65536"},
		{"negative dim", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.W13.Shape = []int64{3, -16, 32}
			return ch
		}, service.Config{}, codes.InvalidArgument, "negative"},
		{"bad scale shape", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.W13Scale.Shape = []int64{2}
			h.TotalBytes -= 4
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.w13_scale"},
		{"header with data", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.W2Scale = proto.Clone(w.GetW2Scale()).(*pb.Tensor)
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.w2_scale: carries data"},
		{"total bytes", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.TotalBytes++
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.total_bytes"},
		{"bad sha256", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Sha256 = "xyz"
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.sha256"},
		{"sha256 mismatch", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Sha256 = strings.Repeat("ab", 32)
			return ch
		}, service.Config{}, codes.InvalidArgument, "does not match"},
		{"over max loaded bytes", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			return ch
		}, service.Config{MaxLoadedBytes: layerBytes + 1000}, codes.ResourceExhausted, "max loaded bytes"},
		{"unknown tensor", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			ch[0].Tensor = "a13_scale"
			return ch
		}, service.Config{}, codes.InvalidArgument, `chunk.tensor: "a13_scale": not a tensor the header declared`},
		{"overlap", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			ch[1].Offset -= 1
			return ch
		}, service.Config{}, codes.InvalidArgument, "chunk[w13]: bytes [99, 199) overlap bytes [0, 100)"},
		{"duplicate", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			return append(ch, ch[2])
		}, service.Config{}, codes.InvalidArgument, "overlap"},
		{"out of range", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			ch[0].Offset = 3*16*32 - 50
			return ch
		}, service.Config{}, codes.InvalidArgument, "outside the tensor's 1536 bytes"},
		{"negative offset", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			ch[0].Offset = -1
			return ch
		}, service.Config{}, codes.InvalidArgument, "outside"},
		{"empty chunk", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			ch[0].Data = nil
			return ch
		}, service.Config{}, codes.InvalidArgument, "chunk[w13].data: is empty"},
		{"gap", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			return append(ch[:3], ch[4:]...)
		}, service.Config{}, codes.InvalidArgument, "chunk[w13]: incomplete: missing bytes [300, 400) of 1536"},
		{"nothing after header", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			return nil
		}, service.Config{}, codes.InvalidArgument, "incomplete: missing bytes [0, 1536)"},
		{"zero scale", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			last := ch[len(ch)-1] // w2_scale
			last.Data = append([]byte{0, 0, 0, 0}, last.Data[4:]...)
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.w2_scale: element 0 is 0: scales must be finite and > 0"},
		// Added with the suite (issue 6).
		{"w13 rank 2", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.W13.Shape = []int64{3 * 16, 32}
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.w13: shape [48 32]: want [E, rows, K]"},
		{"w13 zero dim", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.W13.Shape = []int64{3, 0, 32}
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.w13: shape [3 0 32]: want [E, rows, K] with every dimension >= 1"},
		{"w13 unspecified dtype", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.W13.Dtype = pb.DataType_DATA_TYPE_UNSPECIFIED
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.w13: dtype DATA_TYPE_UNSPECIFIED"},
		{"scale bf16", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.W13Scale.Dtype = pb.DataType_DATA_TYPE_BFLOAT16
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.w13_scale: dtype DATA_TYPE_BFLOAT16: want one of [DATA_TYPE_FLOAT32]"},
		{"shape overflows int64", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.W13.Shape = []int64{math.MaxInt64, 2, 2}
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.w13: shape [9223372036854775807 2 2]: more than 2^40 elements"},
		{"huge declared set tiny data", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			// 256 GiB declared: refused from the header, before any buffer.
			const e, n, k = 1 << 16, 1 << 10, 1 << 11
			h.Weights.W13.Shape = []int64{e, n, k}
			h.Weights.W2.Shape = []int64{e, k, n}
			h.Weights.W13Scale.Shape = []int64{e}
			h.Weights.W2Scale.Shape = []int64{e}
			h.TotalBytes = 2*e*n*k + 2*4*e
			return ch[:1]
		}, service.Config{MaxLoadedBytes: layerBytes + 1<<20}, codes.ResourceExhausted, "header.total_bytes: 274878431232 bytes would exceed the server's max loaded bytes"},
		{"bad block shape", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.WeightBlockShape = []int32{0, 16}
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.weight_block_shape: [0 16]"},
		{"static scale shape", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.A13Scale = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT32, Shape: []int64{2}}
			h.TotalBytes += 8
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.a13_scale: shape [2]: want [] or [1] (per-tensor) or [3] (per-expert)"},
		{"static scale zero", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.A2Scale = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT32, Shape: []int64{}}
			h.TotalBytes += 4
			return append(ch, &pb.LoadExpertsRequest_Chunk{Tensor: "a2_scale", Data: f32Bytes([]float32{0})})
		}, service.Config{}, codes.InvalidArgument, "header.weights.a2_scale: element 0 is 0"},
		{"negative weight scale", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			setScale(ch, "w13_scale", 1, -2)
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.w13_scale: element 1 is -2: scales must be finite and > 0"},
		{"nan weight scale", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			setScale(ch, "w2_scale", 2, float32(math.NaN()))
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.w2_scale: element 2 is NaN"},
		{"inf weight scale", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			setScale(ch, "w13_scale", 0, float32(math.Inf(1)))
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.weights.w13_scale: element 0 is +Inf"},
		{"w2_bias declared, never sent", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.W2Bias = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_BFLOAT16, Shape: []int64{3, 32}}
			h.TotalBytes += 3 * 32 * 2
			return ch
		}, service.Config{}, codes.InvalidArgument, "chunk[w2_bias]: incomplete: missing bytes [0, 192) of 192"},
		{"w13_bias nan chunk", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Weights.W13Bias = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT32, Shape: []int64{3, 16}}
			h.TotalBytes += 3 * 16 * 4
			b := make([]float32, 3*16)
			b[20] = float32(math.NaN())
			return append(ch, &pb.LoadExpertsRequest_Chunk{Tensor: "w13_bias", Data: f32Bytes(b)})
		}, service.Config{}, codes.InvalidArgument, "header.weights.w13_bias: element 20 is NaN: want finite"},
		{"chunk one byte past the end", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			last := ch[15] // w13 bytes [1500, 1536)
			last.Data = append(last.Data, 1)
			return ch
		}, service.Config{}, codes.InvalidArgument, "chunk[w13]: bytes [1500, 1537) are outside the tensor's 1536 bytes"},
		{"truncated chunk", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			last := ch[15]
			last.Data = last.Data[:len(last.Data)-1]
			return ch
		}, service.Config{}, codes.InvalidArgument, "chunk[w13]: incomplete: missing bytes [1535, 1536) of 1536"},
		{"total bytes one short", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.TotalBytes--
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.total_bytes: 3095: the declared tensors hold 3096 bytes"},
		{"name taken", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Name = "layer"
			return ch
		}, service.Config{}, codes.AlreadyExists, `header.name: expert set "layer" is already loaded`},
		{"name too long", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Name = strings.Repeat("x", 129)
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.name"},
		{"1 MiB name", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Name = mib
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.name: " + quotedMiB + ": want 1-128 characters"},
		{"1 MiB chunk tensor", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			ch[0].Tensor = mib
			return ch
		}, service.Config{}, codes.InvalidArgument, "chunk.tensor: " + quotedMiB + ": not a tensor the header declared"},
		{"1 MiB sha256", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			h.Sha256 = mib
			return ch
		}, service.Config{}, codes.InvalidArgument, "header.sha256: " + quotedMiB},
		{"chunk for another tensor's bytes", func(h *pb.LoadExpertsRequest_Header, ch []*pb.LoadExpertsRequest_Chunk) []*pb.LoadExpertsRequest_Chunk {
			ch[16].Tensor = "w13" // the first w2 chunk, sent as w13 [0, 100) again
			return ch
		}, service.Config{}, codes.InvalidArgument, "chunk[w13]: bytes [0, 100) overlap bytes [0, 1536)"},
	}
}

// setScale overwrites element i of the scale tensor's chunk (each scale
// tensor of the test set fits one chunk).
func setScale(ch []*pb.LoadExpertsRequest_Chunk, tensor string, i int, v float32) {
	for _, c := range ch {
		if c.GetTensor() == tensor {
			s := bytesF32(c.GetData())
			s[i] = v
			c.Data = f32Bytes(s)
			return
		}
	}
	panic("no chunk for " + tensor)
}

// oversizedLimit is the message limit of the oversized-message cases.
const oversizedLimit = 32 << 10

// oversized are messages over a small server's limit, sent by a client
// whose own limit is larger, so the server's transport refuses them.
func oversized(rng *rand.Rand) []badCall {
	big := grpc.MaxCallSendMsgSize(64 << 20)
	cfg := service.Config{MaxMessageBytes: oversizedLimit}
	return []badCall{
		{"FusedMoE/oversized message", cfg, func(ctx context.Context, c pb.ExpertServiceClient) error {
			_, err := c.FusedMoE(ctx, request(rng, 300), big) // 48 KB of hidden states
			return err
		}, codes.ResourceExhausted, "larger than max"},
		{"LoadExperts/oversized chunk", cfg, func(ctx context.Context, c pb.ExpertServiceClient) error {
			w := randomWeights(rng, pb.Activation_ACTIVATION_RELU2, 8, 64, 64) // 32 KiB per weight tensor
			stream, err := c.LoadExperts(ctx, big)
			if err != nil {
				return err
			}
			msgs := []*pb.LoadExpertsRequest{
				{Payload: &pb.LoadExpertsRequest_Header_{Header: servicetest.Header("big", w, false)}},
				{Payload: &pb.LoadExpertsRequest_Chunk_{Chunk: servicetest.Chunks(w, 1<<20)[0]}},
			}
			for _, m := range msgs {
				if err := stream.Send(m); err != nil {
					break
				}
			}
			_, err = stream.CloseAndRecv()
			return err
		}, codes.ResourceExhausted, "larger than max"},
		{"FusedMoEStream/oversized message", cfg, func(ctx context.Context, c pb.ExpertServiceClient) error {
			stream, err := c.FusedMoEStream(ctx, big)
			if err != nil {
				return err
			}
			if err := stream.Send(request(rng, 300)); err != nil {
				return err
			}
			_, err = stream.Recv()
			return err
		}, codes.ResourceExhausted, "larger than max"},
	}
}

// cmpIgnoreBackendCounts compares server states of calls that did reach
// the backend (the fault tests).
var cmpIgnoreBackendCounts = cmpopts.IgnoreFields(serverState{}, "BackendCalls", "BackendLoads")

// serviceConfig is a Config with a loaded-bytes budget.
func serviceConfig(maxLoaded int64) service.Config {
	return service.Config{MaxLoadedBytes: maxLoaded}
}

// shmRegionSize is the region every shared-memory bad-input call registers.
const shmRegionSize = 4096

// registerBadRegion registers a fresh shmRegionSize region "r" on c's
// connection with data at offset 0, and unlinks its object at once (the
// server's mapping keeps the pages; the connection's end unmaps them).
func registerBadRegion(ctx context.Context, c pb.ExpertServiceClient, data []byte) error {
	key := fmt.Sprintf("expertd-badinput-%d-%d", os.Getpid(), shmSeq.Add(1))
	f, err := os.OpenFile("/dev/shm/"+key, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	if err := f.Truncate(shmRegionSize); err != nil {
		return err
	}
	if _, err := f.WriteAt(data, 0); err != nil {
		return err
	}
	_, err = c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "r", Key: key, ByteSize: shmRegionSize})
	return err
}

// shmBadInput are malformed shared-memory references on a server with
// shared memory on: each call registers region "r" holding the request's
// hidden states (badM x testK FP32, 480 bytes) at offset 0, then edits the
// request.
func shmBadInput(rng *rand.Rand) []badCall {
	on := service.Config{SharedMemory: true}
	const hb = badM * testK * 4
	call := func(edit func(r *pb.FusedMoERequest)) func(ctx context.Context, c pb.ExpertServiceClient) error {
		return func(ctx context.Context, c pb.ExpertServiceClient) error {
			req := request(rng, badM)
			if err := registerBadRegion(ctx, c, req.GetHiddenStates().GetData()); err != nil {
				return err
			}
			req.HiddenStates.Source = shmRef("r", 0, hb)
			edit(req)
			_, err := c.FusedMoE(ctx, req)
			return err
		}
	}
	hidden := func(off, n int64) func(r *pb.FusedMoERequest) {
		return func(r *pb.FusedMoERequest) { r.HiddenStates.Source = shmRef("r", off, n) }
	}
	out := func(region string, off, n int64) func(r *pb.FusedMoERequest) {
		return func(r *pb.FusedMoERequest) {
			r.OutputShm = &pb.SharedMemoryRef{RegionName: region, Offset: off, ByteSize: n}
		}
	}
	return []badCall{
		{"FusedMoE/shm unknown region", on, call(func(r *pb.FusedMoERequest) { r.HiddenStates.Source = shmRef("nope", 0, hb) }),
			codes.NotFound, `hidden_states.shm.region_name: no shared-memory region "nope" on this connection`},
		{"FusedMoE/shm negative offset", on, call(hidden(-1, hb)), codes.InvalidArgument, `hidden_states.shm.offset: -1: want in [0, 4096]`},
		{"FusedMoE/shm offset past the region", on, call(hidden(shmRegionSize+1, hb)), codes.InvalidArgument, `hidden_states.shm.offset: 4097`},
		{"FusedMoE/shm runs past the region", on, call(hidden(shmRegionSize-hb+1, hb)), codes.InvalidArgument, `hidden_states.shm.byte_size: 480 at offset 3617 runs past the end of region "r" (4096 bytes)`},
		{"FusedMoE/shm offset+size overflows int64", on, call(hidden(8, math.MaxInt64)), codes.InvalidArgument, `hidden_states.shm.byte_size: 9223372036854775807 at offset 8 runs past the end`},
		{"FusedMoE/shm negative size", on, call(hidden(0, -1)), codes.InvalidArgument, `hidden_states.shm.byte_size: -1 at offset 0`},
		{"FusedMoE/shm size one short", on, call(hidden(0, hb-1)), codes.InvalidArgument, `hidden_states.shm.byte_size: 479: shape [3 40] of DATA_TYPE_FLOAT32 needs 480 bytes`},
		{"FusedMoE/shm size disagrees with dtype", on, call(func(r *pb.FusedMoERequest) { r.HiddenStates.Dtype = pb.DataType_DATA_TYPE_BFLOAT16 }),
			codes.InvalidArgument, `hidden_states.shm.byte_size: 480: shape [3 40] of DATA_TYPE_BFLOAT16 needs 240 bytes`},
		{"FusedMoE/shm bad dtype left to validation", on, call(func(r *pb.FusedMoERequest) { r.HiddenStates.Dtype = pb.DataType_DATA_TYPE_INT32 }),
			codes.InvalidArgument, `hidden_states: dtype DATA_TYPE_INT32`},
		{"FusedMoE/shm logits past the region", on, call(func(r *pb.FusedMoERequest) { r.RouterLogits.Source = shmRef("r", shmRegionSize-8, badM*testE*4) }),
			codes.InvalidArgument, `router_logits.shm.byte_size: 72 at offset 4088 runs past the end`},
		{"FusedMoE/shm inline weights short", on, call(func(r *pb.FusedMoERequest) {
			w := randomWeights(rng, pb.Activation_ACTIVATION_RELU2, 2, testK, 8)
			w.W2Scale.Source = shmRef("r", 0, 4)
			r.Experts = &pb.FusedMoERequest_Weights{Weights: w}
		}), codes.InvalidArgument, `weights.w2_scale.shm.byte_size: 4: shape [2] of DATA_TYPE_FLOAT32 needs 8 bytes`},
		{"FusedMoE/output_shm unknown region", on, call(out("nope", 0, badM*testK*2)), codes.NotFound, `output_shm.region_name: no shared-memory region "nope"`},
		{"FusedMoE/output_shm wrong size", on, call(out("r", 1024, badM*testK*4)), codes.InvalidArgument, `output_shm.byte_size: 480: the output [3 40] of DATA_TYPE_BFLOAT16 needs 240 bytes`},
		{"FusedMoE/output_shm past the region", on, call(out("r", shmRegionSize-100, badM*testK*2)), codes.InvalidArgument, `output_shm.byte_size: 240 at offset 3996 runs past the end of region "r"`},
		{"FusedMoE/output_shm overlaps an input", on, call(out("r", 400, badM*testK*2)), codes.InvalidArgument, `output_shm: [400, 640) of region "r" overlaps hidden_states.shm`},
		{"FusedMoE/output_shm without shared memory", service.Config{}, func(ctx context.Context, c pb.ExpertServiceClient) error {
			req := request(rng, badM)
			out("r", 0, badM*testK*2)(req)
			_, err := c.FusedMoE(ctx, req)
			return err
		}, codes.InvalidArgument, `output_shm: shared memory is not enabled on this server`},
		{"FusedMoE/shm 1 MiB region name", on, call(func(r *pb.FusedMoERequest) { r.HiddenStates.Source = shmRef(mib, 0, hb) }),
			codes.InvalidArgument, "hidden_states.shm.region_name: " + quotedMiB + ": 1048576 bytes, want at most 256"},
		{"FusedMoE/output_shm 1 MiB region name", on, call(out(mib, 0, badM*testK*2)), codes.InvalidArgument, "output_shm.region_name: " + quotedMiB},
		{"RegisterSharedMemory/1 MiB key", on, func(ctx context.Context, c pb.ExpertServiceClient) error {
			_, err := c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "r", Key: mib, ByteSize: 1})
			return err
		}, codes.InvalidArgument, "key: " + quotedMiB + ": want 1-255 characters"},
		{"RegisterSharedMemory/1 MiB name", on, func(ctx context.Context, c pb.ExpertServiceClient) error {
			_, err := c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: mib, Key: "k", ByteSize: 1})
			return err
		}, codes.InvalidArgument, "name: " + quotedMiB + ": want 1-128 characters"},
		{"UnregisterSharedMemory/1 MiB name", on, func(ctx context.Context, c pb.ExpertServiceClient) error {
			_, err := c.UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{Name: mib})
			return err
		}, codes.InvalidArgument, "name: " + quotedMiB + ": 1048576 bytes, want at most 256"},
		{"ListSharedMemory/1 MiB name", on, func(ctx context.Context, c pb.ExpertServiceClient) error {
			_, err := c.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{Name: mib})
			return err
		}, codes.InvalidArgument, "name: " + quotedMiB},
		{"UnloadExperts/1 MiB name", service.Config{}, func(ctx context.Context, c pb.ExpertServiceClient) error {
			_, err := c.UnloadExperts(ctx, &pb.UnloadExpertsRequest{Name: mib})
			return err
		}, codes.InvalidArgument, "name: " + quotedMiB + ": 1048576 bytes, want at most 256"},
		{"UnloadExperts/unknown name", service.Config{}, func(ctx context.Context, c pb.ExpertServiceClient) error {
			_, err := c.UnloadExperts(ctx, &pb.UnloadExpertsRequest{Name: strings.Repeat("c", 200)})
			return err
		}, codes.NotFound, `name: no expert set "` + strings.Repeat("c", 128) + `"... (200 bytes) is loaded`},
		{"RegisterSharedMemory/key escapes /dev/shm", on, func(ctx context.Context, c pb.ExpertServiceClient) error {
			_, err := c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "r", Key: "../../etc/passwd", ByteSize: 1})
			return err
		}, codes.InvalidArgument, `key: "../../etc/passwd": character '/'`},
	}
}
