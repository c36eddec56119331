package service_test

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// TestConcurrentCallsOwnTheirBytes runs many calls at once, each with
// fresh random tensors large enough that the codec aliases them on receipt
// and references the output on send (codec.AliasBytes), on a loaded set
// and with inline weights (which the CPU backend computes from in place,
// inside the receive buffer). Every answer is checked twice: bit for bit
// against the backend called directly on the same request, and against
// the float64 reference. A receive buffer released or reused while its
// call still read it, or an output shared between calls, would hand a
// call another call's numbers, as would a pooled output buffer (codec.Pool)
// recycled before gRPC finished sending it; -race flags the unsynchronised
// reuse itself. Responses are checked only after every call has finished, so
// an output overwritten by a later call is caught too.
func TestConcurrentCallsOwnTheirBytes(t *testing.T) {
	shape := kerneltest.Nemotron
	shape.Name, shape.E, shape.TopK, shape.K, shape.N = "aliasing", 8, 3, 512, 32
	const (
		m       = 24 // hidden states 24 KiB as BF16, output 24 or 48 KiB
		callers = 8
		calls   = 3
	)
	rng := newRand(t)
	backend := cpu.New(kernels.Config{Threads: 2})
	c, _, _ := servicetest.StartServerConfig(t, service.Config{MaxConcurrent: 4, MaxQueued: callers}, backend)
	ctx := testContext(t)
	set, _ := kerneltest.NewCase(rng, shape, 1)
	w := weightsProto(set)
	if _, err := servicetest.Upload(ctx, c, servicetest.Header("layer", w, false), servicetest.Chunks(w, 256<<10)); err != nil {
		t.Fatalf("LoadExperts: %v", err)
	}

	type call struct {
		req  *moe.Request
		resp *pb.FusedMoEResponse
	}
	results := make([][]call, callers)
	var wg sync.WaitGroup
	for g := range callers {
		seed1, seed2 := rng.Uint64(), rng.Uint64()
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed1, seed2))
			for i := range calls {
				out := kerneltest.WithOutput([]moe.DType{moe.BFloat16, moe.Float32}[i%2])
				_, req := kerneltest.NewCase(rng, shape, m, out)
				p := requestProto(req, set.E)
				if (g+i)%3 == 0 {
					p.Experts = &pb.FusedMoERequest_Weights{Weights: weightsProto(set)}
				}
				// Each call gets the whole timeout: under -race on a busy
				// machine the calls queue behind each other.
				callCtx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
				resp, err := c.FusedMoE(callCtx, p)
				cancel()
				if err != nil {
					t.Errorf("caller %d call %d: %v", g, i, err)
					return
				}
				if resp.GetTimings().GetReceiveNanos() <= 0 {
					t.Errorf("caller %d call %d: receive_nanos %d, want > 0 (the server times the receive)", g, i, resp.GetTimings().GetReceiveNanos())
				}
				results[g] = append(results[g], call{req, resp})
			}
		}()
	}
	wg.Wait()
	for g, calls := range results {
		for i, cl := range calls {
			runCtx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
			direct, err := kerneltest.RunCase(runCtx, backend, set, cl.req)
			cancel()
			if err != nil {
				t.Fatal(err)
			}
			got := cl.resp.GetOutput().GetData()
			if !slices.Equal(got, direct.Output) {
				t.Errorf("caller %d call %d: output differs from the backend called directly on the same request", g, i)
			}
			ref, _, _ := kerneltest.Reference(set, cl.req)
			if e := kerneltest.RelL2(kerneltest.DecodeOutput(cl.req.OutDType, got), ref); !(e <= kerneltest.FP8Tol) {
				t.Errorf("caller %d call %d: rel-L2 vs reference %.3g, want <= %.3g", g, i, e, kerneltest.FP8Tol)
			}
		}
	}
}
