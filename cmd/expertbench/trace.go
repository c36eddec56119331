package main

import (
	"context"
	"sync"
	"time"

	"google.golang.org/grpc/stats"
)

// callTrace is what gRPC's client stats report about one call: when it
// began, when the request had been marshalled and handed to the
// transport, and the wire sizes both ways.
type callTrace struct {
	mu          sync.Mutex
	begin, sent time.Time
	reqBytes    int
	respBytes   int
}

type traceKey struct{}

// withTrace returns ctx carrying a fresh trace that traceHandler fills.
func withTrace(ctx context.Context) (context.Context, *callTrace) {
	ct := &callTrace{}
	return context.WithValue(ctx, traceKey{}, ct), ct
}

// send is the client's request encode: from the call's start to the
// marshalled request handed to the transport; 0 when unknown.
func (ct *callTrace) send() time.Duration {
	ct.mu.Lock()
	defer ct.mu.Unlock()
	if ct.begin.IsZero() || ct.sent.IsZero() {
		return 0
	}
	return ct.sent.Sub(ct.begin)
}

func (ct *callTrace) sizes() (req, resp int) {
	ct.mu.Lock()
	defer ct.mu.Unlock()
	return ct.reqBytes, ct.respBytes
}

// traceHandler is a client stats.Handler that fills the callTrace of the
// call's context (calls without one are ignored).
type traceHandler struct{}

func (traceHandler) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }

func (traceHandler) HandleRPC(ctx context.Context, s stats.RPCStats) {
	ct, _ := ctx.Value(traceKey{}).(*callTrace)
	if ct == nil {
		return
	}
	ct.mu.Lock()
	defer ct.mu.Unlock()
	switch s := s.(type) {
	case *stats.Begin:
		// A retry begins again; the last attempt is the one that answered.
		ct.begin = s.BeginTime
	case *stats.OutPayload:
		ct.sent, ct.reqBytes = s.SentTime, s.WireLength
	case *stats.InPayload:
		ct.respBytes = s.WireLength
	}
}

func (traceHandler) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

func (traceHandler) HandleConn(context.Context, stats.ConnStats) {}
