package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	mrand "math/rand/v2"
	"os"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// testWeights is a small gated layer for named-set calls.
func testWeights(rng *mrand.Rand) *client.ExpertWeights {
	const e, k, n = 4, 32, 16
	return &client.ExpertWeights{
		Activation: moe.SiluGated,
		W13:        client.FromFP8(randFP8(rng, e*2*n*k), e, 2*n, k),
		W2:         client.FromFP8(randFP8(rng, e*k*n), e, k, n),
		W13Scale:   client.FromFloat32([]float32{0.001, 0.002, 0.003, 0.004}, e),
		W2Scale:    client.FromFloat32([]float32{0.004, 0.003, 0.002, 0.001}, e),
	}
}

// namedRequest is a call on testWeights loaded under name.
func namedRequest(rng *mrand.Rand, name string) *client.FusedMoERequest {
	const e, k, m = 4, 32, 2
	return &client.FusedMoERequest{
		ExpertSet:    name,
		Hidden:       client.FromFloat32(randF32(rng, m*k), m, k),
		RouterLogits: client.FromFloat32(randF32(rng, m*e), m, e),
		Routing:      client.Routing{TopK: 2},
	}
}

// sdkClient dials the daemon at addr with the SDK.
func sdkClient(t *testing.T, addr string) *client.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	c, err := client.Dial(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// withTraceParent is ctx sending a W3C traceparent of a fresh sampled
// remote span, which it returns.
func withTraceParent(ctx context.Context, rng *mrand.Rand) (context.Context, trace.SpanContext) {
	var tid trace.TraceID
	var sid trace.SpanID
	for i := range tid {
		tid[i] = byte(rng.UintN(256))
	}
	for i := range sid {
		sid[i] = byte(rng.UintN(256))
	}
	tid[0], sid[0] = 1, 1 // never the invalid all-zero IDs
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true})
	return metadata.AppendToOutgoingContext(ctx, "traceparent", fmt.Sprintf("00-%s-%s-01", tid, sid)), sc
}

// spansOf waits until the exporter holds a span named name in trace tid,
// and returns that trace's spans.
func spansOf(t *testing.T, exp *tracetest.InMemoryExporter, tid trace.TraceID, name string) []tracetest.SpanStub {
	t.Helper()
	deadline := time.Now().Add(defaultTestTimeout)
	for {
		var got []tracetest.SpanStub
		for _, s := range exp.GetSpans() {
			if s.SpanContext.TraceID() == tid {
				got = append(got, s)
			}
		}
		if slices.ContainsFunc(got, func(s tracetest.SpanStub) bool { return s.Name == name }) {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("no span %q in trace %s; spans: %v", name, tid, spanNames(got))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func spanNames(spans []tracetest.SpanStub) []string {
	var names []string
	for _, s := range spans {
		names = append(names, s.Name+" (parent "+s.Parent.SpanID().String()+")")
	}
	return names
}

// childOf is the span named name whose parent is parent.
func childOf(t *testing.T, spans []tracetest.SpanStub, parent trace.SpanContext, name string) tracetest.SpanStub {
	t.Helper()
	for _, s := range spans {
		if s.Name == name && s.Parent.SpanID() == parent.SpanID() && s.Parent.TraceID() == parent.TraceID() {
			return s
		}
	}
	t.Fatalf("no span %q with parent %s; spans: %v", name, parent.SpanID(), spanNames(spans))
	return tracetest.SpanStub{}
}

// TestTraceParent checks a caller's W3C traceparent becomes the parent of
// the daemon's RPC span, and that the stages below it are child spans:
// queue and kernel for a call with inline weights, batch (then queue and
// kernel under it) for a call on a loaded set, which dynamic batching
// takes.
func TestTraceParent(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	testSpanExporter = exp
	t.Cleanup(func() { testSpanExporter = nil })
	addr, _ := startDaemon(t)
	rng := mrand.New(mrand.NewPCG(uint64(time.Now().UnixNano()), 11))
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	const rpcSpan = "expertd.v1.ExpertService/FusedMoE"

	callCtx, caller := withTraceParent(ctx, rng)
	if _, err := pb.NewExpertServiceClient(dial(t, addr, insecure.NewCredentials())).FusedMoE(callCtx, inlineRequest(rng)); err != nil {
		t.Fatal(err)
	}
	spans := spansOf(t, exp, caller.TraceID(), rpcSpan)
	server := childOf(t, spans, caller, rpcSpan)
	if server.SpanKind != trace.SpanKindServer || !server.Parent.IsRemote() {
		t.Errorf("RPC span kind %v, remote parent %v; want a server span under the caller's", server.SpanKind, server.Parent.IsRemote())
	}
	childOf(t, spans, server.SpanContext, "expertd.queue")
	childOf(t, spans, server.SpanContext, "expertd.kernel")

	c := sdkClient(t, addr)
	if _, err := c.LoadExperts(ctx, "traced", testWeights(rng)); err != nil {
		t.Fatal(err)
	}
	callCtx, caller = withTraceParent(ctx, rng)
	if _, err := c.FusedMoE(callCtx, namedRequest(rng, "traced")); err != nil {
		t.Fatal(err)
	}
	spans = spansOf(t, exp, caller.TraceID(), rpcSpan)
	server = childOf(t, spans, caller, rpcSpan)
	batch := childOf(t, spans, server.SpanContext, "expertd.batch")
	childOf(t, spans, batch.SpanContext, "expertd.queue")
	kernel := childOf(t, spans, batch.SpanContext, "expertd.kernel")
	if !slices.ContainsFunc(kernel.Attributes, func(kv attribute.KeyValue) bool {
		return string(kv.Key) == "expertd.expert_set" && kv.Value.AsString() == "traced"
	}) {
		t.Errorf("kernel span attributes %v, want expertd.expert_set=traced", kernel.Attributes)
	}
}

// TestTracingFromEnv checks the OpenTelemetry variables alone turn
// tracing on (a collector named by OTEL_EXPORTER_OTLP_ENDPOINT or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) and OTEL_SDK_DISABLED or
// OTEL_TRACES_EXPORTER=none turn it off.
func TestTracingFromEnv(t *testing.T) {
	tests := []struct {
		env  map[string]string
		flag string
		want bool
	}{
		{nil, "", false},
		{nil, "http://localhost:4317", true},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, "", true},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, "", true},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_SDK_DISABLED": "true"}, "", false},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_TRACES_EXPORTER": "none"}, "", false},
	}
	for _, tt := range tests {
		got := tracingEnabled(Config{OTLPEndpoint: tt.flag}, func(k string) string { return tt.env[k] })
		if got != tt.want {
			t.Errorf("env %v, -otlp-endpoint %q: tracing %v, want %v", tt.env, tt.flag, got, tt.want)
		}
	}
	tp, shutdown, err := newTracerProvider(context.Background(), Config{}, func(k string) string {
		return map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}[k]
	}, newResource(context.Background(), discard), discard)
	if err != nil {
		t.Fatal(err)
	}
	defer shutdown(context.Background()) //nolint:errcheck // nothing was sent
	if _, ok := tp.(*sdktrace.TracerProvider); !ok {
		t.Errorf("OTEL_EXPORTER_OTLP_ENDPOINT alone: provider %T, want the SDK's", tp)
	}
}

