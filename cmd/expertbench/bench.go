package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/internal/clip"
	"github.com/expertd/expertd/internal/durstat"
	"github.com/expertd/expertd/kernels/cuda"
)

// requestsPerWorker distinct requests each client cycles through, so the
// server sees varying tokens without the generator paying for fresh random
// data on every call.
const requestsPerWorker = 4

// recorder collects latencies from the workers.
type recorder struct {
	mu     sync.Mutex
	window []time.Duration // since the last progress line
	all    []time.Duration
	calls  []callSample
	back   string
}

// callSample is one call as the client saw it and as the server timed it.
type callSample struct {
	latency time.Duration
	send    time.Duration // client: marshal the request, hand it to gRPC
	server  client.Timings
	// reqBytes and respBytes are the messages' wire sizes.
	reqBytes, respBytes int
}

func (r *recorder) add(d time.Duration, res *client.FusedMoEResult, ct *callTrace) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.window = append(r.window, d)
	r.all = append(r.all, d)
	cs := callSample{latency: d, send: ct.send(), server: res.Timings}
	cs.reqBytes, cs.respBytes = ct.sizes()
	r.calls = append(r.calls, cs)
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
	TotalP50    time.Duration `json:"server_total_p50_ns"`
	Stream      bool          `json:"stream"`
	Inflight    int           `json:"inflight"`
	Conns       int           `json:"conns"`
	RTT         rttPair       `json:"rtt"`
	QueueP50    time.Duration `json:"queue_p50_ns"`
	Breakdown   breakdown     `json:"breakdown"`
}

// rttPair is the round trips measured before the load: a bare grpc-go
// server in the generator's process, and the daemon's health service.
type rttPair struct {
	Bare   rtt `json:"bare_grpc"`
	Daemon rtt `json:"daemon_health"`
}

// breakdown is one call's time by phase: the median of each phase over
// the calls, and the medians of the per-call differences that no single
// clock measures. The medians do not add up exactly; each is its own
// distribution.
type breakdown struct {
	// Client is the latency the caller sees; Send the part of it spent
	// marshalling the request and handing it to gRPC (the client's
	// encode).
	Client time.Duration `json:"client_ns"`
	Send   time.Duration `json:"send_ns"`
	// The server's Timings: Receive (reading and unmarshalling the
	// request, before the handler), then Decode (validation), Queue, H2D,
	// Kernel, D2H, and Total from the handler's start to the response
	// built.
	Receive time.Duration `json:"receive_ns"`
	Decode  time.Duration `json:"decode_ns"`
	Queue   time.Duration `json:"queue_ns"`
	H2D     time.Duration `json:"h2d_ns"`
	Kernel  time.Duration `json:"kernel_ns"`
	D2H     time.Duration `json:"d2h_ns"`
	Total   time.Duration `json:"server_total_ns"`
	// RPC is Client - Total: everything outside the handler, i.e. both
	// messages' encoding, transfer and decoding (Receive is part of it).
	RPC time.Duration `json:"rpc_ns"`
	// Service is Total - Kernel: what the handler adds to the backend.
	Service time.Duration `json:"service_ns"`
	// OverheadPct is the median over calls of (Client - Kernel) / Kernel
	// in percent: what the whole service path adds to backend time.
	OverheadPct float64 `json:"overhead_pct"`
	// RequestBytes and ResponseBytes are the median wire sizes.
	RequestBytes  int `json:"request_bytes"`
	ResponseBytes int `json:"response_bytes"`
}

// summarize computes the breakdown of the calls.
func summarize(calls []callSample) breakdown {
	p50 := func(f func(c callSample) time.Duration) time.Duration {
		v := make([]time.Duration, len(calls))
		for i, c := range calls {
			v[i] = f(c)
		}
		slices.Sort(v)
		return durstat.Percentile(v, 0.5)
	}
	b := breakdown{
		Client:        p50(func(c callSample) time.Duration { return c.latency }),
		Send:          p50(func(c callSample) time.Duration { return c.send }),
		Receive:       p50(func(c callSample) time.Duration { return c.server.Receive }),
		Decode:        p50(func(c callSample) time.Duration { return c.server.Decode }),
		Queue:         p50(func(c callSample) time.Duration { return c.server.Queue }),
		H2D:           p50(func(c callSample) time.Duration { return c.server.H2D }),
		Kernel:        p50(func(c callSample) time.Duration { return c.server.Kernel }),
		D2H:           p50(func(c callSample) time.Duration { return c.server.D2H }),
		Total:         p50(func(c callSample) time.Duration { return c.server.Total }),
		RPC:           p50(func(c callSample) time.Duration { return c.latency - c.server.Total }),
		Service:       p50(func(c callSample) time.Duration { return c.server.Total - c.server.Kernel }),
		RequestBytes:  int(p50(func(c callSample) time.Duration { return time.Duration(c.reqBytes) })),
		ResponseBytes: int(p50(func(c callSample) time.Duration { return time.Duration(c.respBytes) })),
	}
	pct := make([]float64, 0, len(calls))
	for _, c := range calls {
		if c.server.Kernel > 0 {
			pct = append(pct, 100*float64(c.latency-c.server.Kernel)/float64(c.server.Kernel))
		}
	}
	if len(pct) > 0 {
		slices.Sort(pct)
		b.OverheadPct = pct[(len(pct)-1)/2]
	}
	return b
}

