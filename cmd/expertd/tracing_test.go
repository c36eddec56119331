package main

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service/servicetest"
)

// collector is an OTLP/gRPC trace receiver that records span names.
type collector struct {
	collectortrace.UnimplementedTraceServiceServer
	mu    sync.Mutex
	names []string
}

func (c *collector) Export(_ context.Context, req *collectortrace.ExportTraceServiceRequest) (*collectortrace.ExportTraceServiceResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				c.names = append(c.names, s.GetName())
			}
		}
	}
	return &collectortrace.ExportTraceServiceResponse{}, nil
}

func (c *collector) spans() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.names...)
}

// TestTracesReachCollector runs the daemon with -otlp-endpoint pointing at
// an in-test collector and checks that an RPC's server span arrives there
// by the time the daemon has exited (the exit flushes the batcher).
func TestTracesReachCollector(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	col := &collector{}
	cs := grpc.NewServer()
	collectortrace.RegisterTraceServiceServer(cs, col)
	go cs.Serve(lis) //nolint:errcheck // stopped below
	defer cs.Stop()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs servicetest.LogBuffer
	ready := make(chan listening, 1)
	done := make(chan error, 1)
	args := []string{"-listen", "127.0.0.1:0", "-admin-addr", "", "-backend", "cpu",
		"-otlp-endpoint", "http://" + lis.Addr().String()}
	go func() { done <- run(ctx, args, func(string) string { return "" }, &logs, ready) }()
	var addrs listening
	select {
	case addrs = <-ready:
	case err := <-done:
		t.Fatalf("run exited early: %v\n%s", err, logs.String())
	case <-time.After(defaultTestTimeout):
		t.Fatal("daemon not ready")
	}

	conn, err := grpc.NewClient(addrs.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	callCtx, callCancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer callCancel()
	if _, err := pb.NewExpertServiceClient(conn).GetServerInfo(callCtx, &pb.GetServerInfoRequest{}); err != nil {
		t.Fatal(err)
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v\n%s", err, logs.String())
		}
	case <-time.After(defaultTestTimeout):
		t.Fatal("daemon did not stop")
	}
	const want = "expertd.v1.ExpertService/GetServerInfo"
	got := col.spans()
	for _, name := range got {
		if name == want {
			return
		}
	}
	t.Errorf("collector received spans %q, want one named %q", got, want)
}
