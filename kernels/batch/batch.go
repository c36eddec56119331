// Package batch is dynamic batching as a kernels.Backend that wraps
// another: FusedMoE calls on the same loaded expert set that
// arrive within Window of each other are merged into one backend call
// and its result is split back, so many callers with a few tokens each
// cost about what one caller with all their tokens costs (a GPU streams a
// layer's weights once per call whatever M is, up to a few hundred
// tokens).
//
// Calls merge only when the merged call computes, for every token, exactly
// what the token's own call would have:
//
//   - the same expert set (the Loaded this Backend's Load returned, so a
//     reloaded set starts new batches);
//   - the same routing: logits of the same dtype with equal top_k,
//     renormalize, scoring, groups, scaling factor and correction bias
//     (bit for bit), or all precomputed top-k with equal k;
//   - the same hidden-state dtype, and for FP8 input scales that are per
//     row: per-tensor and per-token scales merge (a per-tensor scale is
//     repeated for each of its call's tokens, which both backends read as
//     one scale per row anyway), per-group scales merge only with
//     per-group scales;
//   - the same output dtype.
//
// No scale in expertd depends on other tokens: BF16/FP32 hidden states
// are quantized with the set's static a13 scale or dynamically per token
// (per group of Bk in block mode), the intermediate with the static a2
// scale or per (token, expert) row, and an FP8 caller's scale comes with
// its own tokens. A per-tensor dynamic activation scale (amax over the
// whole call) would break this rule, since merged tokens would change each
// other's quantization; should one be added, it must be part of the key
// (never merged). Routing, GEMMs and the combine are per token. On the CPU
// backend the merged result is bit-identical to the separate calls
// (cpu.BatchInvariant; not in its AVX-512 simd build, where summation
// order depends on tokens per expert and results differ by float32
// rounding). On CUDA the GEMM's token tiling depends on tokens per expert,
// so bit-identity is expected but not promised; results stay within the
// backend's tolerance against the reference either way.
//
// A batch that opens while its key is idle (no batch of the key started
// and unfinished) starts at once: a lone caller pays no window, and a GPU
// decode call's kernel is shorter than any window worth having. When an
// execution slot is free too, nothing could join such a batch before it
// runs, so the call runs as a batch of one without one (solo). A batch
// that opens while one of its key runs gathers calls until that one finishes, then waits Window more (see
// await) and starts; it starts at once instead when it fills up to
// MaxTokens or the owner drains (Flush). A batch not full keeps taking
// compatible calls until it has an execution slot and merges its inputs,
// so a burst on an idle key still merges and a busy server batches more,
// the way continuous batching does. So calls of one key (a FusedMoEStream's
// included) run one batch at a time unless batches fill up. A batch waits
// for one execution slot (Options.Slots) as one caller, not one per call.
// Each call waits for its own result or its context: a call that leaves before
// the inputs are merged is dropped from the batch; one that leaves later
// gets nothing and the others are unaffected. The backend call is
// cancelled only when every caller has left. Inputs are copied when the
// batch is merged, so a caller's request buffers are never read after it
// has returned; a batch of one is not merged (its call's own request runs,
// output buffer included), and its caller, should it leave, returns once
// the backend call is over.
//
// Calls with a tensor or the output in device memory (a CUDA IPC region:
// a Tensor of Memory moe.Device, moe.Request.OutDev) are not batched:
// merging copies host bytes, and this process cannot copy device memory
// itself; a caller that keeps its activations on the GPU is one that
// already batches its tokens. They run alone, on an execution slot of
// their own, as do calls of MaxTokens or more, every call when Window is
// 0, and calls on sets this Backend did not load (a caller's one-off
// set, which no other call can share).
package batch

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"time"
	"unsafe"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"

	"github.com/expertd/expertd/codec"
	"github.com/expertd/expertd/internal/spans"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
)

// Span names of the stages this Backend adds below its caller's span.
const (
	spanQueue = "expertd.queue" // waiting for an execution slot
	spanBatch = "expertd.batch" // waiting in, and running, a merged batch
)

