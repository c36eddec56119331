package main

import (
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
)

// Keepalive defaults. The enforcement minimum sits below the SDK's client
// ping interval (client.DefaultKeepaliveTime) with room for timer skew, so
// an SDK client is never sent GOAWAY too_many_pings. Connections are aged
// as grpc-go recommends for servers behind an L4 load balancer (a
// Kubernetes Service): clients reconnect every half hour or so (grpc-go
// adds ±10% jitter) and so spread over new replicas, and the grace lets
// calls and streams in flight finish instead of being cut. With
// -shared-memory connections are not aged unless asked: a connection's
// regions close with it, and a caller that unlinked its object cannot
// register it again.
const (
	defaultKeepaliveMinTime   = 10 * time.Second
	defaultKeepaliveTime      = time.Minute
	defaultKeepaliveTimeout   = 20 * time.Second
	defaultMaxConnectionAge   = 30 * time.Minute
	defaultMaxConnectionGrace = 5 * time.Minute
)

// keepaliveOptions are the server's keepalive enforcement policy and
// connection parameters. A zero MaxConnectionAge or Grace is grpc-go's
// infinity: connections are never aged, or streams are never cut.
func (c Config) keepaliveOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{
			MinTime: c.KeepaliveMinTime,
			// Idle SDK connections ping too, so that a dead peer or a
			// middlebox that dropped the flow is found before the next
			// call rather than by it.
			PermitWithoutStream: true,
		}),
		grpc.KeepaliveParams(keepalive.ServerParameters{
			Time:                  c.KeepaliveTime,
			Timeout:               c.KeepaliveTimeout,
			MaxConnectionAge:      c.MaxConnectionAge,
			MaxConnectionAgeGrace: c.MaxConnectionAgeGrace,
		}),
	}
}

// validateKeepalive checks the keepalive durations.
func (c Config) validateKeepalive() []error {
	var errs []error
	if c.MaxConnectionAge < 0 || c.MaxConnectionAgeGrace < 0 {
		errs = append(errs, fmt.Errorf("-max-connection-age %v, -max-connection-age-grace %v: want >= 0", c.MaxConnectionAge, c.MaxConnectionAgeGrace))
	}
	// grpc-go reads a zero minimum as its own default of 5 minutes, which
	// would refuse the SDK's pings.
	if c.KeepaliveMinTime <= 0 {
		errs = append(errs, fmt.Errorf("-keepalive-min-time %v: want > 0", c.KeepaliveMinTime))
	}
	// grpc-go raises a server ping interval below 1 s to 1 s; refusing it
	// keeps the configured value the one in effect.
	if c.KeepaliveTime < time.Second {
		errs = append(errs, fmt.Errorf("-keepalive-time %v: want >= 1s", c.KeepaliveTime))
	}
	if c.KeepaliveTimeout <= 0 {
		errs = append(errs, fmt.Errorf("-keepalive-timeout %v: want > 0", c.KeepaliveTimeout))
	}
	return errs
}
