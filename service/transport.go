package service

import (
	"context"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/stats"

	"google.golang.org/protobuf/proto"

	"github.com/expertd/expertd/codec"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// ServerOptions are the gRPC server options the service is built for:
// the aliasing codec, so a request's tensor bytes reach validation (and
// the backend) without being copied out of the receive buffer, which for
// FusedMoE requests is recycled once the call is over (releaseRequest);
// a stats
// handler that times each call's receive for Timings.receive_nanos;
// flow-control windows and socket buffers sized for tensors (see
// codec.StreamWindowBytes) and a transport buffer pool that does not
// zero what it recycles (codec.BufferPool); and, with Config.SharedMemory, the stats
// handler that tells the service when a connection ends, since
// shared-memory regions belong to connections. The codec replaces the
// protobuf codec for every service on the server (health and reflection
// included); its wire format is the same.
func (s *Server) ServerOptions() []grpc.ServerOption {
	opts := []grpc.ServerOption{
		// A request that does not parse is InvalidArgument (codec.Codec
		// Refuse), answered by the codec's interceptors.
		grpc.ForceServerCodecV2(codec.Codec{Recycle: isFusedMoERequest, Refuse: true}),
		// releaseRequest is outermost, so it runs after every other
		// interceptor is done with the request.
		grpc.ChainUnaryInterceptor(releaseRequest, codec.UnaryServerInterceptor),
		grpc.ChainStreamInterceptor(codec.StreamServerInterceptor),
		grpc.StatsHandler(receiveTimer{}),
		grpc.InitialWindowSize(codec.StreamWindowBytes),
		grpc.InitialConnWindowSize(codec.ConnWindowBytes),
		grpc.ReadBufferSize(codec.IOBufferBytes),
		grpc.WriteBufferSize(codec.IOBufferBytes),
		experimental.BufferPool(codec.BufferPool()),
	}
	if s.shm.enabled {
		opts = append(opts, grpc.StatsHandler(s.shm))
	}
	return opts
}

// epoch anchors monotonic times stored as integers.
var epoch = time.Now()

// callBegin is when gRPC began a call (its headers read), in nanoseconds
// since epoch; 0 until known.
type callBegin struct{ nanos atomic.Int64 }

type callBeginKey struct{}

// receiveTimer is a stats.Handler that notes when each call began, so
// the handler can tell how long reading and unmarshalling its request
// took: gRPC does both before the handler runs.
type receiveTimer struct{}

func (receiveTimer) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context {
	return context.WithValue(ctx, callBeginKey{}, &callBegin{})
}

func (receiveTimer) HandleRPC(ctx context.Context, s stats.RPCStats) {
	if b, ok := s.(*stats.Begin); ok {
		if cb, _ := ctx.Value(callBeginKey{}).(*callBegin); cb != nil {
			cb.nanos.Store(max(1, b.BeginTime.Sub(epoch).Nanoseconds()))
		}
	}
}

func (receiveTimer) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

func (receiveTimer) HandleConn(context.Context, stats.ConnStats) {}

// receiveNanos is the time from the call's beginning to handlerStart, or 0
// when the server has no receiveTimer.
func receiveNanos(ctx context.Context, handlerStart time.Time) int64 {
	cb, _ := ctx.Value(callBeginKey{}).(*callBegin)
	if cb == nil {
		return 0
	}
	begin := cb.nanos.Load()
	if begin == 0 {
		return 0
	}
	return max(0, handlerStart.Sub(epoch).Nanoseconds()-begin)
}

// isFusedMoERequest picks the messages whose receive buffers the codec
// recycles: FusedMoE requests, the large ones received all the time,
// whose handlers keep no reference to them after they return (the
// batcher copies inputs when it merges them; backends read them during
// the call). LoadExperts chunks are not recycled: a loaded set may keep
// views of them.
func isFusedMoERequest(m proto.Message) bool {
	_, ok := m.(*pb.FusedMoERequest)
	return ok
}

// releaseRequest returns a unary FusedMoE call's receive buffer to the
// codec's pool when the call is over, whatever its outcome. Not deferred:
// a handler that panics may leave work (a batch on another goroutine)
// still reading the request's tensors, so its buffer is left to the
// garbage collector rather than handed to the next call.
func releaseRequest(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	resp, err := handler(ctx, req)
	if m, ok := req.(*pb.FusedMoERequest); ok {
		codec.Release(m)
	}
	return resp, err
}
