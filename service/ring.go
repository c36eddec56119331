package service

import (
	"context"
	"errors"
	"log/slog"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/expertd/expertd/codec"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/ring"
	"github.com/expertd/expertd/shm"
)

// Call rings (AttachRing, docs/ring.md): a caller on this host lays a
// ring out in one of its POSIX regions and attaches it; from then on it
// posts serialized FusedMoERequests into the ring's slots and the ring's
// poller completes them in place with serialized FusedMoEResponses or
// google.rpc.Status errors. A call posted while the poller polls costs no
// socket, no system call and no goroutine wake-up on either side; that is
// the point, since those are most of a small call's latency.
//
// A posted call is copied out of the slot before it is decoded and then
// takes exactly fusedMoE's path (validation, limits, shared-memory
// resolution in the ring's connection, batching, metrics), so a caller
// gains nothing over an RPC by writing garbage: it gets an error
// completion. The poller runs a lone call itself (no goroutine hand-off)
// and hands further calls found at once to goroutines; a call posted while
// the poller runs one waits for it to end.
//
// A ring lives as long as its AttachRing stream, which carries the
// connection's context: the caller cancelling it, the connection closing
// (a caller that dies) or the server draining stops the poller, which
// answers the calls still posted, waits for those running, marks the ring
// closed, wakes every waiter and lets go of the region.

// Ring defaults; the daemon's flags start from these.
const (
	// DefaultRingSpin is how long a poller polls after its ring's last
	// call before it sleeps: long enough to cover the gap between one
	// layer's call and the next in a decode step, short enough that an
	// idle ring costs a core only briefly.
	DefaultRingSpin = 100 * time.Microsecond
	// DefaultRingMaxPerConn bounds one connection's rings.
	DefaultRingMaxPerConn = 4
	// DefaultRingMax bounds the rings served at once: each may hold a
	// core while it polls.
	DefaultRingMax = 32
	// DefaultRingMaxSlotBytes bounds a slot: the request copied out of it
	// and the response encoded into it.
	DefaultRingMaxSlotBytes = 16 << 20
)

// ringSleepTick bounds one futex sleep of an idle poller, so it looks at
// its stop flag even if a wake-up were lost.
const ringSleepTick = 100 * time.Millisecond

// rings counts the rings attached, per connection and in all, against
// the limits.
type rings struct {
	mu     sync.Mutex
	total  int
	byConn map[uint64]int
	// closing is closed when the server drains: pollers stop.
	closing chan struct{}
	closed  bool

	calls    metric.Int64Counter
	attached metric.Int64UpDownCounter
	// codeAttrs are calls' attribute sets by status code, built once: a
	// fresh set per call costs allocations on the path a ring exists to
	// make short.
	codeAttrs [codes.Unauthenticated + 1]metric.MeasurementOption
}

func newRings() *rings { return &rings{byConn: map[uint64]int{}, closing: make(chan struct{})} }

// closeAll stops every poller (Shutdown).
func (rs *rings) closeAll() {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if !rs.closed {
		rs.closed = true
		close(rs.closing)
	}
}

// ringLimits are Config's ring limits with defaults applied.
func (c Config) ringLimits() (perConn, total int, slotBytes int64) {
	perConn, total, slotBytes = c.RingMaxPerConn, c.RingMax, c.RingMaxSlotBytes
	if perConn < 1 {
		perConn = DefaultRingMaxPerConn
	}
	if total < 1 {
		total = DefaultRingMax
	}
	if slotBytes < 1 {
		slotBytes = DefaultRingMaxSlotBytes
	}
	return perConn, total, slotBytes
}

func (s *Server) initRingMetrics(m metric.Meter) {
	for c := range s.rings.codeAttrs {
		s.rings.codeAttrs[c] = metric.WithAttributeSet(attribute.NewSet(attribute.String("code", codes.Code(c).String())))
	}
	var err error
	if s.rings.calls, err = m.Int64Counter("expertd.ring.calls",
		metric.WithDescription("FusedMoE calls completed through call rings, by status code."),
		metric.WithUnit("{call}")); err != nil {
		s.log.Warn("metric not recorded", slog.String("metric", "expertd.ring.calls"), slog.Any("err", err))
	}
	if s.rings.attached, err = m.Int64UpDownCounter("expertd.ring.attached",
		metric.WithDescription("Call rings being served."),
		metric.WithUnit("{ring}")); err != nil {
		s.log.Warn("metric not recorded", slog.String("metric", "expertd.ring.attached"), slog.Any("err", err))
	}
}