// afterWorkerSetup runs after each caller's setup; tests make setup slow
// with it.
var afterWorkerSetup = func() {}

// bench runs the load and summarizes it. The first failed call ends the
// run with its error: a load generator whose calls fail is measuring the
// wrong thing.
func bench(ctx context.Context, c *client.Client, cfg config, stderr io.Writer) (*result, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var (
		rec    recorder
		issued atomic.Int64
		wg     sync.WaitGroup
		// The clock starts once every caller is set up: opening the GPU
		// library and registering regions and rings takes up to seconds,
		// which are neither calls nor time the callers could have called in.
		start, deadline time.Time
		workers         []func()
	)
	var gpu *cuda.Backend
	if cfg.cudaIPC {
		var err error
		if gpu, err = openGPU(cfg.cudaLib); err != nil {
			return nil, fmt.Errorf("-cuda-ipc: %w", err)
		}
		defer gpu.Close()
	}
	conns := []*client.Client{c}
	for range cfg.conns - 1 {
		more, err := cfg.dial.Connect(ctx, cfg.extraDial...)
		if err != nil {
			return nil, fmt.Errorf("-conns: %w", err)
		}
		defer more.Close()
		conns = append(conns, more)
	}
	for w := range cfg.concurrency {
		c := conns[w%len(conns)]
		rng := rand.New(rand.NewPCG(cfg.seed, uint64(w)+1))
		reqs := make([]*client.FusedMoERequest, requestsPerWorker)
		for i := range reqs {
			reqs[i] = cfg.model.request(rng, cfg.set, cfg.tokens, cfg.out, cfg.fp8Hidden)
		}
		if cfg.shm {
			free, err := toSharedMemory(ctx, c, w, reqs, cfg)
			if err != nil {
				return nil, fmt.Errorf("-shm: %w", err)
			}
			defer free()
		}
		if cfg.cudaIPC {
			free, err := toCUDAIPC(ctx, c, gpu, w, reqs, cfg, stderr)
			if err != nil {
				return nil, fmt.Errorf("-cuda-ipc: %w", err)
			}
			defer free()
		}
		call := c.FusedMoE
		if cfg.ring {
			r, free, err := openRing(ctx, c, w, reqs, cfg)
			if err != nil {
				return nil, fmt.Errorf("-ring: %w", err)
			}
			defer free()
			call = r.FusedMoE
		}
		afterWorkerSetup()
		if cfg.stream {
			workers = append(workers, func() {
				if err := streamWorker(ctx, c, cfg, reqs, deadline, &issued, &rec); err != nil {
					cancel(err)
				}
			})
			continue
		}
		workers = append(workers, func() {
			for i := 0; ; i++ {
				if ctx.Err() != nil || time.Now().After(deadline) {
					return
				}
				if cfg.calls > 0 && issued.Add(1) > int64(cfg.calls) {
					return
				}
				callCtx, callCancel := cfg.dial.Call(ctx)
				callCtx, ct := withTrace(callCtx)
				t0 := time.Now()
				res, err := call(callCtx, reqs[i%len(reqs)])
				d := time.Since(t0)
				callCancel()
				if err != nil {
					cancel(fmt.Errorf("FusedMoE call failed after %d calls: %w", rec.count(), err))
					return
				}
				rec.add(d, res, ct)
				res.Release() // only its timings are kept
			}
		})
	}
	start = time.Now()
	deadline = start.Add(cfg.duration)
	for _, run := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			run()
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
				durstat.Percentile(s, 0.5).Round(time.Microsecond), durstat.Percentile(s, 0.99).Round(time.Microsecond))
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
		P50:         durstat.Percentile(all, 0.5), P90: durstat.Percentile(all, 0.9), P99: durstat.Percentile(all, 0.99), Max: all[len(all)-1],
	}
	r.Breakdown = summarize(rec.calls)
	r.KernelP50, r.QueueP50, r.TotalP50 = r.Breakdown.Kernel, r.Breakdown.Queue, r.Breakdown.Total
	r.Stream, r.Inflight, r.Conns = cfg.stream, cfg.inflight, cfg.conns
	return r, nil
}

