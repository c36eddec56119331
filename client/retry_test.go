package client_test

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"github.com/expertd/expertd/client"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// flakyServer answers Unavailable to the first failures calls of each
// method, then succeeds; FusedMoE on the set "slow" blocks until the call
// is cancelled. It counts every attempt.
type flakyServer struct {
	pb.UnimplementedExpertServiceServer
	failures int

	mu    sync.Mutex
	calls map[string]int
}

func (s *flakyServer) attempt(method string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls[method]++
	if s.calls[method] <= s.failures {
		return status.Error(codes.Unavailable, "flaky: try again")
	}
	return nil
}

func (s *flakyServer) count(method string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls[method]
}

func (s *flakyServer) ListExperts(context.Context, *pb.ListExpertsRequest) (*pb.ListExpertsResponse, error) {
	if err := s.attempt("ListExperts"); err != nil {
		return nil, err
	}
	return &pb.ListExpertsResponse{ExpertSets: []*pb.ExpertSetInfo{{Name: "a"}}}, nil
}

func (s *flakyServer) GetServerInfo(context.Context, *pb.GetServerInfoRequest) (*pb.ServerInfo, error) {
	if err := s.attempt("GetServerInfo"); err != nil {
		return nil, err
	}
	return &pb.ServerInfo{Version: "flaky"}, nil
}

func (s *flakyServer) UnloadExperts(context.Context, *pb.UnloadExpertsRequest) (*pb.UnloadExpertsResponse, error) {
	return nil, s.attempt("UnloadExperts")
}