// Slots are the execution slots the Backend's owner bounds its backend
// calls with: every backend call the Backend makes, merged or alone, holds
// one from before its inputs are merged until the inner backend returns.
type Slots interface {
	// Acquire takes a slot, waiting in order of arrival, or fails: ctx
	// ended, or the owner refuses (a full queue), with an error the
	// Backend returns to the call's callers as it is.
	Acquire(ctx context.Context) error
	// TryAcquire takes a slot if one is free now, without waiting, and
	// reports whether it did.
	TryAcquire() bool
	// Release frees a slot Acquire took.
	Release()
}

// Options configure a Backend.
type Options struct {
	// Window is how long a batch that waited for a running one of its key
	// waits after it for more calls; 0 turns merging off (every call runs
	// alone).
	Window time.Duration
	// MaxTokens bounds the tokens of one merged backend call; a call of
	// that many or more runs alone.
	MaxTokens int
	// Slots bound the backend calls; required.
	Slots Slots
	// Tracer, when set, records the expertd.queue span of each backend
	// call's wait for a slot and the expertd.batch span of each batched
	// call; nil records none at no cost.
	Tracer trace.Tracer
	// Meter records expertd.batch.calls and expertd.batch.tokens, with
	// the inner backend's name as attribute "backend"; nil records
	// nothing.
	Meter metric.Meter
	// Logger reports a backend that panicked in a batch; nil discards.
	Logger *slog.Logger
}

// Backend merges compatible FusedMoE calls into calls of the backend it
// wraps (see the package comment). Load wraps the inner backend's sets so
// that a set stays open while a batch of its calls runs, even once every
// caller has left and the set's owner has closed it.
type Backend struct {
	inner     kernels.Backend
	slots     Slots
	tracer    trace.Tracer
	log       *slog.Logger
	window    time.Duration
	maxTokens int

	batchCalls, batchTokens metric.Int64Histogram
	backendAttr             metric.MeasurementOption

	mu   sync.Mutex
	open map[batchKey]*batch
	// busy holds the keys with a batch started and not yet finished
	// (see start and finish).
	busy map[batchKey]*keyState
	// waiting counts calls in batches whose backend call has not started.
	waiting int
	// merged recycles merged batches' hidden-state and logit buffers,
	// which are free again once the backend call returns: fresh ones
	// would fault in a page per 4 KiB on every batch.
	merged codec.Pool
}

// New returns a Backend that runs calls on inner, merging them as o says.
func New(inner kernels.Backend, o Options) *Backend {
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	bt := &Backend{
		inner: inner, slots: o.Slots, tracer: o.Tracer, log: o.Logger,
		window: o.Window, maxTokens: o.MaxTokens,
		open: map[batchKey]*batch{}, busy: map[batchKey]*keyState{},
	}
	if bt.window <= 0 {
		bt.maxTokens = 0
	}
	bt.initMetrics(o.Meter)
	return bt
}

