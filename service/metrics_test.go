package service_test

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
)

// TestMetrics checks the service's instruments count what happened: tokens,
// kernel and queue time per backend, activation and expert set, and
// resident bytes.
func TestMetrics(t *testing.T) {
	rng := newRand(t)
	reader := sdkmetric.NewManualReader()
	meter := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)).Meter("test")
	c, w := loadedServer(t, rng, service.Config{Meter: meter}, &fakeBackend{})
	for _, m := range []int{3, 5} {
		if _, err := c.FusedMoE(testContext(t), request(rng, m)); err != nil {
			t.Fatal(err)
		}
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	want := attribute.NewSet(attribute.String("backend", "fake"), attribute.String("activation", "silu_gated"), attribute.String("expert_set", "layer"))
	wantQueue := attribute.NewSet(attribute.String("backend", "fake"), attribute.String("expert_set", "layer"))
	var tokens, kernelCount, queueCount, loaded int64 = -1, -1, -1, -1
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				if m.Name == "expertd.tokens" && len(d.DataPoints) == 1 && d.DataPoints[0].Attributes.Equals(&want) {
					tokens = d.DataPoints[0].Value
				}
			case metricdata.Histogram[float64]:
				if m.Name == "expertd.kernel.duration" && len(d.DataPoints) == 1 && d.DataPoints[0].Attributes.Equals(&want) {
					kernelCount = int64(d.DataPoints[0].Count)
				}
				if m.Name == "expertd.queue.duration" && len(d.DataPoints) == 1 && d.DataPoints[0].Attributes.Equals(&wantQueue) {
					queueCount = int64(d.DataPoints[0].Count)
				}
			case metricdata.Gauge[int64]:
				if m.Name == "expertd.loaded_expert_bytes" && len(d.DataPoints) == 1 {
					loaded = d.DataPoints[0].Value
				}
			}
		}
	}
	var wantBytes int64
	for _, tt := range []*pb.Tensor{w.GetW13(), w.GetW2(), w.GetW13Scale(), w.GetW2Scale()} {
		wantBytes += int64(len(tt.GetData()))
	}
	if tokens != 8 || kernelCount != 2 || queueCount != 2 || loaded != wantBytes {
		t.Errorf("tokens %d, kernel samples %d, queue samples %d, loaded bytes %d; want 8, 2, 2, %d", tokens, kernelCount, queueCount, loaded, wantBytes)
	}
}
