package service_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// Where a lane's tensors sit in the "dev" region of the tests' allocation.
const laneHOff, laneLOff, laneOOff, laneM = 256, 4096, 8192, 3

// laneServer is ipcServer with a region "dev" over the whole allocation.
func laneServer(t *testing.T, rng *rand.Rand, cfg service.Config, b kernels.Backend) (pb.ExpertServiceClient, *service.Server, *servicetest.FakeDevice, *servicetest.Allocation) {
	t.Helper()
	cfg.Lanes = true
	c, srv, d, a := ipcServer(t, rng, cfg, b)
	if _, err := c.RegisterSharedMemory(testContext(t), ipcRegister("dev", a, 0, ipcAllocBytes)); err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	return c, srv, d, a
}

// laneRequest is an OpenLaneRequest for M = laneM calls with every tensor
// in region "dev" (BF16 output).
func laneRequest(rng *rand.Rand) *pb.OpenLaneRequest {
	call := request(rng, laneM)
	call.HiddenStates.Source = shmRef("dev", laneHOff, laneM*testK*4)
	call.RouterLogits.Source = shmRef("dev", laneLOff, laneM*testE*4)
	call.OutputShm = &pb.SharedMemoryRef{RegionName: "dev", Offset: laneOOff, ByteSize: laneM * testK * 2}
	return &pb.OpenLaneRequest{Call: call}
}

// openLane opens a lane and returns its response, and the function that
// ends the stream and waits for its status.
func openLane(t *testing.T, c pb.ExpertServiceClient, req *pb.OpenLaneRequest) (*pb.OpenLaneResponse, func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(testContext(t))
	stream, err := c.OpenLane(ctx, req)
	if err != nil {
		cancel()
		t.Fatalf("OpenLane: %v", err)
	}
	resp, err := stream.Recv()
	if err != nil {
		cancel()
		t.Fatalf("OpenLane: %v", err)
	}
	return resp, func() error {
		cancel()
		_, err := stream.Recv()
		return err
	}
}

// openLaneErr is the status OpenLane ends with before it serves a lane.
func openLaneErr(ctx context.Context, c pb.ExpertServiceClient, req *pb.OpenLaneRequest) error {
	stream, err := c.OpenLane(ctx, req)
	if err != nil {
		return err
	}
	resp, err := stream.Recv()
	if err == nil {
		return fmt.Errorf("OpenLane served a lane: %v", resp)
	}
	return err
}

// laneMetrics are expertd.lane.open and expertd.lane.calls (-1: absent).
func laneMetrics(t *testing.T, reader *sdkmetric.ManualReader) (open, calls int64) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	open, calls = -1, -1
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Gauge[int64]:
				if m.Name == "expertd.lane.open" && len(d.DataPoints) == 1 {
					open = d.DataPoints[0].Value
				}
			case metricdata.Sum[int64]:
				if m.Name == "expertd.lane.calls" && len(d.DataPoints) == 1 {
					calls = d.DataPoints[0].Value
				}
			}
		}
	}
	return open, calls
}

