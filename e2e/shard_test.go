package e2e

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/shard"
)

// TestShardedFanOut is expert parallelism across hosts on one host: three
// real daemons each hold a shard of a layer's experts, client.Sharded
// routes, dispatches and combines, and the result must match both the
// float64 reference (MOE_SPEC's bar) and one daemon holding the whole
// layer (which one of the three also does, under another name).
func TestShardedFanOut(t *testing.T) {
	const shards = 3
	ds := make([]*daemon, shards)
	addrs := make([]string, shards)
	for i := range ds {
		ds[i] = startDaemon(t)
		addrs[i] = ds[i].Addr
	}
	rng := newRand(t)
	single, err := client.Dial(testContext(t), addrs[0])
	if err != nil {
		t.Fatal(err)
	}
	defer single.Close()

	dsv3 := kerneltest.DeepSeekV3.Scaled(160, 72) // E = 256, 8 groups, top-4 groups; two K blocks, the last short
	nemo := kerneltest.Nemotron.Scaled(136, 72)   // E = 128, sigmoid + bias, ReLU²
	contiguous, err := shard.Contiguous(dsv3.E, shards)
	if err != nil {
		t.Fatal(err)
	}
	roundRobin, err := shard.RoundRobin(nemo.E, shards)
	if err != nil {
		t.Fatal(err)
	}

	type tcase struct {
		name string
		m    int
		opts []kerneltest.Option
		// onShard, when >= 0, routes every token to that shard's experts
		// only (precomputed ids), so the other shards receive nothing.
		onShard int
	}
	layers := []struct {
		name  string
		shape kerneltest.Shape
		m     *shard.Map
		opts  []kerneltest.Option // of the weights
		cases []tcase
	}{
		{"DeepSeekV3", dsv3, contiguous, nil, []tcase{
			{"M=48", 48, nil, -1},
			{"M=1", 1, nil, -1},
			{"M=33/fp8-per-group/fp32-out", 33, []kerneltest.Option{kerneltest.WithHidden(moe.Float8E4M3FN),
				kerneltest.WithHiddenScale(scaling.Block), kerneltest.WithOutput(moe.Float32)}, -1},
			// 560 pairs: two calls under the daemons' -max-tokens 512.
			{"M=70/all-on-shard-2", 70, []kerneltest.Option{kerneltest.WithPrecomputedRouting()}, 2},
		}},
		{"Nemotron", nemo, roundRobin, nil, []tcase{
			{"M=64", 64, nil, -1},
			{"M=1", 1, nil, -1},
			{"M=40/fp8-per-token/fp32-out", 40, []kerneltest.Option{kerneltest.WithHidden(moe.Float8E4M3FN),
				kerneltest.WithOutput(moe.Float32)}, -1},
			{"M=16/all-on-shard-0/fp32-out", 16, []kerneltest.Option{kerneltest.WithPrecomputedRouting(),
				kerneltest.WithOutput(moe.Float32)}, 0},
		}},
	}
	for _, l := range layers {
		t.Run(l.name, func(t *testing.T) {
			ctx := testContext(t)
			sc, err := client.DialSharded(ctx, l.m, addrs)
			if err != nil {
				t.Fatal(err)
			}
			defer sc.Close()
			set, _ := kerneltest.NewCase(rng, l.shape, 1, l.opts...)
			t.Logf("Go: sc, err := client.DialSharded(ctx, m, addrs) with m = %v", l.m)
			infos, err := sc.LoadExperts(ctx, l.name, clienttest.Weights(set))
			if err != nil {
				t.Fatalf("Sharded.LoadExperts: %v", err)
			}
			var total int64
			for i, info := range infos {
				if want := len(l.m.Experts(i)); info.NumExperts != want {
					t.Errorf("shard %d holds %d experts, want %d", i, info.NumExperts, want)
				}
				total += info.Bytes
			}
			whole := l.name + "/whole"
			if _, err := single.LoadExperts(ctx, whole, clienttest.Weights(set)); err != nil {
				t.Fatal(err)
			}
			// Per-tensor and per-expert scales are replicated or sliced, so
			// the shards hold the weights once, plus any replicated scales.
			if total < set.Bytes() || total > set.Bytes()+int64(4*shards*(len(set.W13Scale.Values)+len(set.W2Scale.Values))) {
				t.Errorf("the shards hold %d bytes for a %d-byte set", total, set.Bytes())
			}

			for _, tc := range l.cases {
				t.Run(tc.name, func(t *testing.T) {
					// Each case its own bound, as in TestSharedMemory.
					ctx := testContext(t)
					req := request(rng, l.shape, tc.m, append(append([]kerneltest.Option(nil), l.opts...), tc.opts...)...)
					if tc.onShard >= 0 {
						routeToShard(rng, req, l.m, tc.onShard)
					}
					want, ids, _ := kerneltest.Reference(set, req)
					checkShardsHit(t, ids, req.Routing.TopK, l.m, tc.onShard)

					sreq := clienttest.Request(l.name, set, req)
					sreq.ReturnRouting = true
					got, err := sc.FusedMoE(ctx, sreq)
					if err != nil {
						t.Fatalf("Sharded.FusedMoE: %v", err)
					}
					gotIDs, err := got.TopKIDs.Int32s()
					if err != nil || fmt.Sprint(gotIDs) != fmt.Sprint(ids) {
						t.Errorf("sharded routing differs from the reference's (%v)", err)
					}
					one, err := single.FusedMoE(ctx, clienttest.Request(whole, set, req))
					if err != nil {
						t.Fatalf("single-daemon FusedMoE: %v", err)
					}
					out, err := got.Output.Float32s()
					if err != nil {
						t.Fatal(err)
					}
					base, err := one.Output.Float32s()
					if err != nil {
						t.Fatal(err)
					}
					eSharded, eSingle := kerneltest.RelL2(out, want), kerneltest.RelL2(base, want)
					vsSingle := kerneltest.RelL2(out, widen(base))
					// FP32 outputs differ from one daemon's only by float32
					// rounding; BF16 ones, rounded once from those, by a
					// rare flip of the last bit.
					tol := 1e-6
					if req.OutDType == moe.BFloat16 {
						tol = 1e-3
					}
					if !(eSharded <= kerneltest.FP8Tol) || !(vsSingle <= tol) {
						t.Errorf("%s: rel-L2 %.3g vs reference (single daemon %.3g), %.3g vs single daemon; want <= %.0e and <= %.0e",
							req.OutDType, eSharded, eSingle, vsSingle, kerneltest.FP8Tol, tol)
					} else {
						t.Logf("%s out: rel-L2 %.3g vs reference (single daemon %.3g), %.3g vs single daemon (%d of %d elements bitwise equal)",
							req.OutDType, eSharded, eSingle, vsSingle, bitwiseEqual(out, base), len(out))
					}
				})
			}
		})
	}

	t.Run("errors", func(t *testing.T) {
		ctx := testContext(t)
		sc, err := client.DialSharded(ctx, roundRobin, addrs, client.WithMaxAttempts(1))
		if err != nil {
			t.Fatal(err)
		}
		defer sc.Close()
		set, req := kerneltest.NewCase(rng, nemo, 8)
		_, err = sc.FusedMoE(ctx, clienttest.Request("no-such-set", set, req))
		var se *client.ShardError
		if status.Code(err) != codes.NotFound || !errors.As(err, &se) {
			t.Errorf("unknown set: %v, want NotFound from a *client.ShardError", err)
		}
		if _, err := sc.LoadExperts(ctx, "rr", clienttest.Weights(set)); err != nil {
			t.Fatal(err)
		}
		ds[1].stop(t)
		_, err = sc.FusedMoE(ctx, clienttest.Request("rr", set, req))
		if status.Code(err) != codes.Unavailable || !errors.As(err, &se) || se.Shard != 1 || se.Addr != addrs[1] {
			t.Errorf("shard 1 down: %v, want Unavailable from shard 1 (%s)", err, addrs[1])
		} else {
			t.Logf("shard 1 down: %v", err)
		}
	})
}

