// Command expertd serves fused Mixture-of-Experts layers over gRPC
// (expertd.v1.ExpertService), with health checking, server reflection and
// Prometheus metrics.
//
// With no flags it listens on 127.0.0.1:50051 with the CPU backend (or the
// CUDA one when its library loads) and serves /metrics on 127.0.0.1:9090.
// Run `expertd -h` for every flag; each also reads an EXPERTD_* variable.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/selector"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"
	v1reflectiongrpc "google.golang.org/grpc/reflection/grpc_reflection_v1"
	v1alphareflectiongrpc "google.golang.org/grpc/reflection/grpc_reflection_v1alpha"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/internal/clip"
	"github.com/expertd/expertd/kernels"
	_ "github.com/expertd/expertd/kernels/cpu"  // registers "cpu"
	_ "github.com/expertd/expertd/kernels/cuda" // registers "cuda" (purego: no cgo; fails to open without the library)
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Getenv, os.Stderr, nil); err != nil {
		if errors.Is(err, errUsage) {
			os.Exit(2)
		}
		clip.Fprintf(os.Stderr, "expertd: %v\n", err)
		os.Exit(1)
	}
}

var errUsage = errors.New("usage")

// listening reports the bound addresses once the daemon serves (tests use
// it to find ports chosen with :0).
type listening struct {
	grpc, admin string
}

