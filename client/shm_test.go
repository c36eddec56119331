package client_test

import (
	"bytes"
	"os"
	"slices"
	"testing"
	"unsafe"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
)

// newSharedMemory creates an object of size bytes, closed at cleanup.
func newSharedMemory(t *testing.T, size int64) *client.SharedMemory {
	t.Helper()
	if _, err := os.Stat("/dev/shm"); err != nil {
		t.Skipf("no /dev/shm: %v", err)
	}
	shm, err := client.CreateSharedMemory("", size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { shm.Close() })
	return shm
}

// TestSharedMemoryFusedMoE runs a case with its hidden states, logits and
// output in shared memory and checks the output against the inline call
// (bit for bit) and the float64 reference, read in place from the region.
func TestSharedMemoryFusedMoE(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	c := startServer(t, service.Config{SharedMemory: true})
	for _, out := range []moe.DType{moe.BFloat16, moe.Float32} {
		t.Run(out.String(), func(t *testing.T) {
			set, req := kerneltest.NewCase(rng, kerneltest.Nemotron.Scaled(64, 32), 7, kerneltest.WithOutput(out))
			if _, err := c.LoadExperts(ctx, "layer-"+out.String(), clienttest.Weights(set)); err != nil {
				t.Fatalf("LoadExperts: %v", err)
			}
			r := clienttest.Request("layer-"+out.String(), set, req)
			want, err := c.FusedMoE(ctx, r)
			if err != nil {
				t.Fatalf("inline FusedMoE: %v", err)
			}

			shm := newSharedMemory(t, 1<<16)
			region, err := c.RegisterSharedMemory(ctx, "acts-"+out.String(), shm, 512, 1<<15)
			if err != nil {
				t.Fatalf("RegisterSharedMemory: %v", err)
			}
			if err := shm.Unlink(); err != nil { // the mappings keep it
				t.Fatal(err)
			}
			if r.Hidden, err = region.Put(0, r.Hidden); err != nil {
				t.Fatal(err)
			}
			if r.RouterLogits, err = region.Put(8192, r.RouterLogits); err != nil {
				t.Fatal(err)
			}
			outBytes := int64(len(want.Output.Data))
			r.OutputShm = region.Ref(16384, outBytes)
			res, err := c.FusedMoE(ctx, r)
			if err != nil {
				t.Fatalf("shm FusedMoE: %v", err)
			}
			if res.Output.Shm == nil || *res.Output.Shm != *r.OutputShm {
				t.Errorf("output reference %v, want %v", res.Output.Shm, r.OutputShm)
			}
			if !bytes.Equal(res.Output.Data, want.Output.Data) {
				t.Errorf("shm output differs from the inline output")
			}
			if len(res.Output.Data) == 0 || unsafe.SliceData(res.Output.Data) != &region.Bytes()[16384] {
				t.Errorf("output data is not a view of the region")
			}
			checkOutput(t, res, set, req)
		})
	}
	regions, err := c.ListSharedMemory(ctx)
	if err != nil || len(regions) != 2 || regions[0].Name != "acts-bfloat16" || regions[0].Offset != 512 || regions[0].Size != 1<<15 {
		t.Errorf("ListSharedMemory = %+v, %v; want acts-bfloat16 and acts-float32", regions, err)
	}
	names, err := c.UnregisterSharedMemory(ctx, "")
	if err != nil || !slices.Equal(names, []string{"acts-bfloat16", "acts-float32"}) {
		t.Errorf("UnregisterSharedMemory = %v, %v", names, err)
	}
}