// TestLaneCalls opens a lane on the CPU backend behind fake device memory,
// rings it as a caller's stream would, and checks each call's output is
// the inline FusedMoE call's, bit for bit, for new inputs written in place
// each time; then that cancelling the stream closes the lane and lets go
// of the region, and what the metrics say throughout.
func TestLaneCalls(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	reader := sdkmetric.NewManualReader()
	meter := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)).Meter("test")
	c, _, d, a := laneServer(t, rng, service.Config{Meter: meter}, cpu.New(kernels.Config{Threads: 2}))
	req := laneRequest(rng)
	resp, end := openLane(t, c, req)
	if len(resp.GetFlagsCudaIpcHandle()) != 64 || resp.GetFlagsByteSize() != 256 || resp.GetDoorbellOffset() != 0 || resp.GetDoneOffset() != 128 ||
		resp.GetDepth() != 8 || resp.GetMps() || !resp.GetSkipsOnClose() {
		t.Errorf("OpenLane response %v: want a 64-byte handle, 256 bytes, doorbell 0, done 128, depth 8, no MPS, skips on close", resp)
	}
	if d.Lanes() != 1 {
		t.Fatalf("%d lanes open in the backend, want 1", d.Lanes())
	}
	const calls = 3
	for i := range calls {
		inline := request(rng, laneM)
		copy(a.Mem[laneHOff:], inline.GetHiddenStates().GetData())
		copy(a.Mem[laneLOff:], inline.GetRouterLogits().GetData())
		want, err := c.FusedMoE(ctx, inline)
		if err != nil {
			t.Fatalf("inline FusedMoE: %v", err)
		}
		copy(a.Mem[laneOOff:laneOOff+laneM*testK*2], bytes.Repeat([]byte{0xAB}, laneM*testK*2))
		if err := d.RingLane(resp.GetFlagsCudaIpcHandle(), resp.GetDoorbellOffset(), resp.GetDoneOffset(), 10*time.Second); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		if !bytes.Equal(a.Mem[laneOOff:laneOOff+laneM*testK*2], want.GetOutput().GetData()) {
			t.Errorf("call %d: the lane's output differs from the inline call's: %x vs %x", i, a.Mem[laneOOff:laneOOff+16], want.GetOutput().GetData()[:16])
		}
	}
	if open, n := laneMetrics(t, reader); open != 1 || n != calls {
		t.Errorf("metrics: %d lanes open, %d calls; want 1 and %d", open, n, calls)
	}
	list, err := c.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{Name: "dev"})
	if err != nil || list.GetRegions()[0].GetCallsInFlight() != 1 {
		t.Errorf("ListSharedMemory with the lane open = %v, %v; want the region held by the lane", list, err)
	}

	wantCode(t, end(), codes.Canceled, "")
	waitFor(t, "the lane to close", func() bool { return d.Lanes() == 0 })
	waitFor(t, "the lane's metrics", func() bool { open, n := laneMetrics(t, reader); return open == 0 && n == calls })
	waitFor(t, "the region's release", func() bool {
		list, err := c.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{Name: "dev"})
		return err == nil && list.GetRegions()[0].GetCallsInFlight() == 0
	})
	if _, err := c.UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{Name: "dev"}); err != nil {
		t.Fatal(err)
	}
	if got := d.Open(); got != 0 {
		t.Errorf("%d device regions open after the lane closed and the region was unregistered", got)
	}
}

