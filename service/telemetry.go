package service

import (
	"context"

	"go.opentelemetry.io/otel/trace"

	"github.com/expertd/expertd/internal/spans"
)

// LatencyBuckets are the histogram boundaries, in seconds, of the service's
// durations (kernel and queue time) and of the daemon's RPC durations: 10 µs
// to 10 s in 1-2-5 steps, so a GPU call of about 100 µs and a CPU call of
// seconds are both resolved to within a factor of 2.5.
var LatencyBuckets = []float64{
	1e-5, 2e-5, 5e-5,
	1e-4, 2e-4, 5e-4,
	1e-3, 2e-3, 5e-3,
	1e-2, 2e-2, 5e-2,
	0.1, 0.2, 0.5,
	1, 2, 5, 10,
}

// spanKernel is the span of the backend call, below the RPC span (and
// below kernels/batch's queue and batch spans).
const spanKernel = "expertd.kernel"

// inlineLabel is the expert_set label of calls with inline weights: a label
// per set name is bounded by what is loaded, inline calls have no name.
const inlineLabel = "inline"

// startSpan starts a child span of ctx's span named name, or, with no
// tracer, returns ctx and a span that does nothing, so an untraced daemon
// pays nothing per stage.
func (s *Server) startSpan(ctx context.Context, name string) (context.Context, trace.Span) {
	return spans.Start(ctx, s.cfg.Tracer, name)
}
