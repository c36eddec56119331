package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/expertd/expertd/client"
)

// callTimeout bounds one FusedMoE call: far above any sane layer time, so
// a hung server ends the run instead of holding it.
const callTimeout = time.Minute

// requestsPerWorker distinct requests each client cycles through, so the
// server sees varying tokens without the generator paying for fresh random
// data on every call.
const requestsPerWorker = 4

// recorder collects latencies from the workers.
type recorder struct {
	mu     sync.Mutex
	window []time.Duration // since the last progress line
	all    []time.Duration
	kernel []time.Duration // server-side compute time
	queue  []time.Duration // server-side wait for an execution slot
	back   string
}

func (r *recorder) add(d time.Duration, res *client.FusedMoEResult) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.window = append(r.window, d)
	r.all = append(r.all, d)
	r.kernel = append(r.kernel, res.Timings.Kernel)
	r.queue = append(r.queue, res.Timings.Queue)
	r.back = res.Backend
}

// takeWindow returns the latencies since the last call and the total.
func (r *recorder) takeWindow() ([]time.Duration, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	w := r.window
	r.window = nil
	return w, len(r.all)
}

// percentile is the nearest-rank p-quantile (0 < p <= 1) of sorted.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func sortedCopy(d []time.Duration) []time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s
}

// result is a run's summary.
type result struct {
	Model       string        `json:"model"`
	Backend     string        `json:"backend"`
	Tokens      int           `json:"tokens_per_call"`
	Concurrency int           `json:"concurrency"`
	Calls       int           `json:"calls"`
	Elapsed     time.Duration `json:"elapsed_ns"`
	CallsPerSec float64       `json:"calls_per_s"`
	TokensPerS  float64       `json:"tokens_per_s"`
	P50         time.Duration `json:"p50_ns"`
	P90         time.Duration `json:"p90_ns"`
	P99         time.Duration `json:"p99_ns"`
	Max         time.Duration `json:"max_ns"`
	KernelP50   time.Duration `json:"kernel_p50_ns"`
	QueueP50    time.Duration `json:"queue_p50_ns"`
}

// bench runs the load and summarizes it. The first failed call ends the
// run with its error: a load generator whose calls fail is measuring the
// wrong thing.
func bench(ctx context.Context, c *client.Client, cfg config, stderr io.Writer) (*result, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	start := time.Now()
	deadline := start.Add(cfg.duration)
	var (
		rec    recorder
		issued atomic.Int64
		wg     sync.WaitGroup
	)
	for w := range cfg.concurrency {
		rng := rand.New(rand.NewPCG(cfg.seed, uint64(w)+1))
		reqs := make([]*client.FusedMoERequest, requestsPerWorker)
		for i := range reqs {
			reqs[i] = cfg.model.request(rng, cfg.set, cfg.tokens, cfg.out)
		}
		if cfg.shm {
			free, err := toSharedMemory(ctx, c, w, reqs, cfg)
			if err != nil {
				return nil, fmt.Errorf("-shm: %w", err)
			}
			defer free()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				if ctx.Err() != nil || time.Now().After(deadline) {
					return
				}
				if cfg.calls > 0 && issued.Add(1) > int64(cfg.calls) {
					return
				}
				callCtx, callCancel := context.WithTimeout(ctx, callTimeout)
				t0 := time.Now()
				res, err := c.FusedMoE(callCtx, reqs[i%len(reqs)])
				d := time.Since(t0)
				callCancel()
				if err != nil {
					cancel(fmt.Errorf("FusedMoE call failed after %d calls: %w", rec.count(), err))
					return
				}
				rec.add(d, res)
			}
		}()
	}

	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	var tick <-chan time.Time
	if cfg.progress > 0 {
		t := time.NewTicker(cfg.progress)
		defer t.Stop()
		tick = t.C
	}
	last := start
loop:
	for {
		select {
		case <-done:
			break loop
		case now := <-tick:
			w, total := rec.takeWindow()
			s := sortedCopy(w)
			secs := now.Sub(last).Seconds()
			last = now
			fmt.Fprintf(stderr, "[%6.1fs] %8d calls  %8.1f calls/s  %10.0f tokens/s  p50 %8v  p99 %8v\n",
				now.Sub(start).Seconds(), total, float64(len(w))/secs, float64(len(w)*cfg.tokens)/secs,
				percentile(s, 0.5).Round(time.Microsecond), percentile(s, 0.99).Round(time.Microsecond))
		}
	}
	elapsed := time.Since(start)
	// An interrupt (the parent context) still gets a summary of what
	// completed; a failed call does not.
	if err := context.Cause(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return nil, err
	}
	all := sortedCopy(rec.all)
	if len(all) == 0 {
		return nil, fmt.Errorf("no call completed in %v", cfg.duration)
	}
	r := &result{
		Model: cfg.model.String(), Backend: rec.back, Tokens: cfg.tokens, Concurrency: cfg.concurrency,
		Calls: len(all), Elapsed: elapsed,
		CallsPerSec: float64(len(all)) / elapsed.Seconds(),
		TokensPerS:  float64(len(all)*cfg.tokens) / elapsed.Seconds(),
		P50:         percentile(all, 0.5), P90: percentile(all, 0.9), P99: percentile(all, 0.99), Max: all[len(all)-1],
		KernelP50: percentile(sortedCopy(rec.kernel), 0.5), QueueP50: percentile(sortedCopy(rec.queue), 0.5),
	}
	return r, nil
}

func (r *recorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.all)
}

// print writes the summary: aligned text, or JSON with -json.
func (r *result) print(w io.Writer, cfg config) error {
	if cfg.jsonOut {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(r)
	}
	ms := func(d time.Duration) string { return fmt.Sprintf("%.3f ms", float64(d)/1e6) }
	_, err := fmt.Fprintf(w, `model        %s
backend      %s
tokens/call  %d
concurrency  %d
calls        %d in %.2fs
calls/s      %.1f
tokens/s     %.0f
latency      p50 %s  p90 %s  p99 %s  max %s
server       kernel p50 %s  queue p50 %s
`, r.Model, r.Backend, r.Tokens, r.Concurrency, r.Calls, r.Elapsed.Seconds(), r.CallsPerSec, r.TokensPerS,
		ms(r.P50), ms(r.P90), ms(r.P99), ms(r.Max), ms(r.KernelP50), ms(r.QueueP50))
	return err
}
