package service_test

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// details are the AIP-193 details of err's status.
func details(t *testing.T, err error) []proto.Message {
	t.Helper()
	var got []proto.Message
	for _, d := range status.Convert(err).Details() {
		m, ok := d.(proto.Message)
		if !ok {
			t.Fatalf("status detail %v: %T is not a known message", d, d)
		}
		got = append(got, m)
	}
	return got
}

// TestErrorDetails checks the statuses callers act on without parsing
// text: InvalidArgument carries BadRequest with the field the message
// names, a call over a fixed limit QuotaFailure naming the flag and no
// RetryInfo (the same call would fail again), other codes nothing.
func TestErrorDetails(t *testing.T) {
	rng := newRand(t)
	tests := []struct {
		name     string
		cfg      service.Config
		edit     func(*pb.FusedMoERequest)
		wantCode codes.Code
		want     []proto.Message
	}{
		{"short hidden", service.Config{}, func(r *pb.FusedMoERequest) {
			d := r.HiddenStates.GetData()
			r.HiddenStates.Source = &pb.Tensor_Data{Data: d[:len(d)-1]}
		}, codes.InvalidArgument, []proto.Message{&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{
			Field: "hidden_states", Description: "shape [3 40] needs 480 bytes, got 479",
		}}}}},
		{"nested field", service.Config{}, func(r *pb.FusedMoERequest) { r.HiddenStates.Source = nil },
			codes.InvalidArgument, []proto.Message{&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{
				Field: "hidden_states.data", Description: "is required",
			}}}}},
		{"over max tokens", service.Config{MaxTokens: 2}, func(*pb.FusedMoERequest) {},
			codes.ResourceExhausted, []proto.Message{&errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{{
				Subject: "hidden_states", Description: "M = 3 tokens exceeds the server's max tokens per call 2; split the batch",
				QuotaId: "max-tokens", QuotaValue: 2,
			}}}}},
		{"inline over max loaded bytes", service.Config{MaxLoadedBytes: layerBytes + 1000}, func(r *pb.FusedMoERequest) {
			r.Experts = &pb.FusedMoERequest_Weights{Weights: randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)}
		}, codes.ResourceExhausted, []proto.Message{&errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{{
			Subject: "weights", Description: "17328 bytes would exceed the server's max loaded bytes (17328 of 18328 in use); unload a set first",
			QuotaId: "max-loaded-bytes", QuotaValue: layerBytes + 1000,
		}}}}},
		{"unknown set", service.Config{}, func(r *pb.FusedMoERequest) { r.Experts = &pb.FusedMoERequest_ExpertSet{ExpertSet: "nope"} },
			codes.NotFound, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, _ := loadedServer(t, rng, tt.cfg, &fakeBackend{})
			req := request(rng, 3)
			tt.edit(req)
			_, err := c.FusedMoE(testContext(t), req)
			if got := status.Code(err); got != tt.wantCode {
				t.Fatalf("FusedMoE: %v, want code %v", err, tt.wantCode)
			}
			if diff := cmp.Diff(tt.want, details(t, err), protocmp.Transform()); diff != "" {
				t.Errorf("status details (-want +got):\n%s", diff)
			}
		})
	}
}

// TestBusyRetryInfo checks a call refused by a full queue is told which
// limit it hit and when to retry: a delay within the bounds the server
// answers with, since the queue moves as calls finish.
func TestBusyRetryInfo(t *testing.T) {
	rng := newRand(t)
	b := &fakeBackend{release: make(chan struct{}), started: make(chan struct{}, 1)}
	c, _, _ := servicetest.StartServerConfig(t, service.Config{MaxConcurrent: 1, MaxQueued: -1}, b)
	w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)
	if _, err := servicetest.Upload(testContext(t), c, servicetest.Header("layer", w, false), servicetest.Chunks(w, 1000)); err != nil {
		t.Fatal(err)
	}
	first := make(chan error, 1)
	go func() {
		_, err := c.FusedMoE(testContext(t), request(rng, 1))
		first <- err
	}()
	<-b.started // the one slot is taken, and there is no queue
	_, err := c.FusedMoE(testContext(t), request(rng, 1))
	close(b.release)
	if err := <-first; err != nil {
		t.Fatalf("admitted call: %v", err)
	}
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("call beyond the queue: %v, want ResourceExhausted", err)
	}
	got := details(t, err)
	var delay time.Duration = -1
	for _, d := range got {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			delay = ri.GetRetryDelay().AsDuration()
		}
	}
	if delay < time.Millisecond || delay > time.Second {
		t.Errorf("RetryInfo delay %v, want 1ms to 1s", delay)
	}
	want := &errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{{
		Subject: "server", Description: "server busy: 1 calls running, 0 queued (max queued 0); retry with backoff", QuotaId: "max-queued",
	}}}
	if len(got) == 0 || !cmp.Equal(got[0], proto.Message(want), protocmp.Transform()) {
		t.Errorf("details %v, want QuotaFailure %v first", got, want)
	}
}
