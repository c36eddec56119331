package service

import (
	"context"
	"time"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/batch"
	"github.com/expertd/expertd/moe"
)

// SuggestedBatchWindow is the daemon's default window (-batch-window):
// the shortest that batches many small callers about as well as one large
// one on the GPU, where longer windows batch no better, and on the CPU
// backend, which is insensitive to it (docs/perf-notes.md, "Dynamic
// batching", has the sweep). Since a batch on an idle key starts at once,
// only calls that arrived while a batch of their key ran pay the window,
// after it finishes, so the shortest window that batches well is best.
const SuggestedBatchWindow = 200 * time.Microsecond

// DefaultBatchMaxTokens bounds the tokens of one merged call when
// Config.BatchMaxTokens is 0: a GPU layer's time grows little beyond it
// (docs/perf-notes.md), and it keeps the latency a small caller pays for
// others' tokens bounded on slower backends.
const DefaultBatchMaxTokens = 256

// newBatch is the layer every FusedMoE call runs through: kernels/batch
// around the server's backend, on the server's execution slots, merging
// calls when cfg turns batching on.
func newBatch(s *Server, cfg Config) *batch.Backend {
	o := batch.Options{Window: cfg.BatchWindow, Slots: s.slots, Tracer: cfg.Tracer, Meter: cfg.Meter, Logger: s.log}
	if cfg.BatchWindow > 0 {
		o.MaxTokens = batchMaxTokens(cfg)
	}
	return batch.New(meteredBackend{Backend: s.backend, s: s}, o)
}

// batchMaxTokens is the most tokens of one merged call under cfg:
// BatchMaxTokens, or DefaultBatchMaxTokens when 0, capped by MaxTokens.
func batchMaxTokens(cfg Config) int {
	n := cfg.BatchMaxTokens
	if n <= 0 {
		n = DefaultBatchMaxTokens
	}
	if cfg.MaxTokens > 0 {
		n = min(n, cfg.MaxTokens)
	}
	return n
}

// meteredBackend is the server's backend as kernels/batch calls it: each
// FusedMoE is one backend call, which compute checks and records (kernel
// span, faults, kernel time) under the set label runCall put in ctx; a
// merged batch's calls share their set, so its first caller's label is
// every caller's.
type meteredBackend struct {
	kernels.Backend
	s *Server
}

func (m meteredBackend) FusedMoE(ctx context.Context, l kernels.Loaded, req *moe.Request) (*moe.Result, error) {
	label, _ := ctx.Value(setLabelKey{}).(string)
	return m.s.compute(ctx, label, l, req)
}

// setLabelKey is the context key of a call's expert_set label.
type setLabelKey struct{}

// withSetLabel is ctx carrying a call's expert_set label to compute.
func withSetLabel(ctx context.Context, label string) context.Context {
	return context.WithValue(ctx, setLabelKey{}, label)
}

// Batched is the number of FusedMoE calls waiting in the batcher for their
// batch's backend call to start.
func (s *Server) Batched() int { return s.batch.Waiting() }