var discard = slog.New(slog.DiscardHandler)

// scrape parses the daemon's /metrics.
func scrape(t *testing.T, admin string) map[string]*dto.MetricFamily {
	t.Helper()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(get(t, "http://"+admin+"/metrics")))
	if err != nil {
		t.Fatal(err)
	}
	return fams
}

// servedMetrics starts a daemon, loads a set "layer0", makes one call on
// it (batched) and one with inline weights, and scrapes /metrics.
func servedMetrics(t *testing.T) map[string]*dto.MetricFamily {
	t.Helper()
	addrs, _ := startDaemonAddrs(t, "-admin-addr", "127.0.0.1:0")
	rng := mrand.New(mrand.NewPCG(uint64(time.Now().UnixNano()), 12))
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	c := sdkClient(t, addrs.grpc)
	if _, err := c.LoadExperts(ctx, "layer0", testWeights(rng)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.FusedMoE(ctx, namedRequest(rng, "layer0")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.RPC().FusedMoE(ctx, inlineRequest(rng)); err != nil {
		t.Fatal(err)
	}
	return scrape(t, addrs.admin)
}

// labels is m's labels as a map.
func labels(m *dto.Metric) map[string]string {
	l := map[string]string{}
	for _, p := range m.GetLabel() {
		l[p.GetName()] = p.GetValue()
	}
	return l
}

// bounds are the bucket upper bounds of the first series of histogram
// family name whose labels include want.
func bounds(t *testing.T, fams map[string]*dto.MetricFamily, name string, want map[string]string) []float64 {
	t.Helper()
	for _, m := range fams[name].GetMetric() {
		l := labels(m)
		match := true
		for k, v := range want {
			match = match && strings.Contains(l[k], v)
		}
		if !match || m.GetHistogram() == nil {
			continue
		}
		var b []float64
		for _, bk := range m.GetHistogram().GetBucket() {
			b = append(b, bk.GetUpperBound())
		}
		return b
	}
	t.Fatalf("no %s series with labels %v", name, want)
	return nil
}

// TestMetricsExport scrapes /metrics after calls and checks what the issue
// asks of it: RPC, kernel and queue histograms that resolve a 100 µs call
// (boundaries at 50, 100 and 200 µs), queue time by expert set,
// expertd_build_info, the backend fault gauge, and target_info naming the
// service.
func TestMetricsExport(t *testing.T) {
	fams := servedMetrics(t)

	for _, h := range []struct {
		name   string
		labels map[string]string
	}{
		{"rpc_server_call_duration_seconds", map[string]string{"rpc_method": "FusedMoE"}},
		{"expertd_kernel_duration_seconds", map[string]string{"expert_set": "layer0", "backend": "cpu"}},
		{"expertd_queue_duration_seconds", map[string]string{"expert_set": "layer0"}},
		{"expertd_queue_duration_seconds", map[string]string{"expert_set": "inline"}},
	} {
		b := bounds(t, fams, h.name, h.labels)
		for _, want := range []float64{10e-6, 50e-6, 100e-6, 200e-6, 10} {
			if !slices.Contains(b, want) {
				t.Errorf("%s%v buckets %v: no boundary at %g s", h.name, h.labels, b, want)
			}
		}
	}
	if b := bounds(t, fams, "expertd_batch_calls", nil); len(b) == 0 {
		t.Error("expertd_batch_calls has no buckets")
	}

	bi := fams["expertd_build_info"].GetMetric()
	if len(bi) != 1 {
		t.Fatalf("expertd_build_info: %d series, want 1", len(bi))
	}
	l := labels(bi[0])
	if l["version"] != version() || l["commit"] != revision() || l["go_version"] != runtime.Version() || l["backend"] != "cpu" || bi[0].GetGauge().GetValue() != 1 {
		t.Errorf("expertd_build_info %v = %v, want version %s, commit %s, go_version %s, backend cpu = 1", l, bi[0].GetGauge().GetValue(), version(), revision(), runtime.Version())
	}
	if f := fams["expertd_backend_faulty"].GetMetric(); len(f) != 1 || f[0].GetGauge().GetValue() != 0 {
		t.Errorf("expertd_backend_faulty: %v, want one series = 0", f)
	}
	ti := fams["target_info"].GetMetric()
	if len(ti) != 1 || labels(ti[0])["service_name"] != "expertd" || labels(ti[0])["service_version"] != version() {
		t.Errorf("target_info: %v, want service_name expertd, service_version %s", ti, version())
	}
}

// TestDashboardMetrics checks every metric deploy/grafana/expertd.json
// queries is one the daemon exports, so the dashboard cannot drift from
// the names.
func TestDashboardMetrics(t *testing.T) {
	raw, err := os.ReadFile("../../deploy/grafana/expertd.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash any
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("dashboard is not JSON: %v", err)
	}
	var exprs []string
	var walk func(any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, x := range v {
				if s, ok := x.(string); ok && (k == "expr" || k == "query") {
					exprs = append(exprs, s)
				}
				walk(x)
			}
		case []any:
			for _, x := range v {
				walk(x)
			}
		}
	}
	walk(dash)
	if len(exprs) < 8 {
		t.Fatalf("dashboard has %d queries, want a panel per concern", len(exprs))
	}

	fams := servedMetrics(t)
	// Counters of failures exist once one has happened.
	onFailure := map[string]bool{"expertd_backend_errors_total": true}
	name := regexp.MustCompile(`\b(expertd_[a-z0-9_]+|rpc_server_[a-z0-9_]+|target_info)\b`)
	for _, e := range exprs {
		for _, n := range name.FindAllString(e, -1) {
			fam := n
			if _, ok := fams[fam]; !ok {
				for _, suffix := range []string{"_bucket", "_sum", "_count"} {
					fam = strings.TrimSuffix(fam, suffix)
				}
			}
			if _, ok := fams[fam]; !ok && !onFailure[n] {
				t.Errorf("dashboard query %q uses %s, which /metrics does not export", e, n)
			}
		}
	}
}

// callLines are the daemon's "started call" and "finished call" lines
// for method, with their levels and codes.
func callLines(t *testing.T, logs string, method string) []string {
	t.Helper()
	var out []string
	for line := range strings.Lines(logs) {
		var rec struct {
			Msg, Level string
			Method     string `json:"grpc.method"`
			Code       string `json:"grpc.code"`
		}
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("log line is not JSON: %q", line)
		}
		if rec.Method == method && strings.HasSuffix(rec.Msg, " call") {
			out = append(out, rec.Msg+" "+rec.Level+" "+rec.Code)
		}
	}
	return out
}

