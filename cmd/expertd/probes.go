package main

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
)

// Probe timings. A backend failing for livezFaultGrace is one no call
// will clear (out of rotation it sees none), such as a poisoned CUDA
// context, which only a restart fixes; livezStall bounds how long the
// service may take to answer before the process counts as wedged.
const (
	livezFaultGrace = 2 * time.Minute
	livezStall      = 2 * time.Second
)

// readiness joins what decides whether the replica takes calls: the
// startup manifest loaded and the backend not failing. It drives gRPC
// health and /readyz alike; the drain (hs.Shutdown, svc.Draining) overrides
// both.
type readiness struct {
	hs *health.Server
	// pending counts manifest sets not loaded yet.
	pending atomic.Int64

	mu         sync.Mutex
	loaded     bool
	fault      error
	faultSince time.Time
}

// newReadiness starts NOT_SERVING while pending sets remain.
func newReadiness(hs *health.Server, pending int) *readiness {
	r := &readiness{hs: hs}
	r.pending.Store(int64(pending))
	r.loaded = pending == 0
	r.apply()
	return r
}

// onFault is the service's OnBackendFault.
func (r *readiness) onFault(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err != nil && r.fault == nil {
		r.faultSince = time.Now()
	}
	r.fault = err
	r.apply()
}

// setLoaded marks the manifest loaded.
func (r *readiness) setLoaded() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pending.Store(0)
	r.loaded = true
	r.apply()
}

// apply sets both health entries; after hs.Shutdown (the drain) it
// changes nothing. Callers hold mu (or own r exclusively).
func (r *readiness) apply() {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if r.loaded && r.fault == nil {
		st = healthpb.HealthCheckResponse_SERVING
	}
	r.hs.SetServingStatus("", st)
	r.hs.SetServingStatus(pb.ExpertService_ServiceDesc.ServiceName, st)
}

// notReady says why the replica should take no calls, "" when it should.
func (r *readiness) notReady(svc *service.Server) string {
	if svc.Draining() {
		return "draining"
	}
	r.mu.Lock()
	loaded, fault := r.loaded, r.fault
	r.mu.Unlock()
	if !loaded {
		return fmt.Sprintf("loading the startup manifest: %d sets pending", r.pending.Load())
	}
	if fault != nil {
		return "backend failing: " + fault.Error()
	}
	return ""
}

// notAlive says why the process should be restarted, "" when it should
// not: the service does not answer within livezStall, or the backend has
// failed every call for livezFaultGrace.
func (r *readiness) notAlive(svc *service.Server) string {
	answered := make(chan struct{})
	go func() {
		svc.LoadedBytes() // takes the registry's lock, as every call does
		close(answered)
	}()
	select {
	case <-answered:
	case <-time.After(livezStall):
		return fmt.Sprintf("service did not answer within %v", livezStall)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fault != nil && time.Since(r.faultSince) > livezFaultGrace {
		return fmt.Sprintf("backend failing for %v: %v", time.Since(r.faultSince).Round(time.Second), r.fault)
	}
	return ""
}

// registerProbes serves /livez (restart me?) and /readyz (send me calls?)
// for orchestrators, beside /healthz: 200 "ok", or 503 with the reason.
func registerProbes(mux *http.ServeMux, r *readiness, svc *service.Server) {
	probe := func(why func(*service.Server) string) http.HandlerFunc {
		return func(w http.ResponseWriter, _ *http.Request) {
			if msg := why(svc); msg != "" {
				http.Error(w, msg, http.StatusServiceUnavailable)
				return
			}
			io.WriteString(w, "ok\n")
		}
	}
	mux.HandleFunc("/livez", probe(r.notAlive))
	mux.HandleFunc("/readyz", probe(r.notReady))
}

// probeURL is -probe: one GET, an error unless it answers 200.
func probeURL(url string) error {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s: %s", url, resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}
