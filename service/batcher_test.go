package service_test

import (
	"context"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// neverEnds is a batching window no test outlives. A batch on an idle key
// starts at once, so these tests first occupy the key with a call held in
// the backend; batches gathered behind it then start because they are
// full, or on Shutdown, never on a timer, so what merges with what does
// not depend on timing.
const neverEnds = time.Hour

// recordingBackend wraps a backend, recording the token count of every
// FusedMoE call; with started and release set, each call signals started
// and then waits for release (a send releases one call, closing it all)
// before computing. It returns no routing for a request with NoRouting,
// as the CUDA backend does.
type recordingBackend struct {
	kernels.Backend
	started, release chan struct{}

	mu sync.Mutex
	ms []int
}

func (b *recordingBackend) FusedMoE(ctx context.Context, l kernels.Loaded, req *moe.Request) (*moe.Result, error) {
	b.mu.Lock()
	b.ms = append(b.ms, req.M())
	b.mu.Unlock()
	if b.started != nil {
		b.started <- struct{}{}
	}
	if b.release != nil {
		<-b.release
	}
	res, err := b.Backend.FusedMoE(ctx, l, req)
	if err == nil && req.NoRouting {
		res.TopKIDs, res.TopKWeights = nil, nil
	}
	return res, err
}

// calls is the token count of each backend call so far, sorted.
func (b *recordingBackend) calls() []int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Sorted(slices.Values(b.ms))
}

// batchServer serves backend with cfg and set loaded as "layer".
func batchServer(t *testing.T, cfg service.Config, backend kernels.Backend, set *moe.ExpertSet) (pb.ExpertServiceClient, *service.Server) {
	t.Helper()
	c, srv, _ := servicetest.StartServerConfig(t, cfg, backend)
	w := weightsProto(set)
	if _, err := servicetest.Upload(testContext(t), c, servicetest.Header("layer", w, false), servicetest.Chunks(w, 256<<10)); err != nil {
		t.Fatalf("LoadExperts: %v", err)
	}
	return c, srv
}

// splitRequest cuts r into consecutive requests of the given token counts,
// as separate callers would send them.
func splitRequest(r *moe.Request, sizes []int) []*moe.Request {
	m, k, hs := r.M(), r.Hidden.Shape[1], r.Hidden.DType.Size()
	var out []*moe.Request
	t := 0
	for _, n := range sizes {
		p := &moe.Request{Routing: r.Routing, OutDType: r.OutDType,
			Hidden: moe.Tensor{DType: r.Hidden.DType, Shape: []int{n, k}, Data: r.Hidden.Data[t*k*hs : (t+n)*k*hs]}}
		switch len(r.HiddenScale) {
		case 0:
		case 1:
			p.HiddenScale = r.HiddenScale
		default:
			g := len(r.HiddenScale) / m
			p.HiddenScale = r.HiddenScale[t*g : (t+n)*g]
		}
		if r.TopKIDs != nil {
			tk := r.Routing.TopK
			p.TopKIDs, p.TopKWeights = r.TopKIDs[t*tk:(t+n)*tk], r.TopKWeights[t*tk:(t+n)*tk]
		} else {
			e, ls := r.Logits.Shape[1], r.Logits.DType.Size()
			p.Logits = moe.Tensor{DType: r.Logits.DType, Shape: []int{n, e}, Data: r.Logits.Data[t*e*ls : (t+n)*e*ls]}
		}
		out = append(out, p)
		t += n
	}
	return out
}

// callAll sends every request at once and returns the responses and
// errors in request order.
func callAll(ctx context.Context, c pb.ExpertServiceClient, reqs []*pb.FusedMoERequest) ([]*pb.FusedMoEResponse, []error) {
	resps, errs := make([]*pb.FusedMoEResponse, len(reqs)), make([]error, len(reqs))
	var wg sync.WaitGroup
	for i, r := range reqs {
		wg.Go(func() { resps[i], errs[i] = c.FusedMoE(ctx, r) })
	}
	wg.Wait()
	return resps, errs
}

