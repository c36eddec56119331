package main

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/stats"

	"github.com/expertd/expertd/service"
)

// propagator reads and writes W3C TraceContext (traceparent, tracestate)
// and Baggage, so a caller's trace continues in the daemon's spans.
func propagator() propagation.TextMapPropagator {
	return propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
}

// newResource describes the daemon on its metrics (Prometheus target_info)
// and spans: service.name expertd and its version, which
// OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override. A detector
// that fails leaves the rest: telemetry degrades, the daemon serves.
func newResource(ctx context.Context, log *slog.Logger) *resource.Resource {
	res, err := resource.New(ctx,
		resource.WithAttributes(semconv.ServiceName("expertd"), semconv.ServiceVersion(version())),
		resource.WithTelemetrySDK(),
		resource.WithFromEnv())
	if err != nil {
		log.Warn("telemetry resource incomplete", slog.Any("err", err))
	}
	if res == nil {
		res = resource.NewSchemaless(semconv.ServiceName("expertd"), semconv.ServiceVersion(version()))
	}
	return res
}

// rpcDurationViews give otelgrpc's RPC duration histograms (the current
// rpc.server.call.duration in seconds, and the legacy rpc.server.duration
// in milliseconds that OTEL_SEMCONV_STABILITY_OPT_IN=rpc/old or rpc/dup
// selects) the service's 10 µs - 10 s buckets: otelgrpc's own start at
// 5 ms, above a whole GPU call.
func rpcDurationViews() []sdkmetric.View {
	ms := make([]float64, len(service.LatencyBuckets))
	for i, b := range service.LatencyBuckets {
		ms[i] = b * 1e3
	}
	return []sdkmetric.View{
		sdkmetric.NewView(sdkmetric.Instrument{Name: "rpc.server.call.duration"},
			sdkmetric.Stream{Aggregation: sdkmetric.AggregationExplicitBucketHistogram{Boundaries: service.LatencyBuckets}}),
		sdkmetric.NewView(sdkmetric.Instrument{Name: "rpc.server.duration"},
			sdkmetric.Stream{Aggregation: sdkmetric.AggregationExplicitBucketHistogram{Boundaries: ms}}),
	}
}

// newMeterProvider exports OpenTelemetry instruments through reg, the
// registry /metrics serves.
func newMeterProvider(reg prometheus.Registerer, res *resource.Resource) (*sdkmetric.MeterProvider, error) {
	exporter, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		return nil, fmt.Errorf("prometheus exporter: %w", err)
	}
	return sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter), sdkmetric.WithResource(res),
		sdkmetric.WithView(rpcDurationViews()...)), nil
}

// otherMethod is the method the RPC metrics and spans record for a call
// to a method the server does not serve, as OpenTelemetry's semantic
// conventions name an unknown method: such a name is the caller's choice,
// and recorded as it is each would add a series to every RPC metric and
// a span name, without bound, and before any credential is checked.
const otherMethod = "/_OTHER"

// knownMethods is a stats.Handler in front of otelgrpc's that passes a
// call's method on only when the server serves it, otherMethod
// otherwise, so the rpc_method label takes one value per served method
// plus one. The served set is read from the server at its first call,
// when every service is registered (grpc-go refuses a registration after
// Serve).
type knownMethods struct {
	stats.Handler
	gs     *grpc.Server
	once   sync.Once
	served map[string]bool
}

func (h *knownMethods) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	h.once.Do(func() { h.served = servedMethods(h.gs) })
	if !h.served[info.FullMethodName] {
		other := *info
		other.FullMethodName = otherMethod
		info = &other
	}
	return h.Handler.TagRPC(ctx, info)
}

// registerBuildInfo exports expertd_build_info, always 1, labelled with what
// runs: version, commit, Go version and backend, so dashboards can join any
// series to the build that produced it.
func registerBuildInfo(m metric.Meter, backend string) error {
	attrs := metric.WithAttributes(attribute.String("version", version()), attribute.String("commit", revision()),
		attribute.String("go_version", runtime.Version()), attribute.String("backend", backend))
	_, err := m.Int64ObservableGauge("expertd.build_info",
		metric.WithDescription("Always 1; the labels say which build serves and on which backend."),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			o.Observe(1, attrs)
			return nil
		}))
	return err
}

