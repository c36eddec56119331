package batch_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/batch"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
)

const defaultTestTimeout = 30 * time.Second

// neverEnds is a window no test outlives: batches start because they are
// full or flushed, never on a timer.
const neverEnds = time.Hour

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	t.Cleanup(cancel)
	return ctx
}

// sem is a Slots of cap(sem) places.
type sem chan struct{}

func (s sem) Acquire(ctx context.Context) error {
	select {
	case s <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s sem) TryAcquire() bool {
	select {
	case s <- struct{}{}:
		return true
	default:
		return false
	}
}

func (s sem) Release() { <-s }

// gated is a CPU backend whose every FusedMoE call signals started, then
// waits for a send on (or the close of) release; it records each call's
// tokens, and its sets report their Close on closed.
type gated struct {
	kernels.Backend
	started, release chan struct{}
	panics           bool

	mu   sync.Mutex
	ms   []int
	sets []*spySet
}

func newGated() *gated {
	return &gated{Backend: cpu.New(kernels.Config{Threads: 2}), started: make(chan struct{}, 8), release: make(chan struct{})}
}

type spySet struct {
	kernels.Loaded
	closed chan struct{}
}

func (s *spySet) Close() error {
	close(s.closed)
	return s.Loaded.Close()
}

func (g *gated) Load(ctx context.Context, set *moe.ExpertSet) (kernels.Loaded, error) {
	l, err := g.Backend.Load(ctx, set)
	if err != nil {
		return nil, err
	}
	spy := &spySet{Loaded: l, closed: make(chan struct{})}
	g.mu.Lock()
	g.sets = append(g.sets, spy)
	g.mu.Unlock()
	return spy, nil
}

func (g *gated) FusedMoE(ctx context.Context, l kernels.Loaded, req *moe.Request) (*moe.Result, error) {
	g.mu.Lock()
	g.ms = append(g.ms, req.M())
	g.mu.Unlock()
	g.started <- struct{}{}
	<-g.release
	if g.panics {
		panic("kernel fault")
	}
	return g.Backend.FusedMoE(ctx, l.(*spySet).Loaded, req)
}

func (g *gated) calls() []int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Sorted(slices.Values(g.ms))
}

func (g *gated) waitStarted(t *testing.T) {
	t.Helper()
	select {
	case <-g.started:
	case <-testContext(t).Done():
		t.Fatal("waiting for a backend call to start")
	}
}

// fixture is a batch.Backend over a gated CPU backend with a small
// Mixtral-like set loaded through it.
type fixture struct {
	t   *testing.T
	rng *rand.Rand
	g   *gated
	b   *batch.Backend
	set kernels.Loaded
}

func newFixture(t *testing.T, o batch.Options) *fixture {
	g := newGated()
	if o.Slots == nil {
		o.Slots = make(sem, 2)
	}
	b := batch.New(g, o)
	seed := uint64(time.Now().UnixNano())
	t.Logf("random seed %d (replay with rand.NewPCG(seed, 0xba7c4))", seed)
	rng := rand.New(rand.NewPCG(seed, 0xba7c4))
	es, _ := kerneltest.NewCase(rng, kerneltest.Mixtral.Scaled(40, 24), 1)
	l, err := b.Load(context.Background(), es)
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{t: t, rng: rng, g: g, b: b, set: l}
}

type result struct {
	res *moe.Result
	err error
}

// call runs an m-token request on set in the background.
func (f *fixture) call(ctx context.Context, set kernels.Loaded, m int) (*moe.Request, <-chan result) {
	_, req := kerneltest.NewCase(f.rng, kerneltest.Mixtral.Scaled(40, 24), m)
	ch := make(chan result, 1)
	go func() {
		res, err := f.b.FusedMoE(ctx, set, req)
		ch <- result{res, err}
	}()
	return req, ch
}

func (f *fixture) waitWaiting(n int) {
	f.t.Helper()
	ctx := testContext(f.t)
	for f.b.Waiting() != n {
		if ctx.Err() != nil {
			f.t.Fatalf("waiting for %d calls in batches, have %d", n, f.b.Waiting())
		}
		time.Sleep(time.Millisecond)
	}
}

