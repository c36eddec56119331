package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/ring"
)

// Call rings: the same-host fast path. A Ring is a block of a registered
// POSIX region through which FusedMoE calls are posted to the daemon and
// completed in place (docs/ring.md), so a call goes through no socket and,
// while both sides poll, no system call or thread wake-up. The daemon must
// run with -shared-memory and -ring.
//
//	shm, _ := client.CreateSharedMemory("", 64<<20)
//	region, _ := c.RegisterSharedMemory(ctx, "acts", shm, 0, shm.Size())
//	r, err := c.OpenRing(ctx, region, 0, client.RingOptions{})
//	defer r.Close()
//	hidden, _ := region.Put(client.RingSize(client.RingOptions{}), ...)
//	res, err := r.FusedMoE(ctx, &client.FusedMoERequest{...})
//
// CPU cost: a call keeps its goroutine polling for up to RingOptions.Spin
// while it waits (one core per waiting call), then sleeps on a futex; the
// daemon's poller keeps one core busy for -ring-spin after each call.

// Ring defaults; each has a RingOptions field.
const (
	// DefaultRingSlots is the calls a ring holds in flight at once.
	DefaultRingSlots = 4
	// DefaultRingSlotBytes fits a request with its tensors in shared
	// memory, or small inline ones, and its response.
	DefaultRingSlotBytes = 64 << 10
	// DefaultRingSpin is how long a call polls for its completion before
	// it sleeps: longer than a decode-sized call's kernel, so a caller
	// waiting for one sees it without a wake-up.
	DefaultRingSpin = time.Millisecond
)

// ringWaitTick bounds one futex sleep of a waiting call, so it notices
// its context ending or the ring's stream failing.
const ringWaitTick = 2 * time.Millisecond

// RingOptions shape a ring. The zero value takes the defaults.
type RingOptions struct {
	// Slots is the calls in flight at once (1 to 1024).
	Slots int
	// SlotBytes is one slot, its 64-byte header included: a multiple of
	// 64; a request and its response each take SlotBytes - 64 at most.
	SlotBytes int
	// Spin is how long a call polls for its completion before sleeping;
	// negative sleeps at once.
	Spin time.Duration
}

func (o RingOptions) withDefaults() RingOptions {
	if o.Slots == 0 {
		o.Slots = DefaultRingSlots
	}
	if o.SlotBytes == 0 {
		o.SlotBytes = DefaultRingSlotBytes
	}
	if o.Spin == 0 {
		o.Spin = DefaultRingSpin
	}
	return o
}

// RingSize is the bytes a ring of these options takes in its region.
func RingSize(o RingOptions) int64 {
	o = o.withDefaults()
	return ring.Size(o.Slots, o.SlotBytes)
}

// Ring is a call ring attached on the client's connection. It is safe for
// concurrent use by up to its slot count of callers (more wait for a
// slot); release it with Close.
type Ring struct {
	c      *Client
	r      *ring.Ring
	spin   time.Duration
	free   chan int
	seq    atomic.Uint64
	cancel context.CancelFunc
	// ended is closed, with err set, when the AttachRing stream ends.
	ended chan struct{}
	err   error
	gone  atomic.Bool
	// use is held shared by everything that touches the ring's memory
	// (calls, reclaims) and exclusively by Close once the ring is gone,
	// so that nothing touches the memory after Close returns and the
	// caller unmaps it.
	use sync.RWMutex
}