// initMetrics creates the batch size histograms. Instrument errors only
// degrade telemetry, so they are logged, never fatal.
func (bt *Backend) initMetrics(m metric.Meter) {
	if m == nil {
		m = noop.NewMeterProvider().Meter("")
	}
	bt.backendAttr = metric.WithAttributeSet(attribute.NewSet(attribute.String("backend", bt.inner.Name())))
	sizes := metric.WithExplicitBucketBoundaries(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
	var err error
	if bt.batchCalls, err = m.Int64Histogram("expertd.batch.calls",
		metric.WithDescription("FusedMoE calls merged into one backend call by dynamic batching."),
		metric.WithUnit("{call}"), sizes); err != nil {
		bt.log.Warn("metric not recorded", slog.String("metric", "expertd.batch.calls"), slog.Any("err", err))
		bt.batchCalls, _ = noop.NewMeterProvider().Meter("").Int64Histogram("")
	}
	if bt.batchTokens, err = m.Int64Histogram("expertd.batch.tokens",
		metric.WithDescription("Tokens of one backend call made by dynamic batching."),
		metric.WithUnit("{token}"), sizes); err != nil {
		bt.log.Warn("metric not recorded", slog.String("metric", "expertd.batch.tokens"), slog.Any("err", err))
		bt.batchTokens, _ = noop.NewMeterProvider().Meter("").Int64Histogram("")
	}
}

// Name is the inner backend's.
func (bt *Backend) Name() string { return bt.inner.Name() }

// Capabilities are the inner backend's.
func (bt *Backend) Capabilities() kernels.Capabilities { return bt.inner.Capabilities() }

// Close closes the inner backend.
func (bt *Backend) Close() error { return bt.inner.Close() }

// Load makes set resident in the inner backend; the Loaded it returns is
// what calls merge on.
func (bt *Backend) Load(ctx context.Context, set *moe.ExpertSet) (kernels.Loaded, error) {
	l, err := bt.inner.Load(ctx, set)
	if err != nil {
		return nil, err
	}
	return &loaded{Loaded: l, refs: 1, log: bt.log}, nil
}

// loaded is a set of the inner backend, reference-counted: its owner
// holds one reference until Close, and every batch of its calls holds one
// while it exists, since the batch's callers may all leave (and the owner
// close the set) while its backend call runs.
type loaded struct {
	kernels.Loaded
	log *slog.Logger

	mu   sync.Mutex
	refs int
}

func (l *loaded) hold() {
	l.mu.Lock()
	l.refs++
	l.mu.Unlock()
}

// done drops a reference and closes the inner set with the last one.
func (l *loaded) done() error {
	l.mu.Lock()
	l.refs--
	last := l.refs == 0
	l.mu.Unlock()
	if !last {
		return nil
	}
	return l.Loaded.Close()
}

// Close drops the owner's reference: the inner set closes now, or when
// the last batch holding it ends, which logs a failure to close it.
func (l *loaded) Close() error { return l.done() }

// release ends a batch's hold on l.
func (l *loaded) release() {
	if err := l.done(); err != nil {
		l.log.Error("closing expert set after its last batch", slog.Any("err", err))
	}
}

// Inner is the inner backend's set behind set, one this layer loaded (set
// itself otherwise), for callers that hand a set to the inner backend
// directly (GPU-ordered lanes). Holding set keeps it open.
func Inner(set kernels.Loaded) kernels.Loaded {
	if l, ok := set.(*loaded); ok {
		return l.Loaded
	}
	return set
}

// FusedMoE runs req, merged with compatible calls when it can be.
func (bt *Backend) FusedMoE(ctx context.Context, set kernels.Loaded, req *moe.Request) (*moe.Result, error) {
	res, _, err := bt.Run(ctx, set, req)
	return res, err
}

// Run is FusedMoE that also reports when the backend call that computed
// req started (its slot taken, its inputs merged): the caller's time up
// to then is its wait for its batch and a slot.
func (bt *Backend) Run(ctx context.Context, set kernels.Loaded, req *moe.Request) (*moe.Result, time.Time, error) {
	l, ours := set.(*loaded)
	if ours && bt.accepts(req) {
		return bt.do(ctx, l, req)
	}
	if ours {
		set = l.Loaded
	}
	return bt.alone(ctx, set, req)
}

// alone runs req as a backend call of its own on an execution slot. A
// panicking backend is not recovered: this is the caller's goroutine,
// whose own recovery sees it.
func (bt *Backend) alone(ctx context.Context, set kernels.Loaded, req *moe.Request) (*moe.Result, time.Time, error) {
	_, span := bt.startSpan(ctx, spanQueue)
	err := bt.slots.Acquire(ctx)
	span.End()
	if err != nil {
		return nil, time.Time{}, err
	}
	defer bt.slots.Release()
	started := time.Now()
	res, err := bt.inner.FusedMoE(ctx, set, req)
	return res, started, err
}

func (bt *Backend) startSpan(ctx context.Context, name string) (context.Context, trace.Span) {
	return spans.Start(ctx, bt.tracer, name)
}

// accepts reports whether req can merge with other calls: batching is
// on, req leaves room for another call's tokens, and its tensors and
// output are in host memory (see the package comment).
func (bt *Backend) accepts(req *moe.Request) bool {
	return req.M() < bt.maxTokens && req.Hidden.Memory != moe.Device && req.Logits.Memory != moe.Device && req.OutDev == 0
}

// batchKey is what calls must share to merge.
type batchKey struct {
	set    *loaded
	hidden moe.DType
	// groupScale marks FP8 hidden states with per-group scales.
	groupScale bool
	// logits is 0 for precomputed routing.
	logits             moe.DType
	topK               int
	renormalize        bool
	scoring            moe.Scoring
	groups, topKGroups int
	scalingFactor      float32
	// bias is the correction bias's bytes (in host order: the key only
	// compares them), "" for none.
	bias string
	out  moe.DType
}

// keyOf is r's key for looking batches up. Its bias refers to r's own
// memory, which the caller may reuse once its call returns: a key kept
// in a batch or a map is an owned one (batchKey.owned).
func keyOf(l *loaded, r *moe.Request) batchKey {
	k := batchKey{
		set: l, hidden: r.Hidden.DType, logits: r.Logits.DType,
		topK: r.Routing.TopK, renormalize: r.Routing.Renormalize, scoring: r.Routing.Scoring,
		groups: r.Routing.NumGroups, topKGroups: r.Routing.TopKGroups, scalingFactor: r.Routing.ScalingFactor,
		out: r.OutDType,
	}
	k.groupScale = groupScale(r)
	if b := r.Routing.CorrectionBias; len(b) > 0 {
		// A view: every call looks its key up, and only a kept key needs
		// the bias copied.
		k.bias = unsafe.String((*byte)(unsafe.Pointer(&b[0])), 4*len(b))
	}
	return k
}

// owned is k with a bias of its own, to be kept beyond its caller's call.
func (k batchKey) owned() batchKey {
	k.bias = strings.Clone(k.bias)
	return k
}

// timerResolution is the shortest wait a runtime timer keeps on Linux
// when the process is otherwise idle: the runtime then sleeps in
// epoll_pwait, whose timeout is whole milliseconds, so a shorter timer
// fires about a millisecond late. Shorter waits poll instead (pause),
// which keeps to the window. BenchmarkIdleWait measures both;
// docs/perf-notes.md ("Dynamic batching") has the figures.
const timerResolution = time.Millisecond

// keyState is the started batches of one key.
type keyState struct {
	running int
	// idle is closed when running drops to 0.
	idle chan struct{}
}

// groupScale reports FP8 hidden states with per-group scales (block mode);
// other FP8 scales are per-tensor or per-token, one value per row.
func groupScale(r *moe.Request) bool {
	n := len(r.HiddenScale)
	return r.Hidden.DType == moe.Float8E4M3FN && n != 1 && n != r.M()
}

// batch is calls being gathered into one backend call.
type batch struct {
	key batchKey
	// ctx is the backend call's: the first caller's values, cancelled
	// when every caller has left.
	ctx    context.Context
	cancel context.CancelFunc
	// start is closed when the batch may run (see Backend.start).
	start chan struct{}
	// merged is closed once the members' inputs have been copied.
	merged chan struct{}

	// Guarded by Backend.mu.
	members []*member
	tokens  int
	live    int  // members still waiting for their result
	closed  bool // members fixed and their inputs taken
	// started: start was closed and the batch counted in busy.
	started bool
}

// member is one call in a batch.
type member struct {
	req  *moe.Request
	done chan struct{} // closed when res or err is set
	res  *moe.Result
	err  error
	// queued is when the backend call started.
	queued time.Time
	// calls and tokens are the size of the backend call it ran in.
	calls, tokens int
}

// start lets b run and counts it as running in its key's busy state
// until dispatch finishes it; bt.mu must be held. Every caller of start
// finds b in bt.open (or has just made it), so a batch whose callers all
// left (leave takes it out of open) or that has been taken is never
// started.
func (bt *Backend) start(b *batch) {
	if b.started {
		return
	}
	b.started = true
	close(b.start)
	st := bt.busy[b.key]
	if st == nil {
		st = &keyState{idle: make(chan struct{})}
		bt.busy[b.key] = st
	}
	st.running++
}

// do runs req as part of a batch and returns its share of the result and
// when the backend call started. e must stay acquired until do returns.
//
// The batch's own queue and kernel spans are children of the batch span of
// the call that opened it.
func (bt *Backend) do(ctx context.Context, l *loaded, req *moe.Request) (*moe.Result, time.Time, error) {
	ctx, span := bt.startSpan(ctx, spanBatch)
	defer span.End()
	key := keyOf(l, req)
	if res, queued, ok, err := bt.solo(ctx, key, l, req); ok {
		return res, queued, err
	}
	m := &member{req: req, done: make(chan struct{})}
	b, lead := bt.join(ctx, key, m)
	if lead {
		return bt.lead(ctx, b, m)
	}
	select {
	case <-m.done:
		spans.SetAttrs(span, func() []attribute.KeyValue {
			return []attribute.KeyValue{attribute.Int("expertd.batch.calls", m.calls), attribute.Int("expertd.batch.tokens", m.tokens)}
		})
		return m.res, m.queued, m.err
	case <-ctx.Done():
		bt.leave(b, m)
		return nil, time.Time{}, ctx.Err()
	}
}

// solo runs req as a batch of one with nothing to merge, if its key is
// idle (no batch of it open or started) and an execution slot is free: a
// batch opened now would start at once, take its one member and run its
// request as it is, so the batch itself (its channels, context, members
// and map entry) would be work only other calls need. ok is false, with
// nothing done, otherwise. The key counts as busy while the call runs, so
// calls arriving meanwhile wait for it and batch, as behind any batch. It
// records the batch metrics and recovers a backend's panic as dispatch
// does. Its caller cannot leave early (a batch's only caller would wait
// for the backend call anyway), so the backend call has the caller's
// context, cancelled exactly when the batch's would be.
func (bt *Backend) solo(ctx context.Context, key batchKey, l *loaded, req *moe.Request) (res *moe.Result, queued time.Time, ok bool, err error) {
	_, span := bt.startSpan(ctx, spanQueue)
	bt.mu.Lock()
	ok = bt.open[key] == nil && bt.busy[key] == nil && bt.slots.TryAcquire()
	if ok {
		// The key may keep viewing the caller's bias: it leaves the map
		// before the call returns.
		bt.busy[key] = &keyState{running: 1, idle: make(chan struct{})}
	}
	bt.mu.Unlock()
	span.End()
	if !ok {
		return nil, time.Time{}, false, nil
	}
	// The set stays open for the call, as for a batch's: its owner may
	// close it meanwhile.
	l.hold()
	defer l.release()
	defer func() {
		bt.mu.Lock()
		bt.idle(key)
		bt.mu.Unlock()
	}()
	queued = time.Now()
	bt.batchCalls.Record(ctx, 1, bt.backendAttr)
	bt.batchTokens.Record(ctx, int64(req.M()), bt.backendAttr)
	res, err = bt.compute(ctx, l.Loaded, req)
	return res, queued, true, err
}

// lead runs b, which m's call opened on an idle key, on that call's
// goroutine, so a lone call goes from its caller to the backend with no
// hand-off to a dispatcher and back. Calls arriving meanwhile join b
// until it takes its members, as with a dispatcher. The caller's
// cancellation makes it leave b as in do; its call then returns when
// the backend call ends, which the batch's other callers may still need.
func (bt *Backend) lead(ctx context.Context, b *batch, m *member) (*moe.Result, time.Time, error) {
	left := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		bt.leave(b, m)
		close(left)
	})
	bt.dispatch(b)
	if stop() {
		// m never left, so it was among the members dispatch answered.
		<-m.done
		return m.res, m.queued, m.err
	}
	<-left
	return nil, time.Time{}, ctx.Err()
}