// run is the whole daemon: it returns when ctx is cancelled (after a drain)
// or on a startup failure.
func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer, ready chan<- listening) error {
	cfg, err := parseConfig(args, getenv, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		clip.Fprintf(stderr, "%v\n", err)
		return errUsage
	}
	if cfg.ShowVersion {
		fmt.Fprintln(stdout, "expertd", version())
		return nil
	}
	if cfg.Probe != "" {
		return probeURL(cfg.Probe)
	}
	log := cfg.logger(stderr)
	slog.SetDefault(log)
	for _, w := range cfg.Warnings {
		log.Warn(w)
	}
	if err := cfg.checkPaths(); err != nil {
		return err
	}
	man, shardIndex, err := startupManifest(cfg)
	if err != nil {
		return err
	}
	sec, err := newSecurity(cfg)
	if err != nil {
		return err
	}

	backend, err := openBackend(cfg, log)
	if err != nil {
		return err
	}
	defer backend.Close()

	// Metrics: OpenTelemetry instruments exported through a Prometheus
	// registry, with the Go runtime and process collectors beside them.
	// Metrics and spans share one resource (service.name, version).
	res := newResource(ctx, log)
	promReg := prometheus.NewRegistry()
	promReg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	meters, err := newMeterProvider(promReg, res)
	if err != nil {
		return err
	}
	defer meters.Shutdown(context.Background()) //nolint:errcheck // exit path
	if err := registerBuildInfo(meters.Meter("github.com/expertd/expertd/cmd/expertd"), backend.Name()); err != nil {
		log.Warn("metric not recorded", slog.String("metric", "expertd.build_info"), slog.Any("err", err))
	}
	otel.SetTextMapPropagator(propagator())
	tracer, flushTraces, err := newTracerProvider(ctx, cfg, getenv, res, log)
	if err != nil {
		return err
	}
	defer func() {
		// Flush on exit with a fresh context: ctx is already cancelled.
		fctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := flushTraces(fctx); err != nil {
			log.Warn("flushing traces", slog.Any("err", err))
		}
	}()

	// Health: a backend that keeps failing (a wedged GPU) takes the
	// replica out of rotation until a call succeeds again.
	hs := health.NewServer()
	pending := 0
	if man != nil {
		pending = len(man.Sets)
	}
	rd := newReadiness(hs, pending)
	var mm manifestMetrics
	if man != nil {
		mm = newManifestMetrics(meters.Meter("github.com/expertd/expertd/cmd/expertd"), rd, log)
	}
	scfg := cfg.Config
	scfg.Version = version()
	scfg.Meter = meters.Meter("github.com/expertd/expertd/service")
	scfg.Tracer = serviceTracer(tracer)
	scfg.OnBackendFault = rd.onFault
	scfg.Settings = cfg.inForce()
	svc := service.New(scfg, backend, log)

	gs := newGRPCServer(cfg, log, meters, tracer, append(svc.ServerOptions(), sec.serverOptions()...)...)
	svc.Register(gs)
	healthpb.RegisterHealthServer(gs, hs)
	registerReflection(gs, log)
	sec.authz.learnMethods(gs)

	lis, err := listen(cfg, log)
	if err != nil {
		return fmt.Errorf("listen %s: %w", cfg.Listen, err)
	}
	serveErr := make(chan error, 2)
	go func() { serveErr <- gs.Serve(lis) }()

	var admin *http.Server
	addrs := listening{grpc: grpcTarget(lis.Addr())}
	if cfg.AdminAddr != "" {
		alis, err := net.Listen("tcp", cfg.AdminAddr)
		if err != nil {
			gs.Stop()
			return fmt.Errorf("listen %s (admin): %w", cfg.AdminAddr, err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(promReg, promhttp.HandlerOpts{}))
		mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
			if svc.Draining() {
				http.Error(w, "draining", http.StatusServiceUnavailable)
				return
			}
			if err := svc.BackendFault(); err != nil {
				http.Error(w, "backend failing: "+err.Error(), http.StatusServiceUnavailable)
				return
			}
			io.WriteString(w, "ok\n")
		})
		if cfg.Pprof {
			mux.HandleFunc("/debug/pprof/", pprof.Index)
			mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
			mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
			mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
			mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
		}
		registerProbes(mux, rd, svc)
		admin = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		go func() {
			if err := admin.Serve(alis); !errors.Is(err, http.ErrServerClosed) {
				serveErr <- fmt.Errorf("admin server: %w", err)
			}
		}()
		addrs.admin = alis.Addr().String()
	}
	reclaimCtx, stopReclaim := context.WithCancel(ctx)
	defer stopReclaim()
	go reclaimIdle(reclaimCtx, cfg.IdleFreeMemory, svc.Activity, log)
	log.Info("expertd serving", slog.String("grpc", addrs.grpc), slog.String("admin", addrs.admin),
		slog.String("backend", backend.Name()), slog.Any("backend_details", backend.Capabilities().Details),
		slog.String("version", version()), slog.Int("max_tokens", cfg.MaxTokens), slog.Int64("max_message_bytes", cfg.MaxMessageBytes),
		slog.Int64("max_loaded_bytes", cfg.MaxLoadedBytes), slog.Int("max_concurrent", cfg.MaxConcurrent), slog.Int("max_queued", cfg.MaxQueued),
		slog.Duration("batch_window", cfg.BatchWindow), slog.Int("batch_max_tokens", cfg.BatchMaxTokens),
		slog.String("weights_dir", cfg.WeightsDir), slog.Bool("shared_memory", cfg.SharedMemory),
		slog.Bool("ring", cfg.Ring), slog.Duration("ring_spin", cfg.RingSpin),
		slog.Duration("max_connection_age", cfg.MaxConnectionAge), slog.Bool("tracing", serviceTracer(tracer) != nil),
		slog.Int("max_shm_regions", cfg.MaxShmRegions), slog.Int64("max_shm_bytes", cfg.MaxShmBytes),
		slog.Bool("pprof", cfg.Pprof), slog.Int("stream_workers", cfg.StreamWorkers))
	sec.logPosture(log, cfg, lis.Addr())
	if ready != nil {
		ready <- addrs
	}
	loadErr := make(chan error, 1)
	if man != nil {
		go func() {
			if err := loadManifest(ctx, man, svc, cfg.WeightsDir, shardIndex, rd, mm, log); err != nil {
				loadErr <- err
				return
			}
			rd.setLoaded()
		}()
	}

	select {
	case <-ctx.Done():
	case err := <-serveErr:
		hs.Shutdown()
		gs.Stop()
		return fmt.Errorf("serving: %w", err)
	case err := <-loadErr:
		// A drain that interrupted the load is a normal stop.
		if ctx.Err() == nil {
			hs.Shutdown()
			gs.Stop()
			if admin != nil {
				admin.Close()
			}
			log.Error("startup manifest failed; stopping", slog.Any("err", err))
			return err
		}
		<-ctx.Done()
	}

	// Drain: tell load balancers first, then stop taking calls, let those in
	// flight finish within the timeout, and only then cut what is left.
	log.Info("draining", slog.Duration("timeout", cfg.ShutdownTimeout))
	hs.Shutdown()
	drainCtx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownTimeout)
	defer cancel()
	stopped := make(chan struct{})
	go func() {
		gs.GracefulStop()
		close(stopped)
	}()
	if err := svc.Shutdown(drainCtx); err != nil {
		log.Warn("calls still running at the drain deadline", slog.Any("err", err))
	}
	select {
	case <-stopped:
	case <-drainCtx.Done():
		log.Warn("streams still open at the drain deadline; closing them")
		gs.Stop()
		<-stopped
	}
	if admin != nil {
		shutCtx, c2 := context.WithTimeout(context.Background(), time.Second)
		defer c2()
		admin.Shutdown(shutCtx) //nolint:errcheck // exit path
	}
	log.Info("expertd stopped")
	return nil
}