// streamWorker is one caller over a FusedMoEStream, keeping cfg.inflight
// calls in flight: a call's latency runs from its Go to its result.
func streamWorker(ctx context.Context, c *client.Client, cfg config, reqs []*client.FusedMoERequest, deadline time.Time, issued *atomic.Int64, rec *recorder) error {
	// The stream lives for the run; a call it holds past the run's end by
	// more than -timeout ends it.
	ctx, cancel := context.WithDeadline(ctx, deadline.Add(cfg.dial.Timeout))
	defer cancel()
	p, err := c.Pipeline(ctx, cfg.inflight)
	if err != nil {
		return err
	}
	type sent struct {
		call *client.Call
		t0   time.Time
	}
	var fifo []sent
	finish := func() error {
		s := fifo[0]
		fifo = fifo[1:]
		res, err := s.call.Result()
		d := time.Since(s.t0)
		if err != nil {
			return fmt.Errorf("FusedMoEStream call failed after %d calls: %w", rec.count(), err)
		}
		rec.add(d, res, &callTrace{})
		res.Release() // only its timings are kept
		return nil
	}
	for i := 0; ; i++ {
		if ctx.Err() != nil || time.Now().After(deadline) || (cfg.calls > 0 && issued.Add(1) > int64(cfg.calls)) {
			break
		}
		// Waiting here for the oldest keeps inflight calls out, and the
		// latency of each measured by whoever receives it: this caller.
		if len(fifo) == cfg.inflight {
			if err := finish(); err != nil {
				return err
			}
		}
		t0 := time.Now()
		call, err := p.Go(reqs[i%len(reqs)])
		if err != nil {
			return fmt.Errorf("FusedMoEStream send failed after %d calls: %w", rec.count(), err)
		}
		fifo = append(fifo, sent{call, t0})
	}
	for len(fifo) > 0 {
		if err := finish(); err != nil {
			return err
		}
	}
	if ctx.Err() != nil {
		return nil
	}
	return p.Close()
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
	b := r.Breakdown
	_, err := fmt.Fprintf(w, `model        %s
backend      %s
tokens/call  %d
concurrency  %d
calls        %d in %.2fs
calls/s      %.1f
tokens/s     %.0f
mode         %s
latency      p50 %s  p90 %s  p99 %s  max %s
server       kernel p50 %s  total p50 %s  queue p50 %s
rtt          bare grpc-go p50 %s (p90 %s, p99 %s)  daemon health p50 %s (p90 %s, p99 %s)
breakdown    (p50 of each)
  client     %s  (send %s; request %d B, response %d B on the wire)
  server     receive %s  decode %s  queue %s  h2d %s  kernel %s  d2h %s  total %s
  overhead   rpc (client - server total) %s  service (server total - kernel) %s  client over kernel +%.1f%%
`, r.Model, clip.To(r.Backend, clip.Quoted), r.Tokens, r.Concurrency, r.Calls, r.Elapsed.Seconds(), r.CallsPerSec, r.TokensPerS,
		r.mode(), ms(r.P50), ms(r.P90), ms(r.P99), ms(r.Max), ms(r.KernelP50), ms(r.TotalP50), ms(r.QueueP50),
		ms(r.RTT.Bare.P50), ms(r.RTT.Bare.P90), ms(r.RTT.Bare.P99), ms(r.RTT.Daemon.P50), ms(r.RTT.Daemon.P90), ms(r.RTT.Daemon.P99),
		ms(b.Client), ms(b.Send), b.RequestBytes, b.ResponseBytes,
		ms(b.Receive), ms(b.Decode), ms(b.Queue), ms(b.H2D), ms(b.Kernel), ms(b.D2H), ms(b.Total),
		ms(b.RPC), ms(b.Service), b.OverheadPct)
	return err
}

// mode says how the calls were made.
func (r *result) mode() string {
	m := "unary FusedMoE"
	if r.Stream {
		m = fmt.Sprintf("FusedMoEStream, %d in flight per caller", r.Inflight)
	}
	if r.Conns > 1 {
		m += fmt.Sprintf(", %d connections", r.Conns)
	}
	return m
}