// OpenRing lays a ring out at offset of region (a POSIX region registered
// by this client; offset plus the region's own offset a multiple of 64)
// and has the server attach it. ctx bounds the set-up only: the ring is
// served until Close, the connection closing or the server draining,
// after which its calls fail with Unavailable (fall back to
// Client.FusedMoE, or open a ring again). The region's RingSize(opts)
// bytes at offset belong to the ring meanwhile.
func (c *Client) OpenRing(ctx context.Context, region *Region, offset int64, opts RingOptions) (*Ring, error) {
	o := opts.withDefaults()
	if region.Kind() != POSIXRegion {
		return nil, invalid("OpenRing", fmt.Errorf("region %s is CUDA device memory; a ring needs a POSIX region", region.Name))
	}
	if err := ring.CheckGeometry(o.Slots, o.SlotBytes); err != nil {
		return nil, invalid("OpenRing", err)
	}
	size := ring.Size(o.Slots, o.SlotBytes)
	b := region.Bytes()
	if b == nil || offset < 0 || offset > int64(len(b)) || size > int64(len(b))-offset {
		return nil, invalid("OpenRing", fmt.Errorf("a ring of %d bytes at offset %d does not fit in region %s (%d bytes)", size, offset, region.Name, region.Size()))
	}
	r, err := ring.Init(b[offset:offset+size:offset+size], o.Slots, o.SlotBytes)
	if err != nil {
		return nil, invalid("OpenRing", fmt.Errorf("region %s at offset %d: %w", region.Name, offset, err))
	}
	// The stream outlives ctx; ctx only bounds the wait for the answer.
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, cancel)
	stream, err := c.rpc.AttachRing(sctx, &pb.AttachRingRequest{
		RegionName: region.Name, Offset: offset, SlotCount: uint32(o.Slots), SlotSize: uint32(o.SlotBytes),
	})
	if err == nil {
		_, err = stream.Recv()
	}
	if !stop() || err != nil {
		cancel()
		if err == nil {
			err = status.FromContextError(ctx.Err()).Err()
		}
		return nil, wrap("OpenRing", err)
	}
	rg := &Ring{c: c, r: r, spin: o.Spin, free: make(chan int, o.Slots), cancel: cancel, ended: make(chan struct{})}
	for i := range o.Slots {
		rg.free <- i
	}
	go rg.watch(stream)
	return rg, nil
}

// watch waits for the AttachRing stream to end and records why.
func (r *Ring) watch(stream grpc.ServerStreamingClient[pb.AttachRingResponse]) {
	var err error
	for err == nil {
		_, err = stream.Recv()
	}
	switch {
	case errors.Is(err, context.Canceled), status.Code(err) == codes.Canceled, errors.Is(err, io.EOF):
		err = status.Error(codes.Unavailable, "the ring is closed")
	case status.Code(err) == codes.Unknown:
		err = status.Errorf(codes.Unavailable, "the ring's stream ended: %v", err)
	}
	r.err = err
	r.gone.Store(true)
	close(r.ended)
}

// Close detaches the ring; calls in flight fail with Unavailable. It
// returns once no call touches the ring's memory, which may then be
// reused or unmapped.
func (r *Ring) Close() error {
	r.cancel()
	<-r.ended
	r.use.Lock()
	defer r.use.Unlock()
	return nil
}

// detached is the error of a call on an ended ring.
func (r *Ring) detached() error {
	<-r.ended
	return wrap("Ring.FusedMoE", fmt.Errorf("ring detached: %w", r.err))
}

