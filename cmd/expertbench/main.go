// Command expertbench is a load generator for expertd: c concurrent
// clients call FusedMoE with m tokens per call on a MoE layer of a
// reference model (MOE_SPEC.md section 2), for a bounded time or number of
// calls, and it reports latency percentiles, calls/s and tokens/s, and
// the median breakdown of a call: the client's send (request marshalling),
// the server's Timings (receive, decode, queue, h2d, kernel, d2h, total),
// and from them what the RPC adds (client latency - server total) and
// what the service adds (server total - kernel).
//
//	expertbench -addr 127.0.0.1:50051 -model qwen3 -load -m 64 -c 4 -duration 10s
//
// A progress line goes to stderr once a second; the summary goes to
// stdout. -load first uploads a random layer of the model's shape (scale
// it down with -e, -k and -n); without it, -set names a layer already
// loaded. -scales static gives the layer static per-tensor activation
// scales (scales.go), as bench/peer.py's layers have, instead of dynamic
// ones. Only loopback addresses are accepted unless -allow-remote is
// given. -tls-ca, -tls-cert, -tls-key, -server-name and -token-file reach
// a daemon with TLS and authorization, as in expertd-load.
//
// -stream sends each caller's calls over one FusedMoEStream, with
// -inflight calls in flight on it; -addr unix:///path dials a Unix
// socket. Before the load it measures two round trips, printed beside
// the latencies: a bare grpc-go health server in this process on
// loopback TCP (the floor of any gRPC call on this host) and the
// daemon's health service on the same connection as the calls. -trace
// writes a Go execution trace of the load. -conns spreads the callers
// over several client connections (one by default).
//
// -soak turns it into a soak test (soak.go): three small layers (gated,
// ReLU², block-scaled) called with mixed token counts, a share of
// malformed calls that must be refused with the right code, every good
// response checked against the float64 reference, and the daemon's
// goroutines and memory read from its admin /metrics before, during and
// after; it exits 1 on any wrong answer, unexpected status or growth
// over the thresholds. docs/soak.md has a run and its figures.
//
//	expertbench -soak -addr 127.0.0.1:50051 -admin-addr 127.0.0.1:9090 -c 64 -duration 10m
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"runtime/trace"
	"slices"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/internal/cliflags"
	"github.com/expertd/expertd/internal/clip"
	"github.com/expertd/expertd/moe"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			clip.Fprintf(os.Stderr, "expertbench: %v\n", err)
		}
		if errors.Is(err, errSoakFailed) {
			os.Exit(1)
		}
		os.Exit(2)
	}
}

// Bounds on one run, so that a typo cannot start an endless load.
const (
	maxDuration    = 30 * time.Minute
	maxCalls       = 10_000_000
	maxConcurrency = 256
	maxInflight    = 64
)

// config is a parsed command line.
type config struct {
	dial        cliflags.Dial
	allowRemote bool
	model       model
	tokens      int
	concurrency int
	duration    time.Duration
	calls       int
	load        bool
	maxLoad     int64
	keep        bool
	set         string
	out         moe.DType
	// fp8Hidden sends hidden states as FP8 E4M3 with per-token scales
	// (per token and group in block mode; the layer's a13 with static
	// scales), as the contract's callers do, instead of BF16.
	fp8Hidden bool
	seed      uint64
	progress  time.Duration
	jsonOut   bool
	// shm passes tensors and outputs through shared memory (shm.go).
	shm bool
	// cudaIPC passes them through GPU memory (cudaipc.go), allocated
	// with the kernel library at cudaLib (empty: the default search).
	cudaIPC bool
	cudaLib string
	// ring posts calls through a call ring (ring.go), whose calls poll
	// ringSpin for their completion.
	ring     bool
	ringSpin time.Duration
	// stream sends the calls over one FusedMoEStream per caller, with
	// inflight calls in flight on it (client.Pipeline).
	stream   bool
	inflight int
	// conns is how many client connections the callers take turns on
	// (caller w uses connection w mod conns), dialed with dialOpts.
	conns int
	// extraDial are the client options beyond the flags' (cliflags.Dial
	// Connect) of every connection.
	extraDial []client.Option
	// traceFile receives a Go execution trace of the run.
	traceFile string
	// noRTT skips the round-trip measurements at start.
	noRTT bool
	// k and n are the -k and -n flags as given (0: not given), which
	// -soak applies to all of its sets.
	k, n int
	soak soakConfig
}

