package client_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/internal/testdaemon"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/ring"
	"github.com/expertd/expertd/service"
)

// ringConfig serves rings with a short spin, so tests exercise the
// poller's sleep and wake as well as its polling.
var ringConfig = service.Config{SharedMemory: true, Ring: true, RingSpin: 20 * time.Microsecond, MaxConcurrent: 4}

// gatedBackend is the CPU backend whose calls, while gate is set, wait
// for release: a call the test can hold mid-flight.
type gatedBackend struct {
	kernels.Backend
	gate    atomic.Bool
	entered chan struct{}
	release chan struct{}
}

func newGatedBackend() *gatedBackend {
	return &gatedBackend{Backend: cpu.New(kernels.Config{}), entered: make(chan struct{}, 16), release: make(chan struct{})}
}

func (g *gatedBackend) FusedMoE(ctx context.Context, l kernels.Loaded, req *moe.Request) (*moe.Result, error) {
	if g.gate.Load() {
		g.entered <- struct{}{}
		<-g.release
	}
	return g.Backend.FusedMoE(ctx, l, req)
}

// ringFixture is a server, a client, a loaded layer and a region whose
// first bytes hold a ring and the rest tensors.
type ringFixture struct {
	srv     *testdaemon.Server
	c       *client.Client
	backend *gatedBackend
	shm     *client.SharedMemory
	region  *client.Region
	set     *moe.ExpertSet
	req     *moe.Request
}

const ringLayer = "ring-layer"