// callsResult is what callAll returns.
type callsResult struct {
	resps []*pb.FusedMoEResponse
	errs  []error
}

// callAllAsync is callAll in the background.
func callAllAsync(ctx context.Context, c pb.ExpertServiceClient, reqs []*pb.FusedMoERequest) <-chan callsResult {
	ch := make(chan callsResult, 1)
	go func() {
		resps, errs := callAll(ctx, c, reqs)
		ch <- callsResult{resps, errs}
	}()
	return ch
}

// waitStarted waits for n backend calls to start on gated backend b.
func (b *recordingBackend) waitStarted(t *testing.T, n int) {
	t.Helper()
	ctx := testContext(t)
	for range n {
		select {
		case <-b.started:
		case <-ctx.Done():
			t.Fatalf("waiting for a backend call to start: %v", ctx.Err())
		}
	}
}

// checkCaller checks one caller's response against the float64 reference
// (the spec's bar, the reference's routing when wantRouting, else none)
// and against running its request alone on the backend (bit for bit where
// the backend promises batch invariance).
func checkCaller(t *testing.T, name string, set *moe.ExpertSet, req *moe.Request, resp *pb.FusedMoEResponse, tol float64, wantRouting bool) {
	t.Helper()
	ref, refIDs, _ := kerneltest.Reference(set, req)
	got := kerneltest.DecodeOutput(req.OutDType, resp.GetOutput().GetData())
	if len(got) != req.M()*set.K {
		t.Fatalf("%s: %d output values, want %d", name, len(got), req.M()*set.K)
	}
	if e := kerneltest.RelL2(got, ref); !(e <= tol) {
		t.Errorf("%s: rel-L2 vs reference %.3g, want <= %.3g", name, e, tol)
	}
	if !wantRouting {
		if resp.GetTopkIds() != nil || resp.GetTopkWeights() != nil {
			t.Errorf("%s: routing returned without return_routing", name)
		}
	} else if ids := resp.GetTopkIds().GetData(); len(ids) != 4*len(refIDs) {
		t.Errorf("%s: %d bytes of topk ids, want %d", name, len(ids), 4*len(refIDs))
	} else {
		gotIDs := make([]int32, len(refIDs))
		for i := range gotIDs {
			gotIDs[i] = int32(binary.LittleEndian.Uint32(ids[4*i:]))
		}
		if !slices.Equal(gotIDs, refIDs) {
			t.Errorf("%s: topk ids %v, want the reference's %v", name, gotIDs, refIDs)
		}
	}
	alone, err := kerneltest.RunCase(context.Background(), cpu.New(kernels.Config{Threads: 2}), set, req)
	if err != nil {
		t.Fatal(err)
	}
	if slices.Equal(alone.Output, resp.GetOutput().GetData()) {
		return
	}
	if cpu.BatchInvariant() {
		t.Errorf("%s: batched output differs from the same request run alone", name)
		return
	}
	if e := kerneltest.RelL2(got, toFloat64(kerneltest.DecodeOutput(req.OutDType, alone.Output))); e > 1e-3 {
		t.Errorf("%s: batched output is %.3g (rel-L2) from the same request run alone, want float32 rounding only", name, e)
	}
}

func toFloat64(v []float32) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = float64(x)
	}
	return out
}