// TestCallLogLevels checks calls are logged once, when they finish, at the
// level of their code: nothing at info for a successful call; the
// caller's mistakes and busy refusals at info.
func TestCallLogLevels(t *testing.T) {
	tests := []struct {
		level string
		want  []string
	}{
		{"info", []string{"finished call INFO InvalidArgument", "finished call INFO ResourceExhausted"}},
		{"debug", []string{"finished call DEBUG OK", "finished call INFO InvalidArgument", "finished call INFO ResourceExhausted"}},
	}
	for _, tt := range tests {
		t.Run(tt.level, func(t *testing.T) {
			addr, logs := startDaemon(t, "-log-level", tt.level, "-max-tokens", "2")
			rng := mrand.New(mrand.NewPCG(uint64(time.Now().UnixNano()), 14))
			ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
			defer cancel()
			c := pb.NewExpertServiceClient(dial(t, addr, insecure.NewCredentials()))
			twoTokens := func() *pb.FusedMoERequest {
				r := inlineRequest(rng)
				r.HiddenStates = tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(randF32(rng, 2*32)...), 2, 32)
				r.RouterLogits = tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(randF32(rng, 2*4)...), 2, 4)
				return r
			}
			if _, err := c.FusedMoE(ctx, twoTokens()); err != nil {
				t.Fatal(err)
			}
			bad := twoTokens()
			bad.Routing.TopK = 0
			if _, err := c.FusedMoE(ctx, bad); status.Code(err) != codes.InvalidArgument {
				t.Fatalf("top_k 0: %v, want InvalidArgument", err)
			}
			if _, err := c.FusedMoE(ctx, inlineRequest(rng)); status.Code(err) != codes.ResourceExhausted {
				t.Fatalf("3 tokens, max 2: %v, want ResourceExhausted", err)
			}
			if got := callLines(t, logs.String(), "FusedMoE"); !slices.Equal(got, tt.want) {
				t.Errorf("call log lines %q, want %q", got, tt.want)
			}
		})
	}
}