// TestLaneRefusals: every bad OpenLane names the field (as the
// OpenLaneRequest holds it), opens no lane and leaves the region unheld.
func TestLaneRefusals(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	c, _, d, _ := laneServer(t, rng, service.Config{}, &fakeBackend{})
	w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)
	tests := []struct {
		name     string
		edit     func(r *pb.OpenLaneRequest)
		openErr  error
		wantCode codes.Code
		wantMsg  string
	}{
		{"no call", func(r *pb.OpenLaneRequest) { r.Call = nil }, nil, codes.InvalidArgument, "call: missing"},
		{"depth", func(r *pb.OpenLaneRequest) { r.Depth = 65 }, nil, codes.InvalidArgument, "depth: 65: want 1 to 64"},
		{"inline weights", func(r *pb.OpenLaneRequest) { r.Call.Experts = &pb.FusedMoERequest_Weights{Weights: w} }, nil, codes.InvalidArgument, "call.weights: a lane runs a loaded set"},
		{"return routing", func(r *pb.OpenLaneRequest) { r.Call.ReturnRouting = true }, nil, codes.InvalidArgument, "call.return_routing"},
		{"hidden scale", func(r *pb.OpenLaneRequest) { r.Call.HiddenStatesScale = f32Tensor([]float32{1}, 1) }, nil, codes.InvalidArgument, "call.hidden_states_scale: a lane takes no per-call hidden scales"},
		{"precomputed routing", func(r *pb.OpenLaneRequest) {
			r.Call.TopkIds = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_INT32, Shape: []int64{laneM, 1}, Source: &pb.Tensor_Data{Data: make([]byte, laneM*4)}}
		}, nil, codes.InvalidArgument, "call.topk_ids: a lane routes from router_logits"},
		{"unknown set", func(r *pb.OpenLaneRequest) { r.Call.Experts = &pb.FusedMoERequest_ExpertSet{ExpertSet: "nope"} }, nil, codes.NotFound, `"nope"`},
		{"unknown region", func(r *pb.OpenLaneRequest) { r.Call.HiddenStates.Source = shmRef("none", 0, laneM*testK*4) }, nil, codes.NotFound, "call.hidden_states.shm"},
		{"hidden size", func(r *pb.OpenLaneRequest) { r.Call.HiddenStates.Source = shmRef("dev", laneHOff, 8) }, nil, codes.InvalidArgument,
			"call.hidden_states.shm.byte_size: 8: shape [3 40] of DATA_TYPE_FLOAT32 needs 480 bytes"},
		{"hidden inline", func(r *pb.OpenLaneRequest) {
			r.Call.HiddenStates.Source = &pb.Tensor_Data{Data: make([]byte, laneM*testK*4)}
		}, nil, codes.InvalidArgument, "call.hidden_states.shm: a lane's hidden states must be in a SHARED_MEMORY_KIND_CUDA_IPC region"},
		{"logits inline", func(r *pb.OpenLaneRequest) {
			r.Call.RouterLogits.Source = &pb.Tensor_Data{Data: make([]byte, laneM*testE*4)}
		}, nil, codes.InvalidArgument, "call.router_logits.shm: a lane's router logits must be"},
		{"no output_shm", func(r *pb.OpenLaneRequest) { r.Call.OutputShm = nil }, nil, codes.InvalidArgument, "call.output_shm: a lane's output must be"},
		{"device cannot", func(*pb.OpenLaneRequest) {}, fmt.Errorf("cuda: lane_open: %w: no stream memory operations", kernels.ErrUnsupported), codes.FailedPrecondition,
			"backend fake cannot serve a lane on this device"},
		{"backend fails", func(*pb.OpenLaneRequest) {}, errors.New("cudaMalloc: out of luck"), codes.Internal, "internal error"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d.OpenLaneErr = tt.openErr
			defer func() { d.OpenLaneErr = nil }()
			req := laneRequest(rng)
			tt.edit(req)
			wantCode(t, openLaneErr(ctx, c, req), tt.wantCode, tt.wantMsg)
			if n := d.Lanes(); n != 0 {
				t.Errorf("%d lanes open after a refusal", n)
			}
			waitFor(t, "the region's release", func() bool {
				list, err := c.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{Name: "dev"})
				return err == nil && list.GetRegions()[0].GetCallsInFlight() == 0
			})
		})
	}
}

// TestLaneRefusedServers: without -shared-memory, or on a backend that
// serves no lanes, OpenLane is FailedPrecondition saying what to change;
// ServerInfo says whether lanes are served.
func TestLaneRefusedServers(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	off, _, _ := servicetest.StartServerConfig(t, service.Config{}, servicetest.NewFakeDevice(&fakeBackend{}))
	wantCode(t, openLaneErr(ctx, off, laneRequest(rng)), codes.FailedPrecondition, "-shared-memory")
	host, _, _ := servicetest.StartServerConfig(t, service.Config{SharedMemory: true, Lanes: true}, cpu.New(kernels.Config{Threads: 1}))
	wantCode(t, openLaneErr(ctx, host, laneRequest(rng)), codes.FailedPrecondition, "the cpu backend serves no GPU-ordered lanes")
	// Lanes are opt-in: shared memory and a lane backend alone do not serve them.
	optIn, _, _ := servicetest.StartServerConfig(t, service.Config{SharedMemory: true}, servicetest.NewFakeDevice(&fakeBackend{}))
	wantCode(t, openLaneErr(ctx, optIn, laneRequest(rng)), codes.FailedPrecondition, "-lanes")
	for _, tt := range []struct {
		c    pb.ExpertServiceClient
		want *pb.ServerInfo_LaneInfo
	}{
		{off, &pb.ServerInfo_LaneInfo{MaxLanes: service.DefaultLaneMax, MaxDepth: servicetest.FakeMaxLaneDepth}},
		{host, &pb.ServerInfo_LaneInfo{MaxLanes: service.DefaultLaneMax}},
		{optIn, &pb.ServerInfo_LaneInfo{MaxLanes: service.DefaultLaneMax, MaxDepth: servicetest.FakeMaxLaneDepth}},
	} {
		info, err := tt.c.GetServerInfo(ctx, &pb.GetServerInfoRequest{})
		if err != nil || !proto.Equal(info.GetLane(), tt.want) {
			t.Errorf("ServerInfo.lane = %v, %v; want %v", info.GetLane(), err, tt.want)
		}
	}
	on, _, _, _ := laneServer(t, rng, service.Config{MaxLanes: 3}, &fakeBackend{})
	info, err := on.GetServerInfo(ctx, &pb.GetServerInfoRequest{})
	if want := (&pb.ServerInfo_LaneInfo{Enabled: true, MaxLanes: 3, MaxDepth: servicetest.FakeMaxLaneDepth}); err != nil || !proto.Equal(info.GetLane(), want) {
		t.Errorf("ServerInfo.lane = %v, %v; want %v", info.GetLane(), err, want)
	}
}

