package client_test

import (
	"errors"
	"io"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/kerneltest"
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
	var reqs []*kernels.Request
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
