package cpu

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// nemotronSet is the full-size Nemotron layer (E=128, K=2688, N=1856,
// 1.28 GB of FP8), built once per process and only by benchmarks.
var nemotronSet = sync.OnceValue(func() *moe.ExpertSet {
	s := kerneltest.Nemotron
	rng := rand.New(rand.NewPCG(11, 12))
	// Quantizing 1.28 G float32 weights would need 5 GB and minutes; the
	// kernels' speed does not depend on the values, so fill the weights
	// with a long random sequence of FP8 codes of randn values instead.
	pattern := make([]uint8, 1<<16+1)
	for i := range pattern {
		pattern[i] = scaling.Float32ToE4M3(float32(rng.NormFloat64() * 100))
	}
	fill := func(n int) []uint8 {
		w := make([]uint8, n)
		for i := 0; i < n; i += copy(w[i:], pattern) {
		}
		return w
	}
	set := &moe.ExpertSet{Activation: s.Activation, E: s.E, K: s.K, N: s.N,
		W13: fill(s.E * s.Rows1() * s.K), W2: fill(s.E * s.K * s.N)}
	var err error
	if set.W13Scale, err = scaling.NewWeightScale(nil, []float32{1.0 / 100}, s.E, s.Rows1(), s.K, [2]int{}); err != nil {
		panic(err)
	}
	if set.W2Scale, err = scaling.NewWeightScale(nil, []float32{1.0 / 100}, s.E, s.K, s.N, [2]int{}); err != nil {
		panic(err)
	}
	return set
})

// BenchmarkNemotron times one full-size Nemotron layer (BF16 hidden states,
// sigmoid+bias routing, dynamic per-token activation scales) at M tokens.
// Run with: go test -run '^$' -bench Nemotron -benchtime 3x ./kernels/cpu/
func BenchmarkNemotron(b *testing.B) {
	s := kerneltest.Nemotron
	set := nemotronSet()
	be := New(kernels.Config{})
	l, err := be.Load(context.Background(), set)
	if err != nil {
		b.Fatal(err)
	}
	for _, m := range []int{1, 16, 256} {
		b.Run(fmt.Sprintf("M=%d", m), func(b *testing.B) {
			// Routing and hidden states from a small case of the same shape.
			_, req := kerneltest.NewCase(rand.New(rand.NewPCG(uint64(m), 1)), s.Scaled(s.K, 8), m)
			cpu0 := cpuSeconds()
			for b.Loop() {
				if _, err := be.FusedMoE(context.Background(), l, req); err != nil {
					b.Fatal(err)
				}
			}
			sec := b.Elapsed().Seconds()
			flops := s.FLOPs(m) * float64(b.N)
			b.ReportMetric(float64(m*b.N)/sec, "tokens/s")
			b.ReportMetric(flops/sec/1e9, "GFLOP/s")
			// Per CPU-second of this process: the figure that holds when
			// other work shares the cores (GFLOP/s = this × cores busy).
			if cpu := cpuSeconds() - cpu0; cpu > 0 {
				b.ReportMetric(flops/cpu/1e9, "GFLOP/cpu-s")
			}
		})
	}
}

//go:noinline
func imulChain(n int, k uint64) uint64 {
	a := uint64(1)
	for range n {
		a *= k // a dependent 64-bit IMUL: 3 cycles of latency on Zen 4/5
	}
	return a
}

var sinkU uint64

// BenchmarkClock estimates the core clock from a chain of dependent IMULs
// (3-cycle latency), for the peak-FLOP arithmetic in docs/perf-notes.md.
// Run with: go test -run '^$' -bench Clock -cpu 1 ./kernels/cpu/
func BenchmarkClock(b *testing.B) {
	const n = 1 << 20
	for b.Loop() {
		sinkU += imulChain(n, 3)
	}
	b.ReportMetric(3*float64(n)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GHz")
}

var sinkF float32

// BenchmarkDot4 is the inner kernel alone on one core, data in L1/L2: the
// scalar ceiling the backend's GEMMs can approach.
func BenchmarkDot4(b *testing.B) {
	const k = 2688
	rng := rand.New(rand.NewPCG(1, 1))
	v := make([]float32, 5*k)
	for i := range v {
		v[i] = float32(rng.NormFloat64())
	}
	for b.Loop() {
		s0, s1, s2, s3 := dot4(v[:k], v[k:2*k], v[2*k:3*k], v[3*k:4*k], v[4*k:])
		sinkF += s0 + s1 + s2 + s3
	}
	b.ReportMetric(8*k*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
}
