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
	"google.golang.org/grpc/connectivity"
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

// ping sends pings numbered first to last back to back and reads frames
// until the last one's ack, answering the server's settings; it returns
// the GOAWAY frame if one comes instead.
func (p *pinger) ping(t *testing.T, first, last byte) *http2.GoAwayFrame {
	t.Helper()
	for n := first; n <= last; n++ {
		if err := p.fr.WritePing(false, [8]byte{n}); err != nil {
			t.Fatalf("ping %d: %v", n, err)
		}
	}
	for {
		f, err := p.fr.ReadFrame()
		if err != nil {
			t.Fatalf("ping %d: reading: %v", last, err)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				p.fr.WriteSettingsAck() //nolint:errcheck // a lost ack fails the reads
			}
		case *http2.PingFrame:
			if f.IsAck() && f.Data[0] == last {
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
		if ga := p.ping(t, i+1, i+1); ga != nil {
			t.Fatalf("ping %d, %v after the last: GOAWAY %v %q, want an ack", i+1, 2*minTime, ga.ErrCode, ga.DebugData())
		}
		time.Sleep(2 * minTime)
	}

	// Sent at once, not each after the last one's ack, so that a stalled
	// machine cannot space them out past the minimum.
	p = newPinger(t, addr)
	ga := p.ping(t, 1, 10)
	if ga == nil {
		t.Fatal("10 pings back to back were all answered, want GOAWAY too_many_pings")
	}
	if ga.ErrCode != http2.ErrCodeEnhanceYourCalm || string(ga.DebugData()) != "too_many_pings" {
		t.Fatalf("GOAWAY %v %q, want ENHANCE_YOUR_CALM too_many_pings", ga.ErrCode, ga.DebugData())
	}
}

// TestMaxConnectionAge checks connections are aged (the client connects
// again after -max-connection-age) and that a stream open across the age
// keeps working within the grace, and is cut once the grace is over. The
// test waits for the client to see the GOAWAY, and for the cut, rather
// than for times: a loaded machine only makes each step later.
func TestMaxConnectionAge(t *testing.T) {
	const age = 200 * time.Millisecond
	tests := []struct {
		name string
		// grace leaves the first call room to finish on a loaded machine.
		grace time.Duration
		cut   bool // whether the stream outlives the grace
	}{
		{"within grace", 20 * time.Second, false},
		{"past grace", 2 * time.Second, true},
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
			start := time.Now() // before the connection
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
			// The aged connection's GOAWAY takes the channel out of READY.
			// The channel may report READY only after the first call has
			// its answer (the balancer's update is asynchronous), and a
			// wait for a change from READY returns at once from any other
			// state. No GOAWAY comes before the age less its jitter, so a
			// state other than READY until then is the update still on
			// its way; after it, the GOAWAY may have come already.
			s := conn.GetState()
			for ; s != connectivity.Ready && time.Since(start) < age*9/10; s = conn.GetState() {
				if !conn.WaitForStateChange(ctx, s) {
					t.Fatalf("channel not READY after the first call (%v): %v", s, ctx.Err())
				}
			}
			if s == connectivity.Ready && !conn.WaitForStateChange(ctx, connectivity.Ready) {
				t.Fatalf("no GOAWAY after the connection's age: %v", ctx.Err())
			}
			if tt.cut {
				// Nothing sent: Recv returns when the server cuts the stream.
				if _, err := stream.Recv(); status.Code(err) != codes.Unavailable {
					t.Fatalf("stream past the grace: %v, want Unavailable", err)
				}
				if d, least := time.Since(start), age*9/10+tt.grace; d < least {
					t.Errorf("stream cut %v after the connection began, want >= %v (the age less its jitter, and the grace)", d, least)
				}
			} else {
				if err := call(); err != nil {
					t.Fatalf("call after the connection's age, within the grace: %v", err)
				}
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