// TestSetOutlivesItsCallers checks a merged batch keeps its set open
// while its backend call runs, though every caller has left and the
// owner has closed the set: the inner set closes when the call ends.
func TestSetOutlivesItsCallers(t *testing.T) {
	f := newFixture(t, batch.Options{Window: neverEnds, MaxTokens: 8})
	_, x := f.call(testContext(t), f.set, 1) // idle key: runs at once
	f.g.waitStarted(t)
	ctx, cancel := context.WithCancel(testContext(t))
	_, a := f.call(ctx, f.set, 2)
	_, b := f.call(ctx, f.set, 3)
	f.waitWaiting(2)
	f.b.Flush()
	f.g.waitStarted(t) // A and B merged, in the backend
	cancel()
	for _, ch := range []<-chan result{a, b} {
		if r := <-ch; !errors.Is(r.err, context.Canceled) {
			t.Errorf("cancelled caller: %v, want context.Canceled", r.err)
		}
	}
	if err := f.set.Close(); err != nil {
		t.Fatal(err)
	}
	spy := f.g.sets[0]
	select {
	case <-spy.closed:
		t.Fatal("the inner set closed while a batch on it ran")
	default:
	}
	close(f.g.release)
	if r := <-x; r.err != nil {
		t.Fatalf("X: %v", r.err)
	}
	select {
	case <-spy.closed:
	case <-testContext(t).Done():
		t.Fatal("the inner set never closed after its last batch")
	}
	if got := f.g.calls(); !slices.Equal(got, []int{1, 5}) {
		t.Errorf("backend calls of %v tokens, want [1 5]", got)
	}
}

// TestRunsAlone checks the calls that never merge go straight to the
// inner backend, each on a slot of its own: every call when Window is 0,
// calls on a set the Backend did not load, and calls of MaxTokens or more.
func TestRunsAlone(t *testing.T) {
	tests := []struct {
		name    string
		o       batch.Options
		foreign bool
		m       int
	}{
		{"window 0", batch.Options{}, false, 1},
		{"foreign set", batch.Options{Window: neverEnds, MaxTokens: 8}, true, 1},
		{"max tokens", batch.Options{Window: neverEnds, MaxTokens: 2}, false, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t, tt.o)
			set := f.set
			if tt.foreign {
				var err error
				es, _ := kerneltest.NewCase(f.rng, kerneltest.Mixtral.Scaled(40, 24), 1)
				if set, err = f.g.Load(context.Background(), es); err != nil {
					t.Fatal(err)
				}
			}
			// Both calls are in the backend at once, each its own call.
			_, a := f.call(testContext(t), set, tt.m)
			_, b := f.call(testContext(t), set, tt.m)
			f.g.waitStarted(t)
			f.g.waitStarted(t)
			if n := f.b.Waiting(); n != 0 {
				t.Errorf("Waiting() = %d, want 0", n)
			}
			close(f.g.release)
			for _, ch := range []<-chan result{a, b} {
				if r := <-ch; r.err != nil {
					t.Fatal(r.err)
				}
			}
			if got := f.g.calls(); !slices.Equal(got, []int{tt.m, tt.m}) {
				t.Errorf("backend calls of %v tokens, want two of %d", got, tt.m)
			}
		})
	}
}

// TestRunStarted checks Run reports when the backend call started: after
// the wait for the slot, which a caller counts as queue time.
func TestRunStarted(t *testing.T) {
	slots := make(sem, 1)
	slots <- struct{}{} // taken until released below
	f := newFixture(t, batch.Options{Window: neverEnds, MaxTokens: 8, Slots: slots})
	close(f.g.release)
	_, req := kerneltest.NewCase(f.rng, kerneltest.Mixtral.Scaled(40, 24), 2)
	const held = 20 * time.Millisecond
	// begin comes before the sleep starts, so the slot's release is at
	// least held after it however the goroutines are scheduled.
	begin := time.Now()
	go func() {
		time.Sleep(held)
		slots.Release()
	}()
	_, started, err := f.b.Run(testContext(t), f.set, req)
	if err != nil {
		t.Fatal(err)
	}
	if q := started.Sub(begin); q < held {
		t.Errorf("the backend call started %v after Run began, want at least the %v the slot was held", q, held)
	}
}

// refusing is a Slots that refuses every call.
type refusing struct{ err error }

func (r refusing) Acquire(context.Context) error { return r.err }
func (r refusing) TryAcquire() bool              { return false }
func (r refusing) Release()                      { panic("release without acquire") }

// TestSlotsRefused checks a refusal of the slots reaches the caller as it
// is, merged or alone.
func TestSlotsRefused(t *testing.T) {
	busy := errors.New("server busy")
	for _, o := range []batch.Options{{Slots: refusing{busy}}, {Window: neverEnds, MaxTokens: 8, Slots: refusing{busy}}} {
		f := newFixture(t, o)
		_, ch := f.call(testContext(t), f.set, 1)
		if r := <-ch; !errors.Is(r.err, busy) {
			t.Errorf("window %v: %v, want the refusal", o.Window, r.err)
		}
	}
}

