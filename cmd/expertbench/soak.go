package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/internal/clip"
	"github.com/expertd/expertd/internal/durstat"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
)

// errSoakFailed is a soak that ran but found a wrong answer, an unexpected
// status or growth over a threshold; main exits 1 on it.
var errSoakFailed = errors.New("soak failed")

// soakConfig holds the soak-only flags.
type soakConfig struct {
	on bool
	// badShare of calls are malformed; checkShare of good responses are
	// compared with the float64 reference.
	badShare, checkShare float64
	adminAddr            string
	maxRSSGrowthMiB      float64
	maxGoroutineGrowth   int
	warmup               time.Duration
	// busyOK counts ResourceExhausted on good calls (the daemon's bounded
	// queue) as expected back-pressure instead of a failure.
	busyOK bool
}

// soakSet is one expert set a soak loads.
type soakSet struct {
	name  string
	shape kerneltest.Shape
	opts  []kerneltest.Option
	// out is the output dtype of its calls.
	out moe.DType
}

// soakSets are the layers of a soak: a gated softmax one, a ReLU² sigmoid
// one with a correction bias, and a block-scaled grouped one with FP32
// output, so that both activations, every scoring and two scale
// granularities run side by side. Their own sizes differ; k and n, when
// not 0, replace them all.
func soakSets(prefix string, k, n int) []soakSet {
	size := func(s kerneltest.Shape, dk, dn int) kerneltest.Shape {
		if k != 0 {
			dk = k
		}
		if n != 0 {
			dn = n
		}
		return s.Scaled(dk, dn)
	}
	deepseek := size(kerneltest.DeepSeekV3, 256, 64)
	deepseek.E = 64
	return []soakSet{
		{prefix + "-gated", size(kerneltest.Qwen3, 192, 96), []kerneltest.Option{kerneltest.WithGranularity(scaling.PerExpert)}, moe.BFloat16},
		{prefix + "-relu2", size(kerneltest.Nemotron, 160, 128), []kerneltest.Option{kerneltest.WithGranularity(scaling.PerChannel)}, moe.BFloat16},
		{prefix + "-block", deepseek, []kerneltest.Option{kerneltest.WithBlock(64, 64)}, moe.Float32},
	}
}

// poolEntry is one good request with its float64 reference.
type poolEntry struct {
	setName string
	set     *moe.ExpertSet
	req     *moe.Request
	sdk     *client.FusedMoERequest
	wire    *pb.FusedMoERequest
	want    []float64
}

// newSoakEntry is a request of m fresh tokens on set, drawn like
// kerneltest's cases (hidden states randn/10 in BF16, FP32 logits randn,
// bias randn/10) but without kerneltest.NewCase, which would also draw
// and quantize a whole new set of weights per request.
func newSoakEntry(rng *rand.Rand, ss soakSet, set *moe.ExpertSet, m int) *poolEntry {
	s := ss.shape
	randn := func(n int, scale float64) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = float32(rng.NormFloat64() * scale)
		}
		return v
	}
	req := &moe.Request{
		Hidden: moe.Tensor{DType: moe.BFloat16, Shape: []int{m, s.K},
			Data: client.BFloat16FromFloat32(randn(m*s.K, 0.1), m, s.K).Data},
		Logits: moe.Tensor{DType: moe.Float32, Shape: []int{m, s.E},
			Data: client.FromFloat32(randn(m*s.E, 1), m, s.E).Data},
		Routing: moe.Routing{TopK: s.TopK, Renormalize: s.Renormalize, Scoring: s.Scoring,
			NumGroups: s.NumGroups, TopKGroups: s.TopKGroups, ScalingFactor: s.ScalingFactor},
		OutDType: ss.out,
	}
	if req.Routing.ScalingFactor == 0 {
		req.Routing.ScalingFactor = 1
	}
	if s.Bias {
		req.Routing.CorrectionBias = randn(s.E, 0.1)
	}
	sdk := clienttest.Request(ss.name, set, req)
	return &poolEntry{setName: ss.name, set: set, req: req, sdk: sdk, wire: wireRequest(sdk)}
}