// TestLaneCap: past -lane-max lanes OpenLane is ResourceExhausted naming
// the flag; a lane closing frees its slot.
func TestLaneCap(t *testing.T) {
	rng := newRand(t)
	ctx := testContext(t)
	reader := sdkmetric.NewManualReader()
	meter := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)).Meter("test")
	c, _, d, _ := laneServer(t, rng, service.Config{MaxLanes: 1, Meter: meter}, &fakeBackend{})
	_, end := openLane(t, c, laneRequest(rng))
	wantCode(t, openLaneErr(ctx, c, laneRequest(rng)), codes.ResourceExhausted, "the server already serves 1 lanes (-lane-max 1)")
	wantCode(t, end(), codes.Canceled, "")
	waitFor(t, "the lane to close", func() bool { return d.Lanes() == 0 })
	// The handler gives the slot back after the backend's lane closed.
	waitFor(t, "a free lane slot", func() bool {
		open, _ := laneMetrics(t, reader)
		return open == 0
	})
	_, end = openLane(t, c, laneRequest(rng))
	wantCode(t, end(), codes.Canceled, "")
}

// TestLaneShutdown: a drain ends every lane's stream UNAVAILABLE, and
// Shutdown returns once the lanes are closed; a connection closing closes
// its lanes.
func TestLaneShutdown(t *testing.T) {
	rng := newRand(t)
	c, srv, d, _ := laneServer(t, rng, service.Config{}, &fakeBackend{})
	ctx := testContext(t)
	stream, err := c.OpenLane(ctx, laneRequest(rng))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	if err := srv.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if n := d.Lanes(); n != 0 {
		t.Errorf("%d lanes open after Shutdown returned", n)
	}
	_, err = stream.Recv()
	wantCode(t, err, codes.Unavailable, "draining")
	wantCode(t, openLaneErr(ctx, c, laneRequest(rng)), codes.Unavailable, "draining")

	// A caller that goes away: its connection closes.
	d2 := servicetest.NewFakeDevice(&fakeBackend{})
	c2, _, stop := servicetest.StartServerConfig(t, service.Config{SharedMemory: true, Lanes: true}, d2)
	w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)
	if _, err := servicetest.Upload(ctx, c2, servicetest.Header("layer", w, false), servicetest.Chunks(w, 1000)); err != nil {
		t.Fatal(err)
	}
	a2 := d2.Alloc(ipcAllocBytes)
	if _, err := c2.RegisterSharedMemory(ctx, ipcRegister("dev", a2, 0, ipcAllocBytes)); err != nil {
		t.Fatal(err)
	}
	s2, err := c2.OpenLane(ctx, laneRequest(rng), grpc.WaitForReady(true))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s2.Recv(); err != nil {
		t.Fatal(err)
	}
	stop()
	waitFor(t, "the lane of a closed connection to close", func() bool { return d2.Lanes() == 0 && d2.Open() == 0 })
}
