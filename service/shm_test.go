package service_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

var shmSeq atomic.Int64

// shmObject creates a POSIX shared-memory object of size bytes, as
// shm_open + ftruncate would, and removes it at cleanup. The test writes
// and reads it through f, which sees the same pages as the server's
// mapping.
func shmObject(t testing.TB, size int64) (key string, f *os.File) {
	t.Helper()
	if _, err := os.Stat("/dev/shm"); err != nil {
		t.Skipf("no /dev/shm: %v", err)
	}
	key = fmt.Sprintf("expertd-test-%d-%d", os.Getpid(), shmSeq.Add(1))
	f, err := os.OpenFile("/dev/shm/"+key, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		f.Close()
		os.Remove("/dev/shm/" + key)
	})
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	return key, f
}

func writeAt(t testing.TB, f *os.File, b []byte, off int64) {
	t.Helper()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

func readAt(t testing.TB, f *os.File, n, off int64) []byte {
	t.Helper()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	return b
}

// mapped reports whether this process maps /dev/shm/<key>: the server runs
// in the test's process, so /proc/self/maps shows its mappings.
func mapped(t testing.TB, key string) bool {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Skipf("no /proc/self/maps: %v", err)
	}
	return bytes.Contains(b, []byte("/dev/shm/"+key+"\n")) || bytes.Contains(b, []byte("/dev/shm/"+key+" (deleted)\n"))
}

// waitUnmapped waits (up to the test timeout) for the server to unmap key.
func waitUnmapped(t *testing.T, key string) {
	t.Helper()
	deadline := time.Now().Add(defaultTestTimeout)
	for mapped(t, key) {
		if time.Now().After(deadline) {
			t.Fatalf("/dev/shm/%s still mapped after %v", key, defaultTestTimeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func shmRef(region string, off, n int64) *pb.Tensor_Shm {
	return &pb.Tensor_Shm{Shm: &pb.SharedMemoryRef{RegionName: region, Offset: off, ByteSize: n}}
}

func wantCode(t *testing.T, err error, code codes.Code, msg string) {
	t.Helper()
	if got := status.Code(err); got != code || !strings.Contains(status.Convert(err).Message(), msg) {
		t.Errorf("got %v, want %v containing %q", err, code, msg)
	}
}

// TestSharedMemoryDisabledByDefault: without Config.SharedMemory the RPCs
// answer FailedPrecondition naming the flag, and shm tensors and outputs are
// refused as invalid.
func TestSharedMemoryDisabledByDefault(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	b := &fakeBackend{}
	c, _ := loadedServer(t, rng, service.Config{}, b)
	key, _ := shmObject(t, 4096)
	_, err := c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "r", Key: key, ByteSize: 4096})
	wantCode(t, err, codes.FailedPrecondition, "-shared-memory")
	_, err = c.UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{})
	wantCode(t, err, codes.FailedPrecondition, "-shared-memory")
	_, err = c.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{})
	wantCode(t, err, codes.FailedPrecondition, "-shared-memory")

	req := request(rng, 2)
	req.HiddenStates.Source = shmRef("r", 0, 2*testK*4)
	_, err = c.FusedMoE(ctx, req)
	wantCode(t, err, codes.InvalidArgument, "hidden_states.shm")
	req = request(rng, 2)
	req.OutputShm = &pb.SharedMemoryRef{RegionName: "r", ByteSize: 2 * testK * 2}
	_, err = c.FusedMoE(ctx, req)
	wantCode(t, err, codes.InvalidArgument, "output_shm: shared memory is not enabled")
	if mapped(t, key) {
		t.Errorf("/dev/shm/%s is mapped by a server without shared memory", key)
	}
	if n := b.numCalls(); n != 0 {
		t.Errorf("backend ran %d calls, want 0", n)
	}
}

