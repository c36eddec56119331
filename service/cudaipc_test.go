package service_test

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// ipcAllocBytes is the fake device allocation most CUDA IPC tests share.
const ipcAllocBytes = 1 << 16

// ipcServer serves b behind fake device memory with shared memory on and
// a random set loaded as "layer", and returns an allocation of
// ipcAllocBytes.
func ipcServer(t *testing.T, rng *rand.Rand, cfg service.Config, b kernels.Backend) (pb.ExpertServiceClient, *service.Server, *servicetest.FakeDevice, *servicetest.Allocation) {
	t.Helper()
	d := servicetest.NewFakeDevice(b)
	cfg.SharedMemory = true
	c, srv, _ := servicetest.StartServerConfig(t, cfg, d)
	w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)
	if _, err := servicetest.Upload(testContext(t), c, servicetest.Header("layer", w, false), servicetest.Chunks(w, 1000)); err != nil {
		t.Fatalf("LoadExperts: %v", err)
	}
	return c, srv, d, d.Alloc(ipcAllocBytes)
}

// ipcRegister is a CUDA IPC registration of [off, off+size) of a.
func ipcRegister(name string, a *servicetest.Allocation, off, size int64) *pb.RegisterSharedMemoryRequest {
	return &pb.RegisterSharedMemoryRequest{Name: name, Kind: pb.SharedMemoryKind_SHARED_MEMORY_KIND_CUDA_IPC, CudaIpcHandle: a.Handle, Offset: off, ByteSize: size}
}