// tokenCounts are the M of a set's pool requests, capped at -m: eight
// distinct requests per set, shared by all clients, are enough that
// concurrent calls mostly differ (so a response sent to the wrong caller
// is caught) and few enough that their references are quick to compute.
func tokenCounts(maxM int) []int {
	var ms []int
	for _, m := range []int{1, maxM, 3, maxM / 2, 8, 17, 2, maxM / 4} {
		ms = append(ms, min(max(m, 1), maxM))
	}
	return ms
}

// soakResult is a soak's summary.
type soakResult struct {
	Sets        []string       `json:"sets"`
	Backend     string         `json:"backend"`
	Concurrency int            `json:"concurrency"`
	Elapsed     time.Duration  `json:"elapsed_ns"`
	Calls       int            `json:"calls"`
	Good        int            `json:"good_calls"`
	Malformed   int            `json:"malformed_calls"`
	Checked     int            `json:"checked"`
	Wrong       int            `json:"wrong"`
	WorstRelL2  float64        `json:"worst_rel_l2"`
	Expected    map[string]int `json:"expected_by_code"`
	Unexpected  map[string]int `json:"unexpected_by_code"`
	// FirstUnexpected are the first few unexpected outcomes, verbatim.
	FirstUnexpected []string      `json:"first_unexpected,omitempty"`
	GoodP50         time.Duration `json:"good_p50_ns"`
	GoodP99         time.Duration `json:"good_p99_ns"`
	GoodMax         time.Duration `json:"good_max_ns"`
	BadP50          time.Duration `json:"malformed_p50_ns"`
	BadP99          time.Duration `json:"malformed_p99_ns"`
	// Server figures: idle before the load; the samples of highest RSS in
	// the first and in the second half of the load after the warm-up
	// (their difference is the growth: a leak raises the second, while
	// comparing two single samples would mostly measure how many calls
	// happened to be in flight); the highest overall; idle after.
	ServerBefore *serverStats `json:"server_before,omitempty"`
	ServerEarly  *serverStats `json:"server_early_peak,omitempty"`
	ServerLate   *serverStats `json:"server_late_peak,omitempty"`
	ServerPeak   *serverStats `json:"server_peak,omitempty"`
	ServerEnd    *serverStats `json:"server_end,omitempty"`
	Failures     []string     `json:"failures"`
}

// soakState is what the workers share.
type soakState struct {
	mu         sync.Mutex
	res        soakResult
	good, bad  []time.Duration
	windowGood int
	kinds      atomic.Uint64 // malformed calls started, which picks the next kind
}

// nextMalformed picks the malformed kinds in turn across all workers, so a
// soak of n malformed calls covers min(n, kinds) of them whatever its rate,
// and an entry of the pool the kind applies to, from e on.
func (s *soakState) nextMalformed(pool []*poolEntry, e *poolEntry, maxTokens int) (*malformed, *poolEntry) {
	for range malformedKinds {
		kind := &malformedKinds[(s.kinds.Add(1)-1)%uint64(len(malformedKinds))]
		if kind.applies == nil || kind.applies(e, maxTokens) {
			return kind, e
		}
		for _, other := range pool {
			if kind.applies(other, maxTokens) {
				return kind, other
			}
		}
	}
	// No kind applies to this pool (TestMalformedKinds rules that out for
	// the built-in sets): the unconditional first kind.
	return &malformedKinds[0], e
}

func (s *soakState) expected(code codes.Code, bad bool, d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.res.Calls++
	s.res.Expected[outcomeKey(bad, code.String())]++
	if bad {
		s.res.Malformed++
		s.bad = append(s.bad, d)
	} else {
		s.res.Good++
		if code == codes.OK {
			s.good = append(s.good, d)
			s.windowGood++
		}
	}
}

// outcomeKey names an outcome in the by-code counts: "good:OK",
// "good:ResourceExhausted" (busy), "malformed:InvalidArgument", ...
func outcomeKey(bad bool, code string) string {
	if bad {
		return "malformed:" + code
	}
	return "good:" + code
}