// TestBatchNumbers merges callers of every kind of compatible request
// into one backend call and checks each caller's share: the float64
// reference's numbers and routing, and the bytes of its request run alone.
func TestBatchNumbers(t *testing.T) {
	odd := kerneltest.Shape{Name: "odd", Activation: moe.SiluGated, E: 6, TopK: 3, K: 77, N: 45,
		Scoring: moe.Sigmoid, Bias: true, NumGroups: 3, TopKGroups: 2, ScalingFactor: 1.5}
	fp8 := kerneltest.WithHidden(moe.Float8E4M3FN)
	tests := []struct {
		name  string
		shape kerneltest.Shape
		opts  []kerneltest.Option
		// rescale, when set, gives caller i its own FP8 scales.
		rescale func(rng *rand.Rand, i int, r *moe.Request)
	}{
		{"nemotron bf16 per-token dynamic, sigmoid bias", kerneltest.Nemotron.Scaled(136, 72), nil, nil},
		{"qwen3 per-expert, fp32 out", kerneltest.Qwen3.Scaled(128, 48),
			[]kerneltest.Option{kerneltest.WithGranularity(scaling.PerExpert), kerneltest.WithOutput(moe.Float32)}, nil},
		{"deepseek block, fp8 per-group", kerneltest.DeepSeekV3.Scaled(136, 40),
			[]kerneltest.Option{fp8, kerneltest.WithHiddenScale(scaling.Block)}, nil},
		{"mixtral fp8, per-tensor and per-token scales mixed", kerneltest.Mixtral.Scaled(77, 45),
			[]kerneltest.Option{fp8, kerneltest.WithHiddenScale(scaling.PerTensor)},
			func(rng *rand.Rand, i int, r *moe.Request) {
				s := r.HiddenScale[0] * (0.5 + rng.Float32())
				if i%2 == 0 {
					r.HiddenScale = []float32{s}
					return
				}
				r.HiddenScale = make([]float32, r.M())
				for j := range r.HiddenScale {
					r.HiddenScale[j] = s * (0.5 + rng.Float32())
				}
			}},
		{"mixtral fp32 static scales, precomputed routing", kerneltest.Mixtral.Scaled(77, 45),
			[]kerneltest.Option{kerneltest.WithHidden(moe.Float32), kerneltest.WithStaticScales(), kerneltest.WithPrecomputedRouting()}, nil},
		{"odd K and N, grouped sigmoid, bf16 logits", odd, []kerneltest.Option{kerneltest.WithLogits(moe.BFloat16)}, nil},
	}
	rng := newRand(t)
	sizes := []int{1, 4, 2, 5, 1, 3}
	total := 16
	for ti, tt := range tests {
		// Every other case merges callers that ask for routing with callers
		// that do not; the rest merge only callers that do not, so their
		// batch runs without routing (NoRouting) and splits none.
		wantRouting := func(i int) bool { return ti%2 == 0 && i%2 == 0 }
		t.Run(tt.name, func(t *testing.T) {
			set, whole := kerneltest.NewCase(rand.New(rand.NewPCG(rng.Uint64(), rng.Uint64())), tt.shape, total, tt.opts...)
			reqs := splitRequest(whole, sizes)
			if tt.rescale != nil {
				for i, r := range reqs {
					tt.rescale(rng, i, r)
				}
			}
			b := &recordingBackend{Backend: cpu.New(kernels.Config{Threads: 2}), started: make(chan struct{}, 8), release: make(chan struct{})}
			c, _ := batchServer(t, service.Config{MaxConcurrent: 2, BatchWindow: neverEnds, BatchMaxTokens: total}, b, set)
			wire := make([]*pb.FusedMoERequest, len(reqs))
			for i, r := range reqs {
				wire[i] = requestProto(r, set.E)
				wire[i].ReturnRouting = wantRouting(i)
			}
			// Caller A's request sent once more first keeps the key busy,
			// so the callers gather until their batch is full.
			held := callAllAsync(testContext(t), c, wire[:1])
			b.waitStarted(t, 1)
			batched := callAllAsync(testContext(t), c, wire)
			b.waitStarted(t, 1)
			close(b.release)
			r := <-batched
			for i, req := range reqs {
				if r.errs[i] != nil {
					t.Fatalf("caller %d: %v", i, r.errs[i])
				}
				checkCaller(t, "caller "+string(rune('A'+i)), set, req, r.resps[i], kerneltest.FP8Tol, wantRouting(i))
			}
			if h := <-held; h.errs[0] != nil {
				t.Fatalf("caller A alone: %v", h.errs[0])
			} else {
				checkCaller(t, "caller A alone", set, reqs[0], h.resps[0], kerneltest.FP8Tol, wantRouting(0))
			}
			if got, want := b.calls(), []int{sizes[0], total}; !slices.Equal(got, want) {
				t.Errorf("backend calls of %v tokens, want %v (A alone, then everyone merged)", got, want)
			}
		})
	}
}