// TestCUDAIPCRegister registers device memory and checks every refusal:
// each names the field, leaves the connection's regions as they were and
// leaves no device memory open.
func TestCUDAIPCRegister(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	c, _, d, a := ipcServer(t, rng, service.Config{}, &fakeBackend{})
	resp, err := c.RegisterSharedMemory(ctx, ipcRegister("taken", a, 256, 4096))
	if err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	want := &pb.SharedMemoryRegion{Name: "taken", Kind: pb.SharedMemoryKind_SHARED_MEMORY_KIND_CUDA_IPC, Offset: 256, ByteSize: 4096}
	if diff := cmp.Diff(want, resp.GetRegion(), protocmp.Transform(), protocmp.IgnoreFields(&pb.SharedMemoryRegion{}, "registered_at")); diff != "" {
		t.Errorf("registered region (-want +got):\n%s", diff)
	}
	list, err := c.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{})
	if diff := cmp.Diff(&pb.ListSharedMemoryResponse{Regions: []*pb.SharedMemoryRegion{want}}, list, protocmp.Transform(), protocmp.IgnoreFields(&pb.SharedMemoryRegion{}, "registered_at")); err != nil || diff != "" {
		t.Errorf("ListSharedMemory = %v (-want +got):\n%s", err, diff)
	}
	if got := d.Open(); got != 1 {
		t.Fatalf("%d device regions open after registering one", got)
	}

	reg := func(edit func(r *pb.RegisterSharedMemoryRequest)) *pb.RegisterSharedMemoryRequest {
		r := ipcRegister("r", a, 0, ipcAllocBytes)
		r.CudaIpcHandle = slices.Clone(r.CudaIpcHandle)
		edit(r)
		return r
	}
	randomHandle := make([]byte, 64)
	for i := range randomHandle {
		randomHandle[i] = byte(rng.Uint32())
	}
	tests := []struct {
		name     string
		req      *pb.RegisterSharedMemoryRequest
		openErr  error
		wantCode codes.Code
		wantMsg  string
	}{
		{"no handle", reg(func(r *pb.RegisterSharedMemoryRequest) { r.CudaIpcHandle = nil }), nil, codes.InvalidArgument, "cuda_ipc_handle: 0 bytes: want the 64 bytes of a cudaIpcMemHandle_t"},
		{"short handle", reg(func(r *pb.RegisterSharedMemoryRequest) { r.CudaIpcHandle = r.CudaIpcHandle[:63] }), nil, codes.InvalidArgument, "cuda_ipc_handle: 63 bytes: want the 64 bytes"},
		{"long handle", reg(func(r *pb.RegisterSharedMemoryRequest) { r.CudaIpcHandle = append(r.CudaIpcHandle, 0) }), nil, codes.InvalidArgument, "cuda_ipc_handle: 65 bytes: want the 64 bytes of a cudaIpcMemHandle_t"},
		{"pytorch's prefix", reg(func(r *pb.RegisterSharedMemoryRequest) { r.CudaIpcHandle = append([]byte{3, 'c'}, r.CudaIpcHandle...) }), nil, codes.InvalidArgument,
			"cuda_ipc_handle: 66 bytes: want the 64 bytes of a cudaIpcMemHandle_t; PyTorch's _share_cuda_() puts a version and a type byte before it: send the last 64"},
		{"key set", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Key = "torch_1" }), nil, codes.InvalidArgument, `key: "torch_1": must be empty for SHARED_MEMORY_KIND_CUDA_IPC`},
		{"name taken", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Name = "taken" }), nil, codes.AlreadyExists, `name: "taken": this connection already has`},
		{"bad name", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Name = "" }), nil, codes.InvalidArgument, `name: "": want 1-128 characters`},
		{"negative offset", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Offset = -1 }), nil, codes.InvalidArgument, "offset: -1: want >= 0"},
		{"zero size", reg(func(r *pb.RegisterSharedMemoryRequest) { r.ByteSize = 0 }), nil, codes.InvalidArgument, "byte_size: 0: want >= 1"},
		{"past the allocation", reg(func(r *pb.RegisterSharedMemoryRequest) { r.Offset = 1 }), nil, codes.InvalidArgument,
			"cuda_ipc_handle: backend fake cannot open it: fake device: [1, 1+65536) is outside the allocation's 65536 bytes"},
		{"not a handle", reg(func(r *pb.RegisterSharedMemoryRequest) { r.CudaIpcHandle = randomHandle }), nil, codes.InvalidArgument,
			"cuda_ipc_handle: backend fake cannot open it: fake device: invalid IPC handle"},
		{"backend cannot", reg(func(*pb.RegisterSharedMemoryRequest) {}), fmt.Errorf("cuda: %w: the driver has no CUDA IPC (WSL)", kernels.ErrUnsupported), codes.FailedPrecondition,
			"cuda_ipc_handle: backend fake: cuda: unsupported by backend: the driver has no CUDA IPC (WSL)"},
		{"out of memory", reg(func(*pb.RegisterSharedMemoryRequest) {}), fmt.Errorf("cuda: %w: mapping the allocation", kernels.ErrOutOfMemory), codes.ResourceExhausted,
			"cuda_ipc_handle: backend fake: cuda: backend out of memory"},
		{"open fails", reg(func(*pb.RegisterSharedMemoryRequest) {}), errors.New("cudaIpcOpenMemHandle: invalid device context"), codes.InvalidArgument,
			"cuda_ipc_handle: backend fake cannot open it: cudaIpcOpenMemHandle: invalid device context"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d.OpenErr = tt.openErr
			defer func() { d.OpenErr = nil }()
			_, err := c.RegisterSharedMemory(ctx, tt.req)
			wantCode(t, err, tt.wantCode, tt.wantMsg)
			list, err := c.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{})
			if err != nil {
				t.Fatal(err)
			}
			if len(list.GetRegions()) != 1 || list.GetRegions()[0].GetName() != "taken" {
				t.Errorf("regions after a refused registration: %v, want only \"taken\"", list.GetRegions())
			}
			if got := d.Open(); got != 1 {
				t.Errorf("%d device regions open after a refused registration, want 1", got)
			}
		})
	}

	if _, err := c.UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{Name: "taken"}); err != nil {
		t.Fatal(err)
	}
	if got := d.Open(); got != 0 {
		t.Errorf("%d device regions open after unregistering, want 0", got)
	}
}

