package main

import (
	"context"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/stats"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/codec"
	"github.com/expertd/expertd/internal/durstat"
	"github.com/expertd/expertd/internal/testdaemon"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// BenchmarkCallPath splits a tiny FusedMoE call's latency (Nemotron-like
// ReLU², E = 4, K = 64, N = 32, M = 1 on the CPU backend, where compute
// is a few microseconds) by layer, in one process over loopback TCP, so
// each variant's p50 minus the one before is what that layer adds:
//
//	bare       a health check on a plain grpc.NewServer (the floor)
//	health     the daemon's health service through the SDK's connection
//	service    FusedMoE on a server with only the service's options (no
//	           logging, recovery, selector or OpenTelemetry), SDK client
//	null/...   FusedMoE on a backend that computes nothing: through the
//	           SDK (with and without retries), the generated stub, a
//	           client.Pipeline, and the daemon's server with its
//	           interceptors and OpenTelemetry (chain, at each log level,
//	           and with -stream-workers)
//	null/m256  M = 256 at K = 2688 (1.4 MB each way), TCP and Unix socket,
//	           unary and stream, each call split into stages (below),
//	           and socket: the same bytes echoed over a bare connection
//	daemon     FusedMoE on the real daemon (run, -log-level as given by
//	           the sub-benchmark), SDK client
//	stream     the same over a client.Pipeline of depth 1
//
// Each reports the client latency's p50-ns and p90-ns (ns/op is its
// mean) and the medians of the server's kernel time, of what its handler
// adds (handler-ns: total - kernel) and of everything outside the
// handler (outside-ns: latency - total: both sides' gRPC, the SDK,
// loopback, wake-ups). The m256 variants also report the medians of
// stages of a call, from the stats handlers of both sides (one process,
// one clock): send-ns (the SDK's request build and marshal, until gRPC
// has queued the message), req-ns (the request on the wire, read and
// unmarshalled by the server), serve-ns (the handler, until its
// response is queued), resp-ns (the response's bytes on the wire, read
// and unmarshalled by the client) and result-ns (the SDK's result).
//
//	go test -run '^$' -bench CallPath -benchtime 3000x ./cmd/expertd
func BenchmarkCallPath(b *testing.B) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(1, 2))
	const e, k, n, m = 4, 64, 32, 1
	w := relu2Weights(rng, k, n)
	req := &client.FusedMoERequest{
		ExpertSet: "layer", Hidden: client.BFloat16FromFloat32(randF32(rng, m*k), m, k),
		RouterLogits: client.FromFloat32(randF32(rng, m*e), m, e), Routing: client.Routing{TopK: 2}, OutputDType: moe.BFloat16,
	}
	dial := func(b *testing.B, addr string) *client.Client {
		c, err := client.Dial(ctx, addr)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { c.Close() })
		if _, err := c.LoadExperts(ctx, "layer", w, client.Overwrite()); err != nil {
			b.Fatal(err)
		}
		return c
	}
	daemon := func(b *testing.B, level string) string {
		dctx, cancel := context.WithCancel(ctx)
		ready := make(chan listening, 1)
		done := make(chan error, 1)
		args := []string{"-listen", "127.0.0.1:0", "-admin-addr", "", "-backend", "cpu", "-threads", "1", "-log-level", level}
		go func() { done <- run(dctx, args, func(string) string { return "" }, io.Discard, ready) }()
		b.Cleanup(func() { cancel(); <-done })
		select {
		case a := <-ready:
			return a.grpc
		case err := <-done:
			b.Fatal(err)
		}
		return ""
	}
	// measureStages times call, which returns the server's Timings (zero
	// for health checks), and, with st, splits each call at the points
	// both sides' stats handlers see.
	measureStages := func(b *testing.B, st *stages, call func() (client.Timings, error)) {
		var d, outside, handler, kernel []time.Duration
		var split [numStages][]time.Duration
		for range 200 { // warm-up: connections, pools
			if _, err := call(); err != nil {
				b.Fatal(err)
			}
		}
		b.ResetTimer()
		for range b.N {
			t0 := time.Now()
			t, err := call()
			if err != nil {
				b.Fatal(err)
			}
			end := time.Now()
			l := end.Sub(t0)
			if st != nil {
				for i, v := range st.split(t0, end) {
					split[i] = append(split[i], v)
				}
			}
			d = append(d, l)
			outside = append(outside, l-t.Total)
			handler = append(handler, t.Total-t.Kernel)
			kernel = append(kernel, t.Kernel)
		}
		b.StopTimer()
		p := durstat.Of
		b.ReportMetric(p(d, 0.5), "p50-ns")
		b.ReportMetric(p(d, 0.9), "p90-ns")
		b.ReportMetric(p(kernel, 0.5), "kernel-ns")
		b.ReportMetric(p(handler, 0.5), "handler-ns")
		b.ReportMetric(p(outside, 0.5), "outside-ns")
		if st != nil {
			for i, name := range stageNames {
				b.ReportMetric(p(split[i], 0.5), name+"-ns")
			}
		}
	}
	measure := func(b *testing.B, call func() (client.Timings, error)) { measureStages(b, nil, call) }
	check := func(conn grpc.ClientConnInterface) func() (client.Timings, error) {
		hc := healthpb.NewHealthClient(conn)
		return func() (client.Timings, error) {
			_, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
			return client.Timings{}, err
		}
	}
	timed := func(res *client.FusedMoEResult, err error) (client.Timings, error) {
		if err != nil {
			return client.Timings{}, err
		}
		defer res.Release()
		return res.Timings, nil
	}
	fused := func(c *client.Client) func() (client.Timings, error) {
		return func() (client.Timings, error) { return timed(c.FusedMoE(ctx, req)) }
	}

	b.Run("bare", func(b *testing.B) {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		gs := grpc.NewServer()
		healthpb.RegisterHealthServer(gs, health.NewServer())
		go gs.Serve(lis) //nolint:errcheck // returns when stopped
		b.Cleanup(gs.Stop)
		conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { conn.Close() })
		measure(b, check(conn))
	})
	b.Run("health", func(b *testing.B) {
		measure(b, check(dial(b, daemon(b, "warn")).Conn()))
	})
	// null: no compute, so the kernel's allocations and goroutines (the
	// CPU backend's, not a GPU's) do not disturb the path measured.
	for _, v := range []struct {
		name string
		opts []client.Option
		call func(*client.Client) func() (client.Timings, error)
	}{
		{"sdk", nil, fused},
		{"sdk-no-retry", []client.Option{client.WithMaxAttempts(1)}, fused},
		{"stub", nil, func(c *client.Client) func() (client.Timings, error) {
			msg := &pb.FusedMoERequest{
				Experts:      &pb.FusedMoERequest_ExpertSet{ExpertSet: "layer"},
				HiddenStates: tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(randF32(rng, m*k)...), m, k),
				RouterLogits: tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(randF32(rng, m*e)...), m, e),
				Routing:      &pb.Routing{TopK: 2},
			}
			return func() (client.Timings, error) {
				resp, err := c.RPC().FusedMoE(ctx, msg)
				t := resp.GetTimings()
				return client.Timings{Kernel: time.Duration(t.GetKernelNanos()), Total: time.Duration(t.GetTotalNanos())}, err
			}
		}},
		{"stream", nil, func(c *client.Client) func() (client.Timings, error) {
			p, err := c.Pipeline(ctx, 1)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { p.Close() })
			return func() (client.Timings, error) { return timed(p.Call(req)) }
		}},
	} {
		b.Run("null/"+v.name, func(b *testing.B) {
			srv, err := testdaemon.ServeBackend(service.Config{MaxConcurrent: 4, BatchWindow: service.SuggestedBatchWindow}, servicetest.NullBackend{Backend: cpu.New(kernels.Config{Threads: 1})})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(srv.Stop)
			c, err := client.Dial(ctx, srv.Addr, v.opts...)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { c.Close() })
			if _, err := c.LoadExperts(ctx, "layer", w); err != nil {
				b.Fatal(err)
			}
			measure(b, v.call(c))
		})
	}
	// null/m256: M = 256 BF16 hidden states at Nemotron's K = 2688 (1.4 MB
	// each way) on the null backend, over loopback TCP and a Unix socket,
	// unary and streamed: the transport's share of a large inline call.
	const bigK, bigM = 2688, 256
	bigW := relu2Weights(rng, bigK, 32)
	bigReq := &client.FusedMoERequest{
		ExpertSet: "layer", Hidden: client.BFloat16FromFloat32(randF32(rng, bigM*bigK), bigM, bigK),
		RouterLogits: client.FromFloat32(randF32(rng, bigM*e), bigM, e), Routing: client.Routing{TopK: 2}, OutputDType: moe.BFloat16,
	}
	for _, network := range []string{"tcp", "unix"} {
		listen := func(b *testing.B) net.Listener {
			addr := "127.0.0.1:0"
			if network == "unix" {
				dir, err := os.MkdirTemp("", "expertd-bench")
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { os.RemoveAll(dir) })
				addr = filepath.Join(dir, "s.sock")
			}
			lis, err := net.Listen(network, addr)
			if err != nil {
				b.Fatal(err)
			}
			return lis
		}
		// null/m256/*/socket: the same bytes each way over a bare
		// connection of the same kind, written in chunks of gRPC's write
		// buffer and echoed: the socket's floor under the gRPC variants.
		b.Run("null/m256/"+network+"/socket", func(b *testing.B) {
			lis := listen(b)
			b.Cleanup(func() { lis.Close() })
			size := len(bigReq.Hidden.Data)
			go func() {
				conn, err := lis.Accept()
				if err != nil {
					return
				}
				defer conn.Close()
				buf := make([]byte, size)
				for {
					if _, err := io.ReadFull(conn, buf); err != nil {
						return
					}
					if err := writeChunks(conn, buf, codec.IOBufferBytes); err != nil {
						return
					}
				}
			}()
			conn, err := net.Dial(network, lis.Addr().String())
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { conn.Close() })
			in := make([]byte, size)
			measure(b, func() (client.Timings, error) {
				if err := writeChunks(conn, bigReq.Hidden.Data, codec.IOBufferBytes); err != nil {
					return client.Timings{}, err
				}
				_, err := io.ReadFull(conn, in)
				return client.Timings{}, err
			})
		})
		for _, stream := range []bool{false, true} {
			name := "null/m256/" + network + "/unary"
			if stream {
				name = "null/m256/" + network + "/stream"
			}
			b.Run(name, func(b *testing.B) {
				lis := listen(b)
				svc := service.New(service.Config{MaxConcurrent: 4, BatchWindow: service.SuggestedBatchWindow, MaxTokens: 8192},
					servicetest.NullBackend{Backend: cpu.New(kernels.Config{Threads: 1})}, nil)
				st := &stages{}
				gs := grpc.NewServer(append(svc.ServerOptions(), grpc.MaxRecvMsgSize(64<<20), grpc.MaxSendMsgSize(64<<20),
					grpc.StatsHandler(stageHandler{st, true}))...)
				svc.Register(gs)
				go gs.Serve(lis) //nolint:errcheck // returns when stopped
				b.Cleanup(gs.Stop)
				c, err := client.Dial(ctx, grpcTarget(lis.Addr()), client.WithDialOptions(grpc.WithStatsHandler(stageHandler{st, false})))
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { c.Close() })
				if _, err := c.LoadExperts(ctx, "layer", bigW); err != nil {
					b.Fatal(err)
				}
				call := func() (client.Timings, error) { return timed(c.FusedMoE(ctx, bigReq)) }
				if stream {
					p, err := c.Pipeline(ctx, 1)
					if err != nil {
						b.Fatal(err)
					}
					b.Cleanup(func() { p.Close() })
					call = func() (client.Timings, error) { return timed(p.Call(bigReq)) }
				}
				measureStages(b, st, call)
			})
		}
	}
	// null/chain: the daemon's own server (newGRPCServer: logging,
	// recovery, selector, OpenTelemetry metrics) on the null backend.
	for _, v := range []struct {
		name string
		args []string
	}{
		{"log=info", []string{"-log-level", "info"}},
		{"log=warn", []string{"-log-level", "warn"}},
		{"log=warn/stream-workers=4", []string{"-log-level", "warn", "-stream-workers", "4"}},
	} {
		b.Run("null/chain/"+v.name, func(b *testing.B) {
			cfg, err := parseConfig(v.args, func(string) string { return "" }, io.Discard)
			if err != nil {
				b.Fatal(err)
			}
			log := cfg.logger(io.Discard)
			meters := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
			svc := service.New(service.Config{MaxConcurrent: 4, BatchWindow: service.SuggestedBatchWindow, Meter: meters.Meter("bench")},
				servicetest.NullBackend{Backend: cpu.New(kernels.Config{Threads: 1})}, log)
			gs := newGRPCServer(cfg, log, meters, tracenoop.NewTracerProvider(), svc.ServerOptions()...)
			svc.Register(gs)
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			go gs.Serve(lis) //nolint:errcheck // returns when stopped
			b.Cleanup(gs.Stop)
			measure(b, fused(dial(b, lis.Addr().String())))
		})
	}
	b.Run("service", func(b *testing.B) {
		srv, err := testdaemon.Serve(service.Config{MaxConcurrent: 4, BatchWindow: service.SuggestedBatchWindow})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(srv.Stop)
		measure(b, fused(dial(b, srv.Addr)))
	})
	for _, level := range []string{"info", "warn"} {
		b.Run("daemon/log="+level, func(b *testing.B) {
			measure(b, fused(dial(b, daemon(b, level))))
		})
	}
	b.Run("stream/log=warn", func(b *testing.B) {
		c := dial(b, daemon(b, "warn"))
		p, err := c.Pipeline(ctx, 1)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { p.Close() })
		measure(b, func() (client.Timings, error) { return timed(p.Call(req)) })
	})
}