func parseFlags(args []string, stderr io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("expertbench", flag.ContinueOnError)
	fs.SetOutput(clip.LineWriter(stderr))
	c.dial.Register(fs, "127.0.0.1:50051", "file holding a bearer token (FusedMoE needs the user role; -load also admin)",
		time.Minute, "each call (a FusedMoEStream's run ends at most this long after -duration)")
	fs.BoolVar(&c.allowRemote, "allow-remote", false, "allow a non-loopback -addr")
	name := fs.String("model", "qwen3", "layer shape: "+strings.Join(modelNames(), ", "))
	e := fs.Int("e", 0, "number of experts E (0: the model's)")
	k := fs.Int("k", 0, "hidden size K (0: the model's)")
	n := fs.Int("n", 0, "intermediate size N (0: the model's)")
	topK := fs.Int("topk", 0, "experts per token (0: the model's)")
	fs.IntVar(&c.tokens, "m", 64, "tokens per call")
	fs.IntVar(&c.concurrency, "c", 4, "concurrent clients")
	fs.DurationVar(&c.duration, "duration", 10*time.Second, fmt.Sprintf("how long to run (at most %v)", maxDuration))
	fs.IntVar(&c.calls, "calls", 0, fmt.Sprintf("stop after this many calls (0: no count limit; at most %d)", maxCalls))
	fs.BoolVar(&c.load, "load", false, "upload a random expert set of the shape first (and unload it at the end)")
	maxLoadGiB := fs.Float64("max-load-gib", 8, "with -load: refuse layers larger than this many GiB (the generator and the server each hold a copy)")
	fs.BoolVar(&c.keep, "keep", false, "with -load: leave the set loaded")
	fs.StringVar(&c.set, "set", "expertbench", "expert set name to call (and to load with -load)")
	out := fs.String("out", "bf16", "output dtype: bf16 or fp32")
	hidden := fs.String("hidden", "bf16", "hidden-state dtype sent: bf16, or fp8 (E4M3 with one scale per token, or per token and block group on block-scaled models, or with -scales static the layer's a13; half the bytes)")
	scales := fs.String("scales", "dynamic", scalesUsage)
	fs.Uint64Var(&c.seed, "seed", uint64(time.Now().UnixNano()), "random seed of weights and tokens")
	fs.DurationVar(&c.progress, "progress", time.Second, "progress line interval on stderr (0: none)")
	fs.BoolVar(&c.jsonOut, "json", false, "print the summary as JSON")
	fs.BoolVar(&c.shm, "shm", false, shmUsage)
	fs.BoolVar(&c.cudaIPC, "cuda-ipc", false, cudaIPCUsage)
	fs.BoolVar(&c.ring, "ring", false, ringUsage)
	fs.DurationVar(&c.ringSpin, "ring-spin", client.DefaultRingSpin, "with -ring: how long a call polls for its completion before it sleeps (negative: sleep at once)")
	fs.StringVar(&c.cudaLib, "cuda-lib", os.Getenv("EXPERTD_LIBRARY_PATH"), "with -cuda-ipc: the kernel library (default $EXPERTD_LIBRARY_PATH; empty: build/libexpertd_cuda.so)")
	fs.BoolVar(&c.stream, "stream", false, "send the calls over one FusedMoEStream per caller instead of unary FusedMoE calls")
	fs.IntVar(&c.inflight, "inflight", 1, "calls in flight per caller on its stream (implies -stream when > 1)")
	fs.StringVar(&c.traceFile, "trace", "", "write a Go execution trace of the load to this file (go tool trace FILE)")
	fs.BoolVar(&c.noRTT, "no-rtt", false, "skip the round trips measured at start (a bare grpc-go server in this process, and the daemon's health service)")
	fs.BoolVar(&c.soak.on, "soak", false, soakUsage)
	fs.Float64Var(&c.soak.badShare, "bad-share", 0.05, "with -soak: share of calls that are malformed (0..1)")
	fs.Float64Var(&c.soak.checkShare, "check-share", 1, "with -soak: share of good responses checked against the float64 reference (0..1)")
	fs.StringVar(&c.soak.adminAddr, "admin-addr", "", "with -soak: the daemon's admin address, to read goroutines and memory from /metrics (empty: no server figures)")
	fs.Float64Var(&c.soak.maxRSSGrowthMiB, "max-rss-growth-mib", 64, "with -soak and -admin-addr: fail when the server's highest RSS in the second half of the load (after the warm-up) exceeds that of the first half by more than this")
	fs.IntVar(&c.soak.maxGoroutineGrowth, "max-goroutine-growth", 16, "with -soak and -admin-addr: fail when the idle server has more goroutines than this over its count before the load")
	fs.DurationVar(&c.soak.warmup, "warmup", 0, "with -soak: load time before RSS samples count toward growth (0: a fifth of -duration, at most 1m)")
	fs.BoolVar(&c.soak.busyOK, "busy-ok", true, "with -soak: count ResourceExhausted on good calls (the daemon's bounded queue) as expected back-pressure")
	fs.IntVar(&c.conns, "conns", 1, "client connections the callers take turns on (caller i uses connection i mod conns): each HTTP/2 connection moves its bytes through one writer and one reader goroutine per side")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	}

	m, ok := models[*name]
	if !ok {
		return c, fmt.Errorf("-model %q: want one of %s", *name, strings.Join(modelNames(), ", "))
	}
	for _, o := range []struct {
		v   int
		dst *int
	}{{*e, &m.e}, {*k, &m.k}, {*n, &m.n}, {*topK, &m.topK}} {
		if o.v != 0 {
			*o.dst = o.v
		}
	}
	if m.e != models[*name].e || m.k != models[*name].k || m.n != models[*name].n {
		m.name += "/scaled"
	}
	if err := m.validate(); err != nil {
		return c, err
	}
	switch *scales {
	case "dynamic":
	case "static":
		switch {
		case m.block != [2]int{}:
			return c, fmt.Errorf("-scales static: %s is block-scaled, whose activations are quantized per token group (dynamic), as bench/peer.py's are", m.name)
		case c.soak.on:
			return c, errors.New("-scales static and -soak: the soak loads its own layers; pick one")
		}
		m.a13 = m.staticA13()
	default:
		return c, fmt.Errorf("-scales %s: want dynamic or static", clip.Quote(*scales))
	}
	c.model = m
	c.k, c.n = *k, *n
	c.maxLoad = int64(*maxLoadGiB * (1 << 30))
	if c.load && m.weightBytes() > c.maxLoad {
		return c, fmt.Errorf("-load: a %v layer is %s, above -max-load-gib %g; scale it with -e, -k, -n or raise the limit",
			m, formatBytes(m.weightBytes()), *maxLoadGiB)
	}

	switch *out {
	case "bf16":
		c.out = moe.BFloat16
	case "fp32":
		c.out = moe.Float32
	default:
		return c, fmt.Errorf("-out %q: want bf16 or fp32", *out)
	}
	switch *hidden {
	case "bf16":
	case "fp8":
		c.fp8Hidden = true
	default:
		return c, fmt.Errorf("-hidden %q: want bf16 or fp8", *hidden)
	}
	var errs []error
	if err := c.dial.Check(); err != nil {
		errs = append(errs, err)
	}
	if c.shm && c.cudaIPC {
		errs = append(errs, errors.New("-shm and -cuda-ipc: pick one"))
	}
	if c.inflight < 1 || c.inflight > maxInflight {
		errs = append(errs, fmt.Errorf("-inflight %d: want 1..%d", c.inflight, maxInflight))
	}
	if c.inflight > 1 {
		c.stream = true
	}
	if c.stream && c.soak.on {
		errs = append(errs, errors.New("-stream and -soak: pick one"))
	}
	if c.tokens < 1 {
		errs = append(errs, fmt.Errorf("-m %d: want >= 1", c.tokens))
	}
	if c.concurrency < 1 || c.concurrency > maxConcurrency {
		errs = append(errs, fmt.Errorf("-c %d: want 1..%d", c.concurrency, maxConcurrency))
	}
	if c.conns < 1 || c.conns > c.concurrency {
		errs = append(errs, fmt.Errorf("-conns %d: want 1..%d (-c)", c.conns, c.concurrency))
	}
	if c.duration <= 0 || c.duration > maxDuration {
		errs = append(errs, fmt.Errorf("-duration %v: want > 0 and <= %v", c.duration, maxDuration))
	}
	if c.soak.badShare < 0 || c.soak.badShare > 1 || c.soak.checkShare < 0 || c.soak.checkShare > 1 {
		errs = append(errs, fmt.Errorf("-bad-share %g, -check-share %g: want 0..1", c.soak.badShare, c.soak.checkShare))
	}
	if c.soak.warmup == 0 {
		c.soak.warmup = min(c.duration/5, time.Minute)
	}
	if c.soak.on && c.soak.adminAddr != "" && !c.allowRemote {
		if err := checkLoopback("admin-addr", c.soak.adminAddr); err != nil {
			errs = append(errs, err)
		}
	}
	if c.calls < 0 || c.calls > maxCalls {
		errs = append(errs, fmt.Errorf("-calls %d: want 0..%d", c.calls, maxCalls))
	}
	if !c.allowRemote {
		if err := checkLoopback("addr", c.dial.Addr); err != nil {
			errs = append(errs, err)
		}
	}
	return c, errors.Join(errs...)
}

