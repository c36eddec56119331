package service

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/stats"
)

// TestReceiveNanos: the receive time is the handler's start minus the
// call's Begin, and 0 whenever the server could not observe the Begin.
func TestReceiveNanos(t *testing.T) {
	begin := time.Now()
	tests := []struct {
		name  string
		ctx   func() context.Context
		start time.Time
		want  int64
	}{
		{"no stats handler", context.Background, begin.Add(time.Millisecond), 0},
		{"tagged, no Begin yet", func() context.Context {
			return receiveTimer{}.TagRPC(context.Background(), &stats.RPCTagInfo{})
		}, begin.Add(time.Millisecond), 0},
		{"after Begin", func() context.Context {
			ctx := receiveTimer{}.TagRPC(context.Background(), &stats.RPCTagInfo{})
			receiveTimer{}.HandleRPC(ctx, &stats.Begin{BeginTime: begin})
			return ctx
		}, begin.Add(1500 * time.Microsecond), 1_500_000},
		{"other events do not count", func() context.Context {
			ctx := receiveTimer{}.TagRPC(context.Background(), &stats.RPCTagInfo{})
			receiveTimer{}.HandleRPC(ctx, &stats.InPayload{RecvTime: begin})
			return ctx
		}, begin.Add(time.Millisecond), 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := receiveNanos(tc.ctx(), tc.start); got != tc.want {
				t.Errorf("receiveNanos = %d, want %d", got, tc.want)
			}
		})
	}
}
