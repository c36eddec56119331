package client_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/internal/testdaemon"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/shard"
)

// startShards serves n in-process daemons with cfg and dials them as the
// shards of m.
func startShards(t *testing.T, m *shard.Map, cfg service.Config, opts ...client.Option) (*client.Sharded, []*testdaemon.Server) {
	t.Helper()
	srvs := make([]*testdaemon.Server, m.NumShards())
	addrs := make([]string, m.NumShards())
	for i := range srvs {
		srv, err := testdaemon.Serve(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.Stop)
		srvs[i], addrs[i] = srv, srv.Addr
	}
	sc, err := client.DialSharded(testContext(t), m, addrs, opts...)
	if err != nil {
		t.Fatalf("DialSharded: %v", err)
	}
	t.Cleanup(func() { sc.Close() })
	return sc, srvs
}

// mustMap is a map for a test's fixed, valid placement.
func mustMap(m *shard.Map, err error) *shard.Map {
	if err != nil {
		panic(err)
	}
	return m
}

// TestShardedMatchesSingle runs the same layer on one daemon and over an
// explicit, permuted placement of three, with the scale granularities that
// are sliced (per-channel, block) or reduced (per-expert static activation
// scales), and with calls split by the daemons' max tokens.
func TestShardedMatchesSingle(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	single := startServer(t, service.Config{})
	m := mustMap(shard.New(8, [][]int{{7, 0, 3}, {5, 1}, {2, 6, 4}}))
	// Shard calls of at most 5 rows: every case but M=1 is split.
	sc, _ := startShards(t, m, service.Config{MaxTokens: 5})

	mix := kerneltest.Mixtral.Scaled(72, 40) // E = 8, top-2, softmax
	oai := kerneltest.GptOss.Scaled(48, 32)  // expert biases, sliced too
	oai.E = 8
	tests := []struct {
		name     string
		m        int
		opts     []kerneltest.Option
		perExpAS bool // send the static activation scales per expert
		shape    *kerneltest.Shape
	}{
		{"per-channel/bf16-out", 11, []kerneltest.Option{kerneltest.WithGranularity(scaling.PerChannel)}, false, nil},
		{"block/fp8-per-group/fp32-out", 9, []kerneltest.Option{kerneltest.WithBlock(16, 32), kerneltest.WithHidden(moe.Float8E4M3FN),
			kerneltest.WithHiddenScale(scaling.Block), kerneltest.WithOutput(moe.Float32)}, false, nil},
		{"static-per-expert/fp32-in", 7, []kerneltest.Option{kerneltest.WithStaticScales(), kerneltest.WithHidden(moe.Float32),
			kerneltest.WithOutput(moe.Float32)}, true, nil},
		{"per-tensor-fp8-in/M=1", 1, []kerneltest.Option{kerneltest.WithHidden(moe.Float8E4M3FN), kerneltest.WithHiddenScale(scaling.PerTensor)}, false, nil},
		{"swiglu-oai/biases/per-channel", 13, []kerneltest.Option{kerneltest.WithGranularity(scaling.PerChannel)}, false, &oai},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			shape := mix
			if tc.shape != nil {
				shape = *tc.shape
			}
			set, req := kerneltest.NewCase(rng, shape, tc.m, tc.opts...)
			w := clienttest.Weights(set)
			if tc.perExpAS {
				// The max is the set's scale; the server and the fan-out
				// both reduce [E] to it.
				w.A13Scale = perExpert(*set.A13Scale, set.E, i)
				w.A2Scale = perExpert(*set.A2Scale, set.E, i+1)
			}
			name := fmt.Sprintf("layer%d", i)
			if _, err := sc.LoadExperts(ctx, name, w); err != nil {
				t.Fatal(err)
			}
			if _, err := single.LoadExperts(ctx, name, w); err != nil {
				t.Fatal(err)
			}
			got, err := sc.FusedMoE(ctx, clienttest.Request(name, set, req))
			if err != nil {
				t.Fatal(err)
			}
			one, err := single.FusedMoE(ctx, clienttest.Request(name, set, req))
			if err != nil {
				t.Fatal(err)
			}
			checkOutput(t, got, set, req)
			if got.Output.DType != one.Output.DType || string(got.Output.Data) != string(one.Output.Data) {
				a, _ := got.Output.Float32s()
				b, _ := one.Output.Float32s()
				var mx float64
				for i := range a {
					mx = max(mx, math.Abs(float64(a[i]-b[i])))
				}
				// Only float32 rounding could differ (FMA fusion on some
				// architectures); anything larger is a real difference.
				if mx > 1e-5 {
					t.Errorf("sharded output differs from one daemon's by up to %.3g", mx)
				}
			}
			if freed, err := sc.UnloadExperts(ctx, name); err != nil || freed < set.Bytes() {
				t.Errorf("UnloadExperts = %d, %v; want >= %d bytes freed", freed, err, set.Bytes())
			}
		})
	}
}

// perExpert is an [E] scale whose max, at index i mod e, is top.
func perExpert(top float32, e, i int) client.Tensor {
	v := make([]float32, e)
	for j := range v {
		v[j] = top * (0.5 + 0.05*float32(j%7))
	}
	v[i%e] = top
	return client.FromFloat32(v, e)
}