// TestBatchIncompatible sends groups of calls that must not merge with
// each other (each group fills one batch exactly) and checks every group
// ran as its own backend call with correct results. Each group's first
// request, sent once more beforehand and held in the backend, keeps the
// group's key busy so its callers gather.
func TestBatchIncompatible(t *testing.T) {
	shape := kerneltest.Shape{Name: "odd", Activation: moe.SiluGated, E: 6, TopK: 3, K: 77, N: 45,
		Scoring: moe.Sigmoid, Bias: true, NumGroups: 3, TopKGroups: 2, ScalingFactor: 1.5}
	rng := newRand(t)
	sizes := []int{1, 2, 3}
	const total = 6
	// Every group is the base request with one thing changed.
	groups := []struct {
		name string
		opts []kerneltest.Option
		edit func(r *moe.Request)
	}{
		{"base", nil, nil},
		{"fp32 out", []kerneltest.Option{kerneltest.WithOutput(moe.Float32)}, nil},
		{"fp32 hidden", []kerneltest.Option{kerneltest.WithHidden(moe.Float32)}, nil},
		{"fp8 hidden", []kerneltest.Option{kerneltest.WithHidden(moe.Float8E4M3FN)}, nil},
		{"bf16 logits", []kerneltest.Option{kerneltest.WithLogits(moe.BFloat16)}, nil},
		{"precomputed", []kerneltest.Option{kerneltest.WithPrecomputedRouting()}, nil},
		{"top_k 2", nil, func(r *moe.Request) { r.Routing.TopK = 2 }},
		{"renormalize", nil, func(r *moe.Request) { r.Routing.Renormalize = true }},
		{"scaling factor", nil, func(r *moe.Request) { r.Routing.ScalingFactor = 2 }},
		{"no groups", nil, func(r *moe.Request) { r.Routing.NumGroups, r.Routing.TopKGroups = 0, 0 }},
	}
	var set *moe.ExpertSet
	var reqs, holders []*moe.Request
	var names []string
	var bias []float32
	for _, g := range groups {
		s, whole := kerneltest.NewCase(rand.New(rand.NewPCG(rng.Uint64(), rng.Uint64())), shape, total, g.opts...)
		if set == nil {
			// One set for all: NewCase draws the weights from rng, so
			// later cases have different ones; run them all on the first.
			set, bias = s, whole.Routing.CorrectionBias
		}
		if whole.TopKIDs == nil {
			whole.Routing.CorrectionBias = bias
		}
		if g.edit != nil {
			g.edit(whole)
		}
		if whole.TopKIDs != nil && whole.Routing.TopK != shape.TopK {
			t.Fatalf("%s: precomputed routing with an edited top_k", g.name)
		}
		for i, r := range splitRequest(whole, sizes) {
			reqs = append(reqs, r)
			names = append(names, g.name+"/"+string(rune('A'+i)))
		}
		holders = append(holders, reqs[len(reqs)-len(sizes)])
	}
	// A different correction bias is another group.
	_, whole := kerneltest.NewCase(rand.New(rand.NewPCG(rng.Uint64(), rng.Uint64())), shape, total)
	for i, r := range splitRequest(whole, sizes) {
		reqs = append(reqs, r)
		names = append(names, "other bias/"+string(rune('A'+i)))
	}
	holders = append(holders, reqs[len(reqs)-len(sizes)])
	ngroups := len(groups) + 1

	b := &recordingBackend{Backend: cpu.New(kernels.Config{Threads: 2}), started: make(chan struct{}, 8), release: make(chan struct{})}
	// A slot for every holder and every group's batch: all are held in the
	// backend at once.
	c, _ := batchServer(t, service.Config{MaxConcurrent: 2 * ngroups, BatchWindow: neverEnds, BatchMaxTokens: total}, b, set)
	toWire := func(reqs []*moe.Request) []*pb.FusedMoERequest {
		wire := make([]*pb.FusedMoERequest, len(reqs))
		for i, r := range reqs {
			wire[i] = requestProto(r, set.E)
		}
		return wire
	}
	held := callAllAsync(testContext(t), c, toWire(holders))
	b.waitStarted(t, ngroups)
	batched := callAllAsync(testContext(t), c, toWire(reqs))
	b.waitStarted(t, ngroups)
	close(b.release)
	r := <-batched
	for i, req := range reqs {
		if r.errs[i] != nil {
			t.Fatalf("%s: %v", names[i], r.errs[i])
		}
		checkCaller(t, names[i], set, req, r.resps[i], kerneltest.FP8Tol, true)
	}
	if h := <-held; errors.Join(h.errs...) != nil {
		t.Fatalf("holders: %v", errors.Join(h.errs...))
	}
	want := append(slices.Repeat([]int{sizes[0]}, ngroups), slices.Repeat([]int{total}, ngroups)...)
	if got := b.calls(); !slices.Equal(got, want) {
		t.Errorf("backend calls of %v tokens, want %v (each group's holder, then one per group)", got, want)
	}
}