func (s *soakState) unexpected(code string, bad bool, what string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.res.Calls++
	if bad {
		s.res.Malformed++
	} else {
		s.res.Good++
	}
	s.res.Unexpected[outcomeKey(bad, code)]++
	if len(s.res.FirstUnexpected) < 10 {
		s.res.FirstUnexpected = append(s.res.FirstUnexpected, what)
	}
}

func (s *soakState) checked(relErr float64, wrong bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.res.Checked++
	s.res.WorstRelL2 = max(s.res.WorstRelL2, relErr)
	if wrong {
		s.res.Wrong++
	}
}

// soak runs the soak: load the sets, build the request pool, run the
// clients, then judge. It returns the summary and errSoakFailed (wrapped)
// when the verdict is a failure; other errors mean it could not run.
func soak(ctx context.Context, c *client.Client, cfg config, stderr io.Writer) (*soakResult, error) {
	infoCtx, cancel := cfg.dial.Call(ctx)
	info, err := c.ServerInfo(infoCtx)
	cancel()
	if err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(cfg.seed, 0x50a4))
	sets := soakSets(cfg.set, cfg.k, cfg.n)
	var pool []*poolEntry
	loaded := []string{}
	defer func() {
		if cfg.keep {
			return
		}
		for _, name := range loaded {
			unloadCtx, cancel := cfg.dial.Call(context.Background())
			_, err := c.UnloadExperts(unloadCtx, name)
			cancel()
			if err != nil {
				clip.Fprintf(stderr, "expertbench: unloading: %v\n", err)
			}
		}
	}()
	res := &soakResult{Concurrency: cfg.concurrency, Expected: map[string]int{}, Unexpected: map[string]int{}, Failures: []string{}}
	for _, ss := range sets {
		set, _ := kerneltest.NewCase(rng, ss.shape, 1, ss.opts...)
		loadCtx, cancel := cfg.dial.Call(ctx)
		li, err := c.LoadExperts(loadCtx, ss.name, clienttest.Weights(set), client.Overwrite())
		cancel()
		if err != nil {
			return nil, fmt.Errorf("loading %s: %w", ss.name, err)
		}
		loaded = append(loaded, ss.name)
		res.Backend = li.Backend
		res.Sets = append(res.Sets, fmt.Sprintf("%s %s E=%d top_k=%d K=%d N=%d %v %v", ss.name, ss.shape.Name, set.E, ss.shape.TopK, set.K, set.N, set.Activation, set.W13Scale.Granularity))
		maxM := cfg.tokens
		if info.Limits.MaxTokens > 0 {
			maxM = min(maxM, info.Limits.MaxTokens)
		}
		for _, m := range tokenCounts(maxM) {
			pool = append(pool, newSoakEntry(rng, ss, set, m))
		}
	}
	start := time.Now()
	references(pool)
	fmt.Fprintf(stderr, "expertbench: loaded %d sets, %d requests with references in %v\n", len(sets), len(pool), time.Since(start).Round(time.Millisecond))

	sc := cfg.soak
	// An admin endpoint that stops answering under load is a finding, so
	// failed scrapes fail the run; they are counted, with the first error.
	var scrapes, scrapeErrs int
	var firstScrapeErr error
	scrapeNow := func() *serverStats {
		if sc.adminAddr == "" {
			return nil
		}
		scrapes++
		st, err := scrape(ctx, sc.adminAddr)
		if err != nil {
			scrapeErrs++
			if firstScrapeErr == nil {
				firstScrapeErr = err
			}
			return nil
		}
		return &st
	}
	res.ServerBefore = scrapeNow()

	st := &soakState{res: *res}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	start = time.Now()
	deadline := start.Add(cfg.duration)
	for w := range cfg.concurrency {
		wrng := rand.New(rand.NewPCG(cfg.seed, uint64(w)+1))
		wg.Add(1)
		go func() {
			defer wg.Done()
			soakWorker(runCtx, c, cfg, info.Limits.MaxTokens, pool, wrng, st, deadline)
		}()
	}
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()

	// The daemon is sampled every second (or every -progress, if more
	// often); a progress line goes out every -progress.
	sampleEvery := time.Second
	if cfg.progress > 0 {
		sampleEvery = min(sampleEvery, cfg.progress)
	}
	tick := time.NewTicker(sampleEvery)
	defer tick.Stop()
	warmAt := start.Add(sc.warmup)
	var samples, all []serverStats
	last := start
