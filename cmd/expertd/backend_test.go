package main

import (
	"context"
	"errors"
	"log/slog"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cuda"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service/servicetest"
)

// fakeCUDALibrary builds ../../testdata/fakecuda/fakecuda.c, a kernel
// library that loads but speaks ABI 999, or skips without a C compiler.
func fakeCUDALibrary(t *testing.T) string {
	t.Helper()
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skipf("no C compiler to build the fake library: %v", err)
	}
	out := filepath.Join(t.TempDir(), "libexpertd_cuda.so")
	if b, err := exec.Command(cc, "-shared", "-fPIC", "-DFAKE_ABI=999", "-o", out, "../../testdata/fakecuda/fakecuda.c").CombinedOutput(); err != nil {
		t.Fatalf("building the fake library: %v\n%s", err, b)
	}
	return out
}

// TestBackendFallback checks what each -backend does with a CUDA library
// that cannot serve (here: the wrong ABI version): auto serves on the CPU
// and says why, loudly; cuda refuses to start and says why; cpu never
// looks at the library.
func TestBackendFallback(t *testing.T) {
	lib := fakeCUDALibrary(t)
	tests := []struct {
		backend  string
		wantName string // "" when opening must fail
		wantLog  string
	}{
		{"auto", "cpu", "CUDA backend unavailable; serving on the CPU backend"},
		{"cuda", "", ""},
		{"cpu", "cpu", ""},
	}
	for _, tt := range tests {
		t.Run(tt.backend, func(t *testing.T) {
			var logs servicetest.LogBuffer
			log := slog.New(slog.NewTextHandler(&logs, nil))
			b, err := openBackend(Config{Backend: tt.backend, Kernels: kernels.Config{LibraryPath: lib}, CUDA: cuda.DefaultOptions()}, log)
			if tt.wantName == "" {
				if err == nil {
					b.Close()
					t.Fatalf("-backend %s opened %s with a wrong-ABI library", tt.backend, b.Name())
				}
				if !strings.Contains(err.Error(), "speaks ABI 999") {
					t.Errorf("-backend %s: %v, want the ABI mismatch named", tt.backend, err)
				}
				return
			}
			if err != nil {
				t.Fatalf("-backend %s: %v", tt.backend, err)
			}
			defer b.Close()
			if b.Name() != tt.wantName {
				t.Errorf("-backend %s serves on %s, want %s", tt.backend, b.Name(), tt.wantName)
			}
			got := logs.String()
			if tt.wantLog != "" && (!strings.Contains(got, tt.wantLog) || !strings.Contains(got, "level=WARN") || !strings.Contains(got, "speaks ABI 999")) {
				t.Errorf("log lacks a warning %q with the cause:\n%s", tt.wantLog, got)
			}
			if tt.wantLog == "" && got != "" {
				t.Errorf("unexpected log:\n%s", got)
			}
		})
	}
}

// TestCUDABackendRefusesToStart runs the daemon with -backend cuda and a
// library it cannot use: it must exit with the cause before listening.
func TestCUDABackendRefusesToStart(t *testing.T) {
	lib := fakeCUDALibrary(t)
	var stderr servicetest.LogBuffer
	ready := make(chan listening, 1)
	err := run(context.Background(), []string{"-backend", "cuda", "-library-path", lib, "-listen", "127.0.0.1:0", "-admin-addr", ""},
		func(string) string { return "" }, &stderr, ready)
	if err == nil || !strings.Contains(err.Error(), "backend cuda") || !strings.Contains(err.Error(), "speaks ABI 999") {
		t.Errorf("run: %v, want a start-up error naming the backend and the ABI mismatch", err)
	}
	select {
	case a := <-ready:
		t.Errorf("daemon listened on %s with an unusable cuda backend", a.grpc)
	default:
	}
}

// TestBackendHealth checks the fault callback drives both health entries
// and cannot revive a draining server.
func TestBackendHealth(t *testing.T) {
	hs := health.NewServer()
	set := newReadiness(hs, 0).onFault
	ctx := context.Background()
	check := func(step string, want healthpb.HealthCheckResponse_ServingStatus) {
		t.Helper()
		for _, svc := range []string{"", pb.ExpertService_ServiceDesc.ServiceName} {
			resp, err := hs.Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
			if err != nil || resp.GetStatus() != want {
				t.Errorf("%s: health of %q = %v, %v; want %v", step, svc, resp.GetStatus(), err, want)
			}
		}
	}
	set(nil)
	check("healthy", healthpb.HealthCheckResponse_SERVING)
	set(errors.New("backend cuda: 3 calls in a row failed"))
	check("fault", healthpb.HealthCheckResponse_NOT_SERVING)
	set(nil)
	check("recovered", healthpb.HealthCheckResponse_SERVING)
	hs.Shutdown()
	set(nil)
	check("draining", healthpb.HealthCheckResponse_NOT_SERVING)
}