// waitFor polls cond until it holds; the test's deadline bounds it.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	ctx := testContext(t)
	for !cond() {
		if ctx.Err() != nil {
			t.Fatalf("waiting for %s: %v", what, ctx.Err())
		}
		time.Sleep(time.Millisecond)
	}
}

// batchFixture is a small gated set-up: a CPU backend behind a recorder,
// a random Mixtral-like set and requests of any size on it.
type batchFixture struct {
	t    *testing.T
	rng  *rand.Rand
	set  *moe.ExpertSet
	b    *recordingBackend
	c    pb.ExpertServiceClient
	srv  *service.Server
	sent []*moe.Request
}

func newBatchFixture(t *testing.T, cfg service.Config, gated bool) *batchFixture {
	rng := newRand(t)
	set, _ := kerneltest.NewCase(rng, kerneltest.Mixtral.Scaled(40, 24), 1)
	b := &recordingBackend{Backend: cpu.New(kernels.Config{Threads: 2})}
	if gated {
		b.started, b.release = make(chan struct{}, 8), make(chan struct{})
	}
	c, srv := batchServer(t, cfg, b, set)
	return &batchFixture{t: t, rng: rng, set: set, b: b, c: c, srv: srv}
}

// call sends an m-token request on ctx and returns its kernels form and
// a channel that receives the response and error.
type callResult struct {
	resp *pb.FusedMoEResponse
	err  error
}

func (f *batchFixture) call(ctx context.Context, m int, opts ...kerneltest.Option) (*moe.Request, <-chan callResult) {
	_, req := kerneltest.NewCase(f.rng, kerneltest.Mixtral.Scaled(40, 24), m, opts...)
	ch := make(chan callResult, 1)
	w := requestProto(req, f.set.E)
	go func() {
		resp, err := f.c.FusedMoE(ctx, w)
		ch <- callResult{resp, err}
	}()
	return req, ch
}

// occupy sends a one-token call and waits until it is in the backend
// (gated fixtures only): until it is released, its key is busy, so later
// calls of the key gather behind it instead of starting at once.
func (f *batchFixture) occupy() (*moe.Request, <-chan callResult) {
	f.t.Helper()
	req, ch := f.call(testContext(f.t), 1)
	f.b.waitStarted(f.t, 1)
	return req, ch
}

// check waits for a call and checks its numbers.
func (f *batchFixture) check(name string, req *moe.Request, ch <-chan callResult) *pb.FusedMoEResponse {
	f.t.Helper()
	r := <-ch
	if r.err != nil {
		f.t.Fatalf("%s: %v", name, r.err)
	}
	checkCaller(f.t, name, f.set, req, r.resp, kerneltest.FP8Tol, true)
	return r.resp
}

