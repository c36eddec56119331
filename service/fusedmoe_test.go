package service_test

import (
	"context"
	"io"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// Shapes of the set most FusedMoE tests load: small, with K and N not
// multiples of 16.
const (
	testE, testK, testN, testTopK = 6, 40, 24, 2
)

// request is a valid FusedMoE request on the set "layer" with m tokens.
func request(rng *rand.Rand, m int) *pb.FusedMoERequest {
	return &pb.FusedMoERequest{
		Experts:      &pb.FusedMoERequest_ExpertSet{ExpertSet: "layer"},
		HiddenStates: f32Tensor(randn(rng, m*testK, 0.1), int64(m), testK),
		RouterLogits: f32Tensor(randn(rng, m*testE, 1), int64(m), testE),
		Routing:      &pb.Routing{TopK: testTopK, Renormalize: true},
	}
}

// loadedServer starts a server on b with a random set loaded as "layer".
func loadedServer(t *testing.T, rng *rand.Rand, cfg service.Config, b kernels.Backend) (pb.ExpertServiceClient, *pb.ExpertWeights) {
	t.Helper()
	c, _, _ := servicetest.StartServerConfig(t, cfg, b)
	w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)
	if _, err := servicetest.Upload(testContext(t), c, servicetest.Header("layer", w, false), servicetest.Chunks(w, 1000)); err != nil {
		t.Fatalf("LoadExperts: %v", err)
	}
	return c, w
}

// TestFusedMoEConversion checks what the backend receives for valid
// requests: defaults applied, bytes aliased, routing passed through.
func TestFusedMoEConversion(t *testing.T) {
	rng := newRand(t)
	const m = 3
	ids := []int32{5, 0, 1, 4, 3, 2}
	weights := []float32{0.25, 0.75, 1, -0.5, 2, 0}
	tests := []struct {
		name        string
		edit        func(r *pb.FusedMoERequest)
		wantRouting moe.Routing
		wantOut     moe.DType
		wantIDs     []int32
		wantWeights []float32
	}{
		{"defaults", func(r *pb.FusedMoERequest) {},
			moe.Routing{TopK: testTopK, Renormalize: true, Scoring: moe.Softmax, ScalingFactor: 1}, moe.BFloat16, nil, nil},
		{"sigmoid groups bias", func(r *pb.FusedMoERequest) {
			r.Routing = &pb.Routing{TopK: 4, Scoring: pb.Scoring_SCORING_SIGMOID, NumExpertGroups: 3, TopkGroups: 2, RoutedScalingFactor: 2.5,
				CorrectionBias: f32Tensor([]float32{0.1, -0.2, 0.3, 0, 0.5, -1}, testE)}
			r.OutputDtype = pb.DataType_DATA_TYPE_FLOAT32
		}, moe.Routing{TopK: 4, Scoring: moe.Sigmoid, NumGroups: 3, TopKGroups: 2, ScalingFactor: 2.5,
			CorrectionBias: []float32{0.1, -0.2, 0.3, 0, 0.5, -1}}, moe.Float32, nil, nil},
		{"one group is no grouping", func(r *pb.FusedMoERequest) { r.Routing.NumExpertGroups, r.Routing.TopkGroups = 1, 5 },
			moe.Routing{TopK: testTopK, Renormalize: true, Scoring: moe.Softmax, ScalingFactor: 1}, moe.BFloat16, nil, nil},
		{"precomputed", func(r *pb.FusedMoERequest) {
			r.RouterLogits, r.Routing = nil, nil
			r.TopkIds = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_INT32, Shape: []int64{m, 2}, Source: &pb.Tensor_Data{Data: i32Bytes(ids)}}
			r.TopkWeights = f32Tensor(weights, m, 2)
		}, moe.Routing{TopK: 2, Scoring: moe.Softmax, ScalingFactor: 1}, moe.BFloat16, ids, weights},
	}
	b := &fakeBackend{}
	c, _ := loadedServer(t, rng, service.Config{}, b)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := request(rng, m)
			tt.edit(req)
			resp, err := c.FusedMoE(testContext(t), req)
			if err != nil {
				t.Fatalf("FusedMoE: %v", err)
			}
			got := b.lastCall()
			if diff := cmp.Diff(tt.wantRouting, got.Routing); diff != "" {
				t.Errorf("routing (-want +got):\n%s", diff)
			}
			if got.OutDType != tt.wantOut {
				t.Errorf("OutDType = %v, want %v", got.OutDType, tt.wantOut)
			}
			if diff := cmp.Diff(tt.wantIDs, got.TopKIDs); diff != "" {
				t.Errorf("TopKIDs (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tt.wantWeights, got.TopKWeights); diff != "" {
				t.Errorf("TopKWeights (-want +got):\n%s", diff)
			}
			wantHidden := moe.Tensor{DType: moe.Float32, Shape: []int{m, testK}, Data: req.GetHiddenStates().GetData()}
			if diff := cmp.Diff(wantHidden, got.Hidden); diff != "" {
				t.Errorf("Hidden (-want +got):\n%s", diff)
			}
			if tt.wantIDs == nil {
				wantLogits := moe.Tensor{DType: moe.Float32, Shape: []int{m, testE}, Data: req.GetRouterLogits().GetData()}
				if diff := cmp.Diff(wantLogits, got.Logits); diff != "" {
					t.Errorf("Logits (-want +got):\n%s", diff)
				}
			}
			out := resp.GetOutput()
			if out.GetDtype() != wireDType(tt.wantOut) || !cmp.Equal(out.GetShape(), []int64{m, testK}) || len(out.GetData()) != m*testK*tt.wantOut.Size() {
				t.Errorf("output %v %v with %d bytes, want %v [%d %d]", out.GetDtype(), out.GetShape(), len(out.GetData()), tt.wantOut, m, testK)
			}
			if resp.GetBackend() != "fake" || resp.GetTimings().GetKernelNanos() != 1234 || resp.GetTimings().GetTotalNanos() <= 0 {
				t.Errorf("backend %q timings %v, want fake with kernel 1234 ns and total > 0", resp.GetBackend(), resp.GetTimings())
			}
			if resp.GetTopkIds() != nil {
				t.Errorf("routing returned without return_routing")
			}
			if !got.NoRouting {
				t.Errorf("the backend was asked for routing the call does not return")
			}
		})
	}
}