func TestShardedErrors(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	m := mustMap(shard.Contiguous(8, 2))
	sc, srvs := startShards(t, m, service.Config{}, client.WithMaxAttempts(1))
	mix := kerneltest.Mixtral.Scaled(40, 24)
	set, req := kerneltest.NewCase(rng, mix, 4)
	if _, err := sc.LoadExperts(ctx, "l", clienttest.Weights(set)); err != nil {
		t.Fatal(err)
	}

	bad := []struct {
		name    string
		edit    func(r *client.FusedMoERequest)
		wantMsg string
	}{
		{"inline-weights", func(r *client.FusedMoERequest) { r.ExpertSet, r.Weights = "", clienttest.Weights(set) }, "inline weights are not sharded"},
		{"logits-wrong-E", func(r *client.FusedMoERequest) { r.RouterLogits = client.FromFloat32(make([]float32, 4*7), 4, 7) }, "router_logits"},
		{"logits-nan", func(r *client.FusedMoERequest) {
			v := make([]float32, 4*8)
			v[3] = float32(math.NaN())
			r.RouterLogits = client.FromFloat32(v, 4, 8)
		}, "router_logits: element 3 is NaN"},
		{"top_k-too-big", func(r *client.FusedMoERequest) { r.Routing.TopK = 9 }, "routing.top_k: 9"},
		{"groups", func(r *client.FusedMoERequest) { r.Routing.NumGroups, r.Routing.TopKGroups = 3, 1 }, "routing.num_expert_groups: 3 does not divide E = 8"},
		{"ids-repeated", func(r *client.FusedMoERequest) {
			r.RouterLogits = client.Tensor{}
			r.TopKIDs = client.FromInt32([]int32{1, 1, 2, 3, 4, 5, 6, 7}, 4, 2)
			r.TopKWeights = client.FromFloat32(make([]float32, 8), 4, 2)
		}, "element 1 repeats expert 1"},
		{"ids-out-of-range", func(r *client.FusedMoERequest) {
			r.RouterLogits = client.Tensor{}
			r.TopKIDs = client.FromInt32([]int32{0, 1, 2, 3, 4, 5, 6, 8}, 4, 2)
			r.TopKWeights = client.FromFloat32(make([]float32, 8), 4, 2)
		}, "element 7 is 8"},
		{"scale-for-bf16", func(r *client.FusedMoERequest) { r.HiddenScale = client.FromFloat32([]float32{1}) }, "only FLOAT8_E4M3FN hidden_states take a scale"},
		{"output-dtype", func(r *client.FusedMoERequest) { r.OutputDType = moe.Float16 }, "output_dtype"},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			r := clienttest.Request("l", set, req)
			tc.edit(r)
			_, err := sc.FusedMoE(ctx, r)
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tc.wantMsg) {
				t.Errorf("FusedMoE = %v, want InvalidArgument containing %q", err, tc.wantMsg)
			}
		})
	}

	t.Run("weights-wrong-E", func(t *testing.T) {
		six := kerneltest.Mixtral.Scaled(40, 24)
		six.E = 6
		other, _ := kerneltest.NewCase(rng, six, 1)
		if _, err := sc.LoadExperts(ctx, "six", clienttest.Weights(other)); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "E of the shard map") {
			t.Errorf("LoadExperts of 6 experts on an 8-expert map = %v, want InvalidArgument", err)
		}
	})

	t.Run("deadline", func(t *testing.T) {
		short, cancel := context.WithTimeout(ctx, time.Microsecond)
		defer cancel()
		_, err := sc.FusedMoE(short, clienttest.Request("l", set, req))
		var se *client.ShardError
		if status.Code(err) != codes.DeadlineExceeded || !errors.As(err, &se) {
			t.Errorf("1µs deadline: %v, want DeadlineExceeded from a *client.ShardError", err)
		}
	})

	t.Run("shard-down", func(t *testing.T) {
		srvs[1].Stop()
		r := clienttest.Request("l", set, req)
		// Every token to shard 1's experts and none to shard 0's.
		r.RouterLogits = client.Tensor{}
		r.TopKIDs = client.FromInt32([]int32{4, 5, 6, 7, 5, 4, 7, 6}, 4, 2)
		r.TopKWeights = client.FromFloat32([]float32{1, 1, 1, 1, 1, 1, 1, 1}, 4, 2)
		_, err := sc.FusedMoE(ctx, r)
		var se *client.ShardError
		if status.Code(err) != codes.Unavailable || !errors.As(err, &se) || se.Shard != 1 || !strings.HasPrefix(err.Error(), "shard 1 (") {
			t.Errorf("shard 1 stopped: %v, want Unavailable naming shard 1", err)
		}
		// Calls that need only shard 0 still work.
		r.TopKIDs = client.FromInt32([]int32{0, 1, 2, 3, 1, 0, 3, 2}, 4, 2)
		if _, err := sc.FusedMoE(ctx, r); err != nil {
			t.Errorf("a call for shard 0 only: %v", err)
		}
	})
}

func TestDialShardedErrors(t *testing.T) {
	m := mustMap(shard.Contiguous(4, 2))
	if _, err := client.DialSharded(testContext(t), m, []string{"127.0.0.1:1"}); err == nil {
		t.Error("DialSharded with 1 address for 2 shards succeeded")
	}
	ctx, cancel := context.WithTimeout(testContext(t), 200*time.Millisecond)
	defer cancel()
	srv, err := testdaemon.Serve(service.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	_, err = client.DialSharded(ctx, m, []string{srv.Addr, freeAddr(t)})
	var se *client.ShardError
	if !errors.As(err, &se) || se.Shard != 1 {
		t.Errorf("DialSharded with shard 1 unreachable = %v, want a *client.ShardError for shard 1", err)
	}
}

// freeAddr is a loopback address that nothing listens on.
func freeAddr(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	return addr
}