loop:
	for {
		select {
		case <-done:
			break loop
		case now := <-tick.C:
			s := scrapeNow()
			if s != nil {
				all = append(all, *s)
				if now.After(warmAt) {
					samples = append(samples, *s)
				}
			}
			if cfg.progress > 0 && now.Sub(last) >= cfg.progress-sampleEvery/2 {
				st.mu.Lock()
				calls, bad, unexp, wrong, okN := st.res.Calls, st.res.Malformed, total(st.res.Unexpected), st.res.Wrong, st.windowGood
				st.windowGood = 0
				st.mu.Unlock()
				line := fmt.Sprintf("[%6.1fs] %8d calls  %7.1f good/s  %6d malformed  %d unexpected  %d wrong",
					now.Sub(start).Seconds(), calls, float64(okN)/now.Sub(last).Seconds(), bad, unexp, wrong)
				if s != nil {
					line += fmt.Sprintf("  server: %d goroutines, RSS %.1f MiB", s.Goroutines, mib(s.RSS))
				}
				fmt.Fprintln(stderr, line)
				last = now
			}
		}
	}
	elapsed := time.Since(start)
	st.mu.Lock()
	*res = st.res
	good, bad := sortedCopy(st.good), sortedCopy(st.bad)
	st.mu.Unlock()
	res.Elapsed = elapsed
	if len(good) > 0 {
		res.GoodP50, res.GoodP99, res.GoodMax = durstat.Percentile(good, 0.5), durstat.Percentile(good, 0.99), good[len(good)-1]
	}
	res.BadP50, res.BadP99 = durstat.Percentile(bad, 0.5), durstat.Percentile(bad, 0.99)

	if sc.adminAddr != "" {
		if len(samples) < 2 {
			// A run about as short as its warm-up uses every sample.
			samples = all
		}
		res.ServerEarly, res.ServerLate, res.ServerPeak = halves(samples)
		res.ServerEnd = settle(ctx, sc, res.ServerBefore)
	}
	res.judge(cfg)
	if scrapeErrs > 0 {
		res.Failures = append(res.Failures, fmt.Sprintf("%d of %d scrapes of the daemon's metrics failed (first: %v)", scrapeErrs, scrapes, firstScrapeErr))
	}
	if len(res.Failures) > 0 {
		return res, fmt.Errorf("%w: %s", errSoakFailed, strings.Join(res.Failures, "; "))
	}
	return res, nil
}

// halves returns the highest-RSS sample of the first and of the second
// half of samples, and of all; nil when there are fewer than two.
func halves(samples []serverStats) (early, late, peak *serverStats) {
	if len(samples) < 2 {
		return nil, nil, nil
	}
	highest := func(ss []serverStats) *serverStats {
		h := ss[0]
		for _, s := range ss[1:] {
			if s.RSS > h.RSS {
				h = s
			}
		}
		return &h
	}
	mid := len(samples) / 2
	return highest(samples[:mid]), highest(samples[mid:]), highest(samples)
}

// settleTimeout bounds how long settle waits.
var settleTimeout = 5 * time.Second

