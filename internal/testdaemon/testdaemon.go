// Package testdaemon serves an in-process expertd for the module's tests
// and examples of code that uses package client. It lives apart from the
// SDK's own test helpers (client/clienttest) so that the SDK and they link
// no engine and no service.
package testdaemon

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
		return nil, fmt.Errorf("testdaemon: listen: %w", err)
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
