// Package spans starts the daemon's child spans so that, with tracing
// off, a stage costs nothing: no context, no span, no attribute list.
package spans

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// noop is returned when tracing is off: it records nothing and costs no
// allocation.
var noop = trace.SpanFromContext(context.Background())

// Start starts a child span of ctx's span named name with tr, or, with
// no tracer, returns ctx and a span that does nothing.
func Start(ctx context.Context, tr trace.Tracer, name string) (context.Context, trace.Span) {
	if tr == nil {
		return ctx, noop
	}
	return tr.Start(ctx, name)
}

// SetAttrs sets attributes on a recording span only, so the attribute
// list is not even built for a span nobody samples.
func SetAttrs(span trace.Span, attrs func() []attribute.KeyValue) {
	if span.IsRecording() {
		span.SetAttributes(attrs()...)
	}
}