// settle waits (up to settleTimeout) for the daemon's goroutines to come back to
// where they were before the load, then takes the final sample: calls
// that just ended may still be unwinding.
func settle(ctx context.Context, sc soakConfig, before *serverStats) *serverStats {
	var s *serverStats
	for end := time.Now().Add(settleTimeout); ; {
		st, err := scrape(ctx, sc.adminAddr)
		if err == nil {
			s = &st
			if before == nil || st.Goroutines <= before.Goroutines+sc.maxGoroutineGrowth {
				return s
			}
		}
		if time.Now().After(end) {
			return s
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// judge fills Failures from the counts and thresholds.
func (r *soakResult) judge(cfg config) {
	sc := cfg.soak
	if r.Wrong > 0 {
		r.Failures = append(r.Failures, fmt.Sprintf("%d wrong answers (worst relative L2 %.3g, bound %g)", r.Wrong, r.WorstRelL2, kerneltest.FP8Tol))
	}
	if n := total(r.Unexpected); n > 0 {
		r.Failures = append(r.Failures, fmt.Sprintf("%d unexpected outcomes %v", n, r.Unexpected))
	}
	if r.Expected[outcomeKey(false, codes.OK.String())] == 0 {
		r.Failures = append(r.Failures, "no good call succeeded")
	}
	if sc.adminAddr == "" {
		return
	}
	if r.ServerEarly != nil && r.ServerLate != nil {
		if g := mib(r.ServerLate.RSS - r.ServerEarly.RSS); g > sc.maxRSSGrowthMiB {
			r.Failures = append(r.Failures, fmt.Sprintf("server RSS grew %.1f MiB between the halves of the load after the warm-up, above -max-rss-growth-mib %g", g, sc.maxRSSGrowthMiB))
		}
	}
	if r.ServerBefore != nil && r.ServerEnd != nil {
		if g := r.ServerEnd.Goroutines - r.ServerBefore.Goroutines; g > sc.maxGoroutineGrowth {
			r.Failures = append(r.Failures, fmt.Sprintf("server goroutines %d -> %d idle, growth above -max-goroutine-growth %d", r.ServerBefore.Goroutines, r.ServerEnd.Goroutines, sc.maxGoroutineGrowth))
		}
	}
	if r.ServerBefore == nil || r.ServerEarly == nil || r.ServerEnd == nil {
		r.Failures = append(r.Failures, "server metrics incomplete")
	}
}

// references computes every pool entry's float64 reference, on all cores.
func references(pool []*poolEntry) {
	var wg sync.WaitGroup
	next := make(chan *poolEntry)
	for range runtime.GOMAXPROCS(0) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for e := range next {
				e.want, _, _ = kerneltest.Reference(e.set, e.req)
			}
		}()
	}
	for _, e := range pool {
		next <- e
	}
	close(next)
	wg.Wait()
}

// busyPause is how long a client backs off after ResourceExhausted or an
// unexpected error, as a real caller would, instead of hammering.
func busyPause(rng *rand.Rand) time.Duration {
	return time.Duration(5+rng.IntN(20)) * time.Millisecond
}

// soakWorker is one client's loop until the deadline.
func soakWorker(ctx context.Context, c *client.Client, cfg config, maxTokens int, pool []*poolEntry, rng *rand.Rand, st *soakState, deadline time.Time) {
	sc := cfg.soak
	for ctx.Err() == nil && time.Now().Before(deadline) {
		e := pool[rng.IntN(len(pool))]
		callCtx, cancel := cfg.dial.Call(ctx)
		if rng.Float64() < sc.badShare {
			kind, e := st.nextMalformed(pool, e, maxTokens)
			p := breakRequest(kind, e, maxTokens)
			t0 := time.Now()
			_, err := c.RPC().FusedMoE(callCtx, p)
			d := time.Since(t0)
			cancel()
			code := status.Code(err)
			switch {
			case code == kind.want && status.Convert(err).Message() != "":
				st.expected(code, true, d)
			case code == codes.Canceled && ctx.Err() != nil:
				return
			default:
				st.unexpected(code.String(), true, fmt.Sprintf("%s on %s: got %v, want %v", kind.name, e.setName, err, kind.want))
				time.Sleep(busyPause(rng))
			}
			continue
		}
		t0 := time.Now()
		out, err := c.FusedMoE(callCtx, e.sdk)
		d := time.Since(t0)
		cancel()
		code := status.Code(err)
		switch {
		case err == nil:
			st.expected(codes.OK, false, d)
			if rng.Float64() < sc.checkShare {
				got, derr := out.Output.Float32s()
				rel := kerneltest.RelL2(got, e.want)
				if derr != nil {
					rel = math.Inf(1)
				}
				st.checked(rel, rel > kerneltest.FP8Tol)
			}
		case code == codes.ResourceExhausted && sc.busyOK:
			st.expected(code, false, d)
			time.Sleep(busyPause(rng))
		case code == codes.Canceled && ctx.Err() != nil:
			return
		default:
			st.unexpected(code.String(), false, fmt.Sprintf("good call on %s (M=%d): %v", e.setName, e.req.M(), err))
			time.Sleep(busyPause(rng))
		}
	}
}

func total(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

func mib(n int64) float64 { return float64(n) / (1 << 20) }

// codeCounts writes a by-code map as "A 3, B 1", largest first.
func codeCounts(m map[string]int) string {
	if len(m) == 0 {
		return "none"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return m[keys[i]] > m[keys[j]] || m[keys[i]] == m[keys[j]] && keys[i] < keys[j] })
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %d", k, m[k])
	}
	return strings.Join(parts, ", ")
}