// join adds m to the open batch of its key, opening one if there is none
// or the open one has no room. lead reports a batch opened on an idle
// key, which m's caller runs itself (lead); any other new batch gets a
// dispatcher goroutine.
func (bt *Backend) join(ctx context.Context, key batchKey, m *member) (b *batch, lead bool) {
	n := m.req.M()
	bt.mu.Lock()
	defer bt.mu.Unlock()
	b = bt.open[key]
	if b != nil && b.tokens+n > bt.maxTokens {
		delete(bt.open, key)
		bt.start(b)
		b = nil
	}
	if b == nil {
		key = key.owned()
		b = &batch{key: key, start: make(chan struct{}), merged: make(chan struct{})}
		b.ctx, b.cancel = context.WithCancel(context.WithoutCancel(ctx))
		// The batch holds the set itself: its callers may all leave
		// while the backend call runs, and the set must outlive it.
		key.set.hold()
		bt.open[key] = b
		if bt.busy[key] == nil {
			// Idle key: nobody's batch to wait for. The batch stays open
			// until merged, so calls arriving meanwhile still join it.
			bt.start(b)
			lead = true
		} else {
			go bt.dispatch(b)
		}
	}
	b.members = append(b.members, m)
	b.tokens += n
	b.live++
	bt.waiting++
	if b.tokens >= bt.maxTokens {
		delete(bt.open, key)
		bt.start(b)
	}
	return b, lead
}

