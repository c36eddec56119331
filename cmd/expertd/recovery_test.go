package main

import (
	"context"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"strings"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// panicBackend loads anything and panics in every FusedMoE call.
type panicBackend struct{}

type panicLoaded struct{ set *moe.ExpertSet }

func (l panicLoaded) Set() *moe.ExpertSet { return l.set }
func (l panicLoaded) Close() error        { return nil }

func (panicBackend) Name() string                       { return "panicky" }
func (panicBackend) Capabilities() kernels.Capabilities { return kernels.Capabilities{} }
func (panicBackend) Close() error                       { return nil }
func (panicBackend) Load(_ context.Context, s *moe.ExpertSet) (kernels.Loaded, error) {
	return panicLoaded{s}, nil
}
func (panicBackend) FusedMoE(context.Context, kernels.Loaded, *moe.Request) (*moe.Result, error) {
	panic("kernel bug")
}

// TestPanicBecomesInternal checks a panicking backend costs one call an
// Internal status, is logged with its stack, counts as a backend fault,
// and leaves the server serving.
func TestPanicBecomesInternal(t *testing.T) {
	var logs servicetest.LogBuffer
	log := slog.New(slog.NewJSONHandler(&logs, nil))
	cfg, err := parseConfig(nil, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	gs := newGRPCServer(cfg, log, sdkmetric.NewMeterProvider(), noop.NewTracerProvider())
	svc := service.New(service.Config{}, panicBackend{}, log)
	svc.Register(gs)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go gs.Serve(lis) //nolint:errcheck // stopped below
	defer gs.Stop()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 2))
	const e, k, n = 2, 16, 8
	fp8 := pb.DataType_DATA_TYPE_FLOAT8_E4M3FN
	req := &pb.FusedMoERequest{
		Experts: &pb.FusedMoERequest_Weights{Weights: &pb.ExpertWeights{
			Activation: pb.Activation_ACTIVATION_RELU2,
			W13:        tensor(fp8, randFP8(rng, e*n*k), e, n, k),
			W2:         tensor(fp8, randFP8(rng, e*k*n), e, k, n),
			W13Scale:   tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(0.01)),
			W2Scale:    tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(0.01)),
		}},
		HiddenStates: tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(randF32(rng, k)...), 1, k),
		RouterLogits: tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(randF32(rng, e)...), 1, e),
		Routing:      &pb.Routing{TopK: 1},
	}
	c := pb.NewExpertServiceClient(conn)
	for i := range 3 {
		if _, err := c.FusedMoE(ctx, req); status.Code(err) != codes.Internal {
			t.Errorf("call %d: got %v, want Internal", i, err)
		}
	}
	// Three panics in a row are a backend fault, for health to report.
	if err := svc.BackendFault(); err == nil || !strings.Contains(err.Error(), "panicked: kernel bug") {
		t.Errorf("BackendFault() after 3 panics = %v, want the panic", err)
	}
	if _, err := c.GetServerInfo(ctx, &pb.GetServerInfoRequest{}); err != nil {
		t.Errorf("server not serving after panics: %v", err)
	}
	if out := logs.String(); !strings.Contains(out, "panic in handler") || !strings.Contains(out, "kernel bug") {
		t.Errorf("panic not logged:\n%s", out)
	}
}
