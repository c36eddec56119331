// Package servicetest starts an in-memory ExpertService for tests, so every
// package tests through the same gRPC door that users use.
package servicetest

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/expertd/expertd/kernels"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
)

// MaxMessageBytes is the message limit of the test server and client: large
// enough for test-sized inline weights, small enough that tests notice when
// they stop chunking.
const MaxMessageBytes = 64 << 20

// StartServer serves backend over an in-memory connection with a default
// Config and returns a connected client and a cleanup that stops both
// (also registered with t.Cleanup; calling it twice is harmless).
func StartServer(t testing.TB, backend kernels.Backend) (pb.ExpertServiceClient, func()) {
	t.Helper()
	c, _, cleanup := StartServerConfig(t, service.Config{MaxConcurrent: 4}, backend)
	return c, cleanup
}

// StartServerConfig is StartServer with a chosen Config; it also returns
// the Server, for lifecycle tests (Shutdown).
func StartServerConfig(t testing.TB, cfg service.Config, backend kernels.Backend) (pb.ExpertServiceClient, *service.Server, func()) {
	t.Helper()
	return StartServerLogger(t, cfg, backend, nil)
}

// StartServerLogger is StartServerConfig with the server logging to log,
// for tests that check what the server reports.
func StartServerLogger(t testing.TB, cfg service.Config, backend kernels.Backend, log *slog.Logger) (pb.ExpertServiceClient, *service.Server, func()) {
	t.Helper()
	return startServer(t, cfg, backend, log)
}

// StartServerOptions is StartServerConfig with more gRPC server options
// after the service's own, for tests that intercept calls.
func StartServerOptions(t testing.TB, cfg service.Config, backend kernels.Backend, opts ...grpc.ServerOption) (pb.ExpertServiceClient, *service.Server) {
	t.Helper()
	c, srv, _ := startServer(t, cfg, backend, nil, opts...)
	return c, srv
}

func startServer(t testing.TB, cfg service.Config, backend kernels.Backend, log *slog.Logger, opts ...grpc.ServerOption) (pb.ExpertServiceClient, *service.Server, func()) {
	t.Helper()
	m := serveMem(cfg, backend, log, opts...)
	conn, err := m.dial()
	if err != nil {
		t.Fatalf("servicetest: dialing bufconn: %v", err)
	}
	stopped := false
	cleanup := func() {
		if stopped {
			return
		}
		stopped = true
		conn.Close()
		m.stop()
	}
	t.Cleanup(cleanup)
	return pb.NewExpertServiceClient(conn), m.srv, cleanup
}

// tensorFields are ExpertWeights' tensors with the names chunks use, in
// field (and fingerprint) order.
func tensorFields(w *pb.ExpertWeights) []struct {
	Name   string
	Tensor *pb.Tensor
} {
	return []struct {
		Name   string
		Tensor *pb.Tensor
	}{
		{"w13", w.GetW13()}, {"w2", w.GetW2()}, {"w13_scale", w.GetW13Scale()},
		{"w2_scale", w.GetW2Scale()}, {"a13_scale", w.GetA13Scale()}, {"a2_scale", w.GetA2Scale()},
		{"w13_bias", w.GetW13Bias()}, {"w2_bias", w.GetW2Bias()},
	}
}

// Header declares w (which carries inline data) for a chunked upload: the
// same tensors without their bytes, and their total size.
func Header(name string, w *pb.ExpertWeights, overwrite bool) *pb.LoadExpertsRequest_Header {
	meta := proto.Clone(w).(*pb.ExpertWeights)
	var total int64
	for _, f := range tensorFields(meta) {
		if f.Tensor != nil {
			total += int64(len(f.Tensor.GetData()))
			f.Tensor.Source = nil
		}
	}
	return &pb.LoadExpertsRequest_Header{Name: name, Weights: meta, TotalBytes: total, Overwrite: overwrite}
}

// Chunks splits w's tensor bytes into chunks of at most size bytes, in
// field and offset order.
func Chunks(w *pb.ExpertWeights, size int) []*pb.LoadExpertsRequest_Chunk {
	var out []*pb.LoadExpertsRequest_Chunk
	for _, f := range tensorFields(w) {
		data := f.Tensor.GetData()
		for off := 0; off < len(data); off += size {
			out = append(out, &pb.LoadExpertsRequest_Chunk{Tensor: f.Name, Offset: int64(off), Data: data[off:min(off+size, len(data))]})
		}
	}
	return out
}

// Upload loads w under name through LoadExperts: the header, then the
// chunks in the given order.
func Upload(ctx context.Context, c pb.ExpertServiceClient, h *pb.LoadExpertsRequest_Header, chunks []*pb.LoadExpertsRequest_Chunk) (*pb.ExpertSetInfo, error) {
	stream, err := c.LoadExperts(ctx)
	if err != nil {
		return nil, err
	}
	if err := stream.Send(&pb.LoadExpertsRequest{Payload: &pb.LoadExpertsRequest_Header_{Header: h}}); err != nil {
		_, err = stream.CloseAndRecv()
		return nil, err
	}
	for _, ch := range chunks {
		if err := stream.Send(&pb.LoadExpertsRequest{Payload: &pb.LoadExpertsRequest_Chunk_{Chunk: ch}}); err != nil {
			// The server ended the stream early; its status says why.
			_, err = stream.CloseAndRecv()
			return nil, err
		}
	}
	return stream.CloseAndRecv()
}

// LogBuffer is a log sink that a server's goroutines may write while a test
// reads it: give it to slog.NewJSONHandler, or to a daemon's stderr copy.
type LogBuffer struct {
	mu sync.Mutex
	b  strings.Builder
	// grew, made by a waiting WaitFor, is closed by the next Write.
	grew chan struct{}
}

// Write appends p.
func (l *LogBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.grew != nil {
		close(l.grew)
		l.grew = nil
	}
	return l.b.Write(p)
}

// WaitFor waits until cond holds for everything written so far, checking
// after each Write, or until ctx ends: for what a server logs after the
// client has its answer.
func (l *LogBuffer) WaitFor(ctx context.Context, cond func(log string) bool) error {
	for {
		l.mu.Lock()
		log := l.b.String()
		if l.grew == nil {
			l.grew = make(chan struct{})
		}
		grew := l.grew
		l.mu.Unlock()
		if cond(log) {
			return nil
		}
		select {
		case <-grew:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// String returns everything written so far.
func (l *LogBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