// ringInfo is GetServerInfo's view of the ring settings.
func (s *Server) ringInfo() *pb.ServerInfo_RingInfo {
	perConn, total, slotBytes := s.cfg.ringLimits()
	return &pb.ServerInfo_RingInfo{
		Enabled: s.cfg.Ring && s.cfg.SharedMemory, Version: ring.Version, SpinNanos: s.cfg.RingSpin.Nanoseconds(),
		MaxPerConn: int32(perConn), MaxRings: int32(total), MaxSlotBytes: slotBytes,
	}
}

// AttachRing serves a call ring until the stream ends.
func (s *Server) AttachRing(req *pb.AttachRingRequest, stream grpc.ServerStreamingServer[pb.AttachRingResponse]) error {
	return s.toStatus(stream.Context(), "AttachRing", s.attachRing(req, stream))
}

// servedRing is one attached ring.
type servedRing struct {
	s      *Server
	r      *ring.Ring
	ctx    context.Context
	region string
	// stop is set when the poller must end; calls wait for the running
	// calls the poller handed to goroutines.
	stop  atomic.Bool
	calls sync.WaitGroup
	// broken is set (to an error) when touching the ring's memory
	// faulted: its object was shrunk under the mapping.
	broken atomic.Pointer[error]
}

func (s *Server) attachRing(req *pb.AttachRingRequest, stream grpc.ServerStreamingServer[pb.AttachRingResponse]) error {
	ctx := stream.Context()
	if !s.cfg.SharedMemory {
		return errShmDisabled
	}
	if !s.cfg.Ring {
		return codedf(codes.FailedPrecondition, "", "call rings are disabled on this server; start expertd with -ring (and -shared-memory), or call FusedMoE")
	}
	if s.Draining() {
		return errDraining
	}
	perConn, total, maxSlot := s.cfg.ringLimits()
	slots, slotSize := int(req.GetSlotCount()), int64(req.GetSlotSize())
	if slots < 1 || slots > ring.MaxSlots {
		return invalidf("slot_count", "%d: want 1 to %d", slots, ring.MaxSlots)
	}
	if slotSize > maxSlot {
		return exhaustedf("slot_size", "%d bytes: this server's slots take at most %d (-ring-max-slot-bytes)", slotSize, maxSlot)
	}
	if err := ring.CheckGeometry(slots, int(slotSize)); err != nil {
		return invalidf("slot_size", "%d: want a multiple of %d, at least %d", slotSize, ring.Align, ring.MinSlotSize)
	}
	if err := checkName("region_name", req.GetRegionName()); err != nil {
		return err
	}
	off, size := req.GetOffset(), ring.Size(slots, int(slotSize))

	// Hold the region for the ring's life, as a call holds its regions.
	id, err := s.shm.owner(ctx)
	if err != nil {
		return err
	}
	held := s.shm.regions.Lease(id)
	defer held.Release()
	reg, err := held.Hold(req.GetRegionName())
	if err != nil {
		return shmError("", err)
	}
	switch {
	case reg.Mapping() == nil:
		err = invalidf("region_name", "region %q is %v; a ring must be in host memory (SHARED_MEMORY_KIND_POSIX)", reg.Name, pb.SharedMemoryKind(reg.Kind))
	case off < 0 || off > reg.Size || size > reg.Size-off:
		err = invalidf("offset", "a ring of %d slots of %d bytes (%d bytes) at offset %d does not fit in region %q (%d bytes)", slots, slotSize, size, off, reg.Name, reg.Size)
	case (reg.Offset+off)%ring.Align != 0:
		err = invalidf("offset", "%d: the ring must start %d-byte aligned within its object (region %q starts at %d)", off, ring.Align, reg.Name, reg.Offset)
	}
	if err != nil {
		return err
	}
	if err := reg.Mapping().Check(); err != nil {
		return codedf(codes.FailedPrecondition, "region_name", "shared-memory region %q: %v; unregister and register it again", reg.Name, err)
	}

	mem := reg.Mapping().Bytes()[off : off+size : off+size]
	var r *ring.Ring
	if err := shm.Guard(func() { r, err = ring.Attach(mem, slots, int(slotSize)) }); err != nil {
		return codedf(codes.FailedPrecondition, "region_name", "region %q: %v", reg.Name, err)
	}
	if err != nil {
		return invalidf("region_name", "region %q at offset %d: %v", reg.Name, off, err)
	}
	rs := s.rings
	rs.mu.Lock()
	switch {
	case rs.closed:
		err = errDraining
	case rs.byConn[id] >= perConn:
		err = exhaustedf("", "this connection already serves %d call rings (-ring-max-per-conn %d); detach one first", rs.byConn[id], perConn)
	case rs.total >= total:
		err = exhaustedf("", "the server already serves %d call rings (-ring-max %d); retry later or call FusedMoE", rs.total, total)
	}
	if err != nil {
		rs.mu.Unlock()
		return err
	}
	rs.byConn[id]++
	rs.total++
	rs.mu.Unlock()
	defer func() {
		rs.mu.Lock()
		if rs.byConn[id]--; rs.byConn[id] == 0 {
			delete(rs.byConn, id)
		}
		rs.total--
		rs.mu.Unlock()
	}()

	if err := stream.Send(&pb.AttachRingResponse{Version: ring.Version, SpinNanos: s.cfg.RingSpin.Nanoseconds()}); err != nil {
		return err
	}
	sr := &servedRing{s: s, r: r, ctx: ctx, region: reg.Name}
	if rs.attached != nil {
		rs.attached.Add(ctx, 1)
		defer rs.attached.Add(context.WithoutCancel(ctx), -1)
	}
	s.log.InfoContext(ctx, "call ring attached", slog.String("region", reg.Name), slog.Int64("offset", off),
		slog.Int("slots", slots), slog.Int64("slot_bytes", slotSize), slog.Uint64("conn", id))
	// Wake the poller when the stream ends or the server drains.
	stopAfter := context.AfterFunc(ctx, sr.halt)
	defer stopAfter()
	go func() {
		select {
		case <-rs.closing:
			sr.halt()
		case <-ctx.Done():
		}
	}()
	sr.poll()
	cause := sr.finish()
	s.log.InfoContext(ctx, "call ring detached", slog.String("region", reg.Name), slog.Uint64("conn", id), slog.Any("cause", cause))
	return cause
}