func newRingFixture(t *testing.T, cfg service.Config, m int) *ringFixture {
	t.Helper()
	ctx := testContext(t)
	g := newGatedBackend()
	srv, err := testdaemon.ServeBackend(cfg, g)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	c, err := client.Dial(ctx, srv.Addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	set, req := kerneltest.NewCase(newRand(t), kerneltest.Nemotron.Scaled(64, 32), m, kerneltest.WithOutput(moe.BFloat16))
	if _, err := c.LoadExperts(ctx, ringLayer, clienttest.Weights(set)); err != nil {
		t.Fatalf("LoadExperts: %v", err)
	}
	shm := newSharedMemory(t, 4<<20)
	region, err := c.RegisterSharedMemory(ctx, "ring", shm, 0, shm.Size())
	if err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	return &ringFixture{srv: srv, c: c, backend: g, shm: shm, region: region, set: set, req: req}
}

// openRing opens a ring at the start of the fixture's region, closed
// when the test ends.
func (f *ringFixture) openRing(t *testing.T, opts client.RingOptions) *client.Ring {
	t.Helper()
	r, err := f.c.OpenRing(testContext(t), f.region, 0, opts)
	if err != nil {
		t.Fatalf("OpenRing: %v", err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

func (f *ringFixture) request() *client.FusedMoERequest {
	return clienttest.Request(ringLayer, f.set, f.req)
}

// mappings counts this process's mappings of the fixture's object: the
// client's and, while it holds the region, the in-process server's.
func (f *ringFixture) mappings(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Skipf("no /proc/self/maps: %v", err)
	}
	return strings.Count(string(b), "/dev/shm/"+f.shm.Key())
}

// eventually polls cond until it holds or the test's timeout passes.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(defaultTestTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func regionCalls(t *testing.T, ctx context.Context, c *client.Client, name string) int {
	t.Helper()
	infos, err := c.ListSharedMemory(ctx)
	if err != nil {
		t.Fatalf("ListSharedMemory: %v", err)
	}
	for _, r := range infos {
		if r.Name == name {
			return r.CallsInFlight
		}
	}
	return -1
}

// TestRingFusedMoE checks that a call through the ring answers exactly
// what the RPC answers, with tensors inline and in shared memory, and
// with the poller spinning and sleeping.
func TestRingFusedMoE(t *testing.T) {
	for _, spin := range []time.Duration{0, 20 * time.Microsecond, time.Second} {
		t.Run(spin.String(), func(t *testing.T) {
			ctx := testContext(t)
			cfg := ringConfig
			cfg.RingSpin = spin
			f := newRingFixture(t, cfg, 5)
			info, err := f.c.ServerInfo(ctx)
			if err != nil {
				t.Fatal(err)
			}
			wantInfo := client.RingInfo{Enabled: true, Version: ring.Version, Spin: spin, MaxPerConn: service.DefaultRingMaxPerConn,
				MaxRings: service.DefaultRingMax, MaxSlotBytes: service.DefaultRingMaxSlotBytes}
			if info.Ring != wantInfo {
				t.Errorf("ServerInfo().Ring = %+v, want %+v", info.Ring, wantInfo)
			}
			r, err := f.c.OpenRing(ctx, f.region, 0, client.RingOptions{Spin: -1})
			if err != nil {
				t.Fatalf("OpenRing: %v", err)
			}
			defer r.Close()

			inline := f.request()
			want, err := f.c.FusedMoE(ctx, inline)
			if err != nil {
				t.Fatalf("FusedMoE: %v", err)
			}
			for i := range 3 { // the poller sleeps between calls when spin is short
				got, err := r.FusedMoE(ctx, inline)
				if err != nil {
					t.Fatalf("Ring.FusedMoE %d: %v", i, err)
				}
				if !bytes.Equal(got.Output.Data, want.Output.Data) || got.Backend != want.Backend {
					t.Fatalf("ring call %d differs from the RPC's answer", i)
				}
				time.Sleep(time.Millisecond)
			}

			shmReq := f.request()
			base := client.RingSize(client.RingOptions{})
			if shmReq.Hidden, err = f.region.Put(base, shmReq.Hidden); err != nil {
				t.Fatal(err)
			}
			if shmReq.RouterLogits, err = f.region.Put(base+64<<10, shmReq.RouterLogits); err != nil {
				t.Fatal(err)
			}
			shmReq.OutputShm = f.region.Ref(base+128<<10, int64(len(want.Output.Data)))
			got, err := r.FusedMoE(ctx, shmReq)
			if err != nil {
				t.Fatalf("Ring.FusedMoE (shm): %v", err)
			}
			if got.Output.Shm == nil || *got.Output.Shm != *shmReq.OutputShm || !bytes.Equal(got.Output.Data, want.Output.Data) {
				t.Fatalf("shm ring call: output %v differs from the RPC's answer", got.Output.Shm)
			}
		})
	}
}

// TestRingResultOwned: a result keeps its output and strings when its
// slot carries the next call, whose answer differs (its hidden states are
// zero): the result must not refer to the slot.
func TestRingResultOwned(t *testing.T) {
	ctx := testContext(t)
	f := newRingFixture(t, ringConfig, 3)
	r := f.openRing(t, client.RingOptions{Slots: 1})
	first, err := r.FusedMoE(ctx, f.request())
	if err != nil {
		t.Fatalf("Ring.FusedMoE: %v", err)
	}
	out, backend := bytes.Clone(first.Output.Data), strings.Clone(first.Backend)
	zero := f.request()
	zero.Hidden.Data = make([]byte, len(zero.Hidden.Data))
	second, err := r.FusedMoE(ctx, zero)
	if err != nil {
		t.Fatalf("Ring.FusedMoE: %v", err)
	}
	if bytes.Equal(second.Output.Data, out) {
		t.Fatal("the second call's output equals the first's: the test cannot tell them apart")
	}
	if !bytes.Equal(first.Output.Data, out) || first.Backend != backend {
		t.Error("the first result changed when its slot carried the next call")
	}
}

// TestRingNameNotUTF8: a set name that is not UTF-8 (which protobuf
// cannot carry) is refused as an invalid argument naming the field.
func TestRingNameNotUTF8(t *testing.T) {
	ctx := testContext(t)
	f := newRingFixture(t, ringConfig, 1)
	r := f.openRing(t, client.RingOptions{Slots: 1})
	req := f.request()
	req.ExpertSet = "layer\xff"
	_, err := r.FusedMoE(ctx, req)
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "expert_set") {
		t.Fatalf("Ring.FusedMoE: %v, want InvalidArgument naming expert_set", err)
	}
	// The ring still serves.
	if _, err := r.FusedMoE(ctx, f.request()); err != nil {
		t.Fatalf("Ring.FusedMoE after the refusal: %v", err)
	}
}

// TestRingInFlight runs more concurrent callers than the ring has slots.
func TestRingInFlight(t *testing.T) {
	ctx := testContext(t)
	f := newRingFixture(t, ringConfig, 3)
	want, err := f.c.FusedMoE(ctx, f.request())
	if err != nil {
		t.Fatal(err)
	}
	r, err := f.c.OpenRing(ctx, f.region, 0, client.RingOptions{Slots: 3})
	if err != nil {
		t.Fatalf("OpenRing: %v", err)
	}
	defer r.Close()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			for range 20 {
				got, err := r.FusedMoE(ctx, f.request())
				if err == nil && !bytes.Equal(got.Output.Data, want.Output.Data) {
					err = status.Error(codes.DataLoss, "answer differs from the RPC's")
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// rawRing lays out and attaches a ring by hand, as a client in another
// language would, so the test can post what the SDK never would.
func rawRing(t *testing.T, ctx context.Context, f *ringFixture, slots, slotSize int) *ring.Ring {
	t.Helper()
	r, err := ring.Init(f.region.Bytes()[:ring.Size(slots, slotSize)], slots, slotSize)
	if err != nil {
		t.Fatal(err)
	}
	sctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	stream, err := f.c.RPC().AttachRing(sctx, &pb.AttachRingRequest{RegionName: f.region.Name, SlotCount: uint32(slots), SlotSize: uint32(slotSize)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatalf("AttachRing: %v", err)
	}
	return r
}

// await waits for slot i and decodes its completion.
func await(t *testing.T, r *ring.Ring, i int, seq uint64) (*pb.FusedMoEResponse, *status.Status) {
	t.Helper()
	if !r.WaitDone(i, 0, 10*time.Millisecond, func() bool { return false }) {
		t.Fatal("the ring closed before the completion")
	}
	kind, got, payload, err := r.Response(i)
	if err != nil || got != seq {
		t.Fatalf("Response: seq %d (want %d), %v", got, seq, err)
	}
	defer r.Release(i)
	switch kind {
	case ring.KindStatus:
		var sp spb.Status
		if err := proto.Unmarshal(payload, &sp); err != nil {
			t.Fatal(err)
		}
		return nil, status.FromProto(&sp)
	case ring.KindResponse:
		var resp pb.FusedMoEResponse
		if err := proto.Unmarshal(payload, &resp); err != nil {
			t.Fatal(err)
		}
		return &resp, nil
	}
	t.Fatalf("completion kind %d", kind)
	return nil, nil
}

// TestRingGarbage posts what a careless or hostile caller might: each gets
// an error completion naming the problem (or, for a slot in a state the
// caller owns, nothing), and the next good call is served.
func TestRingGarbage(t *testing.T) {
	ctx := testContext(t)
	f := newRingFixture(t, ringConfig, 2)
	const slots, slotSize = 2, 4096
	r := rawRing(t, ctx, f, slots, slotSize)
	good, err := proto.Marshal(requestProto(t, f.request()))
	if err != nil {
		t.Fatal(err)
	}
	unknown := requestProto(t, f.request())
	unknown.HiddenStates.Source = &pb.Tensor_Shm{Shm: &pb.SharedMemoryRef{RegionName: "nope", ByteSize: int64(len(unknown.GetHiddenStates().GetData()))}}
	badRef, _ := proto.Marshal(unknown)
	noSet := requestProto(t, f.request())
	noSet.Experts = &pb.FusedMoERequest_ExpertSet{ExpertSet: "missing"}
	missing, _ := proto.Marshal(noSet)

	slot := func(off int) []byte { return f.region.Bytes()[ring.HeaderSize+off:] }
	tests := []struct {
		name    string
		post    func(seq uint64)
		code    codes.Code
		message string
	}{
		{"not a proto", func(seq uint64) { r.Post(0, seq, []byte{0xff, 0xff, 0xff}, 0) }, codes.InvalidArgument, "not a serialized"},
		{"length past the slot", func(seq uint64) {
			// Posted by hand: the poller may take a slot the moment its
			// state says Posted, so the bad length goes in first.
			binary.LittleEndian.PutUint64(slot(8), seq)
			binary.LittleEndian.PutUint32(slot(16), slotSize) // req_len
			atomic.StoreUint32((*uint32)(unsafe.Pointer(&slot(0)[0])), ring.Posted)
			r.Ring()
		}, codes.InvalidArgument, "exceeds the slot payload"},
		{"unknown region", func(seq uint64) { r.Post(0, seq, badRef, 0) }, codes.NotFound, `"nope"`},
		{"unknown expert set", func(seq uint64) { r.Post(0, seq, missing, 0) }, codes.NotFound, "missing"},
		{"empty request", func(seq uint64) { r.Post(0, seq, nil, 0) }, codes.InvalidArgument, "experts"},
	}
	seq := uint64(100)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			seq++
			tc.post(seq)
			resp, st := await(t, r, 0, seq)
			if st == nil || st.Code() != tc.code || !strings.Contains(st.Message(), tc.message) {
				t.Fatalf("completion %v, %v; want %v mentioning %q", resp, st.Err(), tc.code, tc.message)
			}
			seq++
			if err := r.Post(1, seq, good, 0); err != nil {
				t.Fatal(err)
			}
			if resp, st := await(t, r, 1, seq); st != nil || len(resp.GetOutput().GetData()) == 0 {
				t.Fatalf("the next good call: %v", st.Err())
			}
		})
	}
	t.Run("state the caller owns", func(t *testing.T) {
		atomic.StoreUint32((*uint32)(unsafe.Pointer(&slot(0)[0])), 7) // an impossible state
		r.Ring()
		time.Sleep(20 * time.Millisecond)
		if s := r.State(0); s != 7 {
			t.Fatalf("the server changed a slot in state 7 to %d", s)
		}
		r.Release(0)
	})
}

// requestProto is the wire form of an SDK request.
func requestProto(t *testing.T, r *client.FusedMoERequest) *pb.FusedMoERequest {
	t.Helper()
	p, err := client.RequestProto(r)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestRingCancel cancels a call mid-flight: it returns at once, and its
// slot (the ring's only one) serves the next call once the server is done
// with it.
func TestRingCancel(t *testing.T) {
	ctx := testContext(t)
	f := newRingFixture(t, ringConfig, 1)
	r, err := f.c.OpenRing(ctx, f.region, 0, client.RingOptions{Slots: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	f.backend.gate.Store(true)
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error)
	go func() {
		_, err := r.FusedMoE(cctx, f.request())
		done <- err
	}()
	<-f.backend.entered
	cancel()
	if err := <-done; status.Code(err) != codes.Canceled {
		t.Fatalf("cancelled call: %v, want Canceled", err)
	}
	f.backend.gate.Store(false)
	close(f.backend.release)
	if _, err := r.FusedMoE(ctx, f.request()); err != nil {
		t.Fatalf("the call after: %v", err)
	}
}

// TestRingDetach ends the ring while a call runs, each way it can end: the
// waiting call fails with Unavailable, later calls too, and the server
// lets go of the region.
func TestRingDetach(t *testing.T) {
	for _, how := range []string{"close", "connection", "drain"} {
		t.Run(how, func(t *testing.T) {
			ctx := testContext(t)
			f := newRingFixture(t, ringConfig, 1)
			r, err := f.c.OpenRing(ctx, f.region, 0, client.RingOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if n := regionCalls(t, ctx, f.c, f.region.Name); n != 1 {
				t.Fatalf("the attached ring holds the region %d times, want 1", n)
			}
			f.backend.gate.Store(true)
			done := make(chan error)
			go func() {
				_, err := r.FusedMoE(ctx, f.request())
				done <- err
			}()
			<-f.backend.entered
			drained := make(chan error)
			switch how {
			case "close":
				r.Close()
				// Nothing may touch the ring's memory once Close returns:
				// not the call in flight, not the reclaim of its slot.
				if err := f.shm.Close(); err != nil {
					t.Fatal(err)
				}
			case "connection":
				f.c.Close() // a caller that dies
			case "drain":
				go func() { drained <- f.srv.Service.Shutdown(ctx) }()
				eventually(t, "the drain", f.srv.Service.Draining)
			}
			if how != "drain" {
				if err := <-done; status.Code(err) != codes.Unavailable {
					t.Fatalf("the call in flight: %v, want Unavailable", err)
				}
			}
			f.backend.gate.Store(false)
			close(f.backend.release)
			if how == "drain" {
				// A drain lets the running call finish.
				if err := <-done; err != nil {
					t.Fatalf("the call in flight during the drain: %v", err)
				}
				if err := <-drained; err != nil {
					t.Fatalf("Shutdown: %v", err)
				}
			}
			if _, err := r.FusedMoE(ctx, f.request()); status.Code(err) != codes.Unavailable {
				t.Fatalf("a call on the detached ring: %v, want Unavailable", err)
			}
			if how == "close" {
				eventually(t, "the server to let go of the region", func() bool { return regionCalls(t, ctx, f.c, f.region.Name) == 0 })
			} else {
				eventually(t, "the server to unmap the region", func() bool { return f.mappings(t) == 1 })
			}
		})
	}
}

// TestAttachRingRefused covers set-ups the server refuses.
func TestAttachRingRefused(t *testing.T) {
	ctx := testContext(t)
	cfg := ringConfig
	cfg.RingMaxPerConn, cfg.RingMaxSlotBytes = 1, 1<<16
	f := newRingFixture(t, cfg, 1)
	r, err := f.c.OpenRing(ctx, f.region, 0, client.RingOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	small, err := f.c.RegisterSharedMemory(ctx, "small", f.shm, 1<<20, 4096)
	if err != nil {
		t.Fatal(err)
	}
	attach := func(t *testing.T, req *pb.AttachRingRequest) error {
		t.Helper()
		s, err := f.c.RPC().AttachRing(ctx, req)
		if err == nil {
			_, err = s.Recv()
		}
		return err
	}
	tests := []struct {
		name    string
		req     *pb.AttachRingRequest
		code    codes.Code
		message string
	}{
		{"unregistered region", &pb.AttachRingRequest{RegionName: "nope", SlotCount: 1, SlotSize: 128}, codes.NotFound, `"nope"`},
		{"too small a region", &pb.AttachRingRequest{RegionName: "small", SlotCount: 64, SlotSize: 128}, codes.InvalidArgument, "does not fit"},
		{"unaligned", &pb.AttachRingRequest{RegionName: "ring", Offset: 8 << 20, SlotCount: 1, SlotSize: 128}, codes.InvalidArgument, "offset"},
		{"misaligned offset", &pb.AttachRingRequest{RegionName: "ring", Offset: 1<<20 + 8, SlotCount: 1, SlotSize: 128}, codes.InvalidArgument, "aligned"},
		{"no layout", &pb.AttachRingRequest{RegionName: "small", SlotCount: 1, SlotSize: 128}, codes.InvalidArgument, "magic"},
		{"slot too large", &pb.AttachRingRequest{RegionName: "ring", SlotCount: 1, SlotSize: 1 << 20}, codes.ResourceExhausted, "-ring-max-slot-bytes"},
		{"bad slot size", &pb.AttachRingRequest{RegionName: "ring", SlotCount: 1, SlotSize: 100}, codes.InvalidArgument, "slot_size"},
		{"no slots", &pb.AttachRingRequest{RegionName: "ring", SlotCount: 0, SlotSize: 128}, codes.InvalidArgument, "slot_count"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := attach(t, tc.req)
			if status.Code(err) != tc.code || !strings.Contains(status.Convert(err).Message(), tc.message) {
				t.Fatalf("AttachRing = %v, want %v mentioning %q", err, tc.code, tc.message)
			}
		})
	}
	t.Run("rings per connection", func(t *testing.T) {
		// A valid layout at 1 MiB, so only the limit can refuse it.
		if _, err := ring.Init(small.Bytes()[:256+128], 1, 128); err != nil {
			t.Fatal(err)
		}
		err := attach(t, &pb.AttachRingRequest{RegionName: "small", SlotCount: 1, SlotSize: 128})
		if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "-ring-max-per-conn") {
			t.Fatalf("AttachRing = %v, want ResourceExhausted naming -ring-max-per-conn", err)
		}
	})
	t.Run("disabled", func(t *testing.T) {
		g := newRingFixture(t, service.Config{SharedMemory: true}, 1)
		_, err := g.c.OpenRing(ctx, g.region, 0, client.RingOptions{})
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "-ring") {
			t.Fatalf("OpenRing = %v, want FailedPrecondition naming -ring", err)
		}
	})
}
