package main

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// newTracerProvider is where RPC spans go: batched to the OTLP collector at
// cfg.OTLPEndpoint, or nowhere (a no-op provider, so an untraced daemon pays
// nothing per call). shutdown flushes what is buffered.
func newTracerProvider(ctx context.Context, cfg Config) (tp trace.TracerProvider, shutdown func(context.Context) error, err error) {
	if cfg.OTLPEndpoint == "" {
		return noop.NewTracerProvider(), func(context.Context) error { return nil }, nil
	}
	exp, err := otlptracegrpc.New(ctx, otlptracegrpc.WithEndpointURL(cfg.OTLPEndpoint))
	if err != nil {
		return nil, nil, fmt.Errorf("otlp trace exporter %s: %w", cfg.OTLPEndpoint, err)
	}
	res := resource.NewWithAttributes(semconv.SchemaURL,
		semconv.ServiceName("expertd"), semconv.ServiceVersion(version()))
	p := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	return p, p.Shutdown, nil
}
