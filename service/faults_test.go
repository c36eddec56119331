package service_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// faultyBackend is fakeBackend with injected failures: errors from Load
// or FusedMoE, or an output one element short (a backend bug the service
// must catch rather than pass on).
type faultyBackend struct {
	*fakeBackend
	mu               sync.Mutex
	loadErr, callErr error
	truncate         bool
}

func (f *faultyBackend) faults() (loadErr, callErr error, truncate bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.loadErr, f.callErr, f.truncate
}

func (f *faultyBackend) heal() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.loadErr, f.callErr, f.truncate = nil, nil, false
}

func (f *faultyBackend) Load(ctx context.Context, set *moe.ExpertSet) (kernels.Loaded, error) {
	if err, _, _ := f.faults(); err != nil {
		return nil, err
	}
	return f.fakeBackend.Load(ctx, set)
}

func (f *faultyBackend) FusedMoE(ctx context.Context, l kernels.Loaded, req *moe.Request) (*moe.Result, error) {
	_, callErr, truncate := f.faults()
	if callErr != nil {
		return nil, callErr
	}
	res, err := f.fakeBackend.FusedMoE(ctx, l, req)
	if err == nil && truncate {
		res.Output = res.Output[:len(res.Output)-req.OutDType.Size()]
	}
	return res, err
}

// TestBackendFaults checks each kind of backend failure becomes the
// status its cause calls for (out of memory: ResourceExhausted, a request
// the backend cannot run: FailedPrecondition, anything else: Internal with
// the detail logged, not sent), that a failed load or inline call gives
// its memory back, and that the server serves normally once the backend
// recovers.
func TestBackendFaults(t *testing.T) {
	rng := newRand(t)
	oom := fmt.Errorf("cuda: moe: ERR_OOM: workspace of 3 GiB: %w", kernels.ErrOutOfMemory)
	unsupported := fmt.Errorf("cuda: top_k 40 (max 32): %w", kernels.ErrUnsupported)
	cudaErr := errors.New("cuda: moe: ERR_CUDA: an illegal memory access was encountered")
	fused := func(ctx context.Context, c pb.ExpertServiceClient) error {
		_, err := c.FusedMoE(ctx, request(rng, 3))
		return err
	}
	inline := func(ctx context.Context, c pb.ExpertServiceClient) error {
		req := request(rng, 3)
		req.Experts = &pb.FusedMoERequest_Weights{Weights: randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)}
		_, err := c.FusedMoE(ctx, req)
		return err
	}
	load := func(ctx context.Context, c pb.ExpertServiceClient) error {
		w := randomWeights(rng, pb.Activation_ACTIVATION_RELU2, 2, 16, 8)
		_, err := servicetest.Upload(ctx, c, servicetest.Header("other", w, false), servicetest.Chunks(w, 100))
		return err
	}
	tests := []struct {
		name             string
		loadErr, callErr error
		truncate         bool
		call             func(context.Context, pb.ExpertServiceClient) error
		wantCode         codes.Code
		wantMsg          string
		// wantLog is in the server log (Internal errors keep their
		// detail there, not in the status).
		wantLog string
	}{
		{"call out of memory", nil, oom, false, fused, codes.ResourceExhausted, "backend fake: cuda: moe: ERR_OOM", ""},
		{"call unsupported", nil, unsupported, false, fused, codes.FailedPrecondition, "backend fake: cuda: top_k 40", ""},
		{"call CUDA error", nil, cudaErr, false, fused, codes.Internal, "FusedMoE: internal error (logged on the server)", "illegal memory access"},
		{"wrong-size output", nil, nil, true, fused, codes.Internal, "FusedMoE: internal error", "returned 238 output bytes"},
		{"load out of memory", oom, nil, false, load, codes.ResourceExhausted, "backend fake: cuda: moe: ERR_OOM", ""},
		{"load CUDA error", cudaErr, nil, false, load, codes.Internal, "LoadExperts: internal error", "illegal memory access"},
		{"inline out of memory", oom, nil, false, inline, codes.ResourceExhausted, "ERR_OOM", ""},
		{"inline call CUDA error", nil, cudaErr, false, inline, codes.Internal, "FusedMoE: internal error", "illegal memory access"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := testContext(t)
			var logs servicetest.LogBuffer
			b := &faultyBackend{fakeBackend: &fakeBackend{}}
			c, srv, _ := servicetest.StartServerLogger(t, serviceConfig(layerBytes+1<<20), b, slog.New(slog.NewTextHandler(&logs, nil)))
			w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)
			if _, err := servicetest.Upload(ctx, c, servicetest.Header("layer", w, false), servicetest.Chunks(w, 1000)); err != nil {
				t.Fatalf("LoadExperts: %v", err)
			}
			before := stateOf(t, c, srv, b.fakeBackend)
			b.mu.Lock()
			b.loadErr, b.callErr, b.truncate = tt.loadErr, tt.callErr, tt.truncate
			b.mu.Unlock()

			err := tt.call(ctx, c)
			if got := status.Code(err); got != tt.wantCode || !strings.Contains(status.Convert(err).Message(), tt.wantMsg) {
				t.Errorf("got %v, want %v containing %q", err, tt.wantCode, tt.wantMsg)
			}
			if tt.wantCode == codes.Internal && strings.Contains(status.Convert(err).Message(), "illegal") {
				t.Errorf("Internal status leaks the backend's detail: %v", err)
			}
			if tt.wantLog != "" && !strings.Contains(logs.String(), tt.wantLog) {
				t.Errorf("server log lacks %q:\n%s", tt.wantLog, logs.String())
			}
			after := stateOf(t, c, srv, b.fakeBackend)
			if diff := cmp.Diff(before, after, protocmp.Transform(), cmpIgnoreBackendCounts); diff != "" {
				t.Errorf("server state changed (-before +after):\n%s", diff)
			}
			if loads, closes := b.counts(); loads-closes != 1 {
				t.Errorf("backend holds %d sets (%d loads, %d closes), want 1 (layer)", loads-closes, loads, closes)
			}

			b.heal()
			if err := tt.call(ctx, c); err != nil {
				t.Errorf("same call once the backend recovered: %v", err)
			}
			if _, err := c.FusedMoE(ctx, request(rng, 2)); err != nil {
				t.Errorf("good call afterwards: %v", err)
			}
		})
	}
}