// TestSharedMemoryReregister: when the server has forgotten a region (as
// after a reconnect), FusedMoE registers the client's regions again and
// repeats the call once.
func TestSharedMemoryReregister(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	c := startServer(t, service.Config{SharedMemory: true})
	set, req := kerneltest.NewCase(rng, kerneltest.Qwen3.Scaled(32, 32), 3)
	if _, err := c.LoadExperts(ctx, "layer", clienttest.Weights(set)); err != nil {
		t.Fatalf("LoadExperts: %v", err)
	}
	shm := newSharedMemory(t, 1<<14)
	region, err := c.RegisterSharedMemory(ctx, "r", shm, 0, shm.Size())
	if err != nil {
		t.Fatal(err)
	}
	r := clienttest.Request("layer", set, req)
	if r.Hidden, err = region.Put(0, r.Hidden); err != nil {
		t.Fatal(err)
	}
	// Behind the SDK's back, as a new connection would.
	if _, err := c.RPC().UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{Name: "r"}); err != nil {
		t.Fatal(err)
	}
	res, err := c.FusedMoE(ctx, r)
	if err != nil {
		t.Fatalf("FusedMoE after the server forgot the region: %v", err)
	}
	checkOutput(t, res, set, req)

	// A region the client never registered is the server's NotFound.
	r.Hidden.Shm.Region = "other"
	_, err = c.FusedMoE(ctx, r)
	if status.Code(err) != codes.NotFound {
		t.Errorf("FusedMoE on an unknown region = %v, want NotFound", err)
	}
}

// TestSharedMemoryLocalChecks: the SDK refuses what cannot fit before
// sending it.
func TestSharedMemoryLocalChecks(t *testing.T) {
	ctx := testContext(t)
	c := startServer(t, service.Config{SharedMemory: true})
	shm := newSharedMemory(t, 4096)
	if _, err := c.RegisterSharedMemory(ctx, "r", shm, 4000, 97); status.Code(err) != codes.InvalidArgument {
		t.Errorf("RegisterSharedMemory past the end = %v, want InvalidArgument", err)
	}
	region, err := c.RegisterSharedMemory(ctx, "r", shm, 96, 4000)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := region.Tensor(moe.Float32, 3000, 2, 128); err == nil {
		t.Errorf("Tensor past the region's end: no error")
	}
	if _, err := region.Tensor(moe.Float32, -4, 1); err == nil {
		t.Errorf("Tensor at a negative offset: no error")
	}
	tt, err := region.Tensor(moe.BFloat16, 100, 3, 4)
	if err != nil || tt.Shm.Size != 24 || len(tt.Data) != 24 || &tt.Data[0] != &shm.Bytes()[196] {
		t.Errorf("Tensor = %+v, %v; want 24 bytes at 196 of the object", tt, err)
	}
	_, err = c.FusedMoE(ctx, &client.FusedMoERequest{ExpertSet: "x", Hidden: client.Tensor{DType: moe.Float32, Shape: []int{2, 2}, Shm: region.Ref(0, 15)}})
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("FusedMoE with a short reference = %v, want InvalidArgument", err)
	}
}

// TestCreateSharedMemory covers the object's life: created 0600 under
// /dev/shm, unlinked by Unlink or Close, Close idempotent, bad keys
// refused.
func TestCreateSharedMemory(t *testing.T) {
	shm := newSharedMemory(t, 10000)
	fi, err := os.Stat("/dev/shm/" + shm.Key())
	if err != nil || fi.Size() != 10000 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("/dev/shm/%s: %v, %v; want 10000 bytes, mode 0600", shm.Key(), fi, err)
	}
	shm.Bytes()[9999] = 7
	if b, err := os.ReadFile("/dev/shm/" + shm.Key()); err != nil || b[9999] != 7 {
		t.Errorf("a write through the mapping is not in the object")
	}
	if _, err := client.CreateSharedMemory(shm.Key(), 10); err == nil {
		t.Errorf("CreateSharedMemory of an existing key: no error")
	}
	if err := shm.Close(); err != nil {
		t.Fatal(err)
	}
	if err := shm.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := os.Stat("/dev/shm/" + shm.Key()); !os.IsNotExist(err) {
		t.Errorf("/dev/shm/%s after Close: %v, want gone", shm.Key(), err)
	}
	if shm.Bytes() != nil {
		t.Errorf("Bytes after Close is not nil")
	}
	for _, key := range []string{"a/b", "../x", "/", "x\x00"} {
		if _, err := client.CreateSharedMemory(key, 10); err == nil {
			t.Errorf("CreateSharedMemory(%q): no error", key)
		}
	}
	if _, err := client.CreateSharedMemory("", 0); err == nil {
		t.Errorf("CreateSharedMemory of 0 bytes: no error")
	}
}