// leave takes m out of b after its caller gave up.
func (bt *Backend) leave(b *batch, m *member) {
	bt.mu.Lock()
	b.live--
	closed := b.closed
	if !closed {
		b.members = slices.DeleteFunc(b.members, func(x *member) bool { return x == m })
		b.tokens -= m.req.M()
		bt.waiting--
		if b.live == 0 && bt.open[b.key] == b {
			// Nobody is left: new calls start a fresh batch rather than
			// join one whose backend call is cancelled.
			delete(bt.open, b.key)
		}
	}
	if b.live == 0 {
		b.cancel()
	}
	bt.mu.Unlock()
	if closed {
		// The dispatcher may be copying m's inputs (or, in a batch of
		// one, the backend reading them); its caller's buffers must not
		// be released before that ends.
		<-b.merged
	}
}

// Flush starts every open batch: a drain should not wait for running
// batches and windows.
func (bt *Backend) Flush() {
	bt.mu.Lock()
	defer bt.mu.Unlock()
	for _, b := range bt.open {
		bt.start(b)
	}
}

// take closes b to joins and departures and returns its members.
func (bt *Backend) take(b *batch) []*member {
	bt.mu.Lock()
	defer bt.mu.Unlock()
	if bt.open[b.key] == b {
		delete(bt.open, b.key)
	}
	b.closed = true
	bt.waiting -= len(b.members)
	return b.members
}