// TestBatchCancel checks callers that leave a batch: before it starts
// (their tokens are dropped), while the backend runs (the others still get
// their results), and all of them (the backend call is abandoned and the
// next batch is fresh).
func TestBatchCancel(t *testing.T) {
	t.Run("waiting", func(t *testing.T) {
		f := newBatchFixture(t, service.Config{MaxConcurrent: 1, BatchWindow: neverEnds, BatchMaxTokens: 6}, true)
		reqX, x := f.occupy()
		ctx, cancel := context.WithCancel(testContext(t))
		_, gone := f.call(ctx, 2)
		waitFor(t, "the first call in the batcher", func() bool { return f.srv.Batched() == 1 })
		cancel()
		if r := <-gone; status.Code(r.err) != codes.Canceled {
			t.Errorf("cancelled call: %v, want Canceled", r.err)
		}
		waitFor(t, "the cancelled call to leave", func() bool { return f.srv.Batched() == 0 })
		// FP32 output is another key, idle: its batch starts at once and
		// waits for the one slot, X's, past the call's deadline.
		dctx, dcancel := context.WithTimeout(testContext(t), 20*time.Millisecond)
		defer dcancel()
		if _, r := f.call(dctx, 1, kerneltest.WithOutput(moe.Float32)); status.Code((<-r).err) != codes.DeadlineExceeded {
			t.Errorf("call past its deadline in the batcher: want DeadlineExceeded")
		}
		waitFor(t, "the expired call to leave", func() bool { return f.srv.Batched() == 0 })
		reqB, b := f.call(testContext(t), 2)
		reqC, c := f.call(testContext(t), 4)
		waitFor(t, "B and C in the batcher", func() bool { return f.srv.Batched() == 2 })
		close(f.b.release)
		f.check("X", reqX, x)
		f.check("B", reqB, b)
		f.check("C", reqC, c)
		if got := f.b.calls(); !slices.Equal(got, []int{1, 6}) {
			t.Errorf("backend calls of %v tokens, want [1 6] (X, then B and C; the departed calls' tokens dropped)", got)
		}
	})
	t.Run("while running", func(t *testing.T) {
		f := newBatchFixture(t, service.Config{MaxConcurrent: 1, BatchWindow: neverEnds, BatchMaxTokens: 6}, true)
		reqX, x := f.occupy()
		ctx, cancel := context.WithCancel(testContext(t))
		_, gone := f.call(ctx, 2)
		reqB, b := f.call(testContext(t), 3)
		reqC, c := f.call(testContext(t), 1)
		waitFor(t, "three calls in the batcher", func() bool { return f.srv.Batched() == 3 })
		f.b.release <- struct{}{} // X
		f.b.waitStarted(t, 1)
		cancel()
		if r := <-gone; status.Code(r.err) != codes.Canceled {
			t.Errorf("cancelled call: %v, want Canceled", r.err)
		}
		close(f.b.release)
		f.check("X", reqX, x)
		f.check("B", reqB, b)
		f.check("C", reqC, c)
		if got := f.b.calls(); !slices.Equal(got, []int{1, 6}) {
			t.Errorf("backend calls of %v tokens, want [1 6]", got)
		}
	})
	t.Run("everyone leaves", func(t *testing.T) {
		f := newBatchFixture(t, service.Config{MaxConcurrent: 1, BatchWindow: neverEnds, BatchMaxTokens: 6}, true)
		reqX, x := f.occupy()
		ctx, cancel := context.WithCancel(testContext(t))
		_, a := f.call(ctx, 2)
		_, b := f.call(ctx, 3)
		waitFor(t, "two calls in the batcher", func() bool { return f.srv.Batched() == 2 })
		cancel()
		for _, ch := range []<-chan callResult{a, b} {
			if r := <-ch; status.Code(r.err) != codes.Canceled {
				t.Errorf("cancelled call: %v, want Canceled", r.err)
			}
		}
		waitFor(t, "the batcher to empty", func() bool { return f.srv.Batched() == 0 })
		reqC, c := f.call(testContext(t), 5)
		reqD, d := f.call(testContext(t), 1)
		waitFor(t, "C and D in the batcher", func() bool { return f.srv.Batched() == 2 })
		close(f.b.release)
		f.check("X", reqX, x)
		f.check("C", reqC, c)
		f.check("D", reqD, d)
		if got := f.b.calls(); !slices.Equal(got, []int{1, 6}) {
			t.Errorf("backend calls of %v tokens, want [1 6] (the abandoned batch never ran)", got)
		}
	})
}