func (s *flakyServer) FusedMoE(ctx context.Context, req *pb.FusedMoERequest) (*pb.FusedMoEResponse, error) {
	if req.GetExpertSet() == "slow" {
		s.attempt("slow")
		<-ctx.Done()
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	if err := s.attempt("FusedMoE"); err != nil {
		return nil, err
	}
	return &pb.FusedMoEResponse{Output: req.GetHiddenStates(), Backend: "flaky"}, nil
}

func (s *flakyServer) LoadExperts(stream pb.ExpertService_LoadExpertsServer) error {
	if err := s.attempt("LoadExperts"); err != nil {
		return err
	}
	return stream.SendAndClose(&pb.ExpertSetInfo{Name: "loaded"})
}

// dialFlaky serves a flakyServer over an in-memory listener and dials it
// through client.WithDialOptions.
func dialFlaky(t *testing.T, failures int, opts ...client.Option) (*client.Client, *flakyServer) {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	fs := &flakyServer{failures: failures, calls: map[string]int{}}
	gs := grpc.NewServer()
	pb.RegisterExpertServiceServer(gs, fs)
	go gs.Serve(lis) //nolint:errcheck // returns on Stop
	t.Cleanup(gs.Stop)
	opts = append([]client.Option{client.WithDialOptions(grpc.WithContextDialer(
		func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }))}, opts...)
	c, err := client.Dial(testContext(t), "passthrough:///bufnet", opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, fs
}

func fusedReq(set string) *client.FusedMoERequest {
	return &client.FusedMoERequest{ExpertSet: set, Hidden: client.FromFloat32([]float32{1, 2}, 1, 2)}
}

// TestRetries: idempotent calls survive Unavailable answers, the others
// fail on the first one and are sent once.
func TestRetries(t *testing.T) {
	tests := []struct {
		method    string
		call      func(context.Context, *client.Client) error
		failures  int
		attempts  []client.Option
		wantCode  codes.Code
		wantCalls int
	}{
		{"ListExperts", func(ctx context.Context, c *client.Client) error { _, err := c.ListExperts(ctx); return err },
			2, nil, codes.OK, 3},
		{"GetServerInfo", func(ctx context.Context, c *client.Client) error { _, err := c.ServerInfo(ctx); return err },
			3, nil, codes.OK, 4},
		{"FusedMoE", func(ctx context.Context, c *client.Client) error {
			_, err := c.FusedMoE(ctx, fusedReq("a"))
			return err
		},
			1, nil, codes.OK, 2},
		{"ListExperts", func(ctx context.Context, c *client.Client) error { _, err := c.ListExperts(ctx); return err },
			client.DefaultMaxAttempts, nil, codes.Unavailable, client.DefaultMaxAttempts},
		{"ListExperts", func(ctx context.Context, c *client.Client) error { _, err := c.ListExperts(ctx); return err },
			1, []client.Option{client.WithMaxAttempts(1)}, codes.Unavailable, 1},
		{"LoadExperts", func(ctx context.Context, c *client.Client) error {
			_, err := c.LoadExperts(ctx, "x", &client.ExpertWeights{W13: client.FromFP8([]byte{1}, 1)}, client.ChunkBytes(1))
			return err
		}, 1, nil, codes.Unavailable, 1},
		{"UnloadExperts", func(ctx context.Context, c *client.Client) error { _, err := c.UnloadExperts(ctx, "x"); return err },
			1, nil, codes.Unavailable, 1},
	}
	for _, tc := range tests {
		t.Run(tc.method, func(t *testing.T) {
			t.Parallel() // backoffs dominate; each case has its own server
			c, fs := dialFlaky(t, tc.failures, tc.attempts...)
			err := tc.call(testContext(t), c)
			if got := status.Code(err); got != tc.wantCode {
				t.Errorf("%s after %d Unavailable answers = %v, want %v", tc.method, tc.failures, err, tc.wantCode)
			}
			if got := fs.count(tc.method); got != tc.wantCalls {
				t.Errorf("%s reached the server %d times, want %d", tc.method, got, tc.wantCalls)
			}
		})
	}
}

// TestDeadlines: a call ends with DeadlineExceeded at the context's
// deadline, or at WithCallTimeout when the context has none, and a
// deadline is not retried.
func TestDeadlines(t *testing.T) {
	tests := []struct {
		name    string
		opts    []client.Option
		timeout time.Duration
		want    time.Duration
	}{
		{"context deadline", nil, 150 * time.Millisecond, 150 * time.Millisecond},
		{"call timeout", []client.Option{client.WithCallTimeout(100 * time.Millisecond)}, 0, 100 * time.Millisecond},
		{"context wins over call timeout", []client.Option{client.WithCallTimeout(time.Hour)}, 100 * time.Millisecond, 100 * time.Millisecond},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, fs := dialFlaky(t, 0, tc.opts...)
			// start precedes the deadline, so took is never short of it.
			start := time.Now()
			ctx := context.Background()
			if tc.timeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tc.timeout)
				defer cancel()
			}
			_, err := c.FusedMoE(ctx, fusedReq("slow"))
			took := time.Since(start)
			if status.Code(err) != codes.DeadlineExceeded {
				t.Errorf("FusedMoE = %v, want DeadlineExceeded", err)
			}
			if took < tc.want || took > tc.want+2*time.Second {
				t.Errorf("FusedMoE returned after %v, want about %v", took, tc.want)
			}
			if n := fs.count("slow"); n != 1 {
				t.Errorf("the server saw %d attempts, want 1", n)
			}
		})
	}
}

// TestWaitForReady: with WithWaitForReady a call made while nothing
// listens waits for the server instead of failing; without it the call
// fails with Unavailable.
func TestWaitForReady(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()

	ctx := testContext(t)
	eager, err := client.Dial(ctx, addr, client.WithoutWaiting(), client.WithMaxAttempts(1))
	if err != nil {
		t.Fatal(err)
	}
	defer eager.Close()
	if _, err := eager.ListExperts(ctx); status.Code(err) != codes.Unavailable {
		t.Errorf("ListExperts with nothing listening = %v, want Unavailable", err)
	}

	patient, err := client.Dial(ctx, addr, client.WithoutWaiting(), client.WithWaitForReady())
	if err != nil {
		t.Fatal(err)
	}
	defer patient.Close()
	got := make(chan error, 1)
	go func() {
		_, err := patient.ListExperts(ctx)
		got <- err
	}()
	time.Sleep(300 * time.Millisecond) // the call is waiting by now
	lis, err = net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("port %s was taken meanwhile: %v", addr, err)
	}
	gs := grpc.NewServer()
	pb.RegisterExpertServiceServer(gs, &flakyServer{calls: map[string]int{}})
	go gs.Serve(lis) //nolint:errcheck // returns on Stop
	defer gs.Stop()
	if err := <-got; err != nil {
		t.Errorf("ListExperts that waited for the server = %v, want success", err)
	}
}
