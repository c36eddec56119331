package main

import (
	"context"
	"fmt"
	"net"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/expertd/expertd/internal/durstat"
)

// A round trip is measured with up to rttCalls health checks after
// rttWarmup, within rttBudget: enough for a stable median in well under a
// second on an idle host, and a bounded pause on a loaded one.
const (
	rttCalls  = 1000
	rttWarmup = 200
	rttBudget = time.Second
)

// rtt is the latency of a unary round trip.
type rtt struct {
	P50 time.Duration `json:"p50_ns"`
	P90 time.Duration `json:"p90_ns"`
	P99 time.Duration `json:"p99_ns"`
}

// checkRTT times health checks on conn, one at a time, each within timeout.
func checkRTT(ctx context.Context, conn grpc.ClientConnInterface, timeout time.Duration) (rtt, error) {
	hc := healthpb.NewHealthClient(conn)
	d := make([]time.Duration, 0, rttCalls)
	end := time.Now().Add(rttBudget)
	for i := 0; i < rttWarmup+rttCalls && (i < rttWarmup+10 || time.Now().Before(end)); i++ {
		cctx, cancel := context.WithTimeout(ctx, timeout)
		t0 := time.Now()
		_, err := hc.Check(cctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err != nil {
			return rtt{}, fmt.Errorf("health check: %w", err)
		}
		if i >= rttWarmup {
			d = append(d, time.Since(t0))
		}
	}
	slices.Sort(d)
	return rtt{durstat.Percentile(d, 0.5), durstat.Percentile(d, 0.9), durstat.Percentile(d, 0.99)}, nil
}

// bareRTT is the floor of a gRPC call on this host: a plain grpc-go
// server (health only, no interceptors, no stats handlers, default
// options) and client in this process over loopback TCP. What expertd
// adds to a call is measured against it.
func bareRTT(ctx context.Context, timeout time.Duration) (rtt, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return rtt{}, err
	}
	gs := grpc.NewServer()
	healthpb.RegisterHealthServer(gs, health.NewServer())
	go gs.Serve(lis) //nolint:errcheck // returns when stopped
	defer gs.Stop()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return rtt{}, err
	}
	defer conn.Close()
	return checkRTT(ctx, conn, timeout)
}
