package client_test

import (
	"context"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/internal/durstat"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/service"
)

// BenchmarkRingPath times one caller's FusedMoE calls through a call ring
// on a backend that computes nothing, at the Nemotron layer's call shape
// (E = 128, K = 2688, top_k 6; the experts' N is cut to 16 since no
// weights are read), M = 1 and 256: the ring's and the daemon's Go side
// of a call, which a GPU call pays on top of the library's own host
// work. inline posts the tensors in the slot; shm places hidden states,
// logits and output in the registered region, as a same-host engine
// does. The server batches and records metrics as the daemon does by
// default. It reports the client latency's p50 and p99 and the median of
// the server's total time; -benchmem's allocs/op counts both sides (one
// process).
//
//	go test -run '^$' -bench RingPath -benchmem -benchtime 20000x ./client
func BenchmarkRingPath(b *testing.B) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(3, 4))
	shape := kerneltest.Nemotron.Scaled(kerneltest.Nemotron.K, 16)
	// The daemon records its metrics with the OpenTelemetry SDK, which
	// costs what a no-op meter does not.
	meter := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader())).Meter("bench")
	srv := serveNull(b, service.Config{SharedMemory: true, Ring: true, RingSpin: time.Second, MaxConcurrent: 4, BatchWindow: service.SuggestedBatchWindow,
		Meter: meter})
	c, err := client.Dial(ctx, srv.Addr)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	for _, m := range []int{1, 256} {
		set, kreq := kerneltest.NewCase(rng, shape, m, kerneltest.WithOutput(moe.BFloat16))
		name := ringLayer + strconv.Itoa(m)
		if _, err := c.LoadExperts(ctx, name, clienttest.Weights(set), client.Overwrite()); err != nil {
			b.Fatal(err)
		}
		for _, place := range []string{"inline", "shm"} {
			req := clienttest.Request(name, set, kreq)
			outBytes := int64(m * shape.K * 2)
			slot := int64(64 << 10)
			if place == "inline" {
				slot = int64(len(req.Hidden.Data)+len(req.RouterLogits.Data)) + outBytes + 16<<10
			}
			opts := client.RingOptions{Slots: 1, SlotBytes: int(slot), Spin: time.Second}
			base := (client.RingSize(opts) + 4095) &^ 4095
			shm, err := client.CreateSharedMemory("", base+8<<20)
			if err != nil {
				b.Skip(err)
			}
			b.Cleanup(func() { shm.Close() })
			region, err := c.RegisterSharedMemory(ctx, "bench-"+place+strconv.Itoa(m), shm, 0, shm.Size())
			if err != nil {
				b.Fatal(err)
			}
			if place == "shm" {
				if req.Hidden, err = region.Put(base, req.Hidden); err != nil {
					b.Fatal(err)
				}
				if req.RouterLogits, err = region.Put(base+3<<20, req.RouterLogits); err != nil {
					b.Fatal(err)
				}
				req.OutputShm = region.Ref(base+6<<20, outBytes)
			}
			r, err := c.OpenRing(ctx, region, 0, opts)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { r.Close() })
			b.Run(place+"/m="+strconv.Itoa(m), func(b *testing.B) {
				call := func() time.Duration {
					res, err := r.FusedMoE(ctx, req)
					if err != nil {
						b.Fatal(err)
					}
					t := res.Timings.Total
					res.Release()
					return t
				}
				for range 500 {
					call()
				}
				lat := make([]time.Duration, 0, b.N)
				total := make([]time.Duration, 0, b.N)
				b.ResetTimer()
				for range b.N {
					t0 := time.Now()
					t := call()
					lat = append(lat, time.Since(t0))
					total = append(total, t)
				}
				b.StopTimer()
				b.ReportMetric(durstat.Of(lat, 0.5), "p50-ns")
				b.ReportMetric(durstat.Of(lat, 0.99), "p99-ns")
				b.ReportMetric(durstat.Of(total, 0.5), "server-ns")
			})
		}
	}
}
