package service

import (
	"context"
	"fmt"
	"math"
	"net"
	"os"
	"strings"
	"testing"
	"unsafe"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// TestSharedMemoryPeers: registration, of either kind, is for callers on
// this host. A TCP peer that is not loopback is refused before any file is
// opened (the key does not exist, so getting past the check would be
// NotFound) or the backend asked (the CPU backend cannot open CUDA IPC
// memory, which would be FailedPrecondition).
func TestSharedMemoryPeers(t *testing.T) {
	s := New(Config{SharedMemory: true}, cpu.New(kernels.Config{}), nil)
	tests := []struct {
		name           string
		addr           net.Addr
		posix, cudaIPC codes.Code
	}{
		{"remote v4", &net.TCPAddr{IP: net.IPv4(10, 1, 2, 3), Port: 4000}, codes.PermissionDenied, codes.PermissionDenied},
		{"remote v6", &net.TCPAddr{IP: net.ParseIP("2001:db8::1"), Port: 4000}, codes.PermissionDenied, codes.PermissionDenied},
		{"loopback v4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 4000}, codes.NotFound, codes.FailedPrecondition},
		{"loopback v6", &net.TCPAddr{IP: net.IPv6loopback, Port: 4000}, codes.NotFound, codes.FailedPrecondition},
		{"unix socket", &net.UnixAddr{Name: "/run/expertd.sock", Net: "unix"}, codes.NotFound, codes.FailedPrecondition},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := s.shm.TagConn(context.Background(), &stats.ConnTagInfo{RemoteAddr: tt.addr})
			defer s.shm.HandleConn(ctx, &stats.ConnEnd{})
			ctx = peer.NewContext(ctx, &peer.Peer{Addr: tt.addr})
			for _, r := range []struct {
				req  *pb.RegisterSharedMemoryRequest
				want codes.Code
			}{
				{&pb.RegisterSharedMemoryRequest{Name: "r", Key: "expertd-test-no-such-object", ByteSize: 1}, tt.posix},
				{&pb.RegisterSharedMemoryRequest{Name: "r", Kind: pb.SharedMemoryKind_SHARED_MEMORY_KIND_CUDA_IPC, CudaIpcHandle: make([]byte, 64), ByteSize: 1}, tt.cudaIPC},
			} {
				_, err := s.RegisterSharedMemory(ctx, r.req)
				if got := status.Code(err); got != r.want {
					t.Errorf("%v: got %v, want %v", r.req.GetKind(), err, r.want)
				}
				if r.want == codes.PermissionDenied && !strings.Contains(status.Convert(err).Message(), "not loopback") {
					t.Errorf("message %q does not say why", status.Convert(err).Message())
				}
			}
		})
	}
}

// FuzzResolveShm feeds arbitrary references and shapes to shmTable.resolve over
// a real 4000-byte region: it must never panic, and what it accepts must
// view bytes inside the region, of the reference's size, with the output
// apart from the input; every region it took must be released.
func FuzzResolveShm(f *testing.F) {
	if _, err := os.Stat("/dev/shm"); err != nil {
		f.Skipf("no /dev/shm: %v", err)
	}
	key := fmt.Sprintf("expertd-fuzz-%d", os.Getpid())
	obj, err := os.OpenFile("/dev/shm/"+key, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { obj.Close(); os.Remove(obj.Name()) })
	if err := obj.Truncate(8192); err != nil {
		f.Fatal(err)
	}
	s := New(Config{SharedMemory: true}, cpu.New(kernels.Config{}), nil)
	ctx := s.shm.TagConn(context.Background(), &stats.ConnTagInfo{})
	f.Cleanup(func() { s.shm.HandleConn(ctx, &stats.ConnEnd{}) })
	const regionOff, regionSize = 100, 4000
	if _, err := s.shm.register(ctx, &pb.RegisterSharedMemoryRequest{Name: "r", Key: key, Offset: regionOff, ByteSize: regionSize}, s.begin); err != nil {
		f.Fatal(err)
	}
	owner := ctx.Value(connKey{}).(uint64)
	look := s.shm.regions.Lease(owner)
	reg, err := look.Hold("r")
	if err != nil {
		f.Fatal(err)
	}
	mem := reg.Mapping().Bytes()
	look.Release()

	f.Add(int64(0), int64(320), int64(2), int64(40), uint8(pb.DataType_DATA_TYPE_FLOAT32), int64(1000), int64(160), uint8(0))
	f.Add(int64(3999), int64(1), int64(1), int64(1), uint8(pb.DataType_DATA_TYPE_FLOAT8_E4M3FN), int64(0), int64(2), uint8(pb.DataType_DATA_TYPE_BFLOAT16))
	f.Add(int64(8), int64(math.MaxInt64), int64(1<<40), int64(1<<40), uint8(pb.DataType_DATA_TYPE_INT32), int64(-1), int64(-1), uint8(9))
	f.Fuzz(func(t *testing.T, hOff, hSize, m, k int64, dt uint8, oOff, oSize int64, odt uint8) {
		req := &pb.FusedMoERequest{
			HiddenStates: &pb.Tensor{Dtype: pb.DataType(dt), Shape: []int64{m, k},
				Source: &pb.Tensor_Shm{Shm: &pb.SharedMemoryRef{RegionName: "r", Offset: hOff, ByteSize: hSize}}},
			OutputDtype: pb.DataType(odt),
			OutputShm:   &pb.SharedMemoryRef{RegionName: "r", Offset: oOff, ByteSize: oSize},
		}
		c, err := s.shm.resolve(ctx, req)
		defer func() {
			c.release()
			if infos, err := s.shm.regions.List(owner, "r"); err != nil || infos[0].CallsInFlight != 0 {
				t.Fatalf("references left after release: %v, %v", infos, err)
			}
		}()
		if err != nil {
			if status.Code(s.toStatus(ctx, "FuzzResolveShm", err)) == codes.Internal {
				t.Fatalf("internal error: %v", err)
			}
			return
		}
		inside := func(b []byte) bool {
			if len(b) == 0 {
				return true
			}
			lo := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
			p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
			return p >= lo && p+uintptr(len(b)) <= lo+uintptr(len(mem))
		}
		if req.GetHiddenStates().GetShm() == nil {
			t.Fatalf("shmTable.resolve modified the request: %v", req.GetHiddenStates())
		}
		mt, ok := c.memory("hidden_states")
		h := mt.Data
		if !ok || mt.Memory == moe.Device || int64(len(h)) != hSize || int64(cap(h)) != hSize || !inside(h) {
			t.Fatalf("hidden view of %d bytes (cap %d) for byte_size %d, inside the region: %v", len(h), cap(h), hSize, inside(h))
		}
		if int64(len(c.out)) != oSize || !inside(c.out) {
			t.Fatalf("output view of %d bytes for byte_size %d, inside the region: %v", len(c.out), oSize, inside(c.out))
		}
		if oSize > 0 && hSize > 0 && oOff < hOff+hSize && hOff < oOff+oSize {
			t.Fatalf("accepted output [%d, %d) over hidden [%d, %d)", oOff, oOff+oSize, hOff, hOff+hSize)
		}
	})
}
