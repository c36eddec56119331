package client_test

import (
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/internal/testdaemon"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/service"
)

// TestFusedMoEStream pipelines several requests before reading any
// result: each result must be its own request's, in order.
func TestFusedMoEStream(t *testing.T) {
	rng := newRand(t)
	c := startServer(t, service.Config{})
	ctx := testContext(t)
	s := kerneltest.Qwen3.Scaled(48, 32)
	set, _ := kerneltest.NewCase(rng, s, 1)
	if _, err := c.LoadExperts(ctx, "layer", clienttest.Weights(set)); err != nil {
		t.Fatal(err)
	}
	stream, err := c.FusedMoEStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var reqs []*moe.Request
	for i := range 5 {
		_, req := kerneltest.NewCase(rng, s, 1+2*i) // distinct M tell the answers apart
		reqs = append(reqs, req)
		if err := stream.Send(clienttest.Request("layer", set, req)); err != nil {
			t.Fatalf("Send %d: %v", i, err)
		}
	}
	// A locally refused request is not sent and does not end the stream.
	if err := stream.Send(&client.FusedMoERequest{ExpertSet: "layer"}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("Send without hidden states = %v, want InvalidArgument", err)
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	for i, req := range reqs {
		res, err := stream.Recv()
		if err != nil {
			t.Fatalf("Recv %d: %v", i, err)
		}
		checkOutput(t, res, set, req)
	}
	if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
		t.Errorf("Recv after the last result = %v, want io.EOF", err)
	}
}

// TestFusedMoEStreamError: a request the server rejects ends the stream
// with that request's status, after the results before it.
func TestFusedMoEStreamError(t *testing.T) {
	rng := newRand(t)
	c := startServer(t, service.Config{})
	ctx := testContext(t)
	s := kerneltest.Mixtral.Scaled(32, 16)
	set, req := kerneltest.NewCase(rng, s, 2)
	if _, err := c.LoadExperts(ctx, "layer", clienttest.Weights(set)); err != nil {
		t.Fatal(err)
	}
	stream, err := c.FusedMoEStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"layer", "missing", "layer"} {
		if err := stream.Send(clienttest.Request(name, set, req)); err != nil && !errors.Is(err, io.EOF) {
			t.Fatalf("Send(%s): %v", name, err)
		}
	}
	stream.CloseSend()
	if res, err := stream.Recv(); err != nil {
		t.Fatalf("first Recv: %v", err)
	} else {
		checkOutput(t, res, set, req)
	}
	if _, err := stream.Recv(); status.Code(err) != codes.NotFound {
		t.Errorf("second Recv = %v, want NotFound for the missing set", err)
	}
}

// gateBackend is the CPU backend whose FusedMoE calls wait, once started,
// until release is closed or their context ends, so a test can hold calls
// in flight.
type gateBackend struct {
	kernels.Backend
	started chan struct{}
	release chan struct{}
}

func newGateBackend() *gateBackend {
	return &gateBackend{Backend: cpu.New(kernels.Config{}), started: make(chan struct{}, 64), release: make(chan struct{})}
}