// Waiting is the number of calls waiting in batches for their backend
// call to start.
func (bt *Backend) Waiting() int {
	bt.mu.Lock()
	defer bt.mu.Unlock()
	return bt.waiting
}

// dispatch runs batch b: wait to start, execution slot, merge, backend
// call, split.
func (bt *Backend) dispatch(b *batch) {
	defer b.key.set.release()
	defer b.cancel()
	defer bt.finish(b)
	var err error
	if bt.await(b) {
		_, span := bt.startSpan(b.ctx, spanQueue)
		err = bt.slots.Acquire(b.ctx)
		span.End()
	} else {
		err = b.ctx.Err()
	}
	members := bt.take(b)
	var req *moe.Request
	switch {
	case err != nil || len(members) == 0:
		close(b.merged)
	case len(members) == 1:
		// A batch of one runs its call's own request: no copy of the
		// inputs, and the output goes where its caller put it
		// (Request.Out, OutDev). Its caller's buffers are read
		// until the backend call ends, so a caller that leaves waits
		// for that (leave) instead of for the merge.
		req = members[0].req
		defer close(b.merged)
	default:
		req = mergeRequests(members, &bt.merged)
		close(b.merged)
		defer func() {
			// The backend call has returned (backends keep no input).
			bt.merged.Put(req.Hidden.Data)
			bt.merged.Put(req.Logits.Data)
		}()
	}
	if err != nil {
		for _, m := range members {
			m.err = err
			close(m.done)
		}
		return
	}
	if len(members) == 0 {
		bt.slots.Release()
		return
	}
	queued := time.Now()
	bt.batchCalls.Record(b.ctx, int64(len(members)), bt.backendAttr)
	bt.batchTokens.Record(b.ctx, int64(req.M()), bt.backendAttr)
	res, err := bt.compute(b.ctx, b.key.set.Loaded, req)
	if err != nil {
		for _, m := range members {
			m.queued, m.err = queued, err
			m.calls, m.tokens = len(members), req.M()
			close(m.done)
		}
		return
	}
	splitResult(res, members, req.M(), req.Hidden.Shape[1]*req.OutDType.Size())
	for _, m := range members {
		m.queued = queued
		m.calls, m.tokens = len(members), req.M()
		close(m.done)
	}
}