// TestSharedMemoryFusedMoE runs the CPU backend with hidden states, logits
// and the output in one region, and checks the output is bit for bit the
// inline call's, written into the region, with no inline bytes.
func TestSharedMemoryFusedMoE(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	c, _ := loadedServer(t, rng, service.Config{SharedMemory: true, MaxConcurrent: 2}, cpu.New(kernels.Config{Threads: 2}))
	const m = 5
	key, f := shmObject(t, 3<<12)
	// A region that starts mid-page, so the server's mapping is not
	// aligned with it.
	const regionOff = 100
	reg, err := c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "acts", Key: "/" + key, Offset: regionOff, ByteSize: 3<<12 - regionOff})
	if err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	want := &pb.SharedMemoryRegion{Name: "acts", Kind: pb.SharedMemoryKind_SHARED_MEMORY_KIND_POSIX, Key: key, Offset: regionOff, ByteSize: 3<<12 - regionOff}
	if diff := cmp.Diff(want, reg.GetRegion(), protocmp.Transform(), protocmp.IgnoreFields(&pb.SharedMemoryRegion{}, "registered_at")); diff != "" {
		t.Errorf("registered region (-want +got):\n%s", diff)
	}
	for _, out := range []pb.DataType{pb.DataType_DATA_TYPE_BFLOAT16, pb.DataType_DATA_TYPE_FLOAT32} {
		t.Run(out.String(), func(t *testing.T) {
			inline := request(rng, m)
			inline.OutputDtype = out
			inline.ReturnRouting = true
			wantResp, err := c.FusedMoE(ctx, inline)
			if err != nil {
				t.Fatalf("inline FusedMoE: %v", err)
			}

			req := proto.Clone(inline).(*pb.FusedMoERequest)
			hb, lb := inline.GetHiddenStates().GetData(), inline.GetRouterLogits().GetData()
			const hOff, lOff, oOff = 8, 4096, 6000
			writeAt(t, f, hb, regionOff+hOff)
			writeAt(t, f, lb, regionOff+lOff)
			outBytes := int64(len(wantResp.GetOutput().GetData()))
			writeAt(t, f, bytes.Repeat([]byte{0xAB}, int(outBytes)), regionOff+oOff)
			req.HiddenStates.Source = shmRef("acts", hOff, int64(len(hb)))
			req.RouterLogits.Source = shmRef("acts", lOff, int64(len(lb)))
			req.OutputShm = &pb.SharedMemoryRef{RegionName: "acts", Offset: oOff, ByteSize: outBytes}
			resp, err := c.FusedMoE(ctx, req)
			if err != nil {
				t.Fatalf("shm FusedMoE: %v", err)
			}
			if diff := cmp.Diff(req.GetOutputShm(), resp.GetOutput().GetShm(), protocmp.Transform()); diff != "" || resp.GetOutput().GetData() != nil {
				t.Errorf("output source %v, want the output_shm reference and no data (-want +got):\n%s", resp.GetOutput().GetSource(), diff)
			}
			if got := readAt(t, f, outBytes, regionOff+oOff); !bytes.Equal(got, wantResp.GetOutput().GetData()) {
				t.Errorf("region output differs from the inline call's")
			}
			if diff := cmp.Diff(wantResp, resp, protocmp.Transform(), protocmp.IgnoreFields(&pb.FusedMoEResponse{}, "timings"), protocmp.IgnoreFields(&pb.Tensor{}, "data", "shm")); diff != "" {
				t.Errorf("response differs from the inline call's (-inline +shm):\n%s", diff)
			}
		})
	}
	list, err := c.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{})
	if err != nil {
		t.Fatalf("ListSharedMemory: %v", err)
	}
	if diff := cmp.Diff(&pb.ListSharedMemoryResponse{Regions: []*pb.SharedMemoryRegion{want}}, list, protocmp.Transform(), protocmp.IgnoreFields(&pb.SharedMemoryRegion{}, "registered_at")); diff != "" {
		t.Errorf("ListSharedMemory (-want +got):\n%s", diff)
	}
	un, err := c.UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{Name: "acts"})
	if err != nil || !slices.Equal(un.GetNames(), []string{"acts"}) {
		t.Fatalf("UnregisterSharedMemory = %v, %v; want [acts]", un, err)
	}
	if mapped(t, key) {
		t.Errorf("/dev/shm/%s still mapped after UnregisterSharedMemory", key)
	}
}

