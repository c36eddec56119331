// Package cpu is expertd's pure-Go FusedMoE backend: the numerical oracle
// for the GPU backends and the default when no GPU is present.
//
// It computes exactly the op of MOE_SPEC.md section 1. Weights stay FP8 in
// memory and are decoded tile by tile through a 256-entry table into a
// buffer sized for L2; every FP8×FP8 product is exact in float32 and
// accumulation is float32, as on tensor cores. Work is spread over
// goroutines by (expert, weight tile), so one token's handful of experts
// still uses every core.
package cpu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

func init() {
	kernels.Register("cpu", func(cfg kernels.Config) (kernels.Backend, error) { return New(cfg), nil })
}

// Backend is the CPU backend. It is safe for concurrent use; each call
// spreads over the configured number of goroutines.
type Backend struct {
	workers int
	// chunk is the most tokens per pipeline pass (maxChunk; tests lower it).
	chunk int
}

// New returns a CPU backend using cfg.Threads goroutines per call
// (GOMAXPROCS when 0).
func New(cfg kernels.Config) *Backend {
	w := cfg.Threads
	if w <= 0 {
		w = runtime.GOMAXPROCS(0)
	}
	return &Backend{workers: w, chunk: maxChunk}
}

// Name implements kernels.Backend.
func (b *Backend) Name() string { return "cpu" }

// Capabilities implements kernels.Backend: both activations, every
// granularity, no token limit.
func (b *Backend) Capabilities() kernels.Capabilities {
	return kernels.Capabilities{
		Activations:   []moe.Activation{moe.SiluGated, moe.Relu2, moe.SwigluOAI, moe.GeluTanhGated, moe.GeluGated},
		Granularities: []scaling.Granularity{scaling.PerTensor, scaling.PerExpert, scaling.PerChannel, scaling.Block},
		Devices:       []string{fmt.Sprintf("%s (%d threads, pure Go, %s dot products)", cpuModel(), b.workers, simdKernel)},
	}
}

// cpuModel is the first "model name" of /proc/cpuinfo, or GOARCH.
func cpuModel() string {
	data, err := os.ReadFile("/proc/cpuinfo")
	if err == nil {
		for _, line := range strings.Split(string(data), "\n") {
			if name, ok := strings.CutPrefix(line, "model name"); ok {
				return strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(name), ":"))
			}
		}
	}
	return runtime.GOARCH
}

// errClosed is returned for calls on a closed set.
var errClosed = errors.New("cpu: expert set is closed")

// loaded is an expert set held in host memory. The RWMutex lets Close wait
// for calls in flight.
type loaded struct {
	mu     sync.RWMutex
	set    *moe.ExpertSet
	closed bool
}

func (l *loaded) Set() *moe.ExpertSet { return l.set }

func (l *loaded) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	l.set = &moe.ExpertSet{Activation: l.set.Activation, E: l.set.E, K: l.set.K, N: l.set.N}
	return nil
}

// Load implements kernels.Backend. The CPU backend computes straight from
// the set's FP8 slices, so loading copies nothing.
func (b *Backend) Load(ctx context.Context, set *moe.ExpertSet) (kernels.Loaded, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return &loaded{set: set}, nil
}

// errDevice refuses device tensors: the service gives them only to
// backends that open CUDA IPC memory, which this one cannot, so one
// reaching it is a service bug to report rather than a pointer to follow.
var errDevice = fmt.Errorf("cpu: %w: a tensor or the output is in device memory (CUDA IPC); the cpu backend computes on host memory only", kernels.ErrUnsupported)

// FusedMoE implements kernels.Backend.
func (b *Backend) FusedMoE(ctx context.Context, set kernels.Loaded, req *moe.Request) (*moe.Result, error) {
	if req.Hidden.Dev != 0 || req.Logits.Dev != 0 || req.OutDev != 0 {
		return nil, errDevice
	}
	l, ok := set.(*loaded)
	if !ok {
		return nil, fmt.Errorf("cpu: expert set %T was not loaded by this backend", set)
	}
	l.mu.RLock()
	defer l.mu.RUnlock()
	if l.closed {
		return nil, errClosed
	}
	start := time.Now()
	res, err := b.run(ctx, l.set, req)
	if err != nil {
		return nil, fmt.Errorf("cpu: fused moe: %w", err)
	}
	res.KernelNanos = time.Since(start).Nanoseconds()
	return res, nil
}

// BatchInvariant reports whether a token's output is bit-identical however
// many other tokens share its call, so that merging calls (the service's
// dynamic batching) cannot change a result. It holds for the default
// build. With GOEXPERIMENT=simd on an AVX-512 CPU the decoded-tile dot
// products sum in a different order from the per-code ones used for
// experts with a single token, so results differ by float32 rounding
// (within the usual tolerance) depending on how tokens share experts.
func BatchInvariant() bool { return simdKernel == "scalar" }

// Close implements kernels.Backend; the CPU backend holds no resources.
func (b *Backend) Close() error { return nil }