// testSpanExporter, when set by a test, receives every span synchronously
// and turns tracing on without a collector.
var testSpanExporter sdktrace.SpanExporter

// tracingEnabled reports whether the daemon exports spans: -otlp-endpoint,
// or the OpenTelemetry variables that name a collector
// (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), unless
// OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none turn it off.
func tracingEnabled(cfg Config, getenv func(string) string) bool {
	if testSpanExporter != nil || cfg.OTLPEndpoint != "" {
		return true
	}
	if strings.EqualFold(getenv("OTEL_SDK_DISABLED"), "true") || getenv("OTEL_TRACES_EXPORTER") == "none" {
		return false
	}
	return getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
}

// newTracerProvider is where spans go: batched to the OTLP/gRPC collector
// (-otlp-endpoint, else the exporter's OTEL_EXPORTER_OTLP_* variables:
// endpoint, headers, certificates, timeout), sampled as OTEL_TRACES_SAMPLER
// says (by default every trace, or as the caller's traceparent decided), or
// nowhere: a no-op provider, so an untraced daemon pays nothing per call.
// shutdown flushes what is buffered.
func newTracerProvider(ctx context.Context, cfg Config, getenv func(string) string, res *resource.Resource, log *slog.Logger) (tp trace.TracerProvider, shutdown func(context.Context) error, err error) {
	if !tracingEnabled(cfg, getenv) {
		return noop.NewTracerProvider(), func(context.Context) error { return nil }, nil
	}
	opts := []sdktrace.TracerProviderOption{sdktrace.WithResource(res)}
	if testSpanExporter != nil {
		opts = append(opts, sdktrace.WithSyncer(testSpanExporter))
	} else {
		for _, v := range []string{"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"} {
			if p := getenv(v); p != "" && p != "grpc" {
				log.Warn("expertd exports traces over OTLP/gRPC only; point it at the collector's gRPC port (4317)",
					slog.String("variable", v), slog.String("ignored", p))
			}
		}
		var eopts []otlptracegrpc.Option
		if cfg.OTLPEndpoint != "" {
			eopts = append(eopts, otlptracegrpc.WithEndpointURL(cfg.OTLPEndpoint))
		}
		exp, err := otlptracegrpc.New(ctx, eopts...)
		if err != nil {
			return nil, nil, fmt.Errorf("otlp trace exporter: %w", err)
		}
		opts = append(opts, sdktrace.WithBatcher(exp))
	}
	p := sdktrace.NewTracerProvider(opts...)
	return p, p.Shutdown, nil
}

// serviceTracer is the service's tracer for spans below the RPC, nil when
// tracing is off so the service skips them entirely.
func serviceTracer(tp trace.TracerProvider) trace.Tracer {
	if _, ok := tp.(*sdktrace.TracerProvider); !ok {
		return nil
	}
	return tp.Tracer("github.com/expertd/expertd/service")
}

// callLevel is the log level of a finished call by its code. A call that
// succeeded is debug (thousands a second are routine). A caller's own
// mistake (a malformed request, an unknown set or method, a cancelled
// call) and a busy refusal (ResourceExhausted: backpressure that callers
// retry, which under overload comes at the rate of calls and is counted
// by code in rpc_server_call_duration_seconds) are info, visible at the
// default level and silent at warn. What an operator may have to act on
// (deadlines missed, denied credentials, draining) is warn; a fault of the
// server is error.
func callLevel(code codes.Code) logging.Level {
	switch code {
	case codes.OK:
		return logging.LevelDebug
	case codes.Canceled, codes.InvalidArgument, codes.NotFound, codes.AlreadyExists, codes.FailedPrecondition,
		codes.OutOfRange, codes.Unimplemented, codes.ResourceExhausted:
		return logging.LevelInfo
	case codes.DeadlineExceeded, codes.Unavailable, codes.Aborted,
		codes.Unauthenticated, codes.PermissionDenied:
		return logging.LevelWarn
	default: // Unknown, Internal, DataLoss
		return logging.LevelError
	}
}
