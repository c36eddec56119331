// Package clienttest serves an in-process expertd for tests and examples
// of code that uses package client, and converts kerneltest cases into the
// SDK's request types, so that a test can check a result against
// kerneltest.Reference.
package clienttest

import (
	"context"
	"fmt"
	"net"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/service"
)

// MaxMessageBytes is the test server's message limit: roomy for inline
// test weights, small enough that a client that stops chunking large
// uploads is noticed.
const MaxMessageBytes = 16 << 20

// Server is a running in-process expertd on a loopback TCP port.
type Server struct {
	// Addr is "127.0.0.1:port", ready for client.Dial.
	Addr string
	// Service is the ExpertService behind it (for Shutdown in tests).
	Service *service.Server
	gs      *grpc.Server
	backend kernels.Backend
}

// Serve starts ExpertService on the CPU backend, with the standard health
// service, on a fresh loopback port. A zero cfg.MaxMessageBytes means
// MaxMessageBytes; a zero MaxConcurrent means 2.
func Serve(cfg service.Config) (*Server, error) {
	return ServeBackend(cfg, cpu.New(kernels.Config{}))
}

// ServeBackend is Serve on backend (servicetest.FakeDevice, say, to
// register CUDA IPC memory without a GPU), which Stop closes.
func ServeBackend(cfg service.Config, backend kernels.Backend) (*Server, error) {
	if cfg.MaxMessageBytes == 0 {
		cfg.MaxMessageBytes = MaxMessageBytes
	}
	if cfg.MaxConcurrent == 0 {
		cfg.MaxConcurrent = 2
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("clienttest: listen: %w", err)
	}
	svc := service.New(cfg, backend, nil)
	gs := grpc.NewServer(append(svc.ServerOptions(), grpc.MaxRecvMsgSize(int(cfg.MaxMessageBytes)), grpc.MaxSendMsgSize(int(cfg.MaxMessageBytes)),
		// The SDK pings every client.DefaultKeepaliveTime, with or without
		// RPCs in flight (a caller on a call ring sends none for minutes);
		// grpc-go's default policy answers that with GOAWAY too_many_pings.
		// Half the interval leaves room for timer skew, as the daemon's
		// -keepalive-min-time does.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: client.DefaultKeepaliveTime / 2, PermitWithoutStream: true}))...)
	svc.Register(gs)
	hs := health.NewServer()
	hs.SetServingStatus(pb.ExpertService_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(gs, hs)
	go gs.Serve(lis) //nolint:errcheck // returns when stopped
	return &Server{Addr: lis.Addr().String(), Service: svc, gs: gs, backend: backend}, nil
}

// MustServe is Serve with a default Config that panics on failure, for
// examples.
func MustServe() *Server {
	s, err := Serve(service.Config{})
	if err != nil {
		panic(err)
	}
	return s
}

// Stop drains the service for up to a second, then stops the server.
func (s *Server) Stop() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	s.Service.Shutdown(ctx) //nolint:errcheck // best effort
	s.gs.Stop()
	s.backend.Close()
}

// Weights is the SDK form of a kerneltest expert set.
func Weights(set *kernels.ExpertSet) *client.ExpertWeights {
	scale := func(ws scaling.WeightScale) client.Tensor {
		return client.FromFloat32(ws.Values, ws.Shape()...)
	}
	w := &client.ExpertWeights{
		Activation:  client.Activation(set.Activation),
		W13:         client.FromFP8(set.W13, set.E, set.Rows1(), set.K),
		W2:          client.FromFP8(set.W2, set.E, set.K, set.N),
		W13Scale:    scale(set.W13Scale),
		W2Scale:     scale(set.W2Scale),
		BlockShape:  set.Block,
		SwigluLimit: set.SwigluLimit, SwigluAlpha: set.SwigluAlpha,
	}
	if set.W13Bias != nil {
		w.W13Bias = client.FromFloat32(set.W13Bias, set.E, set.Rows1())
	}
	if set.W2Bias != nil {
		w.W2Bias = client.FromFloat32(set.W2Bias, set.E, set.K)
	}
	if set.A13Scale != nil {
		w.A13Scale = client.FromFloat32([]float32{*set.A13Scale})
	}
	if set.A2Scale != nil {
		w.A2Scale = client.FromFloat32([]float32{*set.A2Scale})
	}
	return w
}

// Request is the SDK form of a kerneltest request on the loaded set name
// (or, with name "", on inline weights the caller fills in).
func Request(name string, set *kernels.ExpertSet, r *kernels.Request) *client.FusedMoERequest {
	m := r.M()
	tensor := func(t kernels.Tensor) client.Tensor {
		return client.Tensor{DType: client.DType(t.DType), Shape: t.Shape, Data: t.Data}
	}
	req := &client.FusedMoERequest{
		ExpertSet:   name,
		Hidden:      tensor(r.Hidden),
		OutputDType: client.DType(r.OutDType),
		Routing: client.Routing{
			TopK: r.Routing.TopK, Renormalize: r.Routing.Renormalize, Scoring: client.Scoring(r.Routing.Scoring),
			NumGroups: r.Routing.NumGroups, TopKGroups: r.Routing.TopKGroups, ScalingFactor: r.Routing.ScalingFactor,
		},
	}
	switch n := len(r.HiddenScale); {
	case n == 0:
	case n == 1:
		req.HiddenScale = client.FromFloat32(r.HiddenScale)
	case n == m:
		req.HiddenScale = client.FromFloat32(r.HiddenScale, m)
	default:
		req.HiddenScale = client.FromFloat32(r.HiddenScale, m, n/m)
	}
	if r.Routing.CorrectionBias != nil {
		req.Routing.CorrectionBias = client.FromFloat32(r.Routing.CorrectionBias, set.E)
	}
	if r.TopKIDs != nil {
		k := r.Routing.TopK
		req.TopKIDs = client.FromInt32(r.TopKIDs, m, k)
		req.TopKWeights = client.FromFloat32(r.TopKWeights, m, k)
	} else {
		req.RouterLogits = tensor(r.Logits)
	}
	return req
}
