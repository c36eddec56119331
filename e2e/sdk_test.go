package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// newRand is a fresh random source per test, its seed logged for replay.
func newRand(t *testing.T) *rand.Rand {
	seed := uint64(time.Now().UnixNano())
	t.Logf("random seed %d", seed)
	return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
}

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), defaultTimeout)
	t.Cleanup(cancel)
	return ctx
}

// relL2 checks got against the float64 reference of the case and returns
// the relative L2 error.
func checkAgainstReference(t *testing.T, what string, got []float32, set *moe.ExpertSet, req *moe.Request) {
	t.Helper()
	want, _, _ := kerneltest.Reference(set, req)
	e := kerneltest.RelL2(got, want)
	if e > 2e-2 {
		t.Errorf("%s: relative L2 error %.3g against the float64 reference, want <= 2e-2", what, e)
		return
	}
	t.Logf("%s: relative L2 error %.2g", what, e)
}

// tokens is a fresh request of m tokens for the loaded set (NewCase
// draws new weights each time; only its tokens and routing are kept).
func tokens(rng *rand.Rand, s kerneltest.Shape, m int, opts ...kerneltest.Option) *moe.Request {
	_, req := kerneltest.NewCase(rng, s, m, opts...)
	return req
}

// miniDeepSeek is DeepSeek-V3's routing (8 groups, top-4 groups, bias,
// scale 2.5) and block FP8 on 32 experts and small K, N.
func miniDeepSeek() kerneltest.Shape {
	s := kerneltest.DeepSeekV3.Scaled(160, 96)
	s.E = 32
	return s
}

