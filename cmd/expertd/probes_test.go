package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/health"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/service"
)

// TestReadiness walks the states /readyz and /livez report: loading,
// ready, a backend fault (not ready; not alive once it has lasted
// livezFaultGrace), recovered, draining.
func TestReadiness(t *testing.T) {
	b, err := kernels.Open("cpu", kernels.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	svc := service.New(service.Config{}, b, slog.New(slog.NewTextHandler(io.Discard, nil)))
	r := newReadiness(health.NewServer(), 2)
	check := func(step, wantReady, wantAlive string) {
		t.Helper()
		if got := r.notReady(svc); !strings.Contains(got, wantReady) || (wantReady == "") != (got == "") {
			t.Errorf("%s: notReady = %q, want %q", step, got, wantReady)
		}
		if got := r.notAlive(svc); !strings.Contains(got, wantAlive) || (wantAlive == "") != (got == "") {
			t.Errorf("%s: notAlive = %q, want %q", step, got, wantAlive)
		}
	}
	check("loading", "2 sets pending", "")
	r.pending.Add(-1)
	check("one loaded", "1 sets pending", "")
	r.setLoaded()
	check("loaded", "", "")
	r.onFault(errors.New("backend cuda: 3 calls in a row failed"))
	check("fault", "backend failing: backend cuda", "")
	r.mu.Lock()
	r.faultSince = time.Now().Add(-livezFaultGrace - time.Second)
	r.mu.Unlock()
	check("lasting fault", "backend failing", "backend failing for 2m")
	r.onFault(nil)
	check("recovered", "", "")
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	svc.Shutdown(ctx)
	check("draining", "draining", "")
}
