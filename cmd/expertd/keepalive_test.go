package main

import (
	"context"
	"errors"
	"io"
	mrand "math/rand/v2"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/client"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// TestKeepaliveDefaultsAgree checks the SDK's default ping interval is
// allowed by the daemon's default enforcement policy, with room for timer
// skew: otherwise every idle SDK connection would be closed with
// too_many_pings.
func TestKeepaliveDefaultsAgree(t *testing.T) {
	if client.DefaultKeepaliveTime < 2*defaultKeepaliveMinTime {
		t.Errorf("client.DefaultKeepaliveTime %v, want >= 2 x the daemon's -keepalive-min-time default %v", client.DefaultKeepaliveTime, defaultKeepaliveMinTime)
	}
}

// pinger is a raw HTTP/2 client connection: grpc-go clients cannot ping
// more often than every 10 s, too slow for a test of the policy.
type pinger struct {
	conn net.Conn
	fr   *http2.Framer
}

func newPinger(t *testing.T, addr string) *pinger {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, defaultTestTimeout)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	conn.SetDeadline(time.Now().Add(defaultTestTimeout)) //nolint:errcheck // a missed deadline fails the reads
	if _, err := io.WriteString(conn, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(conn, conn)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	return &pinger{conn: conn, fr: fr}
}

// ping sends one ping and reads frames until its ack, answering the
// server's settings; it returns the GOAWAY frame if one comes instead.
func (p *pinger) ping(t *testing.T, n byte) *http2.GoAwayFrame {
	t.Helper()
	if err := p.fr.WritePing(false, [8]byte{n}); err != nil {
		t.Fatalf("ping %d: %v", n, err)
	}
	for {
		f, err := p.fr.ReadFrame()
		if err != nil {
			t.Fatalf("ping %d: reading: %v", n, err)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				p.fr.WriteSettingsAck() //nolint:errcheck // a lost ack fails the reads
			}
		case *http2.PingFrame:
			if f.IsAck() && f.Data[0] == n {
				return nil
			}
		case *http2.GoAwayFrame:
			return f
		}
	}
}

// TestKeepaliveEnforcement checks the daemon's policy: pings at the
// allowed interval, on a connection with no calls, are answered; pings
// faster than -keepalive-min-time get GOAWAY ENHANCE_YOUR_CALM
// too_many_pings.
func TestKeepaliveEnforcement(t *testing.T) {
	const minTime = 100 * time.Millisecond
	addr, _ := startDaemon(t, "-keepalive-min-time", minTime.String())

	p := newPinger(t, addr)
	// grpc-go closes the connection at the fourth ping that breaks its
	// policy; six at the allowed pace break none.
	for i := range byte(6) {
		if ga := p.ping(t, i+1); ga != nil {
			t.Fatalf("ping %d, %v after the last: GOAWAY %v %q, want an ack", i+1, 2*minTime, ga.ErrCode, ga.DebugData())
		}
		time.Sleep(2 * minTime)
	}

	p = newPinger(t, addr)
	for i := range byte(10) {
		if ga := p.ping(t, i+1); ga != nil {
			if ga.ErrCode != http2.ErrCodeEnhanceYourCalm || string(ga.DebugData()) != "too_many_pings" {
				t.Fatalf("GOAWAY %v %q, want ENHANCE_YOUR_CALM too_many_pings", ga.ErrCode, ga.DebugData())
			}
			return
		}
	}
	t.Fatal("10 pings back to back were all answered, want GOAWAY too_many_pings")
}

// TestMaxConnectionAge checks connections are aged (the client connects
// again after -max-connection-age) and that a stream open across the age
// keeps working within the grace, and is cut once the grace is over.
func TestMaxConnectionAge(t *testing.T) {
	const age = 200 * time.Millisecond
	tests := []struct {
		name     string
		grace    time.Duration
		wait     time.Duration // between the stream's two calls
		wantCode codes.Code    // of the second call
	}{
		// Past the age with its +10% jitter; the grace is still running.
		{"within grace", 20 * time.Second, 3 * age, codes.OK},
		{"past grace", 300 * time.Millisecond, 3*age + 300*time.Millisecond, codes.Unavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			addr, _ := startDaemon(t, "-max-connection-age", age.String(), "-max-connection-age-grace", tt.grace.String())
			var dials atomic.Int32
			conn := dial(t, addr, insecure.NewCredentials(), grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) {
				dials.Add(1)
				return (&net.Dialer{}).DialContext(ctx, "tcp", a)
			}))
			rpc := pb.NewExpertServiceClient(conn)
			ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
			defer cancel()
			rng := mrand.New(mrand.NewPCG(uint64(time.Now().UnixNano()), 7))
			stream, err := rpc.FusedMoEStream(ctx)
			if err != nil {
				t.Fatal(err)
			}
			call := func() error {
				if err := stream.Send(inlineRequest(rng)); err != nil && !errors.Is(err, io.EOF) {
					return err
				}
				_, err := stream.Recv()
				return err
			}
			if err := call(); err != nil {
				t.Fatalf("first call: %v", err)
			}
			time.Sleep(tt.wait)
			err = call()
			if got := status.Code(err); got != tt.wantCode {
				t.Fatalf("call after the connection's age: %v, want code %v", err, tt.wantCode)
			}
			if err == nil {
				stream.CloseSend() //nolint:errcheck // Recv reports
				if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
					t.Fatalf("closing the stream: %v, want EOF", err)
				}
			}
			if _, err := rpc.GetServerInfo(ctx, &pb.GetServerInfoRequest{}); err != nil {
				t.Fatalf("call on a new connection: %v", err)
			}
			if n := dials.Load(); n != 2 {
				t.Errorf("%d connections made, want 2 (the first aged out)", n)
			}
		})
	}
}