func modelNames() []string {
	var names []string
	for n := range models {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// checkLoopback refuses addresses that leave the host: a load generator
// should not be pointed at someone else's server by accident. A Unix
// socket (unix:path, unix:///path) never leaves it.
func checkLoopback(flagName, addr string) error {
	if strings.HasPrefix(addr, "unix:") {
		return nil
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("-%s %q: %w", flagName, addr, err)
	}
	if host == "localhost" {
		return nil
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		return nil
	}
	return fmt.Errorf("-%s %q is not a loopback address; pass -allow-remote to load a remote server", flagName, addr)
}

// run is the whole command.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	cfg.extraDial = []client.Option{client.WithDialOptions(grpc.WithStatsHandler(traceHandler{}))}
	c, err := cfg.dial.Connect(ctx, cfg.extraDial...)
	if err != nil {
		return err
	}
	defer c.Close()

	if cfg.soak.on {
		res, err := soak(ctx, c, cfg, stderr)
		if res != nil {
			if perr := res.print(stdout, cfg); perr != nil && err == nil {
				err = perr
			}
		}
		return err
	}
	if !cfg.load && cfg.model.a13 > 0 {
		if err := checkStaticSet(ctx, c, cfg); err != nil {
			return err
		}
	}
	if cfg.load {
		if err := loadSet(ctx, c, cfg, stderr); err != nil {
			return err
		}
		if !cfg.keep {
			defer func() {
				unloadCtx, cancel := cfg.dial.Call(context.Background())
				defer cancel()
				if _, err := c.UnloadExperts(unloadCtx, cfg.set); err != nil {
					clip.Fprintf(stderr, "expertbench: unloading: %v\n", err)
				}
			}()
		}
	}
	var rtts rttPair
	if !cfg.noRTT {
		if rtts.Bare, err = bareRTT(ctx, cfg.dial.Timeout); err != nil {
			return fmt.Errorf("bare grpc-go round trip: %w", err)
		}
		if rtts.Daemon, err = checkRTT(ctx, c.Conn(), cfg.dial.Timeout); err != nil {
			return fmt.Errorf("daemon round trip: %w", err)
		}
	}
	if cfg.traceFile != "" {
		f, err := os.Create(cfg.traceFile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := trace.Start(f); err != nil {
			return fmt.Errorf("-trace: %w", err)
		}
		defer trace.Stop()
	}
	res, err := bench(ctx, c, cfg, stderr)
	if err != nil {
		return err
	}
	res.RTT = rtts
	return res.print(stdout, cfg)
}

// loadSet uploads a random layer of the configured shape, with a progress
// line for large sets.
func loadSet(ctx context.Context, c *client.Client, cfg config, stderr io.Writer) error {
	start := time.Now()
	w := cfg.model.randomWeights(cfg.seed)
	fmt.Fprintf(stderr, "expertbench: generated %s of random weights for %v in %v\n",
		formatBytes(cfg.model.weightBytes()), cfg.model, time.Since(start).Round(time.Millisecond))
	start = time.Now()
	last := start
	ctx, cancel := cfg.dial.Call(ctx)
	defer cancel()
	info, err := c.LoadExperts(ctx, cfg.set, w, client.Overwrite(), client.OnProgress(func(p client.Progress) {
		if time.Since(last) >= time.Second {
			last = time.Now()
			clip.Fprintf(stderr, "expertbench: loading %s: %s of %s\n", cfg.set, formatBytes(p.SentBytes), formatBytes(p.TotalBytes))
		}
	}))
	if err != nil {
		return err
	}
	secs := time.Since(start).Seconds()
	clip.Fprintf(stderr, "expertbench: loaded %s (%s) in %.2fs, %.0f MB/s, on %s\n",
		info.Name, formatBytes(info.Bytes), secs, float64(info.Bytes)/secs/1e6, info.Backend)
	return nil
}

func formatBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}