// TestSharedMemoryInputsEverywhere puts every kind of request tensor,
// inline weights included, in shared memory.
func TestSharedMemoryInputsEverywhere(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	b := &fakeBackend{}
	c, w := loadedServer(t, rng, service.Config{SharedMemory: true}, b)
	key, f := shmObject(t, 1<<20)
	if _, err := c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "all", Key: key, ByteSize: 1 << 20}); err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	const m = 3
	req := request(rng, m)
	req.Experts = &pb.FusedMoERequest_Weights{Weights: w}
	req.RouterLogits, req.Routing = nil, nil
	req.TopkIds = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_INT32, Shape: []int64{m, 2}, Source: &pb.Tensor_Data{Data: i32Bytes([]int32{0, 1, 2, 3, 4, 5})}}
	req.TopkWeights = f32Tensor([]float32{.5, .5, .25, .75, 1, 0}, m, 2)
	want := proto.Clone(req).(*pb.FusedMoERequest)
	var off int64
	for _, x := range []*pb.Tensor{req.HiddenStates, req.TopkIds, req.TopkWeights, w.W13, w.W2, w.W13Scale, w.W2Scale} {
		d := x.GetData()
		writeAt(t, f, d, off)
		x.Source = shmRef("all", off, int64(len(d)))
		off += int64(len(d)) + 64
	}
	if _, err := c.FusedMoE(ctx, req); err != nil {
		t.Fatalf("FusedMoE: %v", err)
	}
	got := b.lastCall()
	if !bytes.Equal(got.Hidden.Data, want.GetHiddenStates().GetData()) || !slices.Equal(got.TopKIDs, []int32{0, 1, 2, 3, 4, 5}) || !slices.Equal(got.TopKWeights, []float32{.5, .5, .25, .75, 1, 0}) {
		t.Errorf("backend got hidden %d bytes, ids %v, weights %v; want the region's", len(got.Hidden.Data), got.TopKIDs, got.TopKWeights)
	}
}