// await holds b until it may start and reports whether it did, false if
// every caller left first. A batch not started when it opened (its key was
// busy) waits for its key to go idle and then one more window, in which
// the callers of the batch that just finished, if they call again at
// once, join it: without that, closed-loop callers settle into one large
// and one small batch alternating, and a small batch costs as much per
// token as no batching on the CPU. Joins, flush, or a full batch may start
// it sooner.
func (bt *Backend) await(b *batch) bool {
	for {
		bt.mu.Lock()
		started, st := b.started, bt.busy[b.key]
		bt.mu.Unlock()
		if started {
			return true
		}
		if st != nil {
			select {
			case <-st.idle:
			case <-b.start:
			case <-b.ctx.Done():
			}
		} else {
			bt.pause(b, bt.window)
		}
		bt.mu.Lock()
		switch {
		case b.started:
		case b.ctx.Err() != nil:
			bt.mu.Unlock()
			return false
		case st == nil && bt.busy[b.key] == nil:
			bt.start(b)
		}
		started = b.started
		bt.mu.Unlock()
		if started {
			return true
		}
	}
}

// pause waits d, or less if b starts or every caller leaves. Below
// timerResolution it polls, yielding to other goroutines between looks,
// since a timer would take a millisecond or more: at most d of one core
// per batch that waited for a running one.
func (bt *Backend) pause(b *batch, d time.Duration) {
	if d >= timerResolution {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-b.start:
		case <-b.ctx.Done():
		}
		return
	}
	for end := time.Now().Add(d); time.Now().Before(end); runtime.Gosched() {
		select {
		case <-b.start:
			return
		case <-b.ctx.Done():
			return
		default:
		}
	}
}

// finish ends b's count in its key's busy state, if it was started; by
// then b has been taken, so it cannot start later.
func (bt *Backend) finish(b *batch) {
	bt.mu.Lock()
	defer bt.mu.Unlock()
	if b.started {
		bt.idle(b.key)
	}
}

// idle ends one started batch's count in key's busy state; bt.mu must be
// held.
func (bt *Backend) idle(key batchKey) {
	st := bt.busy[key]
	if st.running--; st.running == 0 {
		close(st.idle)
		delete(bt.busy, key)
	}
}

