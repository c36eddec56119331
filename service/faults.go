package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/expertd/expertd/kernels"
)

// faultThreshold is how many backend failures in a row, with no success
// between, make BackendFault report the backend broken. One failure is
// often a bad moment (a transient CUDA error); a run of them is a device
// or driver that will not recover without a restart (a sticky CUDA error
// poisons the context for every later call).
const faultThreshold = 3

// faults tracks the backend's unexplained failures.
type faults struct {
	mu      sync.Mutex
	inARow  int
	last    error
	counter metric.Int64Counter
}

// backendErrorKind names a backend error for metrics and says whether it
// counts as a fault: out-of-memory and unsupported are answers about the
// request, cancellation is the caller's; anything else is the backend's.
func backendErrorKind(err error) (string, bool) {
	switch {
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return "canceled", false
	case errors.Is(err, kernels.ErrOutOfMemory):
		return "out_of_memory", false
	case errors.Is(err, kernels.ErrUnsupported):
		return "unsupported", false
	}
	return "internal", true
}

// backendDone records the outcome of one backend call (op is "load" or
// "fused_moe") and returns err.
func (s *Server) backendDone(ctx context.Context, op string, err error) error {
	f := &s.faults
	if err == nil && op == "load" {
		// A copy to the device working says little about the kernels;
		// only a computed call clears a fault.
		return nil
	}
	if err == nil {
		f.mu.Lock()
		cleared := f.inARow >= faultThreshold
		f.inARow, f.last = 0, nil
		f.mu.Unlock()
		if cleared {
			s.log.InfoContext(ctx, "backend recovered: a call succeeded", slog.String("backend", s.backend.Name()))
			if s.cfg.OnBackendFault != nil {
				s.cfg.OnBackendFault(nil)
			}
		}
		return nil
	}
	kind, fault := backendErrorKind(err)
	f.counter.Add(ctx, 1, metric.WithAttributes(attribute.String("backend", s.backend.Name()),
		attribute.String("op", op), attribute.String("kind", kind)))
	if !fault {
		return err
	}
	f.mu.Lock()
	f.inARow++
	f.last = err
	n := f.inARow
	f.mu.Unlock()
	if n == faultThreshold {
		s.log.ErrorContext(ctx, "backend failing: every recent call failed; restart the daemon or check the device",
			slog.String("backend", s.backend.Name()), slog.Int("failures_in_a_row", n), slog.Any("err", err))
		if s.cfg.OnBackendFault != nil {
			s.cfg.OnBackendFault(s.BackendFault())
		}
	}
	return err
}

// BackendFault reports a backend that looks broken: non-nil, with the
// latest error, once faultThreshold calls in a row have failed for reasons
// other than the request (not out-of-memory, unsupported or cancelled);
// nil again after the next successful FusedMoE call. The daemon's health
// checks use it, so a wedged GPU takes the replica out of rotation instead
// of answering Internal forever. Out of rotation it may see no call that
// could clear it: a replica that stays unhealthy is one for the
// orchestrator to restart, which is what a poisoned CUDA context needs
// anyway.
func (s *Server) BackendFault() error {
	f := &s.faults
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.inARow < faultThreshold {
		return nil
	}
	return fmt.Errorf("backend %s: %d calls in a row failed, latest: %w", s.backend.Name(), f.inARow, f.last)
}