// halt makes the poller stop and wakes it if it sleeps.
func (sr *servedRing) halt() {
	sr.stop.Store(true)
	shm.Guard(sr.r.Ring) //nolint:errcheck // a broken ring's poller stops anyway
}

// poll runs the poller until halt: it takes the posted
// slots, runs them, and polls Config.RingSpin after the last before it
// sleeps on the doorbell.
//
// The poller is an ordinary goroutine, not one locked to its thread: a
// call blocks here and there (the execution slot, the batcher, a backend's
// worker goroutines), and each time a locked goroutine blocks and wakes,
// the runtime must hand its thread over and back, a wake-up per block
// (docs/perf-notes.md, "Call rings"). A spinning goroutine keeps its
// thread anyway.
func (sr *servedRing) poll() {
	r, spin := sr.r, sr.s.cfg.RingSpin
	last := time.Now()
	jobs := make([]slotCall, 0, r.Slots())
	for n := 0; !sr.stop.Load(); n++ {
		seen := uint32(0)
		err := shm.Guard(func() {
			seen = r.Doorbell()
			jobs = jobs[:0]
			for i := range r.Slots() {
				if r.State(i) != ring.Posted {
					continue
				}
				c := slotCall{i: i, start: time.Now()}
				var ok bool
				if c.req, c.seq, c.timeout, ok, c.err = r.Take(i, sr.s.outputs.Get); ok {
					jobs = append(jobs, c)
				}
			}
		})
		if err != nil {
			sr.fail(err)
			return
		}
		if len(jobs) > 0 {
			for _, c := range jobs[:len(jobs)-1] {
				sr.calls.Add(1)
				go func() {
					defer sr.calls.Done()
					sr.serve(c)
				}()
			}
			sr.serve(jobs[len(jobs)-1])
			last = time.Now()
			continue
		}
		if spin > 0 && (n%64 != 63 || time.Since(last) < spin) {
			continue
		}
		if err := shm.Guard(func() { r.Sleep(seen, ringSleepTick) }); err != nil {
			sr.fail(err)
			return
		}
		last = time.Now()
	}
}

