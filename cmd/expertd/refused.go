package main

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
)

// refusedLog logs the calls grpc-go ends before any interceptor runs, which
// the call log (an interceptor) never sees: chiefly a unary request over
// -max-message-bytes, which grpc-go refuses while reading it, answering
// only "received message larger than max (N vs. M)". Metrics count them
// (otelgrpc is a stats handler too); this says which method and why.
type refusedLog struct{ log *slog.Logger }

// rpcSeen is a call's method and whether the interceptors reached it.
type rpcSeen struct {
	method  string
	reached atomic.Bool
}

type rpcSeenKey struct{}

func (h refusedLog) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	return context.WithValue(ctx, rpcSeenKey{}, &rpcSeen{method: info.FullMethodName})
}

func (h refusedLog) HandleRPC(ctx context.Context, s stats.RPCStats) {
	end, ok := s.(*stats.End)
	if !ok || end.Error == nil {
		return
	}
	seen, ok := ctx.Value(rpcSeenKey{}).(*rpcSeen)
	if !ok || seen.reached.Load() {
		return
	}
	st := status.Convert(end.Error)
	attrs := []any{slog.String("grpc.method", seen.method), slog.String("grpc.code", st.Code().String()), slog.String("grpc.error", st.Message())}
	if strings.Contains(st.Message(), "received message larger than max") {
		attrs = append(attrs, slog.String("hint", "the request exceeds -max-message-bytes: the caller should split it, pass tensors in shared memory, or load weights with LoadExperts"))
	}
	h.log.WarnContext(ctx, "call refused before its handler", attrs...)
}

func (refusedLog) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

func (refusedLog) HandleConn(context.Context, stats.ConnStats) {}

// markReached, the first interceptor, tells refusedLog the call got past
// grpc-go's own checks, so the call log has it.
func markReached(ctx context.Context) {
	if seen, ok := ctx.Value(rpcSeenKey{}).(*rpcSeen); ok {
		seen.reached.Store(true)
	}
}

func reachedUnary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	markReached(ctx)
	return next(ctx, req)
}

func reachedStream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, next grpc.StreamHandler) error {
	markReached(ss.Context())
	return next(srv, ss)
}
