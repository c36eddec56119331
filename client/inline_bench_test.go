package client_test

import (
	"context"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/internal/durstat"
	"github.com/expertd/expertd/internal/testdaemon"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// serveNull starts an in-process daemon with cfg on a backend that
// computes nothing, stopped when b ends.
func serveNull(b *testing.B, cfg service.Config) *testdaemon.Server {
	srv, err := testdaemon.ServeBackend(cfg, servicetest.NullBackend{Backend: cpu.New(kernels.Config{})})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(srv.Stop)
	return srv
}

// BenchmarkInlinePath times unary FusedMoE calls with inline tensors over
// loopback TCP on a backend that computes nothing, at the Nemotron
// layer's M = 256 call (K = 2688, E = 128, top_k 6; BF16 hidden states
// and FP32 logits in, 1.5 MB; BF16 out, 1.4 MB): the transport's share
// of a large inline call on both sides, with the daemon's server options
// and the SDK's dial options. c=1 is one caller (the client latency's p50
// and p90, and the median of the server's total, so outside-ns is what
// the socket, gRPC and both codecs add); c=8 is eight callers on one
// connection or on eight, reporting tokens/s. Every result is released,
// as an engine calling a layer in a loop does. Both sides share one
// process, so -benchmem counts both.
//
//	go test -run '^$' -bench InlinePath -benchmem -benchtime 400x ./client
func BenchmarkInlinePath(b *testing.B) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(5, 6))
	const m = 256
	shape := kerneltest.Nemotron.Scaled(kerneltest.Nemotron.K, 16)
	srv := serveNull(b, service.Config{MaxConcurrent: 8, BatchWindow: service.SuggestedBatchWindow})
	set, kreq := kerneltest.NewCase(rng, shape, m, kerneltest.WithOutput(moe.BFloat16))
	req := clienttest.Request("inline", set, kreq)
	var conns [8]*client.Client
	for i := range conns {
		c, err := client.Dial(ctx, srv.Addr)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { c.Close() })
		conns[i] = c
	}
	if _, err := conns[0].LoadExperts(ctx, "inline", clienttest.Weights(set)); err != nil {
		b.Fatal(err)
	}

	b.Run("c=1", func(b *testing.B) {
		lat := make([]time.Duration, 0, b.N)
		total := make([]time.Duration, 0, b.N)
		b.ResetTimer()
		for range b.N {
			start := time.Now()
			res, err := conns[0].FusedMoE(ctx, req)
			if err != nil {
				b.Fatal(err)
			}
			lat = append(lat, time.Since(start))
			total = append(total, res.Timings.Total)
			res.Release()
		}
		b.StopTimer()
		p50, srvTotal := durstat.Of(lat, 0.5), durstat.Of(total, 0.5)
		b.ReportMetric(p50, "p50-ns")
		b.ReportMetric(durstat.Of(lat, 0.9), "p90-ns")
		b.ReportMetric(srvTotal, "server-ns")
		b.ReportMetric(p50-srvTotal, "outside-ns")
	})
	for _, n := range []int{1, 8} {
		b.Run("c=8/conns="+strconv.Itoa(n), func(b *testing.B) {
			var next atomic.Int64
			var wg sync.WaitGroup
			errs := make(chan error, 8)
			b.ResetTimer()
			start := time.Now()
			for w := range 8 {
				wg.Go(func() {
					c := conns[w%n]
					for next.Add(1) <= int64(b.N) {
						res, err := c.FusedMoE(ctx, req)
						if err != nil {
							errs <- err
							return
						}
						res.Release()
					}
				})
			}
			wg.Wait()
			elapsed := time.Since(start)
			b.StopTimer()
			close(errs)
			if err := <-errs; err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(b.N*m)/elapsed.Seconds(), "tokens/s")
		})
	}
}
