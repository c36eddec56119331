package client_test

import (
	"bytes"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/internal/testdaemon"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// startDeviceServer serves the CPU backend behind fake CUDA IPC device
// memory with shared memory on, and returns a client dialed to it.
func startDeviceServer(t *testing.T) (*client.Client, *servicetest.FakeDevice) {
	t.Helper()
	d := servicetest.NewFakeDevice(cpu.New(kernels.Config{Threads: 2}))
	srv, err := testdaemon.ServeBackend(service.Config{SharedMemory: true}, d)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	c, err := client.Dial(testContext(t), srv.Addr)
	if err != nil {
		t.Fatalf("Dial(%s) = %v", srv.Addr, err)
	}
	t.Cleanup(func() { c.Close() })
	return c, d
}

// TestCUDASharedMemoryFusedMoE keeps hidden states, logits and the output
// in (fake) device memory, as a PyTorch caller would with a storage that
// starts inside its allocation, and checks the output there against the
// inline call (bit for bit) and the float64 reference. The region is
// registered again, with the handle the SDK kept, when the server has
// forgotten it.
func TestCUDASharedMemoryFusedMoE(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	c, d := startDeviceServer(t)
	set, req := kerneltest.NewCase(rng, kerneltest.Nemotron.Scaled(64, 32), 7, kerneltest.WithOutput(moe.Float32))
	if _, err := c.LoadExperts(ctx, "layer", clienttest.Weights(set)); err != nil {
		t.Fatalf("LoadExperts: %v", err)
	}
	r := clienttest.Request("layer", set, req)
	want, err := c.FusedMoE(ctx, r)
	if err != nil {
		t.Fatalf("inline FusedMoE: %v", err)
	}

	a := d.Alloc(1 << 16)
	const storageOff = 512 // where the storage starts in its allocation
	handle := bytes.Clone(a.Handle)
	region, err := c.RegisterCUDASharedMemory(ctx, "acts", handle, storageOff, 1<<15)
	if err != nil {
		t.Fatalf("RegisterCUDASharedMemory: %v", err)
	}
	clear(handle) // the SDK keeps its own copy for registering again
	if region.Kind() != client.CUDAIPCRegion || region.Bytes() != nil || region.Size() != 1<<15 {
		t.Errorf("region kind %v, %d local bytes, size %d; want cuda_ipc, none, %d", region.Kind(), len(region.Bytes()), region.Size(), 1<<15)
	}
	if _, err := region.Put(0, r.Hidden); err == nil {
		t.Errorf("Put into device memory: no error")
	}
	// The caller's own copies to the device.
	const hOff, lOff, oOff = 0, 8192, 16384
	copy(a.Mem[storageOff+hOff:], r.Hidden.Data)
	copy(a.Mem[storageOff+lOff:], r.RouterLogits.Data)
	if r.Hidden, err = region.Tensor(r.Hidden.DType, hOff, r.Hidden.Shape...); err != nil || r.Hidden.Data != nil {
		t.Fatalf("region.Tensor = %+v, %v; want a reference without local bytes", r.Hidden, err)
	}
	if r.RouterLogits, err = region.Tensor(r.RouterLogits.DType, lOff, r.RouterLogits.Shape...); err != nil {
		t.Fatal(err)
	}
	outBytes := int64(len(want.Output.Data))
	r.OutputShm = region.Ref(oOff, outBytes)

	for _, forget := range []bool{false, true} {
		clear(a.Mem[storageOff+oOff : storageOff+oOff+outBytes])
		if forget { // behind the SDK's back, as a new connection would
			if _, err := c.RPC().UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{Name: "acts"}); err != nil {
				t.Fatal(err)
			}
		}
		res, err := c.FusedMoE(ctx, r)
		if err != nil {
			t.Fatalf("FusedMoE (server forgot the region: %v): %v", forget, err)
		}
		if res.Output.Shm == nil || *res.Output.Shm != *r.OutputShm || res.Output.Data != nil {
			t.Errorf("output reference %v with %d local bytes, want %v and none", res.Output.Shm, len(res.Output.Data), r.OutputShm)
		}
		got := a.Mem[storageOff+oOff : storageOff+oOff+outBytes]
		if !bytes.Equal(got, want.Output.Data) {
			t.Errorf("device output differs from the inline output (server forgot the region: %v)", forget)
		}
		res.Output.Data = got
		checkOutput(t, res, set, req)
	}

	regions, err := c.ListSharedMemory(ctx)
	if err != nil || len(regions) != 1 || regions[0].Kind != client.CUDAIPCRegion || regions[0].Key != "" || regions[0].Offset != storageOff {
		t.Errorf("ListSharedMemory = %+v, %v; want acts, cuda_ipc, no key, offset %d", regions, err, storageOff)
	}
	if _, err := c.UnregisterSharedMemory(ctx, ""); err != nil {
		t.Fatal(err)
	}
	if n := d.Open(); n != 0 {
		t.Errorf("%d device regions open after unregistering", n)
	}
}

// TestCUDASharedMemoryChecks: the SDK refuses a malformed registration
// before sending it, and a server on a backend that cannot open device
// memory says so.
func TestCUDASharedMemoryChecks(t *testing.T) {
	ctx := testContext(t)
	c := startServer(t, service.Config{SharedMemory: true})
	tests := []struct {
		name         string
		handle       []byte
		offset, size int64
		wantCode     codes.Code
		wantMsg      string
	}{
		{"short handle", make([]byte, 63), 0, 1, codes.InvalidArgument, "handle is 63 bytes, want the 64"},
		{"negative offset", make([]byte, 64), -1, 1, codes.InvalidArgument, "-1"},
		{"empty", make([]byte, 64), 0, 0, codes.InvalidArgument, "size >= 1"},
		{"cpu backend", make([]byte, 64), 0, 1, codes.FailedPrecondition, "the cpu backend cannot open CUDA IPC memory"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := c.RegisterCUDASharedMemory(ctx, "r", tt.handle, tt.offset, tt.size)
			if got := status.Code(err); got != tt.wantCode || !bytes.Contains([]byte(status.Convert(err).Message()), []byte(tt.wantMsg)) {
				t.Errorf("RegisterCUDASharedMemory = %v, want %v containing %q", err, tt.wantCode, tt.wantMsg)
			}
		})
	}
}