// stageNames name the stages stages.split returns, in order.
var stageNames = [...]string{"send", "req", "serve", "resp", "result"}

const numStages = len(stageNames)

// stages holds when the last call passed each point that the client's and
// the server's stats handlers see, in nanoseconds since epoch; calls are
// sequential, so the last call's points are the current call's.
type stages struct {
	clientSent, serverRecv, serverSent, clientRecv atomic.Int64
}

var epoch = time.Now()

// split is the current call's stage durations; start and end are when
// the caller began and ended it.
func (s *stages) split(start, end time.Time) [numStages]time.Duration {
	at := func(v *atomic.Int64) time.Time { return epoch.Add(time.Duration(v.Load())) }
	points := []time.Time{start, at(&s.clientSent), at(&s.serverRecv), at(&s.serverSent), at(&s.clientRecv), end}
	var d [numStages]time.Duration
	for i := range d {
		d[i] = points[i+1].Sub(points[i])
	}
	return d
}

// stageHandler is a stats.Handler noting one side's points in a stages.
type stageHandler struct {
	s      *stages
	server bool
}

func (h stageHandler) HandleRPC(_ context.Context, st stats.RPCStats) {
	now := int64(time.Since(epoch))
	switch st.(type) {
	case *stats.OutPayload:
		if h.server {
			h.s.serverSent.Store(now)
		} else {
			h.s.clientSent.Store(now)
		}
	case *stats.InPayload:
		if h.server {
			h.s.serverRecv.Store(now)
		} else {
			h.s.clientRecv.Store(now)
		}
	}
}

func (stageHandler) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }

func (stageHandler) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

func (stageHandler) HandleConn(context.Context, stats.ConnStats) {}

// writeChunks writes p to w in writes of at most chunk bytes, as gRPC's
// write buffer flushes a large message.
func writeChunks(w io.Writer, p []byte, chunk int) error {
	for len(p) > 0 {
		n := min(chunk, len(p))
		if _, err := w.Write(p[:n]); err != nil {
			return err
		}
		p = p[n:]
	}
	return nil
}