// TestCUDAIPCRefusedServers: without -shared-memory, or on a backend that
// cannot open device memory, CUDA IPC registration is FailedPrecondition
// saying what to change, and nothing is opened.
func TestCUDAIPCRefusedServers(t *testing.T) {
	ctx := testContext(t)
	d := servicetest.NewFakeDevice(&fakeBackend{})
	a := d.Alloc(4096)
	off, _, _ := servicetest.StartServerConfig(t, service.Config{}, d)
	_, err := off.RegisterSharedMemory(ctx, ipcRegister("r", a, 0, 4096))
	wantCode(t, err, codes.FailedPrecondition, "-shared-memory")
	if got := d.Open(); got != 0 {
		t.Errorf("%d device regions open on a server without shared memory", got)
	}

	host, _, _ := servicetest.StartServerConfig(t, service.Config{SharedMemory: true}, cpu.New(kernels.Config{Threads: 1}))
	_, err = host.RegisterSharedMemory(ctx, ipcRegister("r", a, 0, 4096))
	wantCode(t, err, codes.FailedPrecondition, "kind: the cpu backend cannot open CUDA IPC memory; run expertd with -backend cuda")
}

// TestCUDAIPCFusedMoE runs the CPU backend with hidden states, logits and
// the output in device memory (a region starting inside the allocation),
// and checks that the backend got device addresses, base + region offset
// + tensor offset, and no host bytes, and that the output written there is
// the inline call's, bit for bit, with a reference and no bytes in the
// response.
func TestCUDAIPCFusedMoE(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	c, _, d, a := ipcServer(t, rng, service.Config{MaxConcurrent: 2}, cpu.New(kernels.Config{Threads: 2}))
	const regionOff, m = 512, 5
	if _, err := c.RegisterSharedMemory(ctx, ipcRegister("dev", a, regionOff, ipcAllocBytes-regionOff)); err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	const hOff, lOff, oOff = 256, 4096, 8192
	tests := []struct {
		name              string
		out               pb.DataType
		hidden, logits, o bool // in device memory
	}{
		{"all on the device, bf16", pb.DataType_DATA_TYPE_BFLOAT16, true, true, true},
		{"all on the device, fp32", pb.DataType_DATA_TYPE_FLOAT32, true, true, true},
		{"hidden only", pb.DataType_DATA_TYPE_BFLOAT16, true, false, false},
		{"logits and output", pb.DataType_DATA_TYPE_FLOAT32, false, true, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			inline := request(rng, m)
			inline.OutputDtype = tt.out
			inline.ReturnRouting = true
			wantResp, err := c.FusedMoE(ctx, inline)
			if err != nil {
				t.Fatalf("inline FusedMoE: %v", err)
			}
			wantOut := wantResp.GetOutput().GetData()

			req := proto.Clone(inline).(*pb.FusedMoERequest)
			var wantHidden, wantLogits, wantOutDev uintptr
			if tt.hidden {
				b := req.GetHiddenStates().GetData()
				copy(a.Mem[regionOff+hOff:], b)
				req.HiddenStates.Source = shmRef("dev", hOff, int64(len(b)))
				wantHidden = a.Addr + regionOff + hOff
			}
			if tt.logits {
				b := req.GetRouterLogits().GetData()
				copy(a.Mem[regionOff+lOff:], b)
				req.RouterLogits.Source = shmRef("dev", lOff, int64(len(b)))
				wantLogits = a.Addr + regionOff + lOff
			}
			if tt.o {
				copy(a.Mem[regionOff+oOff:], bytes.Repeat([]byte{0xAB}, len(wantOut)))
				req.OutputShm = &pb.SharedMemoryRef{RegionName: "dev", Offset: oOff, ByteSize: int64(len(wantOut))}
				wantOutDev = a.Addr + regionOff + oOff
			}
			resp, err := c.FusedMoE(ctx, req)
			if err != nil {
				t.Fatalf("FusedMoE: %v", err)
			}
			calls := d.Calls()
			got := calls[len(calls)-1]
			if got.Hidden.Dev != wantHidden || (got.Hidden.Data == nil) != tt.hidden ||
				got.Logits.Dev != wantLogits || (got.Logits.Data == nil) != tt.logits ||
				got.OutDev != wantOutDev || (got.Out == nil) != tt.o {
				t.Errorf("backend got hidden at %#x (%d host bytes), logits at %#x (%d host bytes), output at %#x (%d host bytes); want %#x, %#x, %#x and host bytes for the rest",
					got.Hidden.Dev, len(got.Hidden.Data), got.Logits.Dev, len(got.Logits.Data), got.OutDev, len(got.Out), wantHidden, wantLogits, wantOutDev)
			}
			if tt.o {
				if diff := cmp.Diff(req.GetOutputShm(), resp.GetOutput().GetShm(), protocmp.Transform()); diff != "" || resp.GetOutput().GetData() != nil {
					t.Errorf("output source %v, want the output_shm reference and no data (-want +got):\n%s", resp.GetOutput().GetSource(), diff)
				}
				if !bytes.Equal(a.Mem[regionOff+oOff:regionOff+oOff+len(wantOut)], wantOut) {
					t.Errorf("device output differs from the inline call's")
				}
			} else if !bytes.Equal(resp.GetOutput().GetData(), wantOut) {
				t.Errorf("inline output differs from the inline call's")
			}
			if diff := cmp.Diff(wantResp, resp, protocmp.Transform(), protocmp.IgnoreFields(&pb.FusedMoEResponse{}, "timings"), protocmp.IgnoreFields(&pb.Tensor{}, "data", "shm")); diff != "" {
				t.Errorf("response differs from the inline call's (-inline +device):\n%s", diff)
			}
		})
	}
}