// TestBackendFault checks the broken-backend signal: request-caused
// failures (out of memory) never raise it, faultThreshold (3) unexplained
// failures in a row do, with the latest error, one log line and one
// OnBackendFault call, and one success clears it (and says so); every
// failure is counted by kind.
func TestBackendFault(t *testing.T) {
	rng := newRand(t)
	reader := sdkmetric.NewManualReader()
	var logs servicetest.LogBuffer
	b := &faultyBackend{fakeBackend: &fakeBackend{}}
	var notified []error // OnBackendFault's calls, in order
	var nmu sync.Mutex
	cfg := service.Config{
		Meter: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)).Meter("test"),
		OnBackendFault: func(err error) {
			nmu.Lock()
			notified = append(notified, err)
			nmu.Unlock()
		},
	}
	c, srv, _ := servicetest.StartServerLogger(t, cfg, b, slog.New(slog.NewTextHandler(&logs, nil)))
	w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)
	if _, err := servicetest.Upload(testContext(t), c, servicetest.Header("layer", w, false), servicetest.Chunks(w, 1000)); err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		callErr   error
		wantCode  codes.Code
		wantFault bool
	}{
		{fmt.Errorf("workspace: %w", kernels.ErrOutOfMemory), codes.ResourceExhausted, false},
		{errors.New("ERR_CUDA: illegal address 1"), codes.Internal, false},
		{errors.New("ERR_CUDA: illegal address 2"), codes.Internal, false},
		{fmt.Errorf("workspace: %w", kernels.ErrOutOfMemory), codes.ResourceExhausted, false},
		{errors.New("ERR_CUDA: illegal address 3"), codes.Internal, true},
		{errors.New("ERR_CUDA: illegal address 4"), codes.Internal, true},
		{nil, codes.OK, false},
	}
	for i, st := range steps {
		b.mu.Lock()
		b.callErr = st.callErr
		b.mu.Unlock()
		_, err := c.FusedMoE(testContext(t), request(rng, 2))
		if got := status.Code(err); got != st.wantCode {
			t.Errorf("step %d: got %v, want %v", i, err, st.wantCode)
		}
		fault := srv.BackendFault()
		if (fault != nil) != st.wantFault {
			t.Errorf("step %d: BackendFault() = %v, want fault %v", i, fault, st.wantFault)
		}
		if fault != nil && !strings.Contains(fault.Error(), st.callErr.Error()) {
			t.Errorf("step %d: BackendFault() = %v, want the latest error %q", i, fault, st.callErr)
		}
	}
	if n := strings.Count(logs.String(), "backend failing"); n != 1 {
		t.Errorf("logged \"backend failing\" %d times, want once:\n%s", n, logs.String())
	}
	if n := strings.Count(logs.String(), "backend recovered"); n != 1 {
		t.Errorf("logged \"backend recovered\" %d times, want once:\n%s", n, logs.String())
	}
	nmu.Lock()
	if len(notified) != 2 || notified[0] == nil || !strings.Contains(notified[0].Error(), "illegal address 3") || notified[1] != nil {
		t.Errorf("OnBackendFault calls = %v, want [the fault with illegal address 3, nil]", notified)
	}
	nmu.Unlock()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "expertd.backend.errors" {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				kind, _ := dp.Attributes.Value("kind")
				got[kind.AsString()] += dp.Value
			}
		}
	}
	if diff := cmp.Diff(map[string]int64{"out_of_memory": 2, "internal": 4}, got); diff != "" {
		t.Errorf("expertd.backend.errors by kind (-want +got):\n%s", diff)
	}
}
