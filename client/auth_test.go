package client

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
)

func TestIsLoopbackTarget(t *testing.T) {
	tests := []struct {
		target string
		want   bool
	}{
		{"127.0.0.1:50051", true},
		{"127.9.8.7:1", true},
		{"localhost:50051", true},
		{"[::1]:50051", true},
		{"dns:///localhost:50051", true},
		{"passthrough:///127.0.0.1:1", true},
		{"unix:///run/expertd.sock", true},
		{"10.0.0.1:50051", false},
		{"0.0.0.0:50051", false},
		{"expertd.example:50051", false},
		{"localhost.example:50051", false},
		{"dns:///expertd.example:443", false},
		{"127.0.0.1", false}, // no port: unreadable, so remote
	}
	for _, tt := range tests {
		if got := isLoopbackTarget(tt.target); got != tt.want {
			t.Errorf("isLoopbackTarget(%q) = %v, want %v", tt.target, got, tt.want)
		}
	}
}

// TestBearerTokenPlaintextRemote checks Dial refuses to send a token in
// the clear to another host, and says why without echoing the token.
func TestBearerTokenPlaintextRemote(t *testing.T) {
	token := randomToken(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := Dial(ctx, "expertd.example:50051", WithBearerToken(token), WithoutWaiting())
	if err == nil {
		c.Close()
		t.Fatal("Dial sent a bearer token over plaintext to a remote host")
	}
	if !strings.Contains(err.Error(), "WithTransportCredentials") || strings.Contains(err.Error(), token) {
		t.Errorf("Dial error %q: want it to name WithTransportCredentials and not contain the token", err)
	}
}

// TestBearerTokenSent checks the token arrives as `authorization: Bearer`
// metadata on a loopback plaintext connection, and that without the
// option no authorization metadata is sent.
func TestBearerTokenSent(t *testing.T) {
	got := make(chan []string, 2)
	gs := grpc.NewServer(grpc.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		got <- metadata.ValueFromIncomingContext(ctx, "authorization")
		return h(ctx, req)
	}))
	hs := health.NewServer()
	hs.SetServingStatus(serviceName, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(gs, hs)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go gs.Serve(lis) //nolint:errcheck // stopped below
	defer gs.Stop()

	token := randomToken(t)
	tests := []struct {
		name string
		opts []Option
		want string
	}{
		{"token", []Option{WithBearerToken(token)}, "Bearer " + token},
		{"none", nil, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			c, err := Dial(ctx, lis.Addr().String(), tt.opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if err := c.Health(ctx); err != nil {
				t.Fatal(err)
			}
			if md := <-got; strings.Join(md, ",") != tt.want {
				t.Errorf("authorization metadata %q, want %q", md, tt.want)
			}
		})
	}
}

func randomToken(t *testing.T) string {
	t.Helper()
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}