func wireDType(d moe.DType) pb.DataType { return pb.DataType(d) }

func TestFusedMoEReturnRouting(t *testing.T) {
	rng := newRand(t)
	b := &fakeBackend{}
	c, _ := loadedServer(t, rng, service.Config{}, b)
	req := request(rng, 3)
	req.RouterLogits, req.Routing = nil, nil
	ids := []int32{4, 1, 0, 5, 2, 3}
	ws := []float32{0.5, 0.25, 1, 2, 0.125, 0}
	req.TopkIds = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_INT32, Shape: []int64{3, 2}, Source: &pb.Tensor_Data{Data: i32Bytes(ids)}}
	req.TopkWeights = f32Tensor(ws, 3, 2)
	req.ReturnRouting = true
	resp, err := c.FusedMoE(testContext(t), req)
	if err != nil {
		t.Fatal(err)
	}
	if b.lastCall().NoRouting {
		t.Errorf("the backend was told to skip the routing the call returns")
	}
	want := &pb.FusedMoEResponse{TopkIds: req.TopkIds, TopkWeights: req.TopkWeights}
	got := &pb.FusedMoEResponse{TopkIds: resp.GetTopkIds(), TopkWeights: resp.GetTopkWeights()}
	if diff := cmp.Diff(want, got, protocmp.Transform()); diff != "" {
		t.Errorf("returned routing (-want +got):\n%s", diff)
	}
}

// TestFusedMoEStream checks one response per request, in order, and that a
// bad request ends the stream with its status.
func TestFusedMoEStream(t *testing.T) {
	rng := newRand(t)
	b := &fakeBackend{}
	c, _ := loadedServer(t, rng, service.Config{}, b)
	ctx := testContext(t)
	stream, err := c.FusedMoEStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sizes := []int{1, 5, 2, 7}
	for _, m := range sizes {
		if err := stream.Send(request(rng, m)); err != nil {
			t.Fatal(err)
		}
	}
	for i, m := range sizes {
		resp, err := stream.Recv()
		if err != nil {
			t.Fatalf("response %d: %v", i, err)
		}
		if got := resp.GetOutput().GetShape(); !cmp.Equal(got, []int64{int64(m), testK}) {
			t.Errorf("response %d has shape %v, want [%d %d]", i, got, m, testK)
		}
	}
	bad := request(rng, 2)
	bad.Routing.TopK = 0
	if err := stream.Send(bad); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "routing.top_k") {
		t.Errorf("after a bad request: got %v, want InvalidArgument naming routing.top_k", err)
	}
}

// TestFusedMoEInline runs inline weights and checks the backend saw the
// same set a chunked load produces, and freed it after the call.
func TestFusedMoEInline(t *testing.T) {
	rng := newRand(t)
	b := &fakeBackend{}
	c, w := loadedServer(t, rng, service.Config{MaxLoadedBytes: 1 << 20}, b)
	req := request(rng, 4)
	req.Experts = &pb.FusedMoERequest_Weights{Weights: w}
	if _, err := c.FusedMoE(testContext(t), req); err != nil {
		t.Fatalf("FusedMoE inline: %v", err)
	}
	if loads, closes := b.counts(); loads != 2 || closes != 1 {
		t.Errorf("backend loads/closes = %d/%d, want 2/1 (the inline set is freed)", loads, closes)
	}
	list, _ := c.ListExperts(testContext(t), &pb.ListExpertsRequest{})
	if len(list.GetExpertSets()) != 1 {
		t.Errorf("inline call changed the registry: %v", list)
	}

	// An inline set counts against max loaded bytes.
	c2, _, _ := servicetest.StartServerConfig(t, service.Config{MaxLoadedBytes: 100}, &fakeBackend{})
	if _, err := c2.FusedMoE(testContext(t), req); status.Code(err) != codes.ResourceExhausted {
		t.Errorf("inline set over max loaded bytes: got %v, want ResourceExhausted", err)
	}
}

// TestFusedMoEStreamOrder runs a stream whose later requests finish first:
// they must run concurrently yet be answered in request order.
func TestFusedMoEStreamOrder(t *testing.T) {
	rng := newRand(t)
	b := &fakeBackend{delay: func(r *moe.Request) time.Duration { return time.Duration(r.M()) * 10 * time.Millisecond }}
	c, _ := loadedServer(t, rng, service.Config{MaxConcurrent: 4}, b)
	stream, err := c.FusedMoEStream(testContext(t))
	if err != nil {
		t.Fatal(err)
	}
	sizes := []int{5, 4, 3, 2, 1, 3}
	for _, m := range sizes {
		if err := stream.Send(request(rng, m)); err != nil {
			t.Fatal(err)
		}
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	var got []int
	for {
		resp, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("after %d responses: %v", len(got), err)
		}
		got = append(got, int(resp.GetOutput().GetShape()[0]))
	}
	if diff := cmp.Diff(sizes, got); diff != "" {
		t.Errorf("response order by M (-want +got):\n%s", diff)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.maxInFlight < 2 || b.maxInFlight > 4 {
		t.Errorf("at most %d calls of the stream ran at once, want 2..4 (MaxConcurrent)", b.maxInFlight)
	}
}

// TestFusedMoEStreamFailureWhileOpen: a call that fails while the client
// keeps its side open (sending nothing more, not closing) still ends the
// stream with the call's status at once, after the good calls before it.
// The good calls take a while, so another worker is waiting to receive
// when the bad request arrives: the one that fails it is not the one
// blocked in Recv.
func TestFusedMoEStreamFailureWhileOpen(t *testing.T) {
	rng := newRand(t)
	b := &fakeBackend{delay: func(*moe.Request) time.Duration { return 20 * time.Millisecond }}
	c, _ := loadedServer(t, rng, service.Config{MaxConcurrent: 4}, b)
	stream, err := c.FusedMoEStream(testContext(t))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := stream.Send(request(rng, 2)); err != nil {
			t.Fatal(err)
		}
		if _, err := stream.Recv(); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	bad := request(rng, 2)
	bad.Routing.TopK = 0
	if err := stream.Send(bad); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); status.Code(err) != codes.InvalidArgument {
		t.Errorf("after a bad request: got %v, want InvalidArgument", err)
	}
}

// TestFusedMoEStreamCallerGone: a client that goes away with calls
// running on its stream stops them (their context ends), and the server
// counts none in flight afterwards: Shutdown returns at once.
func TestFusedMoEStreamCallerGone(t *testing.T) {
	rng := newRand(t)
	b := &fakeBackend{release: make(chan struct{}), started: make(chan struct{}, 8)}
	c, srv, _ := servicetest.StartServerConfig(t, service.Config{MaxConcurrent: 4}, b)
	w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)
	if _, err := servicetest.Upload(testContext(t), c, servicetest.Header("layer", w, false), servicetest.Chunks(w, 1000)); err != nil {
		t.Fatalf("LoadExperts: %v", err)
	}
	ctx, cancel := context.WithCancel(testContext(t))
	stream, err := c.FusedMoEStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := stream.Send(request(rng, 1)); err != nil {
			t.Fatal(err)
		}
	}
	for range 3 {
		<-b.started
	}
	cancel()
	if _, err := stream.Recv(); status.Code(err) != codes.Canceled {
		t.Errorf("Recv after cancel: %v, want Canceled", err)
	}
	sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer scancel()
	if err := srv.Shutdown(sctx); err != nil {
		t.Errorf("Shutdown after the caller left: %v, want the stream's calls ended", err)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.inFlight != 0 {
		t.Errorf("%d backend calls still running", b.inFlight)
	}
}