// print writes the soak summary: aligned text, or JSON with -json.
func (r *soakResult) print(w io.Writer, cfg config) error {
	if cfg.jsonOut {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(r)
	}
	ms := func(d time.Duration) string { return fmt.Sprintf("%.3f ms", float64(d)/1e6) }
	var b strings.Builder
	fmt.Fprintf(&b, "soak         %d sets\n", len(r.Sets))
	for _, s := range r.Sets {
		fmt.Fprintf(&b, "  set        %s\n", s)
	}
	fmt.Fprintf(&b, "backend      %s\nconcurrency  %d\n", r.Backend, r.Concurrency)
	fmt.Fprintf(&b, "calls        %d in %.2fs (%.1f/s): %d good, %d malformed\n", r.Calls, r.Elapsed.Seconds(), float64(r.Calls)/r.Elapsed.Seconds(), r.Good, r.Malformed)
	fmt.Fprintf(&b, "checked      %d responses against the float64 reference: %d wrong (worst relative L2 %.3g, bound %g)\n", r.Checked, r.Wrong, r.WorstRelL2, kerneltest.FP8Tol)
	fmt.Fprintf(&b, "expected     %s\n", codeCounts(r.Expected))
	fmt.Fprintf(&b, "unexpected   %s\n", codeCounts(r.Unexpected))
	for _, u := range r.FirstUnexpected {
		clip.Fprintf(&b, "  first      %s\n", u)
	}
	fmt.Fprintf(&b, "latency      good p50 %s  p99 %s  max %s; malformed p50 %s  p99 %s\n", ms(r.GoodP50), ms(r.GoodP99), ms(r.GoodMax), ms(r.BadP50), ms(r.BadP99))
	if r.ServerBefore != nil && r.ServerEnd != nil {
		fmt.Fprintf(&b, "goroutines   %d idle before, %d idle after\n", r.ServerBefore.Goroutines, r.ServerEnd.Goroutines)
		if r.ServerEarly != nil && r.ServerLate != nil {
			fmt.Fprintf(&b, "server RSS   %.1f MiB idle before; highest %.1f in the first half after warm-up, %.1f in the second: growth %+.1f MiB; peak %.1f; %.1f idle after\n",
				mib(r.ServerBefore.RSS), mib(r.ServerEarly.RSS), mib(r.ServerLate.RSS), mib(r.ServerLate.RSS-r.ServerEarly.RSS), mib(r.ServerPeak.RSS), mib(r.ServerEnd.RSS))
			fmt.Fprintf(&b, "server heap  %.1f MiB in use idle before, %.1f and %.1f at those samples, %.1f idle after\n",
				mib(r.ServerBefore.HeapInuse), mib(r.ServerEarly.HeapInuse), mib(r.ServerLate.HeapInuse), mib(r.ServerEnd.HeapInuse))
		}
	} else {
		fmt.Fprintf(&b, "server       no figures (pass -admin-addr to read the daemon's /metrics)\n")
	}
	if len(r.Failures) == 0 {
		fmt.Fprintf(&b, "verdict      PASS\n")
	} else {
		clip.Fprintf(&b, "verdict      FAIL: %s\n", strings.Join(r.Failures, "; "))
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// soakUsage names what -soak uses of the ordinary flags.
const soakUsage = "soak mode: load a gated, a ReLU² and a block-scaled set (sizes replaced by -k, -n), call them with up to -m tokens " +
	"from -c clients for -duration, mixing in -bad-share malformed calls and checking -check-share of good responses against " +
	"the float64 reference; exit 1 on a wrong answer, an unexpected status, or growth over the thresholds"