// TestSharedMemoryRegister checks registration's refusals: every one names
// the field, maps nothing and leaves the connection's regions as they were.
func TestSharedMemoryRegister(t *testing.T) {
	ctx := testContext(t)
	c, _, _ := servicetest.StartServerConfig(t, service.Config{SharedMemory: true}, &fakeBackend{})
	key, _ := shmObject(t, 8192)
	if _, err := c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "taken", Key: key, ByteSize: 10}); err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	dir := t.TempDir()
	link := filepath.Base(dir) + "-link"
	if err := os.Symlink("/dev/shm/"+key, "/dev/shm/"+link); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove("/dev/shm/" + link) })
	sub := filepath.Base(dir) + "-dir"
	if err := os.Mkdir("/dev/shm/"+sub, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove("/dev/shm/" + sub) })
	reg := func(edit func(r *pb.RegisterSharedMemoryRequest)) *pb.RegisterSharedMemoryRequest {
		r := &pb.RegisterSharedMemoryRequest{Name: "r", Key: key, Offset: 0, ByteSize: 8192}
		edit(r)
		return r
	}
	tests := []struct {
		name     string
		req      *pb.RegisterSharedMemoryRequest
		wantCode codes.Code
		wantMsg  string
	}{
		{"no name", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Name = "" }), codes.InvalidArgument, `name: "": want 1-128 characters`},
		{"bad name", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Name = "a b" }), codes.InvalidArgument, `name: "a b": character ' '`},
		{"name taken", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Name = "taken" }), codes.AlreadyExists, `name: "taken": this connection already has`},
		{"unknown kind", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Kind = 3 }), codes.InvalidArgument, "kind: 3: want SHARED_MEMORY_KIND_POSIX or SHARED_MEMORY_KIND_CUDA_IPC"},
		{"cuda kind on a host backend", reg(func(r *pb.RegisterSharedMemoryRequest) {
			r.Kind, r.Key, r.CudaIpcHandle = pb.SharedMemoryKind_SHARED_MEMORY_KIND_CUDA_IPC, "", make([]byte, 64)
		}), codes.FailedPrecondition, "kind: the fake backend cannot open CUDA IPC memory; run expertd with -backend cuda"},
		{"posix with a handle", reg(func(r *pb.RegisterSharedMemoryRequest) { r.CudaIpcHandle = make([]byte, 64) }), codes.InvalidArgument, "cuda_ipc_handle: 64 bytes: must be empty for SHARED_MEMORY_KIND_POSIX"},
		{"no key", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Key = "" }), codes.InvalidArgument, `key: "": want 1-255 characters`},
		{"only slash", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Key = "/" }), codes.InvalidArgument, `key: "/": want 1-255`},
		{"long key", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Key = strings.Repeat("k", 256) }), codes.InvalidArgument, "key: \"kkk"},
		{"path", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Key = "/dev/shm/" + key }), codes.InvalidArgument, "key: \"/dev/shm/" + key + "\": character '/'"},
		{"escape", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Key = "../../etc/passwd" }), codes.InvalidArgument, "character '/'"},
		{"dotdot", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Key = ".." }), codes.InvalidArgument, `key: "..": must not be "." or contain ".."`},
		{"nul", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Key = key + "\x00x" }), codes.InvalidArgument, `character '\x00'`},
		{"missing", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Key = key + "-none" }), codes.NotFound, "key: /dev/shm/" + key + "-none does not exist"},
		{"symlink", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Key = link }), codes.InvalidArgument, "is a symbolic link"},
		{"directory", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Key = sub }), codes.InvalidArgument, "is not a regular file"},
		{"negative offset", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Offset = -1 }), codes.InvalidArgument, "offset: -1: want >= 0"},
		{"zero size", reg(func(r *pb.RegisterSharedMemoryRequest) { r.ByteSize = 0 }), codes.InvalidArgument, "byte_size: 0: want >= 1"},
		{"past the end", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Offset = 1 }), codes.InvalidArgument, "byte_size: offset 1 + byte_size 8192 exceeds /dev/shm/" + key + "'s 8192 bytes"},
		{"overflow", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Offset, r.ByteSize = 1<<62, 1<<62 }), codes.InvalidArgument, "byte_size: offset 4611686018427387904 + byte_size 4611686018427387904"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := c.RegisterSharedMemory(ctx, tt.req)
			wantCode(t, err, tt.wantCode, tt.wantMsg)
			list, err := c.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{})
			if err != nil {
				t.Fatal(err)
			}
			if len(list.GetRegions()) != 1 || list.GetRegions()[0].GetName() != "taken" {
				t.Errorf("regions after a refused registration: %v, want only \"taken\"", list.GetRegions())
			}
		})
	}
	_, err := c.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{Name: "nope"})
	wantCode(t, err, codes.NotFound, `name: no shared-memory region "nope"`)
	_, err = c.UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{Name: "nope"})
	wantCode(t, err, codes.NotFound, `name: no shared-memory region "nope"`)
}

// TestSharedMemoryUnregisterWhileInUse: a region unregistered while a call
// reads it disappears from the connection at once, but stays mapped until
// the call ends, which still writes its output there.
func TestSharedMemoryUnregisterWhileInUse(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	b := &fakeBackend{started: make(chan struct{}, 1), release: make(chan struct{})}
	c, _ := loadedServer(t, rng, service.Config{SharedMemory: true}, b)
	key, f := shmObject(t, 4096)
	if _, err := c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "r", Key: key, ByteSize: 4096}); err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	const m = 2
	req := request(rng, m)
	writeAt(t, f, req.GetHiddenStates().GetData(), 0)
	req.HiddenStates.Source = shmRef("r", 0, m*testK*4)
	req.OutputDtype = pb.DataType_DATA_TYPE_FLOAT32
	req.OutputShm = &pb.SharedMemoryRef{RegionName: "r", Offset: 1024, ByteSize: m * testK * 4}
	type result struct {
		resp *pb.FusedMoEResponse
		err  error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := c.FusedMoE(ctx, req)
		done <- result{resp, err}
	}()
	<-b.started
	list, err := c.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{Name: "r"})
	if err != nil || list.GetRegions()[0].GetCallsInFlight() != 1 {
		t.Errorf("ListSharedMemory during the call = %v, %v; want calls_in_flight 1", list, err)
	}
	if _, err := c.UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{Name: "r"}); err != nil {
		t.Fatalf("UnregisterSharedMemory: %v", err)
	}
	if list, err := c.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{}); err != nil || len(list.GetRegions()) != 0 {
		t.Errorf("ListSharedMemory after unregistering = %v, %v; want none", list, err)
	}
	if !mapped(t, key) {
		t.Errorf("/dev/shm/%s unmapped under a running call", key)
	}
	again := request(rng, m)
	again.HiddenStates.Source = shmRef("r", 0, m*testK*4)
	_, err = c.FusedMoE(ctx, again)
	wantCode(t, err, codes.NotFound, `hidden_states.shm.region_name: no shared-memory region "r"`)

	close(b.release)
	r := <-done
	if r.err != nil {
		t.Fatalf("the running call failed: %v", r.err)
	}
	// The fake backend's output is each element's index.
	if got := bytesF32(readAt(t, f, m*testK*4, 1024)); got[0] != 0 || got[m*testK-1] != m*testK-1 {
		t.Errorf("region output starts %v and ends %v, want 0 and %d", got[0], got[m*testK-1], m*testK-1)
	}
	// The call released the region before it answered.
	if mapped(t, key) {
		t.Errorf("/dev/shm/%s still mapped after its last call", key)
	}
}