// slotCall is one call taken from a slot.
type slotCall struct {
	i       int
	start   time.Time
	req     []byte
	seq     uint64
	timeout time.Duration
	// err is a malformed slot (a length beyond it).
	err error
}

// fail stops the ring after a fault touching its memory.
func (sr *servedRing) fail(err error) {
	err = codedf(codes.FailedPrecondition, "", "call ring in region %q: %v (was its object shrunk?); the ring is detached", sr.region, err)
	sr.broken.Store(&err)
	sr.stop.Store(true)
}

// finish ends a stopped ring: it waits for the calls running, answers
// those still posted, closes the ring and says why it ended.
func (sr *servedRing) finish() error {
	sr.calls.Wait()
	cause := error(errDraining)
	if err := sr.ctx.Err(); err != nil {
		cause = codedf(codes.Canceled, "", "the ring's stream ended: %v", err)
	}
	if b := sr.broken.Load(); b != nil {
		shm.Guard(sr.r.Close) //nolint:errcheck // the memory may be gone
		return *b
	}
	st := status.Convert(sr.s.toStatus(sr.ctx, "AttachRing", cause))
	shm.Guard(func() { //nolint:errcheck // a fault here leaves nothing more to do
		for i := range sr.r.Slots() {
			if _, seq, _, ok, _ := sr.r.Take(i, nil); ok {
				sr.complete(i, seq, nil, st)
			}
		}
		sr.r.Close()
	})
	return cause
}

// serve runs a taken call and completes its slot. A panic in the call (a
// backend bug) is answered Internal, as the daemon's recovery middleware
// answers one in an RPC.
func (sr *servedRing) serve(c slotCall) {
	s := sr.s
	code := codes.OK
	err := shm.Guard(func() {
		resp, out, cerr := sr.call(c)
		if cerr != nil {
			st := status.Convert(s.toStatus(sr.ctx, "AttachRing", cerr))
			code = st.Code()
			sr.complete(c.i, c.seq, nil, st)
		} else {
			sr.complete(c.i, c.seq, resp, nil)
		}
		s.outputs.Put(out)
	})
	s.outputs.Put(c.req)
	if err != nil {
		// The call or the completion faulted; a fault in the ring's
		// memory means the ring is gone, any other panic is a bug.
		s.log.ErrorContext(sr.ctx, "panic serving a call ring slot", slog.String("region", sr.region), slog.Int("slot", c.i),
			slog.Any("panic", err), slog.String("stack", string(debug.Stack())))
		code = codes.Internal
		if cerr := shm.Guard(func() {
			sr.complete(c.i, c.seq, nil, status.New(codes.Internal, "AttachRing: internal error (logged on the server)"))
		}); cerr != nil {
			sr.fail(cerr)
		}
	}
	if s.rings.calls != nil {
		var attrs metric.MeasurementOption
		if int(code) < len(s.rings.codeAttrs) {
			attrs = s.rings.codeAttrs[code]
		} else {
			attrs = metric.WithAttributes(attribute.String("code", code.String()))
		}
		s.rings.calls.Add(sr.ctx, 1, attrs)
	}
}

// call decodes one posted request and runs it as FusedMoE does. out is
// the response's pooled output buffer, for the caller to Put once the
// response is encoded.
func (sr *servedRing) call(c slotCall) (*pb.FusedMoEResponse, []byte, error) {
	if c.err != nil {
		return nil, nil, invalidf("slot", "%d: %v", c.i, c.err)
	}
	ctx := sr.ctx
	if c.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.timeout)
		defer cancel()
	}
	var p pb.FusedMoERequest
	if err := decodeSlot(c.i, c.req, &p); err != nil {
		return nil, nil, err
	}
	resp, out, err := sr.s.fusedMoE(ctx, c.start, &p)
	if err != nil {
		return nil, nil, err
	}
	if n, limit := resp.SizeVT(), sr.r.Payload(); n > limit {
		sr.s.outputs.Put(out)
		return nil, nil, exhaustedf("slot_size", "the response takes %d bytes, a slot's payload %d; set output_shm or attach a ring with larger slots", n, limit)
	}
	return resp, out, nil
}

