package client_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/service"
)

// TestReleaseReceiveBuffer: a large inline result, unary or streamed,
// holds the receive buffer its output aliases until Release, which clears
// the tensors; a small result holds none.
func TestReleaseReceiveBuffer(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	c := startServer(t, service.Config{})
	// BF16 output of 16 x 1024: 32 KiB, above the codec's aliasing size.
	shape := kerneltest.Nemotron.Scaled(1024, 16)
	shape.E, shape.TopK = 8, 2
	set, req := kerneltest.NewCase(rng, shape, 16)
	if _, err := c.LoadExperts(ctx, "big", clienttest.Weights(set)); err != nil {
		t.Fatal(err)
	}
	p, err := c.Pipeline(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for _, v := range []struct {
		name string
		call func(*client.FusedMoERequest) (*client.FusedMoEResult, error)
	}{
		{"unary", func(r *client.FusedMoERequest) (*client.FusedMoEResult, error) { return c.FusedMoE(ctx, r) }},
		{"stream", p.Call},
	} {
		t.Run(v.name, func(t *testing.T) {
			r := clienttest.Request("big", set, req)
			r.ReturnRouting = true
			for i := range 3 { // later calls reuse released buffers
				res, err := v.call(r)
				if err != nil {
					t.Fatal(err)
				}
				checkOutput(t, res, set, req)
				buf := client.ReceiveBuffer(res)
				if !buf.Holds() {
					t.Fatalf("call %d: no receive buffer held", i)
				}
				if !buf.Contains(res.Output.Data) || !buf.Contains(res.TopKIDs.Data) {
					t.Errorf("call %d: output or routing does not alias the receive buffer", i)
				}
				res.Release()
				if client.ReceiveBuffer(res).Holds() || res.Output.Data != nil || res.TopKIDs.Data != nil {
					t.Errorf("call %d: after Release the result still refers to the buffer", i)
				}
				res.Release() // a second Release does nothing
			}
		})
	}

	shape = kerneltest.Nemotron.Scaled(32, 16)
	shape.E, shape.TopK = 8, 2
	small, sreq := kerneltest.NewCase(rng, shape, 1)
	if _, err := c.LoadExperts(ctx, "small", clienttest.Weights(small)); err != nil {
		t.Fatal(err)
	}
	res, err := c.FusedMoE(ctx, clienttest.Request("small", small, sreq))
	if err != nil {
		t.Fatal(err)
	}
	if client.ReceiveBuffer(res).Holds() {
		t.Error("a small result holds a receive buffer")
	}
	res.Release()
	checkOutput(t, res, small, sreq) // nothing pooled: the output stays
	var nilRes *client.FusedMoEResult
	nilRes.Release()
}

// TestHeldResultsStayIntact: results kept unreleased while later calls'
// responses arrive (into the same transport memory as far as it is free)
// keep their own outputs; each is checked against its reference only
// after every call has returned.
func TestHeldResultsStayIntact(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	c := startServer(t, service.Config{})
	p, err := c.Pipeline(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	shape := kerneltest.Nemotron.Scaled(1024, 16) // BF16 output 16 x 1024: above the aliasing size
	shape.E, shape.TopK = 8, 2
	type kept struct {
		res  *client.FusedMoEResult
		set  *moe.ExpertSet
		kreq *moe.Request
	}
	var all []kept
	for i := range 6 {
		set, kreq := kerneltest.NewCase(rng, shape, 16)
		name := "held" + strconv.Itoa(i)
		if _, err := c.LoadExperts(ctx, name, clienttest.Weights(set)); err != nil {
			t.Fatal(err)
		}
		call := c.FusedMoE
		if i%2 == 1 {
			call = func(_ context.Context, r *client.FusedMoERequest) (*client.FusedMoEResult, error) { return p.Call(r) }
		}
		res, err := call(ctx, clienttest.Request(name, set, kreq))
		if err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		if !client.ReceiveBuffer(res).Holds() {
			t.Fatalf("call %d: no receive buffer held", i)
		}
		all = append(all, kept{res, set, kreq})
	}
	for _, k := range all {
		checkOutput(t, k.res, k.set, k.kreq)
		k.res.Release()
	}
}