func (b *gateBackend) FusedMoE(ctx context.Context, l kernels.Loaded, r *moe.Request) (*moe.Result, error) {
	b.started <- struct{}{}
	select {
	case <-b.release:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return b.Backend.FusedMoE(ctx, l, r)
}

// pipelineShape is the small layer the Pipeline tests run.
var pipelineShape = kerneltest.Mixtral.Scaled(32, 16)

// loadLayer loads a random set of pipelineShape as "layer" and returns it
// with one request on it.
func loadLayer(t *testing.T, rng *rand.Rand, c *client.Client) (*moe.ExpertSet, *moe.Request) {
	t.Helper()
	set, req := kerneltest.NewCase(rng, pipelineShape, 2)
	if _, err := c.LoadExperts(testContext(t), "layer", clienttest.Weights(set)); err != nil {
		t.Fatal(err)
	}
	return set, req
}

// gatedServer serves a gateBackend with MaxConcurrent 2 and returns it,
// the server and a client dialed to it with opts.
func gatedServer(t *testing.T, opts ...client.Option) (*gateBackend, *testdaemon.Server, *client.Client) {
	t.Helper()
	gate := newGateBackend()
	srv, err := testdaemon.ServeBackend(service.Config{MaxConcurrent: 2}, gate)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	c, err := client.Dial(testContext(t), srv.Addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return gate, srv, c
}

// TestPipelineOrder keeps three calls in flight over many: every result
// is its own request's, read in order or out of it, and Close returns
// once the last is answered.
func TestPipelineOrder(t *testing.T) {
	rng := newRand(t)
	c := startServer(t, service.Config{MaxConcurrent: 3, BatchWindow: 0})
	ctx := testContext(t)
	s := pipelineShape
	set, _ := loadLayer(t, rng, c)
	for _, depth := range []int{1, 3} {
		p, err := c.Pipeline(ctx, depth)
		if err != nil {
			t.Fatal(err)
		}
		var (
			calls []*client.Call
			reqs  []*moe.Request
		)
		for i := range 12 {
			_, req := kerneltest.NewCase(rng, s, 1+i%7) // distinct M tell the answers apart
			call, err := p.Go(clienttest.Request("layer", set, req))
			if err != nil {
				t.Fatalf("depth %d: Go %d: %v", depth, i, err)
			}
			calls, reqs = append(calls, call), append(reqs, req)
		}
		// A locally refused request is not sent and does not end the
		// pipeline.
		if _, err := p.Go(&client.FusedMoERequest{ExpertSet: "layer"}); status.Code(err) != codes.InvalidArgument {
			t.Errorf("Go without hidden states = %v, want InvalidArgument", err)
		}
		// The last first: waiting for it receives the others on the way.
		for _, i := range []int{11, 0, 5, 10, 1, 2, 3, 4, 6, 7, 8, 9} {
			res, err := calls[i].Result()
			if err != nil {
				t.Fatalf("depth %d: Result %d: %v", depth, i, err)
			}
			checkOutput(t, res, set, reqs[i])
		}
		_, req := kerneltest.NewCase(rng, s, 2)
		res, err := p.Call(clienttest.Request("layer", set, req))
		if err != nil {
			t.Fatalf("depth %d: Call: %v", depth, err)
		}
		checkOutput(t, res, set, req)
		if err := p.Close(); err != nil {
			t.Errorf("depth %d: Close = %v", depth, err)
		}
		if _, err := p.Go(clienttest.Request("layer", set, req)); err == nil {
			t.Errorf("depth %d: Go after Close succeeded", depth)
		}
	}
}

// TestPipelineConcurrentCallers: goroutines sharing one pipeline each get
// their own answers.
func TestPipelineConcurrentCallers(t *testing.T) {
	rng := newRand(t)
	c := startServer(t, service.Config{MaxConcurrent: 2})
	ctx := testContext(t)
	s := pipelineShape
	set, _ := loadLayer(t, rng, c)
	p, err := c.Pipeline(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	var reqs [4][]*moe.Request
	for g := range reqs {
		for i := range 5 {
			_, req := kerneltest.NewCase(rng, s, 1+g+i)
			reqs[g] = append(reqs[g], req)
		}
	}
	var wg sync.WaitGroup
	for g := range reqs {
		wg.Go(func() {
			for _, req := range reqs[g] {
				res, err := p.Call(clienttest.Request("layer", set, req))
				if err != nil {
					t.Errorf("caller %d: %v", g, err)
					return
				}
				checkOutput(t, res, set, req)
			}
		})
	}
	wg.Wait()
	if err := p.Close(); err != nil {
		t.Errorf("Close = %v", err)
	}
}

// TestPipelineCancel: cancelling the pipeline's context while calls run
// fails them (and later ones) with Canceled, promptly, and frees the
// server's slots.
func TestPipelineCancel(t *testing.T) {
	rng := newRand(t)
	gate, _, c := gatedServer(t)
	ctx := testContext(t)
	set, req := loadLayer(t, rng, c)
	pctx, cancel := context.WithCancel(ctx)
	p, err := c.Pipeline(pctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	first, err := p.Go(clienttest.Request("layer", set, req))
	if err != nil {
		t.Fatal(err)
	}
	second, err := p.Go(clienttest.Request("layer", set, req))
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		<-gate.started // both calls are running on the server
	}
	cancel()
	for i, call := range []*client.Call{first, second} {
		if _, err := call.Result(); status.Code(err) != codes.Canceled {
			t.Errorf("call %d after cancel: %v, want Canceled", i, err)
		}
	}
	if _, err := p.Go(clienttest.Request("layer", set, req)); status.Code(err) != codes.Canceled {
		t.Errorf("Go after cancel: %v, want Canceled", err)
	}
	p.Close() //nolint:errcheck // already failed
	// The server's calls ended with the stream: a new call gets a slot.
	close(gate.release)
	res, err := c.FusedMoE(ctx, clienttest.Request("layer", set, req))
	if err != nil {
		t.Fatalf("FusedMoE after the cancelled stream: %v", err)
	}
	checkOutput(t, res, set, req)
}

// TestPipelineServerGone: a server that stops while calls are in flight
// fails them with Unavailable, and later calls too, without hanging.
func TestPipelineServerGone(t *testing.T) {
	rng := newRand(t)
	gate, srv, c := gatedServer(t, client.WithMaxAttempts(1))
	ctx := testContext(t)
	set, req := loadLayer(t, rng, c)
	p, err := c.Pipeline(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	call, err := p.Go(clienttest.Request("layer", set, req))
	if err != nil {
		t.Fatal(err)
	}
	<-gate.started
	srv.Stop()
	if _, err := call.Result(); status.Code(err) != codes.Unavailable && status.Code(err) != codes.Canceled {
		t.Errorf("call in flight when the server stopped: %v, want Unavailable (or Canceled)", err)
	}
	if _, err := p.Call(clienttest.Request("layer", set, req)); err == nil {
		t.Error("Call after the server stopped succeeded")
	}
	if err := p.Close(); err == nil {
		t.Error("Close after the server stopped = nil, want the error that ended the stream")
	}
}