// complete encodes resp (or st, when resp is nil) into slot i and marks it
// Done. Either fits: responses are sized by call, and a status message is
// bounded by the messages this package writes, cut to the payload. A
// response is encoded by vtprotobuf's generated encoder, which writes
// proto.Marshal's bytes (FuzzCompletionBytes) without reflection.
func (sr *servedRing) complete(i int, seq uint64, resp *pb.FusedMoEResponse, st *status.Status) {
	buf := sr.r.CompletionBuffer(i)
	kind := ring.KindResponse
	var b []byte
	err := errCompletionSize
	if resp != nil {
		if n := resp.SizeVT(); n <= cap(buf) {
			b = buf[:n]
			_, err = resp.MarshalToSizedBufferVT(b)
		}
	} else {
		kind = ring.KindStatus
		sp := st.Proto()
		// Leave room for the code and framing.
		if limit := sr.r.Payload() - 16; len(sp.Message) > limit {
			sp.Message = sp.Message[:max(limit, 0)]
		}
		sp.Details = nil
		b, err = proto.MarshalOptions{}.MarshalAppend(buf, sp)
	}
	if err != nil || len(b) > cap(buf) || (len(b) > 0 && &b[0] != &buf[:1][0]) {
		// Cannot happen for the sizes checked above; answer something the
		// caller can read rather than a torn slot.
		b, _ = proto.MarshalOptions{}.MarshalAppend(buf, status.New(codes.Internal, "AttachRing: completion does not fit the slot").Proto())
		kind = ring.KindStatus
	}
	sr.r.Complete(i, seq, kind, len(b))
}

// errCompletionSize is a completion larger than its slot.
var errCompletionSize = errors.New("completion larger than the slot")

// decodeSlot parses a request taken from slot i into p. b is the call's
// copy of the slot, unchanged until the call ends, so p's tensors alias
// it, as codec.Unmarshal's do in a large message. The generated decoder
// does that with no reflection and no copy at any size, where
// codec.Unmarshal copies each tensor of a small message; its strings are
// then copied (b goes back to a pool after the call, and names outlive
// it: metric labels, logs). Whatever protobuf parses, it parses to the
// same message. It is laxer on malformed input (strings need not be
// UTF-8, a varint may overflow, an unknown field is skipped by rules of
// its own), which validation then judges like any request; a string that
// is not UTF-8, which protobuf refuses, is refused naming its field; and a
// known field of the wrong wire type, which protobuf keeps as an unknown
// field, it refuses: what it refuses goes to codec.Unmarshal, for
// protobuf's verdict.
func decodeSlot(i int, b []byte, p *pb.FusedMoERequest) error {
	if p.UnmarshalVTUnsafe(b) == nil {
		if field := ownStrings(p); field != "" {
			return invalidf(field, "not valid UTF-8")
		}
		return nil
	}
	if err := codec.Unmarshal(b, p); err != nil {
		return invalidf("slot", "%d: the request is not a serialized expertd.v1.FusedMoERequest: %v", i, err)
	}
	return nil
}

// ownStrings replaces the strings of p, which alias the decoder's input,
// by copies, and returns the field of the first that is not valid UTF-8
// ("" when all are). They are the set's name and the regions of
// shared-memory references (TestOwnStringsCovers keeps this in step with
// the contract).
func ownStrings(p *pb.FusedMoERequest) string {
	own := func(s *string) bool {
		if !utf8.ValidString(*s) {
			return false
		}
		*s = strings.Clone(*s)
		return true
	}
	if e, ok := p.Experts.(*pb.FusedMoERequest_ExpertSet); ok && !own(&e.ExpertSet) {
		return "expert_set"
	}
	if r := p.OutputShm; r != nil && !own(&r.RegionName) {
		return "output_shm.region_name"
	}
	for _, x := range requestTensors(p) {
		if r := x.t.GetShm(); r != nil && !own(&r.RegionName) {
			return x.field + ".shm.region_name"
		}
	}
	return ""
}
