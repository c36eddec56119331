package client_test

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/kernels/kerneltest"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
)

// TestErrorDetailsFromServer checks what the SDK exposes of a real
// server's statuses: the field of an InvalidArgument, the limit of a
// ResourceExhausted without a retry delay (retrying would not help), and
// that the status and message stay what they were.
func TestErrorDetailsFromServer(t *testing.T) {
	rng := newRand(t)
	c := startServer(t, service.Config{MaxTokens: 4})
	ctx := testContext(t)
	set, req := kerneltest.NewCase(rng, kerneltest.Qwen3.Scaled(64, 48), 5)
	if _, err := c.LoadExperts(ctx, "layer", clienttest.Weights(set)); err != nil {
		t.Fatal(err)
	}

	_, err := c.FusedMoE(ctx, clienttest.Request("layer", set, req))
	var ce *client.Error
	if !errors.As(err, &ce) || status.Code(err) != codes.ResourceExhausted || ce.Method != "FusedMoE" {
		t.Fatalf("over max tokens: %v (%T), want a *client.Error with ResourceExhausted", err, err)
	}
	if d, ok := ce.RetryDelay(); ok {
		t.Errorf("over max tokens: RetryDelay %v, want none", d)
	}
	if q := ce.QuotaViolations(); len(q) != 1 || q[0].GetQuotaId() != "max-tokens" || q[0].GetQuotaValue() != 4 {
		t.Errorf("over max tokens: quota violations %v, want max-tokens = 4", q)
	}

	_, req = kerneltest.NewCase(rng, kerneltest.Qwen3.Scaled(64, 48), 2)
	r := clienttest.Request("layer", set, req)
	r.Routing.TopK = set.E + 1
	_, err = c.FusedMoE(ctx, r)
	if !errors.As(err, &ce) || ce.Code() != codes.InvalidArgument || ce.Field() != "routing.top_k" {
		t.Fatalf("top_k > E: %v: code %v field %q, want InvalidArgument naming routing.top_k", err, status.Code(err), ce.Field())
	}
	if want := "expertd FusedMoE: rpc error: code = InvalidArgument desc = routing.top_k: "; len(err.Error()) < len(want) || err.Error()[:len(want)] != want {
		t.Errorf("message %q, want it to start %q", err.Error(), want)
	}
}

// busyServer answers the first failures FusedMoE calls with
// ResourceExhausted, with RetryInfo of delay when delay > 0.
type busyServer struct {
	pb.UnimplementedExpertServiceServer
	failures int
	delay    time.Duration

	mu    sync.Mutex
	calls []time.Time
}

func (s *busyServer) FusedMoE(_ context.Context, req *pb.FusedMoERequest) (*pb.FusedMoEResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls = append(s.calls, time.Now())
	if len(s.calls) > s.failures {
		return &pb.FusedMoEResponse{Output: req.GetHiddenStates(), Backend: "busy"}, nil
	}
	st := status.New(codes.ResourceExhausted, "server busy")
	if s.delay > 0 {
		st, _ = st.WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(s.delay)})
	}
	return nil, st.Err()
}

// TestRetryInfoHonoured checks FusedMoE retries a ResourceExhausted that
// carries RetryInfo after about the delay it names, within the client's
// attempts, and does not retry one without it.
func TestRetryInfoHonoured(t *testing.T) {
	const delay = 50 * time.Millisecond
	tests := []struct {
		name      string
		failures  int
		delay     time.Duration
		wantCode  codes.Code
		wantCalls int
	}{
		{"retried after the delay", 2, delay, codes.OK, 3},
		{"attempts run out", 10, delay, codes.ResourceExhausted, client.DefaultMaxAttempts},
		{"no RetryInfo", 2, 0, codes.ResourceExhausted, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			lis := bufconn.Listen(1 << 20)
			bs := &busyServer{failures: tt.failures, delay: tt.delay}
			gs := grpc.NewServer()
			pb.RegisterExpertServiceServer(gs, bs)
			go gs.Serve(lis) //nolint:errcheck // returns on Stop
			t.Cleanup(gs.Stop)
			c, err := client.Dial(testContext(t), "passthrough:///bufnet", client.WithDialOptions(grpc.WithContextDialer(
				func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) })))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			_, err = c.FusedMoE(testContext(t), fusedReq("a"))
			if got := status.Code(err); got != tt.wantCode {
				t.Fatalf("FusedMoE: %v, want code %v", err, tt.wantCode)
			}
			bs.mu.Lock()
			defer bs.mu.Unlock()
			if len(bs.calls) != tt.wantCalls {
				t.Fatalf("%d attempts, want %d", len(bs.calls), tt.wantCalls)
			}
			for i := 1; i < len(bs.calls); i++ {
				// The delay with its jitter of -20%.
				if gap := bs.calls[i].Sub(bs.calls[i-1]); gap < 4*tt.delay/5 {
					t.Errorf("attempt %d came %v after the last, want >= %v", i+1, gap, 4*tt.delay/5)
				}
			}
		})
	}
}
