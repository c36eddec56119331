package servicetest

import (
	"context"
	"log/slog"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/service"
)

// StartServerDial serves backend over an in-memory listener, like
// StartServerConfig, for tests that open and close their own connections
// (shared-memory regions belong to one connection). dial opens a new
// connection, closed at cleanup if the test has not closed it.
func StartServerDial(t testing.TB, cfg service.Config, backend kernels.Backend) (dial func() *grpc.ClientConn, srv *service.Server) {
	t.Helper()
	m := serveMem(cfg, backend, nil)
	t.Cleanup(m.stop)
	dial = func() *grpc.ClientConn {
		t.Helper()
		conn, err := m.dial()
		if err != nil {
			t.Fatalf("servicetest: dialing bufconn: %v", err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}
	return dial, m.srv
}

// memServer is a service served over an in-memory listener with the
// daemon's server options.
type memServer struct {
	lis      *bufconn.Listener
	srv      *service.Server
	gs       *grpc.Server
	maxBytes int
}

// serveMem starts backend's service with opts after its own server
// options; MaxMessageBytes defaults to this package's.
func serveMem(cfg service.Config, backend kernels.Backend, log *slog.Logger, opts ...grpc.ServerOption) *memServer {
	if cfg.MaxMessageBytes == 0 {
		cfg.MaxMessageBytes = MaxMessageBytes
	}
	m := &memServer{lis: bufconn.Listen(1 << 20), srv: service.New(cfg, backend, log), maxBytes: int(cfg.MaxMessageBytes)}
	m.gs = grpc.NewServer(append(append(m.srv.ServerOptions(), grpc.MaxRecvMsgSize(m.maxBytes), grpc.MaxSendMsgSize(m.maxBytes)), opts...)...)
	m.srv.Register(m.gs)
	go m.gs.Serve(m.lis) //nolint:errcheck // Serve returns when Stop is called
	return m
}

// dial opens a client connection with the server's message limits.
func (m *memServer) dial() (*grpc.ClientConn, error) {
	return grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return m.lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(m.maxBytes), grpc.MaxCallSendMsgSize(m.maxBytes)),
	)
}

// stop drains the service (best effort, as tests need) and stops serving.
func (m *memServer) stop() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	m.srv.Shutdown(ctx) //nolint:errcheck // best effort in tests
	m.gs.Stop()
}