// TestPanic checks a panicking backend: in a merged batch every caller gets
// an error (nothing above the dispatcher would recover it); alone, the
// panic reaches the caller's goroutine.
func TestPanic(t *testing.T) {
	t.Run("merged", func(t *testing.T) {
		f := newFixture(t, batch.Options{Window: neverEnds, MaxTokens: 8})
		f.g.panics = true
		_, x := f.call(testContext(t), f.set, 1)
		f.g.waitStarted(t)
		_, a := f.call(testContext(t), f.set, 2)
		_, b := f.call(testContext(t), f.set, 3)
		f.waitWaiting(2)
		f.b.Flush()
		close(f.g.release)
		for _, ch := range []<-chan result{x, a, b} {
			if r := <-ch; r.err == nil || !strings.Contains(r.err.Error(), "backend cpu panicked: kernel fault") {
				t.Errorf("caller of a panicking batch: %v, want the panic as an error", r.err)
			}
		}
	})
	t.Run("alone", func(t *testing.T) {
		f := newFixture(t, batch.Options{})
		f.g.panics = true
		close(f.g.release)
		_, req := kerneltest.NewCase(f.rng, kerneltest.Mixtral.Scaled(40, 24), 1)
		defer func() {
			if p := recover(); p != "kernel fault" {
				t.Errorf("recovered %v, want the backend's panic", p)
			}
		}()
		f.b.FusedMoE(testContext(t), f.set, req) //nolint:errcheck // panics
		t.Error("FusedMoE returned")
	})
}

// TestKeyOwnsBias checks a batch's key keeps its correction bias when the
// caller that opened the batch leaves and reuses the memory: a later call
// with the first bias still joins the batch, so the two calls left in it
// run as one backend call.
func TestKeyOwnsBias(t *testing.T) {
	f := newFixture(t, batch.Options{Window: neverEnds, MaxTokens: 8})
	e := f.set.Set().E
	biased := func(ctx context.Context, m int, bias []float32) <-chan result {
		_, req := kerneltest.NewCase(f.rng, kerneltest.Mixtral.Scaled(40, 24), m)
		req.Routing.Scoring = moe.Sigmoid
		req.Routing.CorrectionBias = bias
		ch := make(chan result, 1)
		go func() {
			res, err := f.b.FusedMoE(ctx, f.set, req)
			ch <- result{res, err}
		}()
		return ch
	}
	bias := func(v float32) []float32 {
		b := make([]float32, e)
		for i := range b {
			b[i] = v
		}
		return b
	}
	x := biased(testContext(t), 1, bias(0.5)) // idle key: runs at once
	f.g.waitStarted(t)
	ctx, cancel := context.WithCancel(testContext(t))
	aBias := bias(0.5)
	a := biased(ctx, 2, aBias) // opens the batch that waits for X
	f.waitWaiting(1)
	c := biased(testContext(t), 3, bias(0.5))
	f.waitWaiting(2)
	cancel()
	if r := <-a; !errors.Is(r.err, context.Canceled) {
		t.Fatalf("cancelled caller: %v, want context.Canceled", r.err)
	}
	copy(aBias, bias(-0.5)) // its memory, reused
	d := biased(testContext(t), 2, bias(0.5))
	f.waitWaiting(2)
	f.b.Flush()
	close(f.g.release)
	for _, ch := range []<-chan result{x, c, d} {
		if r := <-ch; r.err != nil {
			t.Fatal(r.err)
		}
	}
	if got := f.g.calls(); !slices.Equal(got, []int{1, 5}) {
		t.Errorf("backend calls of %v tokens, want [1 5]: C and D in one batch", got)
	}
}

// TestIdleKeyWaitingForSlot checks a call on an idle key that finds no
// free slot opens a batch, which calls arriving while it waits join: the
// batch is skipped only when nothing could join it (a free slot).
func TestIdleKeyWaitingForSlot(t *testing.T) {
	slots := make(sem, 1)
	slots <- struct{}{} // taken until released below
	f := newFixture(t, batch.Options{Window: neverEnds, MaxTokens: 8, Slots: slots})
	_, a := f.call(testContext(t), f.set, 1)
	f.waitWaiting(1)
	_, b := f.call(testContext(t), f.set, 2)
	f.waitWaiting(2)
	slots.Release()
	close(f.g.release)
	for _, ch := range []<-chan result{a, b} {
		if r := <-ch; r.err != nil {
			t.Fatal(r.err)
		}
	}
	if got := f.g.calls(); !slices.Equal(got, []int{3}) {
		t.Errorf("backend calls of %v tokens, want [3]: one batch", got)
	}
}