// FusedMoE runs one MoE layer through the ring: the same request, checks
// and answer as Client.FusedMoE, without a retry. ctx's deadline goes to
// the server with the call; a call whose ctx ends returns at once, and
// its slot is reused once the server has finished it.
func (r *Ring) FusedMoE(ctx context.Context, req *FusedMoERequest) (*FusedMoEResult, error) {
	p, err := req.proto()
	if err != nil {
		return nil, invalid("Ring.FusedMoE", err)
	}
	n := p.SizeVT()
	if n > r.r.Payload() {
		return nil, wrap("Ring.FusedMoE", status.Errorf(codes.ResourceExhausted, "the request takes %d bytes, a slot's payload %d; put tensors in shared memory or open a ring with larger slots", n, r.r.Payload()))
	}
	r.use.RLock()
	defer r.use.RUnlock()
	var i int
	select {
	case i = <-r.free:
	case <-r.ended:
		return nil, r.detached()
	case <-ctx.Done():
		return nil, wrap("Ring.FusedMoE", status.FromContextError(ctx.Err()).Err())
	}
	if r.gone.Load() {
		r.free <- i
		return nil, r.detached()
	}
	var timeout time.Duration
	if dl, ok := ctx.Deadline(); ok {
		if timeout = time.Until(dl); timeout <= 0 {
			r.free <- i
			return nil, wrap("Ring.FusedMoE", status.Error(codes.DeadlineExceeded, context.DeadlineExceeded.Error()))
		}
	}
	// The request is encoded straight into the slot (a buffer of its own
	// would cost an allocation and a copy of the tensors per call), by
	// vtprotobuf's generated encoder, which unlike proto.Marshal neither
	// reflects nor checks that strings are UTF-8: a name that is not is
	// refused by the daemon's parse, InvalidArgument naming the field.
	if _, err := p.MarshalToSizedBufferVT(r.r.RequestBuffer(i)[:n]); err != nil {
		r.free <- i
		return nil, invalid("Ring.FusedMoE", err)
	}
	seq := r.seq.Add(1)
	r.r.PostWritten(i, seq, n, timeout)
	if !r.r.WaitDone(i, r.spin, ringWaitTick, func() bool { return ctx.Err() != nil || r.gone.Load() }) {
		go r.reclaim(i)
		if err := ctx.Err(); err != nil {
			return nil, wrap("Ring.FusedMoE", status.FromContextError(err).Err())
		}
		return nil, r.detached()
	}
	res, err := r.result(i, seq)
	r.r.Release(i)
	r.free <- i
	return res, err
}

// result decodes slot i's completion.
func (r *Ring) result(i int, seq uint64) (*FusedMoEResult, error) {
	kind, got, payload, err := r.r.Response(i)
	if err == nil && got != seq {
		err = fmt.Errorf("completion of call %d in the slot of call %d", got, seq)
	}
	if err != nil {
		return nil, wrap("Ring.FusedMoE", status.Errorf(codes.Internal, "malformed completion: %v", err))
	}
	switch kind {
	case ring.KindStatus:
		var sp spb.Status
		if err := proto.Unmarshal(payload, &sp); err != nil {
			return nil, wrap("Ring.FusedMoE", status.Errorf(codes.Internal, "malformed error completion: %v", err))
		}
		return nil, wrap("Ring.FusedMoE", status.ErrorProto(&sp))
	case ring.KindResponse:
		// The slot is reused, so the response is copied out of it once and
		// parsed in place by the generated decoder, which (unlike
		// proto.Unmarshal) neither copies each field again nor reflects:
		// everything the result holds refers to the copy, which the
		// garbage collector frees. A response it refuses is parsed again
		// by proto.Unmarshal, for protobuf's verdict.
		b := slices.Clone(payload)
		var resp pb.FusedMoEResponse
		if resp.UnmarshalVTUnsafe(b) != nil {
			if err := proto.Unmarshal(b, &resp); err != nil {
				return nil, wrap("Ring.FusedMoE", fmt.Errorf("malformed response: %w", err))
			}
		}
		res, err := resultFromProto(&resp)
		if err != nil {
			return nil, wrap("Ring.FusedMoE", fmt.Errorf("malformed response: %w", err))
		}
		r.c.viewOutputs(res)
		return res, nil
	}
	return nil, wrap("Ring.FusedMoE", status.Errorf(codes.Internal, "malformed completion: kind %d", kind))
}

// reclaim frees slot i of an abandoned call once the server completes it,
// or when the ring ends (then nothing will use the slot again).
func (r *Ring) reclaim(i int) {
	defer func() { r.free <- i }()
	r.use.RLock()
	defer r.use.RUnlock()
	if !r.gone.Load() && r.r.WaitDone(i, 0, 50*time.Millisecond, r.gone.Load) {
		r.r.Release(i)
	}
}