// TestBatchMaxTokens checks the token bound: a call that does not fit
// starts the open batch and opens the next, a call of the bound or more
// runs alone at once, and queue time counts the wait in the batcher.
func TestBatchMaxTokens(t *testing.T) {
	f := newBatchFixture(t, service.Config{MaxConcurrent: 1, BatchWindow: neverEnds, BatchMaxTokens: 8}, true)
	reqX, x := f.occupy()
	reqA, a := f.call(testContext(t), 5)
	waitFor(t, "A in the batcher", func() bool { return f.srv.Batched() == 1 })
	const held = 20 * time.Millisecond
	time.Sleep(held) // A waits at least this long, in its batch
	reqB, b := f.call(testContext(t), 5)
	// A's batch is started (B did not fit) but waits for X's slot.
	waitFor(t, "B in the batcher", func() bool { return f.srv.Batched() == 2 })
	close(f.b.release)
	f.check("X", reqX, x)
	respA := f.check("A", reqA, a)
	if q := time.Duration(respA.GetTimings().GetQueueNanos()); q < held {
		t.Errorf("A waited in the batcher for at least %v but reports queue time %v", held, q)
	}
	waitFor(t, "B alone in the batcher", func() bool { return f.srv.Batched() == 1 })
	reqBig, big := f.call(testContext(t), 8)
	f.check("alone", reqBig, big)
	reqC, c := f.call(testContext(t), 3)
	f.check("B", reqB, b)
	f.check("C", reqC, c)
	if got := f.b.calls(); !slices.Equal(got, []int{1, 5, 8, 8}) {
		t.Errorf("backend calls of %v tokens, want [1 5 8 8] (X, A alone, the 8-token call alone, B+C)", got)
	}
}

// TestBatchShutdown checks a drain does not wait for the running batch or
// the window: calls in the batcher run at once and succeed, new calls are
// refused.
func TestBatchShutdown(t *testing.T) {
	f := newBatchFixture(t, service.Config{MaxConcurrent: 2, BatchWindow: neverEnds, BatchMaxTokens: 8}, true)
	reqX, x := f.occupy()
	reqA, a := f.call(testContext(t), 2)
	reqB, b := f.call(testContext(t), 3)
	waitFor(t, "two calls in the batcher", func() bool { return f.srv.Batched() == 2 })
	drained := make(chan error, 1)
	go func() { drained <- f.srv.Shutdown(testContext(t)) }()
	waitFor(t, "the drain", f.srv.Draining)
	if _, r := f.call(testContext(t), 1); status.Code((<-r).err) != codes.Unavailable {
		t.Errorf("call while draining: want Unavailable")
	}
	f.b.waitStarted(t, 1) // A and B, while X still runs
	close(f.b.release)
	f.check("X", reqX, x)
	f.check("A", reqA, a)
	f.check("B", reqB, b)
	if err := <-drained; err != nil {
		t.Errorf("Shutdown: %v", err)
	}
	if got := f.b.calls(); !slices.Equal(got, []int{1, 5}) {
		t.Errorf("backend calls of %v tokens, want [1 5]", got)
	}
}

