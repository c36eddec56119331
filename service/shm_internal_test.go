package service

import (
	"context"
	"net"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// TestSharedMemoryPeers: registration is for callers on this host. A TCP
// peer that is not loopback is refused before any file is opened (the key
// does not exist, so getting past the check would be NotFound).
func TestSharedMemoryPeers(t *testing.T) {
	s := New(Config{SharedMemory: true}, cpu.New(kernels.Config{}), nil)
	tests := []struct {
		name string
		addr net.Addr
		want codes.Code
	}{
		{"remote v4", &net.TCPAddr{IP: net.IPv4(10, 1, 2, 3), Port: 4000}, codes.PermissionDenied},
		{"remote v6", &net.TCPAddr{IP: net.ParseIP("2001:db8::1"), Port: 4000}, codes.PermissionDenied},
		{"loopback v4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 4000}, codes.NotFound},
		{"loopback v6", &net.TCPAddr{IP: net.IPv6loopback, Port: 4000}, codes.NotFound},
		{"unix socket", &net.UnixAddr{Name: "/run/expertd.sock", Net: "unix"}, codes.NotFound},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := s.shm.TagConn(context.Background(), &stats.ConnTagInfo{RemoteAddr: tt.addr})
			defer s.shm.HandleConn(ctx, &stats.ConnEnd{})
			ctx = peer.NewContext(ctx, &peer.Peer{Addr: tt.addr})
			_, err := s.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "r", Key: "expertd-test-no-such-object", ByteSize: 1})
			if got := status.Code(err); got != tt.want {
				t.Errorf("got %v, want %v", err, tt.want)
			}
			if tt.want == codes.PermissionDenied && !strings.Contains(status.Convert(err).Message(), "not loopback") {
				t.Errorf("message %q does not say why", status.Convert(err).Message())
			}
		})
	}
}

// TestCheckShmKey: keys are single names under /dev/shm.
func TestCheckShmKey(t *testing.T) {
	for key, want := range map[string]string{
		"a": "a", "/a": "a", "torch_123.buf-0": "torch_123.buf-0", "..": "", "/../x": "", "a/b": "", "//a": "",
		"a..b": "", ".": "", "/.": "", "": "", "/": "", "é": "", strings.Repeat("x", 255): strings.Repeat("x", 255), strings.Repeat("x", 256): "",
	} {
		got, err := checkShmKey(key)
		if got != want || (err == nil) != (want != "") {
			t.Errorf("checkShmKey(%q) = %q, %v; want %q", key, got, err, want)
		}
	}
}