// TestCUDAIPCRefusedReferences: device memory may hold only hidden_states,
// router_logits and the output, and its references are checked as POSIX
// ones are. Nothing reaches the backend, and every call releases the
// region.
func TestCUDAIPCRefusedReferences(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	b := &fakeBackend{}
	c, _, d, a := ipcServer(t, rng, service.Config{}, b)
	w := randomWeights(rng, pb.Activation_ACTIVATION_RELU2, 2, testK, 8)
	if _, err := c.RegisterSharedMemory(ctx, ipcRegister("dev", a, 0, 4096)); err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	const m = 3
	const hb = m * testK * 4
	fp8Hidden := func(r *pb.FusedMoERequest) {
		r.HiddenStates = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT8_E4M3FN, Shape: []int64{m, testK}, Source: &pb.Tensor_Data{Data: make([]byte, m*testK)}}
		r.HiddenStatesScale = f32Tensor([]float32{1}, 1)
	}
	precomputed := func(r *pb.FusedMoERequest) {
		r.RouterLogits = nil
		r.TopkIds = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_INT32, Shape: []int64{m, 1}, Source: &pb.Tensor_Data{Data: i32Bytes([]int32{0, 1, 2})}}
		r.TopkWeights = f32Tensor([]float32{1, 1, 1}, m, 1)
	}
	sigmoid := func(r *pb.FusedMoERequest) {
		r.Routing.Scoring = pb.Scoring_SCORING_SIGMOID
		r.Routing.CorrectionBias = f32Tensor(make([]float32, testE), testE)
	}
	inlineWeights := func(r *pb.FusedMoERequest) {
		r.Experts = &pb.FusedMoERequest_Weights{Weights: proto.Clone(w).(*pb.ExpertWeights)}
		r.RouterLogits = f32Tensor(make([]float32, m*2), m, 2)
	}
	type refused struct {
		name     string
		edit     func(r *pb.FusedMoERequest)
		wantCode codes.Code
		wantMsg  string
	}
	// forbidden moves the tensor x picks, of a request prepare made
	// valid, into device memory.
	forbidden := func(prepare func(r *pb.FusedMoERequest), field string, x func(r *pb.FusedMoERequest) *pb.Tensor) refused {
		return refused{field, func(r *pb.FusedMoERequest) {
			prepare(r)
			t := x(r)
			t.Source = shmRef("dev", 1024, int64(len(t.GetData())))
		}, codes.InvalidArgument, field + `.shm: region "dev" is CUDA IPC device memory; only hidden_states, router_logits and output_shm may live there`}
	}
	hidden := func(off, n int64) func(r *pb.FusedMoERequest) {
		return func(r *pb.FusedMoERequest) { r.HiddenStates.Source = shmRef("dev", off, n) }
	}
	out := func(off, n int64) func(r *pb.FusedMoERequest) {
		return func(r *pb.FusedMoERequest) {
			hidden(0, hb)(r)
			r.OutputShm = &pb.SharedMemoryRef{RegionName: "dev", Offset: off, ByteSize: n}
		}
	}
	tests := []refused{
		forbidden(fp8Hidden, "hidden_states_scale", func(r *pb.FusedMoERequest) *pb.Tensor { return r.HiddenStatesScale }),
		forbidden(precomputed, "topk_ids", func(r *pb.FusedMoERequest) *pb.Tensor { return r.TopkIds }),
		forbidden(precomputed, "topk_weights", func(r *pb.FusedMoERequest) *pb.Tensor { return r.TopkWeights }),
		forbidden(sigmoid, "routing.correction_bias", func(r *pb.FusedMoERequest) *pb.Tensor { return r.Routing.CorrectionBias }),
		forbidden(inlineWeights, "weights.w13", func(r *pb.FusedMoERequest) *pb.Tensor { return r.GetWeights().W13 }),
		forbidden(inlineWeights, "weights.w2_scale", func(r *pb.FusedMoERequest) *pb.Tensor { return r.GetWeights().W2Scale }),
		{"hidden one byte short", hidden(0, hb-1), codes.InvalidArgument, `hidden_states.shm.byte_size: 479: shape [3 40] of DATA_TYPE_FLOAT32 needs 480 bytes`},
		{"hidden past the region", hidden(4096-hb+1, hb), codes.InvalidArgument, `hidden_states.shm.byte_size: 480 at offset 3617 runs past the end of region "dev" (4096 bytes)`},
		{"hidden dtype", func(r *pb.FusedMoERequest) { hidden(0, hb)(r); r.HiddenStates.Dtype = pb.DataType_DATA_TYPE_INT32 }, codes.InvalidArgument, "hidden_states: dtype DATA_TYPE_INT32"},
		{"logits shape", func(r *pb.FusedMoERequest) {
			r.RouterLogits.Shape = []int64{m, testE - 1}
			r.RouterLogits.Source = shmRef("dev", 2048, m*(testE-1)*4)
		}, codes.InvalidArgument, "router_logits: shape [3 5]: want [3 6]"},
		{"output size", out(2048, m*testK*4), codes.InvalidArgument, "output_shm.byte_size: 480: the output [3 40] of DATA_TYPE_BFLOAT16 needs 240 bytes"},
		{"output over the hidden states", out(hb-2, m*testK*2), codes.InvalidArgument, `output_shm: [478, 718) of region "dev" overlaps hidden_states.shm`},
		{"output past the region", out(4000, m*testK*2), codes.InvalidArgument, `output_shm.byte_size: 240 at offset 4000 runs past the end of region "dev"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := request(rng, m)
			tt.edit(req)
			_, err := c.FusedMoE(ctx, req)
			wantCode(t, err, tt.wantCode, tt.wantMsg)
			list, err := c.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{Name: "dev"})
			if err != nil || list.GetRegions()[0].GetCallsInFlight() != 0 {
				t.Errorf("ListSharedMemory after the call = %v, %v; want the region with no calls in flight", list, err)
			}
		})
	}
	if n := b.numCalls(); n != 0 {
		t.Errorf("backend ran %d calls, want 0", n)
	}
	if n := len(d.Calls()); n != 0 {
		t.Errorf("device backend got %d calls, want 0", n)
	}
}

// TestCUDAIPCNotBatched: calls with tensors or the output in device
// memory run alone even when batching would merge them, since merging
// copies host bytes. Three calls arrive while the first is in the
// backend: batched, the last two would wait for it and merge.
func TestCUDAIPCNotBatched(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	b := &fakeBackend{started: make(chan struct{}, 3), release: make(chan struct{})}
	// Batches gathered while the first call runs start a window after
	// it ends.
	c, srv, d, a := ipcServer(t, rng, service.Config{BatchWindow: 5 * time.Millisecond, MaxConcurrent: 4}, b)
	if _, err := c.RegisterSharedMemory(ctx, ipcRegister("dev", a, 0, ipcAllocBytes)); err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	const m, calls = 2, 3
	// callHeld sends calls requests (edited by edit): the first is held
	// in the backend until the others are in, which ready says, then all
	// finish and must succeed.
	callHeld := func(t *testing.T, what string, edit func(i int, r *pb.FusedMoERequest), ready func() bool) {
		t.Helper()
		release := make(chan struct{})
		b.mu.Lock()
		b.release = release
		b.mu.Unlock()
		errs := make(chan error, calls)
		reqs := make([]*pb.FusedMoERequest, calls)
		for i := range reqs {
			reqs[i] = request(rng, m)
			edit(i, reqs[i])
		}
		call := func(i int) {
			_, err := c.FusedMoE(ctx, reqs[i])
			errs <- err
		}
		go call(0)
		<-b.started
		for i := 1; i < calls; i++ {
			go call(i)
		}
		waitFor(t, what, ready)
		close(release)
		for range calls {
			if err := <-errs; err != nil {
				t.Errorf("FusedMoE: %v", err)
			}
		}
	}
	tests := []struct {
		name string
		edit func(i int, r *pb.FusedMoERequest)
	}{
		{"hidden", func(i int, r *pb.FusedMoERequest) { r.HiddenStates.Source = shmRef("dev", int64(i)*4096, m*testK*4) }},
		{"logits", func(i int, r *pb.FusedMoERequest) { r.RouterLogits.Source = shmRef("dev", int64(i)*4096, m*testE*4) }},
		{"output", func(i int, r *pb.FusedMoERequest) {
			r.OutputShm = &pb.SharedMemoryRef{RegionName: "dev", Offset: int64(i) * 4096, ByteSize: m * testK * 2}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := len(d.Calls())
			// Unbatched, both start in the backend; batched, they would
			// wait for the first call's batch to finish.
			callHeld(t, "the calls to start or be batched", tt.edit, func() bool {
				b.mu.Lock()
				defer b.mu.Unlock()
				return b.inFlight == calls || srv.Batched() > 0
			})
			for len(b.started) > 0 {
				<-b.started
			}
			got := d.Calls()[before:]
			var ms []int
			for _, r := range got {
				ms = append(ms, r.M())
			}
			if !slices.Equal(ms, []int{m, m, m}) {
				t.Errorf("backend calls of %v tokens, want %v", ms, []int{m, m, m})
			}
			for i, r := range got {
				if r.Hidden.Dev == 0 && r.Logits.Dev == 0 && r.OutDev == 0 {
					t.Errorf("backend call %d has no device address", i)
				}
			}
		})
	}
	// The same calls in host memory merge on this server, so the checks
	// above can tell.
	t.Run("host calls merge", func(t *testing.T) {
		callHeld(t, "two calls to be batched", func(int, *pb.FusedMoERequest) {}, func() bool { return srv.Batched() == calls-1 })
		<-b.started
		got := d.Calls()
		if last := got[len(got)-1].M(); last != (calls-1)*m {
			t.Errorf("last backend call has %d tokens, want %d (the two batched calls merged)", last, (calls-1)*m)
		}
	})
}

// TestCUDAIPCConnectionClosed: a connection's device regions are closed
// when it ends, and the rest on Shutdown; no region is closed twice (the
// fake's Close fails then, which the server would log).
func TestCUDAIPCConnectionClosed(t *testing.T) {
	ctx := testContext(t)
	d := servicetest.NewFakeDevice(&fakeBackend{})
	a := d.Alloc(4096)
	dial, srv := servicetest.StartServerDial(t, service.Config{SharedMemory: true}, d)
	ca, cb := pb.NewExpertServiceClient(dial()), dial()
	for i, c := range []pb.ExpertServiceClient{ca, pb.NewExpertServiceClient(cb)} {
		for _, name := range []string{"x", "y"} {
			if _, err := c.RegisterSharedMemory(ctx, ipcRegister(name, a, int64(i)*1024, 1024)); err != nil {
				t.Fatalf("RegisterSharedMemory: %v", err)
			}
		}
	}
	if got := d.Open(); got != 4 {
		t.Fatalf("%d device regions open, want 4", got)
	}
	if err := cb.Close(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the closed connection's regions to close", func() bool { return d.Open() == 2 })
	if list, err := ca.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{}); err != nil || len(list.GetRegions()) != 2 {
		t.Errorf("the open connection's regions = %v, %v; want x and y", list, err)
	}
	if err := srv.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if got := d.Open(); got != 0 {
		t.Errorf("%d device regions open after Shutdown", got)
	}
}

// TestCUDAIPCUnregisterWhileInUse: a device region unregistered while a
// call uses it disappears from the connection at once but stays open until
// the call ends, which still writes its output there.
func TestCUDAIPCUnregisterWhileInUse(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	b := &fakeBackend{started: make(chan struct{}, 1), release: make(chan struct{})}
	c, _, d, a := ipcServer(t, rng, service.Config{}, b)
	if _, err := c.RegisterSharedMemory(ctx, ipcRegister("dev", a, 0, 4096)); err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	const m = 2
	req := request(rng, m)
	req.HiddenStates.Source = shmRef("dev", 0, m*testK*4)
	req.OutputDtype = pb.DataType_DATA_TYPE_FLOAT32
	req.OutputShm = &pb.SharedMemoryRef{RegionName: "dev", Offset: 1024, ByteSize: m * testK * 4}
	done := make(chan error, 1)
	go func() {
		_, err := c.FusedMoE(ctx, req)
		done <- err
	}()
	<-b.started
	if _, err := c.UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{Name: "dev"}); err != nil {
		t.Fatalf("UnregisterSharedMemory: %v", err)
	}
	if list, err := c.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{}); err != nil || len(list.GetRegions()) != 0 {
		t.Errorf("ListSharedMemory after unregistering = %v, %v; want none", list, err)
	}
	if got := d.Open(); got != 1 {
		t.Errorf("%d device regions open under a running call, want 1", got)
	}
	again := request(rng, m)
	again.HiddenStates.Source = shmRef("dev", 0, m*testK*4)
	_, err := c.FusedMoE(ctx, again)
	wantCode(t, err, codes.NotFound, `hidden_states.shm.region_name: no shared-memory region "dev"`)

	close(b.release)
	if err := <-done; err != nil {
		t.Fatalf("the running call failed: %v", err)
	}
	// The fake backend's output is each element's index.
	if got := bytesF32(a.Mem[1024 : 1024+m*testK*4]); got[0] != 0 || got[m*testK-1] != m*testK-1 {
		t.Errorf("device output starts %v and ends %v, want 0 and %d", got[0], got[m*testK-1], m*testK-1)
	}
	if got := d.Open(); got != 0 {
		t.Errorf("%d device regions open after the last call", got)
	}
}

// TestSharedMemoryPinned: a backend that can page-lock host memory gets
// each POSIX region's whole mapping pinned while it is registered, and
// unpinned before it is unmapped. A failure to pin is logged once and the
// regions are served unpinned.
func TestSharedMemoryPinned(t *testing.T) {
	ctx := testContext(t)
	d := servicetest.NewFakeDevice(&fakeBackend{})
	c, _, _ := servicetest.StartServerConfig(t, service.Config{SharedMemory: true}, d)
	key, _ := shmObject(t, 8192)
	var unpinned []bool // whether the object was still mapped at each unpin
	d.OnUnpin = func([]byte) { unpinned = append(unpinned, mapped(t, key)) }
	// The region starts 100 bytes into the object's first page, which is
	// mapped and pinned whole.
	if _, err := c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "r", Key: key, Offset: 100, ByteSize: 8000}); err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	if got := d.Pinned(); got != 8100 {
		t.Errorf("%d bytes pinned, want 8100", got)
	}
	if _, err := c.UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{}); err != nil {
		t.Fatal(err)
	}
	if got := d.Pinned(); got != 0 || !slices.Equal(unpinned, []bool{true}) {
		t.Errorf("after unregistering: %d bytes pinned, unpins with the object mapped %v; want 0 and [true]", got, unpinned)
	}

	log := &servicetest.LogBuffer{}
	d = servicetest.NewFakeDevice(&fakeBackend{})
	d.PinErr = errors.New("cudaHostRegister: RLIMIT_MEMLOCK")
	c, _, _ = servicetest.StartServerLogger(t, service.Config{SharedMemory: true}, d, slog.New(slog.NewTextHandler(log, nil)))
	for _, name := range []string{"a", "b"} {
		if _, err := c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: name, Key: key, ByteSize: 4096}); err != nil {
			t.Fatalf("RegisterSharedMemory with pinning failing: %v", err)
		}
	}
	if n := strings.Count(log.String(), "shared memory not page-locked"); n != 1 || !strings.Contains(log.String(), "RLIMIT_MEMLOCK") {
		t.Errorf("%d warnings about pinning, want 1 with the error; log:\n%s", n, log)
	}
}

// TestSharedMemoryOutputInPlace: the backend writes the output straight
// into output_shm (moe.Request.Out is the region's bytes, so there is
// no copy afterwards), unbatched or in a batch of one (a merged batch's
// output is copied there by shmCall.writeOutput instead).
func TestSharedMemoryOutputInPlace(t *testing.T) {
	for _, tt := range []struct {
		name    string
		cfg     service.Config
		inPlace bool
	}{
		{"unbatched", service.Config{}, true},
		{"batch of one", service.Config{BatchWindow: time.Millisecond}, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rng := newRand(t)
			ctx := testContext(t)
			d := servicetest.NewFakeDevice(cpu.New(kernels.Config{Threads: 2}))
			tt.cfg.SharedMemory = true
			c, _ := loadedServer(t, rng, tt.cfg, d)
			key, f := shmObject(t, 1<<14)
			if _, err := c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "r", Key: key, ByteSize: 1 << 14}); err != nil {
				t.Fatalf("RegisterSharedMemory: %v", err)
			}
			const m, oOff = 4, 4096
			inline := request(rng, m)
			want, err := c.FusedMoE(ctx, inline)
			if err != nil {
				t.Fatalf("inline FusedMoE: %v", err)
			}
			n := int64(len(want.GetOutput().GetData()))
			req := proto.Clone(inline).(*pb.FusedMoERequest)
			req.OutputShm = &pb.SharedMemoryRef{RegionName: "r", Offset: oOff, ByteSize: n}
			if _, err := c.FusedMoE(ctx, req); err != nil {
				t.Fatalf("FusedMoE: %v", err)
			}
			if got := readAt(t, f, n, oOff); !bytes.Equal(got, want.GetOutput().GetData()) {
				t.Errorf("region output differs from the inline call's")
			}
			calls := d.Calls()
			out := calls[len(calls)-1].Out
			lo, hi := mappingRange(t, key)
			inRegion := len(out) > 0 && addrOf(out) >= lo && addrOf(out)+uintptr(len(out)) <= hi
			if inRegion != tt.inPlace {
				t.Errorf("backend's Out (%d bytes) in the region's mapping: %v, want %v", len(out), inRegion, tt.inPlace)
			}
		})
	}
}

// mappingRange is the address range of this process's mapping of
// /dev/shm/<key> (the server runs in the test's process).
func mappingRange(t *testing.T, key string) (lo, hi uintptr) {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Skipf("no /proc/self/maps: %v", err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.HasSuffix(line, " /dev/shm/"+key) {
			continue
		}
		var l, h uint64
		if _, err := fmt.Sscanf(line, "%x-%x", &l, &h); err != nil {
			t.Fatalf("/proc/self/maps line %q: %v", line, err)
		}
		return uintptr(l), uintptr(h)
	}
	t.Fatalf("/dev/shm/%s is not mapped", key)
	return 0, 0
}

// addrOf is the address of b's first byte.
func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }
