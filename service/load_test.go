package service_test

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/testing/protocmp"

	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

func TestLoadListUnload(t *testing.T) {
	ctx := testContext(t)
	rng := newRand(t)
	c, _ := servicetest.StartServer(t, &fakeBackend{})
	w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, 4, 40, 24)
	chunks := servicetest.Chunks(w, 333)
	rng.Shuffle(len(chunks), func(i, j int) { chunks[i], chunks[j] = chunks[j], chunks[i] })
	h := servicetest.Header("layer0", w, false)
	h.Sha256 = strings.ToUpper(fingerprintOf(w))

	got, err := servicetest.Upload(ctx, c, h, chunks)
	if err != nil {
		t.Fatalf("LoadExperts: %v", err)
	}
	want := &pb.ExpertSetInfo{
		Name: "layer0", Activation: pb.Activation_ACTIVATION_SILU_GATED,
		NumExperts: 4, HiddenSize: 40, IntermediateSize: 24,
		W13ScaleGranularity: "per-expert", W2ScaleGranularity: "per-expert",
		Bytes:       4*48*40 + 4*40*24 + 4*4 + 4*4,
		Fingerprint: fingerprintOf(w),
		Backend:     "fake",
	}
	ignoreTime := protocmp.IgnoreFields(&pb.ExpertSetInfo{}, "loaded_at")
	if diff := cmp.Diff(want, got, protocmp.Transform(), ignoreTime); diff != "" {
		t.Errorf("LoadExperts info (-want +got):\n%s", diff)
	}
	if got.GetLoadedAt().AsTime().IsZero() {
		t.Errorf("loaded_at is unset")
	}

	list, err := c.ListExperts(ctx, &pb.ListExpertsRequest{})
	if err != nil {
		t.Fatalf("ListExperts: %v", err)
	}
	if diff := cmp.Diff(&pb.ListExpertsResponse{ExpertSets: []*pb.ExpertSetInfo{got}}, list, protocmp.Transform()); diff != "" {
		t.Errorf("ListExperts (-want +got):\n%s", diff)
	}

	un, err := c.UnloadExperts(ctx, &pb.UnloadExpertsRequest{Name: "layer0"})
	if err != nil {
		t.Fatalf("UnloadExperts: %v", err)
	}
	if un.GetFreedBytes() != want.Bytes {
		t.Errorf("freed %d bytes, want %d", un.GetFreedBytes(), want.Bytes)
	}
	if _, err := c.UnloadExperts(ctx, &pb.UnloadExpertsRequest{Name: "layer0"}); status.Code(err) != codes.NotFound {
		t.Errorf("second UnloadExperts: got %v, want NotFound", err)
	}
	if list, _ := c.ListExperts(ctx, &pb.ListExpertsRequest{}); len(list.GetExpertSets()) != 0 {
		t.Errorf("ListExperts after unload: %v, want none", list)
	}
}

func TestLoadStreamShape(t *testing.T) {
	rng := newRand(t)
	w := randomWeights(rng, pb.Activation_ACTIVATION_RELU2, 2, 16, 8)
	tests := []struct {
		name    string
		msgs    []*pb.LoadExpertsRequest
		wantMsg string
	}{
		{"empty stream", nil, "stream ended before a header"},
		{"chunk first", []*pb.LoadExpertsRequest{{Payload: &pb.LoadExpertsRequest_Chunk_{Chunk: servicetest.Chunks(w, 10)[0]}}}, "chunk: arrived before the header"},
		{"two headers", []*pb.LoadExpertsRequest{
			{Payload: &pb.LoadExpertsRequest_Header_{Header: servicetest.Header("x", w, false)}},
			{Payload: &pb.LoadExpertsRequest_Header_{Header: servicetest.Header("x", w, false)}},
		}, "message 1 after the header is not a chunk"},
		{"safetensors then more", []*pb.LoadExpertsRequest{
			{Payload: &pb.LoadExpertsRequest_Safetensors{Safetensors: &pb.LoadExpertsRequest_SafetensorsSource{Name: "x"}}},
			{Payload: &pb.LoadExpertsRequest_Safetensors{Safetensors: &pb.LoadExpertsRequest_SafetensorsSource{Name: "x"}}},
		}, "safetensors: must be the stream's only message"},
		{"empty payload", []*pb.LoadExpertsRequest{{}}, "payload"},
	}
	c, _ := servicetest.StartServer(t, &fakeBackend{})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := testContext(t)
			stream, err := c.LoadExperts(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range tt.msgs {
				if stream.Send(m) != nil {
					break
				}
			}
			_, err = stream.CloseAndRecv()
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tt.wantMsg) {
				t.Errorf("got %v, want InvalidArgument containing %q", err, tt.wantMsg)
			}
		})
	}
}

func TestLoadOverwrite(t *testing.T) {
	ctx := testContext(t)
	rng := newRand(t)
	b := &fakeBackend{}
	c, _ := servicetest.StartServer(t, b)
	w1 := randomWeights(rng, pb.Activation_ACTIVATION_RELU2, 2, 16, 8)
	w2 := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, 3, 16, 8)
	if _, err := servicetest.Upload(ctx, c, servicetest.Header("s", w1, false), servicetest.Chunks(w1, 64)); err != nil {
		t.Fatal(err)
	}
	_, err := servicetest.Upload(ctx, c, servicetest.Header("s", w2, false), servicetest.Chunks(w2, 64))
	if status.Code(err) != codes.AlreadyExists {
		t.Errorf("second load without overwrite: got %v, want AlreadyExists", err)
	}
	info, err := servicetest.Upload(ctx, c, servicetest.Header("s", w2, true), servicetest.Chunks(w2, 64))
	if err != nil {
		t.Fatalf("load with overwrite: %v", err)
	}
	if got, want := info.GetFingerprint(), fingerprintOf(w2); got != want {
		t.Errorf("fingerprint %s, want %s", got, want)
	}
	list, _ := c.ListExperts(ctx, &pb.ListExpertsRequest{})
	if got := len(list.GetExpertSets()); got != 1 || list.GetExpertSets()[0].GetNumExperts() != 3 {
		t.Errorf("ListExperts = %v, want the one overwritten set", list)
	}
	if loads, closes := b.counts(); loads != 2 || closes != 1 {
		t.Errorf("backend loads/closes = %d/%d, want 2/1 (the replaced set is freed)", loads, closes)
	}
}

// TestLoadedBytesAccounting checks the max-loaded-bytes budget is taken by
// loads and given back by unloads, so a freed slot can be reused.
func TestLoadedBytesAccounting(t *testing.T) {
	ctx := testContext(t)
	rng := newRand(t)
	a := randomWeights(rng, pb.Activation_ACTIVATION_RELU2, 2, 16, 8)
	b := randomWeights(rng, pb.Activation_ACTIVATION_RELU2, 2, 16, 8)
	size := servicetest.Header("x", a, false).GetTotalBytes()
	c, _, _ := servicetest.StartServerConfig(t, service.Config{MaxLoadedBytes: size}, &fakeBackend{})
	steps := []struct {
		name     string
		do       func() error
		wantCode codes.Code
	}{
		{"load a", func() error {
			_, err := servicetest.Upload(ctx, c, servicetest.Header("a", a, false), servicetest.Chunks(a, 64))
			return err
		}, codes.OK},
		{"load b over budget", func() error {
			_, err := servicetest.Upload(ctx, c, servicetest.Header("b", b, false), servicetest.Chunks(b, 64))
			return err
		}, codes.ResourceExhausted},
		{"overwrite a needs room for both", func() error {
			_, err := servicetest.Upload(ctx, c, servicetest.Header("a", b, true), servicetest.Chunks(b, 64))
			return err
		}, codes.ResourceExhausted},
		{"unload a", func() error {
			_, err := c.UnloadExperts(ctx, &pb.UnloadExpertsRequest{Name: "a"})
			return err
		}, codes.OK},
		{"load b in the freed room", func() error {
			_, err := servicetest.Upload(ctx, c, servicetest.Header("b", b, false), servicetest.Chunks(b, 64))
			return err
		}, codes.OK},
	}
	for _, s := range steps {
		if got := status.Code(s.do()); got != s.wantCode {
			t.Errorf("%s: got %v, want %v", s.name, got, s.wantCode)
		}
	}
}

// TestWaitIdleAfterRefusedChunk checks that an upload whose chunk the
// transport refuses has given its reservation back once WaitIdle
// returns. grpc-go answers the client from inside the handler's Recv,
// before the handler's clean-up; gating that Recv's return holds the
// reservation past the answer, so the order is the same on every run.
func TestWaitIdleAfterRefusedChunk(t *testing.T) {
	ctx := testContext(t)
	rng := newRand(t)
	gate := make(chan struct{})
	hold := func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		return handler(srv, gatedStream{ss, gate})
	}
	c, srv := servicetest.StartServerOptions(t, service.Config{MaxMessageBytes: oversizedLimit}, &fakeBackend{}, grpc.ChainStreamInterceptor(hold))
	release := sync.OnceFunc(func() { close(gate) })
	t.Cleanup(release) // a failed test must not leave the handler blocked
	if srv.WaitIdle(ctx) != nil || srv.LoadedBytes() != 0 {
		t.Fatalf("a fresh server is busy or holds %d bytes", srv.LoadedBytes())
	}

	w := randomWeights(rng, pb.Activation_ACTIVATION_RELU2, 8, 64, 64) // 32 KiB per weight tensor
	h := servicetest.Header("big", w, false)
	stream, err := c.LoadExperts(ctx, grpc.MaxCallSendMsgSize(64<<20))
	if err != nil {
		t.Fatalf("LoadExperts: %v", err)
	}
	for _, m := range []*pb.LoadExpertsRequest{
		{Payload: &pb.LoadExpertsRequest_Header_{Header: h}},
		{Payload: &pb.LoadExpertsRequest_Chunk_{Chunk: servicetest.Chunks(w, 1<<20)[0]}},
	} {
		if stream.Send(m) != nil {
			break
		}
	}
	if _, err := stream.CloseAndRecv(); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("oversized chunk: got %v, want ResourceExhausted", err)
	}
	// The client has its answer; the handler is still in Recv.
	if got := srv.LoadedBytes(); got != h.GetTotalBytes() {
		t.Fatalf("loaded bytes %d while the refused upload's handler runs, want its reservation %d", got, h.GetTotalBytes())
	}
	if _, running := srv.Activity(); running != 1 {
		t.Fatalf("%d calls running, want the refused upload's", running)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if err := srv.WaitIdle(cancelled); !errors.Is(err, context.Canceled) {
		t.Fatalf("WaitIdle while the upload's handler runs: %v, want %v", err, context.Canceled)
	}
	release()
	if err := srv.WaitIdle(ctx); err != nil {
		t.Fatalf("WaitIdle: %v", err)
	}
	if got := srv.LoadedBytes(); got != 0 {
		t.Errorf("loaded bytes %d once idle, want 0", got)
	}
}

// gatedStream holds a failed receive's return until gate is closed.
type gatedStream struct {
	grpc.ServerStream
	gate <-chan struct{}
}

func (g gatedStream) RecvMsg(m any) error {
	err := g.ServerStream.RecvMsg(m)
	if err != nil && !errors.Is(err, io.EOF) {
		<-g.gate
	}
	return err
}