// rpcSeries counts the series of the RPC metrics, and those with a label
// value containing s.
func rpcSeries(fams map[string]*dto.MetricFamily, s string) (all, with int) {
	for name, f := range fams {
		if !strings.HasPrefix(name, "rpc_") {
			continue
		}
		for _, m := range f.GetMetric() {
			all++
			for _, v := range labels(m) {
				if strings.Contains(v, s) {
					with++
					break
				}
			}
		}
	}
	return all, with
}

// scrapeUntil scrapes /metrics until some RPC series carries each of the
// label values given, and fails the test if that takes
// defaultTestTimeout.
func scrapeUntil(t *testing.T, admin string, values ...string) map[string]*dto.MetricFamily {
	t.Helper()
	deadline := time.Now().Add(defaultTestTimeout)
	for {
		fams := scrape(t, admin)
		missing := slices.IndexFunc(values, func(v string) bool { _, n := rpcSeries(fams, v); return n == 0 })
		if missing < 0 {
			return fams
		}
		if time.Now().After(deadline) {
			t.Fatalf("no RPC series with %q after %v", values[missing], defaultTestTimeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestUnknownMethodsBounded: calls to methods the server does not serve,
// without credentials, add no series per method name: they are all
// recorded as _OTHER, and a served method keeps its own label.
func TestUnknownMethodsBounded(t *testing.T) {
	path, user, _ := writeTokens(t)
	addrs, _ := startDaemonAddrs(t, "-auth-tokens-file", path, "-admin-addr", "127.0.0.1:0")
	conn := dial(t, addrs.grpc, insecure.NewCredentials())
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	unknown := func(from, to int) {
		for i := from; i < to; i++ {
			err := conn.Invoke(ctx, fmt.Sprintf("/zqx.Svc%d/M", i), &pb.ListExpertsRequest{}, &pb.ListExpertsResponse{})
			if status.Code(err) != codes.Unauthenticated {
				t.Fatalf("unknown method %d without a token: %v, want Unauthenticated", i, err)
			}
		}
	}
	unknown(0, 5)
	authed := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+user)
	if _, err := pb.NewExpertServiceClient(conn).GetServerInfo(authed, &pb.GetServerInfoRequest{}); err != nil {
		t.Fatal(err)
	}
	// The server records an RPC once its status is sent, so the client
	// can have its answer first: the baseline waits for the series of
	// the calls made so far.
	before, named := rpcSeries(scrapeUntil(t, addrs.admin, "_OTHER", "GetServerInfo"), "zqx")
	if named != 0 {
		t.Errorf("%d RPC series carry a caller's method name", named)
	}
	unknown(5, 50)
	fams := scrape(t, addrs.admin)
	after, named := rpcSeries(fams, "zqx")
	if named != 0 || after != before {
		t.Errorf("45 more unknown methods: %d RPC series -> %d, %d with a caller's method name; want no new series", before, after, named)
	}
	if _, other := rpcSeries(fams, "_OTHER"); other == 0 {
		t.Error("no RPC series records the unknown methods as _OTHER")
	}
	if _, info := rpcSeries(fams, "GetServerInfo"); info == 0 {
		t.Error("GetServerInfo is not recorded under its own method")
	}
}