// TestSharedMemoryPerConnection: a region is visible only on the connection
// that registered it, and closing that connection unmaps it.
func TestSharedMemoryPerConnection(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	dial, _ := servicetest.StartServerDial(t, service.Config{SharedMemory: true}, &fakeBackend{})
	a, b := dial(), dial()
	ca, cb := pb.NewExpertServiceClient(a), pb.NewExpertServiceClient(b)
	w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)
	if _, err := servicetest.Upload(ctx, ca, servicetest.Header("layer", w, false), servicetest.Chunks(w, 1000)); err != nil {
		t.Fatalf("LoadExperts: %v", err)
	}
	key, f := shmObject(t, 4096)
	if _, err := ca.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "r", Key: key, ByteSize: 4096}); err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	// The other connection may use the same name for its own region.
	if _, err := cb.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "r", Key: key, ByteSize: 100}); err != nil {
		t.Fatalf("RegisterSharedMemory on the second connection: %v", err)
	}
	req := request(rng, 2)
	writeAt(t, f, req.GetHiddenStates().GetData(), 0)
	req.HiddenStates.Source = shmRef("r", 0, 2*testK*4)
	if _, err := ca.FusedMoE(ctx, req); err != nil {
		t.Fatalf("FusedMoE on the registering connection: %v", err)
	}
	_, err := cb.FusedMoE(ctx, req)
	wantCode(t, err, codes.InvalidArgument, `hidden_states.shm.byte_size: 320 at offset 0 runs past the end of region "r" (100 bytes)`)
	if _, err := cb.UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{}); err != nil {
		t.Fatal(err)
	}
	_, err = cb.FusedMoE(ctx, req)
	wantCode(t, err, codes.NotFound, `hidden_states.shm.region_name: no shared-memory region "r" on this connection`)

	a.Close()
	waitUnmapped(t, key)
}

// TestSharedMemoryShutdown: Shutdown unmaps every region.
func TestSharedMemoryShutdown(t *testing.T) {
	ctx := testContext(t)
	c, srv, _ := servicetest.StartServerConfig(t, service.Config{SharedMemory: true}, &fakeBackend{})
	key, _ := shmObject(t, 4096)
	if _, err := c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "r", Key: key, ByteSize: 4096}); err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	if !mapped(t, key) {
		t.Fatalf("/dev/shm/%s not mapped after registering", key)
	}
	if err := srv.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if mapped(t, key) {
		t.Errorf("/dev/shm/%s still mapped after Shutdown", key)
	}
	_, err := c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "r2", Key: key, ByteSize: 4096})
	wantCode(t, err, codes.Unavailable, "draining")
}