// TestGoSDK drives the built daemon with the Go SDK as a user would:
// dial, check health and limits, load layers of three reference shapes
// in chunks, run them and compare with the float64 reference, call
// concurrently, and check the errors a user meets.
func TestGoSDK(t *testing.T) {
	d := startDaemon(t)
	ctx := testContext(t)
	rng := newRand(t)

	t.Logf("Go: c, err := client.Dial(ctx, %q)", d.Addr)
	c, err := client.Dial(ctx, d.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Health(ctx); err != nil {
		t.Fatalf("Health: %v", err)
	}
	info, err := c.ServerInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Limits.MaxTokens != 512 || info.Limits.MaxConcurrent != 2 || len(info.Backends) == 0 || info.Backends[0].Name != "cpu" {
		t.Errorf("ServerInfo = %+v, want max tokens 512, max concurrent 2 (the flags) and the cpu backend", info)
	}

	tests := []struct {
		name  string
		shape kerneltest.Shape
		opts  []kerneltest.Option
	}{
		{"qwen3", kerneltest.Qwen3.Scaled(96, 64), []kerneltest.Option{kerneltest.WithGranularity(scaling.PerExpert)}},
		{"nemotron", kerneltest.Nemotron.Scaled(80, 48), []kerneltest.Option{kerneltest.WithGranularity(scaling.PerChannel)}},
		{"deepseek", miniDeepSeek(), []kerneltest.Option{kerneltest.WithBlock(64, 64), kerneltest.WithOutput(moe.Float32)}},
	}
	loaded := map[string]*moe.ExpertSet{}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			// Each step its own bound: the float64 references of the
			// steps before must not eat into this one's on a slow machine.
			ctx := testContext(t)
			set, _ := kerneltest.NewCase(rng, tc.shape, 1, tc.opts...)
			loaded[tc.name] = set
			t.Logf("Go: info, err := c.LoadExperts(ctx, %q, &client.ExpertWeights{Activation: client.%v, W13: client.FromFP8(w13, %d, %d, %d), ...}, client.OnProgress(fn))",
				tc.name, map[moe.Activation]string{moe.SiluGated: "SiluGated", moe.Relu2: "Relu2"}[set.Activation], set.E, set.Rows1(), set.K)
			reports := 0
			info, err := c.LoadExperts(ctx, tc.name, clienttest.Weights(set), client.ChunkBytes(64<<10),
				client.OnProgress(func(client.Progress) { reports++ }))
			if err != nil {
				t.Fatalf("LoadExperts: %v", err)
			}
			if want := 1 + int((set.Bytes()+64<<10-1)/(64<<10)); reports < want {
				t.Errorf("%d progress reports for %d bytes in 64 KiB chunks, want >= %d", reports, set.Bytes(), want)
			}
			if info.Bytes != set.Bytes() {
				t.Errorf("loaded %d bytes, want %d", info.Bytes, set.Bytes())
			}
			for _, m := range []int{1, 17} {
				req := tokens(rng, tc.shape, m, tc.opts...)
				t.Logf("Go: res, err := c.FusedMoE(ctx, &client.FusedMoERequest{ExpertSet: %q, Hidden: ..., RouterLogits: client.FromFloat32(logits, %d, %d), Routing: client.Routing{TopK: %d, ...}}); out, err := res.Output.Float32s()",
					tc.name, m, set.E, tc.shape.TopK)
				res, err := c.FusedMoE(ctx, clienttest.Request(tc.name, set, req))
				if err != nil {
					t.Fatalf("FusedMoE M=%d: %v", m, err)
				}
				got, err := res.Output.Float32s()
				if err != nil {
					t.Fatal(err)
				}
				checkAgainstReference(t, fmt.Sprintf("M=%d", m), got, set, req)
			}
		})
	}

	t.Run("concurrent", func(t *testing.T) {
		ctx := testContext(t)
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for g := range 4 {
			rng := rand.New(rand.NewPCG(rng.Uint64(), uint64(g)))
			set := loaded["qwen3"]
			req := tokens(rng, tests[0].shape, 8, tests[0].opts...)
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range 3 {
					res, err := c.FusedMoE(ctx, clienttest.Request("qwen3", set, req))
					if err != nil {
						errs <- err
						return
					}
					got, _ := res.Output.Float32s()
					want, _, _ := kerneltest.Reference(set, req)
					if e := kerneltest.RelL2(got, want); e > 2e-2 {
						errs <- fmt.Errorf("relative L2 error %.3g", e)
						return
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
	})

	t.Run("errors", func(t *testing.T) {
		ctx := testContext(t)
		set := loaded["qwen3"]
		req := tokens(rng, tests[0].shape, 513, tests[0].opts...)
		if _, err := c.FusedMoE(ctx, clienttest.Request("qwen3", set, req)); status.Code(err) != codes.ResourceExhausted {
			t.Errorf("M=513 over -max-tokens 512: %v, want ResourceExhausted", err)
		}
		req = tokens(rng, tests[0].shape, 2, tests[0].opts...)
		if _, err := c.FusedMoE(ctx, clienttest.Request("no-such-set", set, req)); status.Code(err) != codes.NotFound {
			t.Errorf("unknown set: %v, want NotFound", err)
		}
		bad := clienttest.Request("qwen3", set, req)
		bad.RouterLogits.Shape = []int{2, set.E + 1}
		bad.RouterLogits.Data = make([]byte, 4*2*(set.E+1))
		if _, err := c.FusedMoE(ctx, bad); status.Code(err) != codes.InvalidArgument {
			t.Errorf("logits [2, E+1]: %v, want InvalidArgument", err)
		}
		short, cancel := context.WithTimeout(ctx, time.Microsecond)
		defer cancel()
		if _, err := c.FusedMoE(short, clienttest.Request("qwen3", set, req)); status.Code(err) != codes.DeadlineExceeded {
			t.Errorf("1µs deadline: %v, want DeadlineExceeded", err)
		}
	})

	ctx = testContext(t)
	sets, err := c.ListExperts(ctx)
	if err != nil || len(sets) != 3 || sets[0].Name != "deepseek" || sets[0].W13ScaleGranularity != "block" {
		t.Errorf("ListExperts = %+v, %v; want deepseek (block), nemotron, qwen3", sets, err)
	}
	for _, s := range sets {
		if _, err := c.UnloadExperts(ctx, s.Name); err != nil {
			t.Errorf("UnloadExperts(%s): %v", s.Name, err)
		}
	}
}

// freePort is a loopback port that was free a moment ago, for a test
// that must restart the daemon on the same address.
func freePort(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	return lis.Addr().String()
}

// TestGoSDKAcrossRestart: one client outlives a daemon restart. While the
// daemon is down, idempotent calls fail with Unavailable once their
// retries are spent and loads fail at once; after the restart the same
// client works again, and finds the (in-memory) sets gone.
func TestGoSDKAcrossRestart(t *testing.T) {
	addr := freePort(t)
	d := startDaemon(t, "-listen", addr)
	ctx := testContext(t)
	c, err := client.Dial(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rng := newRand(t)
	s := kerneltest.Mixtral.Scaled(32, 48)
	set, req := kerneltest.NewCase(rng, s, 3)
	if _, err := c.LoadExperts(ctx, "m", clienttest.Weights(set)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.FusedMoE(ctx, clienttest.Request("m", set, req)); err != nil {
		t.Fatal(err)
	}

	d.stop(t)
	start := time.Now()
	if _, err := c.ListExperts(ctx); status.Code(err) != codes.Unavailable {
		t.Errorf("ListExperts with the daemon down = %v, want Unavailable", err)
	}
	t.Logf("ListExperts gave up after %v of retries", time.Since(start).Round(time.Millisecond))
	if _, err := c.LoadExperts(ctx, "m", clienttest.Weights(set)); status.Code(err) != codes.Unavailable {
		t.Errorf("LoadExperts with the daemon down = %v, want Unavailable", err)
	}

	startDaemon(t, "-listen", addr)
	// The client reconnects on its own, with backoff of at most 2 s; its
	// retries may or may not span the wait, so allow a few calls.
	start = time.Now()
	var sets []client.ExpertSetInfo
	for time.Since(start) < 5*time.Second {
		if sets, err = c.ListExperts(ctx); err == nil {
			break
		}
	}
	if err != nil || len(sets) != 0 {
		t.Errorf("ListExperts for 5s after the restart = %v, %v; want success with no sets", sets, err)
	}
	t.Logf("the client was back %v after the restart", time.Since(start).Round(time.Millisecond))
	if _, err := c.FusedMoE(ctx, clienttest.Request("m", set, req)); status.Code(err) != codes.NotFound {
		t.Errorf("FusedMoE on the lost set = %v, want NotFound", err)
	}
}