// request draws fresh hidden states, logits and bias for a set of shape s
// loaded earlier. Its own weights, generated once per process from a fixed
// seed and cached by kerneltest, are not used (without static scales the
// request does not depend on them); generating fresh ones per call would
// dominate the test's time under -race.
func request(rng *rand.Rand, s kerneltest.Shape, m int, opts ...kerneltest.Option) *moe.Request {
	_, req := kerneltest.Case{Shape: s, M: m, Opts: opts}.New(rng)
	return req
}

// routeToShard replaces req's routing with precomputed ids drawn from
// shard s's experts only (distinct per token).
func routeToShard(rng *rand.Rand, req *moe.Request, m *shard.Map, s int) {
	experts := m.Experts(s)
	k, n := req.Routing.TopK, req.M()
	for t := range n {
		perm := rng.Perm(len(experts))
		for j := range k {
			req.TopKIDs[t*k+j] = int32(experts[perm[j]])
		}
	}
}

// checkShardsHit logs how many tokens and pairs of the routing ids each
// shard gets and, when onShard >= 0, checks that only that shard gets any.
func checkShardsHit(t *testing.T, ids []int32, topK int, m *shard.Map, onShard int) {
	t.Helper()
	d, err := m.Dispatch(ids, topK)
	if err != nil {
		t.Fatal(err)
	}
	tokens := make([]int, m.NumShards())
	for s := range tokens {
		tokens[s] = d.Tokens(s)
		if onShard >= 0 && (s == onShard) != (tokens[s] > 0) {
			t.Fatalf("shard %d gets %d tokens; the case wants tokens on shard %d only", s, tokens[s], onShard)
		}
	}
	t.Logf("tokens per shard %v, pairs per shard %v", tokens, lens(d.Pairs))
}

func lens(p [][]int) []int {
	n := make([]int, len(p))
	for i := range p {
		n[i] = len(p[i])
	}
	return n
}

func widen(v []float32) []float64 {
	w := make([]float64, len(v))
	for i, x := range v {
		w[i] = float64(x)
	}
	return w
}

func bitwiseEqual(a, b []float32) int {
	n := 0
	for i := range a {
		if math.Float32bits(a[i]) == math.Float32bits(b[i]) {
			n++
		}
	}
	return n
}
