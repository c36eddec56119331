package servicetest

import (
	"context"
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
	if cfg.MaxMessageBytes == 0 {
		cfg.MaxMessageBytes = MaxMessageBytes
	}
	lis := bufconn.Listen(1 << 20)
	srv = service.New(cfg, backend, nil)
	gs := grpc.NewServer(append(srv.ServerOptions(), grpc.MaxRecvMsgSize(int(cfg.MaxMessageBytes)), grpc.MaxSendMsgSize(int(cfg.MaxMessageBytes)))...)
	srv.Register(gs)
	go gs.Serve(lis) //nolint:errcheck // Serve returns when Stop is called
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx) //nolint:errcheck // best effort in tests
		gs.Stop()
	})
	dial = func() *grpc.ClientConn {
		t.Helper()
		conn, err := grpc.NewClient("passthrough:///bufnet",
			grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
			grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(int(cfg.MaxMessageBytes)), grpc.MaxCallSendMsgSize(int(cfg.MaxMessageBytes))),
		)
		if err != nil {
			t.Fatalf("servicetest: dialing bufconn: %v", err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}
	return dial, srv
}
