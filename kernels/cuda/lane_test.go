//go:build (linux || darwin) && (amd64 || arm64)

package cuda

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/ebitengine/purego"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// fakeLaneBackend is a backend on the fake library (built with flags) and
// a set loaded on it, with a request whose tensors are at fake device
// addresses, as a lane takes them.
func fakeLaneBackend(t *testing.T, flags ...string) (*Backend, kernels.Loaded, *moe.Request) {
	t.Helper()
	lib, err := openLibrary(fakeLibrary(t, flags...))
	if err != nil {
		t.Fatal(err)
	}
	b := &Backend{lib: lib, info: "fake device", live: map[*loaded]struct{}{}}
	t.Cleanup(func() { b.Close() })
	set, req := kerneltest.NewCase(rand.New(rand.NewPCG(1, 3)), kerneltest.Qwen3.Scaled(64, 32), 1,
		kerneltest.WithGranularity(scaling.PerExpert))
	l, err := b.Load(context.Background(), set)
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	r := *req
	r.Hidden = moe.Tensor{Memory: moe.Device, Dev: 0x7e00_0000_0000, DevBytes: int64(len(req.Hidden.Data)), DType: req.Hidden.DType, Shape: req.Hidden.Shape}
	r.Logits = moe.Tensor{Memory: moe.Device, Dev: 0x7e00_1000_0000, DevBytes: int64(len(req.Logits.Data)), DType: req.Logits.DType, Shape: req.Logits.Shape}
	r.OutDev = 0x7e00_2000_0000
	r.Out = nil
	return b, l, &r
}

// fakeLaneCall makes one call on a fake lane as a caller's stream would
// (the fake library's fakecuda_lane_call, on the flags the lane reports).
func fakeLaneCall(t *testing.T, b *Backend, f kernels.LaneFlags) {
	t.Helper()
	h, err := purego.Dlopen(b.lib.path, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		t.Fatal(err)
	}
	var call func(handle *byte, doorbell, done int64) int32
	sym, err := purego.Dlsym(h, "fakecuda_lane_call")
	if err != nil {
		t.Fatal(err)
	}
	purego.RegisterFunc(&call, sym)
	if rc := call(&f.Handle[0], f.Doorbell, f.Done); rc != 0 {
		t.Fatalf("fakecuda_lane_call: %d (1: not the fake's handle, 2: done never set)", rc)
	}
}

// TestLaneLifecycle rings a lane on the fake library as a caller's stream
// would (done = 0, doorbell = 1, wait for done), counts the calls it
// served, and closes it: through Close, and through the backend's Close.
func TestLaneLifecycle(t *testing.T) {
	b, l, req := fakeLaneBackend(t)
	lane, err := b.OpenLane(l, req, 4)
	if err != nil {
		t.Fatalf("OpenLane: %v", err)
	}
	f := lane.Flags()
	if f.Bytes != laneFlagsBytes || f.Doorbell != laneDoorbell || f.Done != laneDone {
		t.Errorf("flags %+v: want %d bytes, doorbell at %d, done at %d", f, laneFlagsBytes, laneDoorbell, laneDone)
	}
	if !lane.SkipsOnClose() || lane.MPS() {
		t.Errorf("mode: skips %v, MPS %v; the fake reports skips only", lane.SkipsOnClose(), lane.MPS())
	}
	const calls = 5
	for range calls {
		fakeLaneCall(t, b, f)
	}
	if got := lane.Served(); got != calls {
		t.Errorf("Served = %d, want %d", got, calls)
	}
	if err := lane.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if got := lane.Served(); got != calls {
		t.Errorf("Served after Close = %d, want %d", got, calls)
	}
	if err := lane.Close(); err != nil {
		t.Errorf("second Close: %v, want nil", err)
	}

	// A lane still open when the backend closes is closed with it.
	if _, err := b.OpenLane(l, req, 1); err != nil {
		t.Fatalf("OpenLane: %v", err)
	}
	if err := b.Close(); err != nil {
		t.Fatalf("backend Close: %v", err)
	}
	if n := len(b.lanes); n != 0 {
		t.Errorf("%d lanes left open after the backend closed", n)
	}
}

// TestLaneRefusals checks OpenLane's argument checks and that a library
// failure keeps its message and sentinel.
func TestLaneRefusals(t *testing.T) {
	b, l, req := fakeLaneBackend(t)
	host := *req
	host.Hidden.Dev = 0
	scaled := *req
	scaled.HiddenScale = []float32{1}
	for _, tt := range []struct {
		name  string
		req   *moe.Request
		depth int
		want  string
	}{
		{"depth 0", req, 0, "lane depth 0: want 1 to 64"},
		{"depth too large", req, MaxLaneDepth + 1, "lane depth 65"},
		{"host hidden", &host, 1, "must be in device memory"},
		{"hidden scales", &scaled, 1, "no hidden scales"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			lane, err := b.OpenLane(l, tt.req, tt.depth)
			if err == nil {
				lane.Close()
				t.Fatal("OpenLane succeeded")
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("OpenLane: %v, want it to say %q", err, tt.want)
			}
		})
	}

	b2, l2, req2 := fakeLaneBackend(t, "-DFAKE_LANE_RC=2")
	_, err := b2.OpenLane(l2, req2, 2)
	if err == nil || !strings.Contains(err.Error(), "lane_open: ERR_UNSUPPORTED: fake: no stream memory operations") {
		t.Errorf("OpenLane on a library that refuses: %v", err)
	}
	if !errors.Is(err, kernels.ErrUnsupported) {
		t.Errorf("OpenLane's refusal %v does not wrap kernels.ErrUnsupported", err)
	}
}