// TestSharedMemoryShrunk: an object truncated under its region is refused
// before anything reads it, instead of faulting.
func TestSharedMemoryShrunk(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	b := &fakeBackend{}
	c, _ := loadedServer(t, rng, service.Config{SharedMemory: true}, b)
	key, f := shmObject(t, 8192)
	if _, err := c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "r", Key: key, ByteSize: 8192}); err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	if err := f.Truncate(100); err != nil {
		t.Fatal(err)
	}
	req := request(rng, 2)
	req.HiddenStates.Source = shmRef("r", 0, 2*testK*4)
	_, err := c.FusedMoE(ctx, req)
	wantCode(t, err, codes.FailedPrecondition, `shared-memory region "r": its object no longer covers the region`)
	if n := b.numCalls(); n != 0 {
		t.Errorf("backend ran %d calls, want 0", n)
	}
}

// TestSharedMemoryStream: FusedMoEStream resolves each request's
// references on its own, writing each output to its own slice.
func TestSharedMemoryStream(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	c, _ := loadedServer(t, rng, service.Config{SharedMemory: true, MaxConcurrent: 2}, &fakeBackend{})
	key, f := shmObject(t, 1<<14)
	if _, err := c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "r", Key: key, ByteSize: 1 << 14}); err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	stream, err := c.FusedMoEStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	const calls, m = 3, 2
	const outBytes = m * testK * 4
	for i := range calls {
		req := request(rng, m)
		req.OutputDtype = pb.DataType_DATA_TYPE_FLOAT32
		writeAt(t, f, req.GetHiddenStates().GetData(), int64(i)*1024)
		req.HiddenStates.Source = shmRef("r", int64(i)*1024, m*testK*4)
		req.OutputShm = &pb.SharedMemoryRef{RegionName: "r", Offset: 8192 + int64(i)*1024, ByteSize: outBytes}
		if err := stream.Send(req); err != nil {
			t.Fatal(err)
		}
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	for i := range calls {
		resp, err := stream.Recv()
		if err != nil {
			t.Fatalf("response %d: %v", i, err)
		}
		if got := resp.GetOutput().GetShm().GetOffset(); got != 8192+int64(i)*1024 {
			t.Errorf("response %d: output at offset %d, want %d", i, got, 8192+i*1024)
		}
		if got := bytesF32(readAt(t, f, outBytes, 8192+int64(i)*1024)); got[m*testK-1] != m*testK-1 {
			t.Errorf("response %d: region output ends with %v, want %d", i, got[m*testK-1], m*testK-1)
		}
	}
}

// TestSharedMemoryMetrics: the gauges count mapped regions and bytes, and
// return to zero once they are unregistered.
func TestSharedMemoryMetrics(t *testing.T) {
	ctx := testContext(t)
	reader := sdkmetric.NewManualReader()
	meter := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)).Meter("test")
	c, _, _ := servicetest.StartServerConfig(t, service.Config{SharedMemory: true, Meter: meter}, &fakeBackend{})
	gauges := func() (regions, mapped int64) {
		t.Helper()
		var rm metricdata.ResourceMetrics
		if err := reader.Collect(context.Background(), &rm); err != nil {
			t.Fatal(err)
		}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				if d, ok := m.Data.(metricdata.Gauge[int64]); ok && len(d.DataPoints) == 1 {
					switch m.Name {
					case "expertd.shared_memory.regions":
						regions = d.DataPoints[0].Value
					case "expertd.shared_memory.mapped_bytes":
						mapped = d.DataPoints[0].Value
					}
				}
			}
		}
		return regions, mapped
	}
	key, _ := shmObject(t, 8192)
	for _, r := range []*pb.RegisterSharedMemoryRequest{{Name: "a", Key: key, ByteSize: 8192}, {Name: "b", Key: key, Offset: 5000, ByteSize: 100}} {
		if _, err := c.RegisterSharedMemory(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	if r, b := gauges(); r != 2 || b != 8292 {
		t.Errorf("gauges with two regions: %d regions, %d bytes; want 2, 8292", r, b)
	}
	if _, err := c.UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{}); err != nil {
		t.Fatal(err)
	}
	if r, b := gauges(); r != 0 || b != 0 {
		t.Errorf("gauges after unregistering: %d regions, %d bytes; want 0, 0", r, b)
	}
}