// compute is a batch's backend call, made holding its execution slot,
// which it releases. A panicking backend becomes an error for every
// caller: the daemon's recovery middleware does not see a dispatcher's
// goroutine, and one bad call must not take the daemon down.
func (bt *Backend) compute(ctx context.Context, set kernels.Loaded, req *moe.Request) (res *moe.Result, err error) {
	defer bt.slots.Release()
	defer func() {
		if p := recover(); p != nil {
			bt.log.ErrorContext(ctx, "backend panicked in a batched call", slog.Any("panic", p), slog.String("stack", string(debug.Stack())))
			res, err = nil, fmt.Errorf("backend %s panicked: %v", bt.inner.Name(), p)
		}
	}()
	return bt.inner.FusedMoE(ctx, set, req)
}

// mergeRequests is one request with every member's tokens in member order.
// The inputs are copied: the merged request must not alias any caller's
// buffers, since a caller may return (and its buffers be reused) while
// the backend call runs.
func mergeRequests(members []*member, pool *codec.Pool) *moe.Request {
	first := members[0].req
	var m, scales, hiddenBytes, logitBytes, pairs int
	for _, x := range members {
		m += x.req.M()
		scales += len(x.req.HiddenScale)
		hiddenBytes += len(x.req.Hidden.Data)
		logitBytes += len(x.req.Logits.Data)
		pairs += len(x.req.TopKIDs)
	}
	// Out stays nil: the backend allocates the merged output, which
	// splitResult hands out as views, so no part of it may go back to a
	// pool (the members' own Out buffers go unused; their callers see
	// that the output is not theirs).
	out := &moe.Request{
		Hidden:   moe.Tensor{DType: first.Hidden.DType, Shape: []int{m, first.Hidden.Shape[1]}, Data: pool.Get(hiddenBytes)[:0]},
		Routing:  first.Routing,
		OutDType: first.OutDType,
		// The batch returns routing if any member wants it.
		NoRouting: !slices.ContainsFunc(members, func(x *member) bool { return !x.req.NoRouting }),
	}
	if first.Routing.CorrectionBias != nil {
		out.Routing.CorrectionBias = slices.Clone(first.Routing.CorrectionBias)
	}
	perRow := first.Hidden.DType == moe.Float8E4M3FN && !groupScale(first)
	switch {
	case perRow:
		out.HiddenScale = make([]float32, 0, m)
	case len(first.HiddenScale) > 0:
		out.HiddenScale = make([]float32, 0, scales)
	}
	if first.TopKIDs != nil {
		out.TopKIDs = make([]int32, 0, pairs)
		out.TopKWeights = make([]float32, 0, pairs)
	} else {
		out.Logits = moe.Tensor{DType: first.Logits.DType, Shape: []int{m, first.Logits.Shape[1]}, Data: pool.Get(logitBytes)[:0]}
	}
	for _, x := range members {
		r := x.req
		out.Hidden.Data = append(out.Hidden.Data, r.Hidden.Data...)
		if perRow && len(r.HiddenScale) == 1 {
			for range r.M() {
				out.HiddenScale = append(out.HiddenScale, r.HiddenScale[0])
			}
		} else {
			out.HiddenScale = append(out.HiddenScale, r.HiddenScale...)
		}
		out.Logits.Data = append(out.Logits.Data, r.Logits.Data...)
		out.TopKIDs = append(out.TopKIDs, r.TopKIDs...)
		out.TopKWeights = append(out.TopKWeights, r.TopKWeights...)
	}
	return out
}

// splitResult gives each member its rows of res, a result of m tokens
// with row bytes of output each. The slices share res's buffers without
// overlapping; a result without routing (the batch's NoRouting) gives
// members none.
func splitResult(res *moe.Result, members []*member, m, row int) {
	topK := len(res.TopKIDs) / m
	t := 0
	for _, m := range members {
		n := m.req.M()
		m.res = &moe.Result{
			Output:      res.Output[t*row : (t+n)*row : (t+n)*row],
			TopKIDs:     res.TopKIDs[t*topK : (t+n)*topK : (t+n)*topK],
			TopKWeights: res.TopKWeights[t*topK : (t+n)*topK : (t+n)*topK],
			KernelNanos: res.KernelNanos,
		}
		t += n
	}
}