// TestBatchMetrics checks a batch is recorded once: its size in calls and
// tokens, one kernel time, and every caller's tokens.
func TestBatchMetrics(t *testing.T) {
	rng := newRand(t)
	reader := sdkmetric.NewManualReader()
	meter := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)).Meter("test")
	b := &recordingBackend{Backend: &fakeBackend{}, started: make(chan struct{}, 8), release: make(chan struct{})}
	c, _ := loadedServer(t, rng, service.Config{Meter: meter, MaxConcurrent: 2, BatchWindow: neverEnds, BatchMaxTokens: 6}, b)
	held := callAllAsync(testContext(t), c, []*pb.FusedMoERequest{request(rng, 1)})
	b.waitStarted(t, 1)
	batched := callAllAsync(testContext(t), c, []*pb.FusedMoERequest{request(rng, 1), request(rng, 2), request(rng, 3)})
	b.waitStarted(t, 1)
	close(b.release)
	for _, ch := range []<-chan callsResult{held, batched} {
		if r := <-ch; errors.Join(r.errs...) != nil {
			t.Fatal(errors.Join(r.errs...))
		}
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					got[m.Name] += p.Value
				}
			case metricdata.Histogram[int64]:
				for _, p := range d.DataPoints {
					got[m.Name+" count"] += int64(p.Count)
					got[m.Name+" sum"] += p.Sum
				}
			case metricdata.Histogram[float64]:
				for _, p := range d.DataPoints {
					got[m.Name+" count"] += int64(p.Count)
				}
			}
		}
	}
	// The one-token call that held the key is a batch of its own.
	want := map[string]int64{
		"expertd.tokens": 1 + 6, "expertd.kernel.duration count": 1 + 1,
		"expertd.batch.calls count": 1 + 1, "expertd.batch.calls sum": 1 + 3,
		"expertd.batch.tokens count": 1 + 1, "expertd.batch.tokens sum": 1 + 6,
	}
	for name, w := range want {
		if got[name] != w {
			t.Errorf("%s = %d, want %d", name, got[name], w)
		}
	}
}

// TestBatchIdleStartsAtOnce checks a call on an idle key does not wait
// for the window, however long: one after the other, each runs alone.
func TestBatchIdleStartsAtOnce(t *testing.T) {
	f := newBatchFixture(t, service.Config{MaxConcurrent: 1, BatchWindow: neverEnds, BatchMaxTokens: 8}, false)
	for _, name := range []string{"A", "B", "C"} {
		ctx, cancel := context.WithTimeout(testContext(t), 10*time.Second)
		req, ch := f.call(ctx, 2)
		r := <-ch
		cancel()
		if r.err != nil {
			t.Fatalf("%s alone on an idle key: %v (did it wait for the %v window?)", name, r.err, neverEnds)
		}
		checkCaller(t, name, f.set, req, r.resp, kerneltest.FP8Tol, true)
		if q := time.Duration(r.resp.GetTimings().GetQueueNanos()); q > 5*time.Second {
			t.Errorf("%s queued %v alone on an idle key", name, q)
		}
	}
	if got := f.b.calls(); !slices.Equal(got, []int{2, 2, 2}) {
		t.Errorf("backend calls of %v tokens, want [2 2 2]", got)
	}
}

// TestBatchWaitsForRunning checks a batch does not start while another of
// its key runs (unless full): calls arriving meanwhile gather into one
// batch that starts, one window after the running one ends, as one backend
// call. Windows below a millisecond are polled, longer ones timed.
func TestBatchWaitsForRunning(t *testing.T) {
	for _, window := range []time.Duration{200 * time.Microsecond, 2 * time.Millisecond} {
		t.Run(window.String(), func(t *testing.T) {
			f := newBatchFixture(t, service.Config{MaxConcurrent: 4, BatchWindow: window, BatchMaxTokens: 6}, true)
			reqA, a := f.call(testContext(t), 2)
			f.b.waitStarted(t, 1) // A's key was idle: it runs at once, alone
			reqB, b := f.call(testContext(t), 1)
			waitFor(t, "B in the batcher", func() bool { return f.srv.Batched() == 1 })
			select {
			case <-f.b.started:
				t.Fatal("a second batch of the key started while the first ran")
			case <-time.After(20 * time.Millisecond):
			}
			reqC, c := f.call(testContext(t), 2)
			waitFor(t, "C in the batcher", func() bool { return f.srv.Batched() == 2 })
			close(f.b.release)
			for _, x := range []struct {
				name string
				req  *moe.Request
				ch   <-chan callResult
			}{{"A", reqA, a}, {"B", reqB, b}, {"C", reqC, c}} {
				f.check(x.name, x.req, x.ch)
			}
			if got := f.b.calls(); !slices.Equal(got, []int{2, 3}) {
				t.Errorf("backend calls of %v tokens, want [2 3] (B and C together)", got)
			}
		})
	}
}