// newGRPCServer builds the server with message limits, panic recovery,
// call logging (not for health checks and reflection, which would drown
// the log), OpenTelemetry RPC metrics and spans, and keepalive. extra (the service's own
// options, TLS credentials, the authorization interceptors) follows; its
// interceptors run after logging, so refused calls are logged with their
// code.
func newGRPCServer(cfg Config, log *slog.Logger, meters *sdkmetric.MeterProvider, tracer trace.TracerProvider, extra ...grpc.ServerOption) *grpc.Server {
	rec := recovery.WithRecoveryHandlerContext(func(ctx context.Context, p any) error {
		log.ErrorContext(ctx, "panic in handler", slog.Any("panic", p), slog.String("stack", string(debug.Stack())))
		return status.Error(codes.Internal, "internal error (logged on the server)")
	})
	logger := logging.LoggerFunc(func(ctx context.Context, lvl logging.Level, msg string, fields ...any) {
		log.Log(ctx, slog.Level(lvl), msg, fields...)
	})
	// One line per call, when it finishes, at the level callLevel gives
	// its code: a healthy daemon at the default info level logs no line
	// per call.
	logOpts := []logging.Option{logging.WithLogOnEvents(logging.FinishCall), logging.WithLevels(callLevel)}
	// OpenTelemetry RPC metrics and spans, recording methods the server
	// does not serve under one name.
	rpcTelemetry := &knownMethods{Handler: otelgrpc.NewServerHandler(otelgrpc.WithMeterProvider(meters),
		otelgrpc.WithTracerProvider(tracer), otelgrpc.WithPropagators(propagator()))}
	logged := selector.MatchFunc(func(_ context.Context, c interceptors.CallMeta) bool {
		return c.Service != healthpb.Health_ServiceDesc.ServiceName && !strings.HasPrefix(c.Service, "grpc.reflection.")
	})
	opts := []grpc.ServerOption{
		grpc.MaxRecvMsgSize(int(cfg.MaxMessageBytes)),
		grpc.MaxSendMsgSize(int(cfg.MaxMessageBytes)),
		// Unknown methods go through the interceptors (authorization,
		// logging) like the others, instead of grpc-go's Unimplemented
		// answered before them.
		grpc.UnknownServiceHandler(unknownMethod),
		grpc.StatsHandler(rpcTelemetry),
		grpc.StatsHandler(refusedLog{log}),
		// Recovery runs innermost so a panic is logged as the Internal it
		// becomes.
		grpc.ChainUnaryInterceptor(
			reachedUnary,
			selector.UnaryServerInterceptor(logging.UnaryServerInterceptor(logger, logOpts...), logged),
			recovery.UnaryServerInterceptor(rec),
		),
		grpc.ChainStreamInterceptor(
			reachedStream,
			selector.StreamServerInterceptor(logging.StreamServerInterceptor(logger, logOpts...), logged),
			recovery.StreamServerInterceptor(rec),
		),
	}
	opts = append(opts, cfg.keepaliveOptions()...)
	if cfg.StreamWorkers > 0 {
		opts = append(opts, grpc.NumStreamWorkers(uint32(cfg.StreamWorkers)))
	}
	gs := grpc.NewServer(append(opts, extra...)...)
	rpcTelemetry.gs = gs
	return gs
}

// registerReflection serves reflection v1 and v1alpha with expert.proto's
// comments, so `grpcurl describe` doubles as the API manual; without them
// (a broken embedded descriptor) it still serves, undocumented.
func registerReflection(gs *grpc.Server, log *slog.Logger) {
	opts := reflection.ServerOptions{Services: gs}
	if res, err := pb.DocumentedFiles(); err != nil {
		log.Warn("reflection serves expert.proto without comments", slog.Any("err", err))
	} else {
		opts.DescriptorResolver = res
	}
	v1reflectiongrpc.RegisterServerReflectionServer(gs, reflection.NewServerV1(opts))
	v1alphareflectiongrpc.RegisterServerReflectionServer(gs, reflection.NewServer(opts))
}

// openBackend opens the configured backend. auto prefers cuda and falls
// back to cpu with a loud warning, so a GPU host with a broken driver still
// serves (slowly) instead of crash-looping.
func openBackend(cfg Config, log *slog.Logger) (kernels.Backend, error) {
	kcfg := cfg.Kernels
	ccfg := kcfg
	ccfg.Options = cfg.CUDA
	if cfg.Backend != "auto" {
		open := kcfg
		if cfg.Backend == "cuda" {
			open = ccfg
		}
		b, err := kernels.Open(cfg.Backend, open)
		if err != nil {
			return nil, fmt.Errorf("backend %s: %w", cfg.Backend, err)
		}
		return b, nil
	}
	b, err := kernels.Open("cuda", ccfg)
	if err == nil {
		return b, nil
	}
	log.Warn("CUDA backend unavailable; serving on the CPU backend, which is orders of magnitude slower",
		slog.String("backend", "cpu"), slog.String("wanted", "cuda"),
		slog.String("library_path", cfg.Kernels.LibraryPath), slog.Any("err", err),
		slog.Any("registered", kernels.Names()))
	return kernels.Open("cpu", kcfg)
}

// startupManifest reads -manifest, if set, and fixes the shard this
// daemon serves when the manifest is sharded.
func startupManifest(cfg Config) (*manifest, int, error) {
	if cfg.Manifest == "" {
		return nil, 0, nil
	}
	if cfg.WeightsDir == "" {
		return nil, 0, errors.New("-manifest loads from -weights-dir, which is not set")
	}
	m, err := readManifest(cfg.Manifest)
	if err != nil {
		return nil, 0, err
	}
	if m.Shard == nil {
		return m, 0, nil
	}
	idx, err := m.Shard.resolveIndex(cfg.ShardIndex, os.Hostname)
	return m, idx, err
}
