package codec

import (
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"google.golang.org/grpc/mem"
)

// framePool is the transport's buffer pool (BufferPool). It carves the
// buffers of HTTP/2 data frames, in the order grpc-go asks for them, out
// of large arenas, so that the frames of a message read from one
// connection without other frames between them lie back to back in
// memory; the codec then parses such a message where it lies
// (contiguous) instead of gathering its frames into one buffer.
//
// Why: a large message arrives as HTTP/2 frames of 16 KiB, grpc-go reads
// each into its own buffer, and parsing needs the message contiguous.
// Gathering the frames is a full copy of the message that can only start
// once its last frame is in, so it adds to every call's latency;
// adjacent frames need no gathering.
//
// An arena is reused once every frame carved from it has been returned;
// the current one starts again from its beginning whenever it has none
// out, so a lone caller's messages are received into the same warm
// memory call after call. Frames of different messages that interleave
// (concurrent calls) are not back to back, and their messages are
// gathered by copying, as are messages that straddle two arenas. Once
// that happens the pool hands out recycled frame buffers instead, for
// plainFrames frames, and then tries arenas again: under concurrent load
// an arena cannot restart while other calls' frames are out, so carving
// walks through cold memory, which costs the copy out of the read buffer
// more than the gathering it was meant to save.
type framePool struct {
	// sizes serves what is not carved from an arena.
	sizes Pool
	// plain counts the frames still to come from sizes.
	plain atomic.Int64
	// regions recycles the handles of carved frames.
	regions sync.Pool

	mu sync.Mutex
	// cur is the arena frames are carved from.
	cur *arena
	// recent are the arenas a message being received may lie in: the
	// current one and those retired last. Lookups see no others, so an
	// arena held by a message nobody releases is not kept alive here
	// for ever.
	recent [recentArenas]*arena
	// free holds retired arenas with no frame out, for reuse.
	free []*arena
}

const (
	// arenaBytes is one arena's size: room for a whole decode- or
	// chunked-prefill-sized FusedMoE message (M = 1024 BF16 on
	// Nemotron is 5.5 MB), which must fit one arena to be parsed in
	// place.
	arenaBytes = 8 << 20
	// maxFrameBytes is the largest buffer carved from an arena: grpc-go
	// reads DATA frames of at most 16 KiB (the HTTP/2 default frame size,
	// which it advertises and does not raise). Larger requests are not
	// frames.
	maxFrameBytes = 16 << 10
	// recentArenas bounds the arenas a lookup searches.
	recentArenas = 4
	// plainFrames is how many frames come from recycled buffers after a
	// carved message was not back to back: 512 MiB of frames, so that
	// under sustained concurrent load a few hundred messages pass between
	// tries, each of which carves the frames of every message in flight
	// until one is complete.
	plainFrames = 1 << 15
	// freeArenas bounds the idle arenas kept for reuse (beyond it a
	// retired arena goes to the garbage collector): enough for the
	// arenas that concurrent calls' held messages keep out of use to
	// come back warm, where a sync.Pool would drop them at every other
	// collection and fresh ones would fault in every page again.
	freeArenas = 4
)

// arena is one block frames are carved from.
type arena struct {
	buf []byte
	// next is the offset of the next frame; guarded by framePool.mu.
	next int
	// out counts frames carved and not yet returned.
	out atomic.Int64
	// retired is set once frames are carved from another arena;
	// guarded by framePool.mu.
	retired bool
}

// region is a buffer handed to grpc-go: the *[]byte that Get returns
// points at b, the first field, so Put finds the region from it. Buffers
// not carved from an arena are regions too, with no arena and the
// pointer sizes keeps them by.
type region struct {
	b []byte
	a *arena
	h *[]byte
}

// frames backs BufferPool.
var frames framePool

// Get implements mem.BufferPool.
func (p *framePool) Get(n int) *[]byte {
	r, _ := p.regions.Get().(*region)
	if r == nil {
		r = new(region)
	}
	if n > maxFrameBytes || p.plain.Load() > 0 && p.plain.Add(-1) >= 0 {
		r.h = p.sizes.get(n)
		r.b = *r.h
		return &r.b
	}
	p.mu.Lock()
	a := p.cur
	switch {
	case a != nil && a.out.Load() == 0:
		a.next = 0
	case a == nil || a.next+n > len(a.buf):
		a = p.fresh()
	}
	p.carveInto(r, a, n)
	p.mu.Unlock()
	return &r.b
}

// carve takes a region of n bytes from a at its next offset; p.mu is
// held.
func (p *framePool) carve(a *arena, n int) *region {
	r, _ := p.regions.Get().(*region)
	if r == nil {
		r = new(region)
	}
	p.carveInto(r, a, n)
	return r
}

// carveInto points r at n bytes of a from its next offset; p.mu is held.
func (*framePool) carveInto(r *region, a *arena, n int) {
	r.b = a.buf[a.next : a.next+n : a.next+n]
	r.a = a
	a.next += n
	a.out.Add(1)
}

// fresh retires the current arena and makes a free or new one current;
// p.mu is held.
func (p *framePool) fresh() *arena {
	if old := p.cur; old != nil {
		old.retired = true
		p.reuse(old)
	}
	var a *arena
	if n := len(p.free); n > 0 {
		a, p.free = p.free[n-1], p.free[:n-1]
	} else {
		a = &arena{buf: make([]byte, arenaBytes)}
	}
	a.retired = false
	a.next = 0
	p.cur = a
	// a goes first; a reused arena may be in the list already.
	prev := a
	for i := range p.recent {
		prev, p.recent[i] = p.recent[i], prev
		if prev == a {
			break
		}
	}
	return a
}

// reuse keeps a retired arena with no frame out for reuse; p.mu is held.
func (p *framePool) reuse(a *arena) {
	if !a.retired || a.out.Load() != 0 {
		return
	}
	a.retired = false
	if len(p.free) < freeArenas {
		p.free = append(p.free, a)
	}
}

// Put implements mem.BufferPool; b must come from Get.
func (p *framePool) Put(b *[]byte) {
	r := (*region)(unsafe.Pointer(b))
	if a := r.a; a == nil {
		// Back by the pointer sizes handed out, not &r.b, which the
		// region's reuse overwrites.
		*r.h = r.b
		p.sizes.put(r.h)
	} else if a.out.Add(-1) == 0 {
		p.mu.Lock()
		p.reuse(a)
		p.mu.Unlock()
	}
	*r = region{}
	p.regions.Put(r)
}

// inPlace returns data's bytes as one slice of an arena, with what holds
// that slice: the buffers it lies in, referenced (Ref) for the caller to
// Free, and the region a tail was copied into (nil when none), for the
// caller to Put, once it no longer uses the slice. The slice is nil when
// data is not back to back in one recent arena; when data was carved
// from one nonetheless, frames come from recycled buffers for a while
// (plainFrames).
//
// A message's last frame is often small (what follows its last large
// field), and grpc-go allocates frames below 1 KiB without a pool; such a
// tail, up to one frame, is copied into the arena right after the rest
// when nothing has been carved there yet.
func (p *framePool) inPlace(data mem.BufferSlice) ([]byte, mem.BufferSlice, *[]byte) {
	if len(data) == 0 || data[0].Len() == 0 {
		return nil, nil, nil
	}
	start := uintptr(unsafe.Pointer(unsafe.SliceData(data[0].ReadOnlyData())))
	end := start
	n := 0 // data[:n] lie back to back from start to end
	for _, b := range data {
		d := b.ReadOnlyData()
		if len(d) > 0 && uintptr(unsafe.Pointer(unsafe.SliceData(d))) != end {
			break
		}
		end += uintptr(len(d))
		n++
	}
	tail := data[n:].Len()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, a := range p.recent {
		if a == nil {
			break
		}
		base := uintptr(unsafe.Pointer(unsafe.SliceData(a.buf)))
		if start < base || start >= base+uintptr(len(a.buf)) {
			continue
		}
		lo, hi := int(start-base), int(end-base)
		if hi > len(a.buf) || tail > 0 && (tail > maxFrameBytes || a != p.cur || a.next != hi || hi+tail > len(a.buf)) {
			p.plain.Store(plainFrames)
			return nil, nil, nil
		}
		var copied *[]byte
		if tail > 0 {
			r := p.carve(a, tail)
			data[n:].CopyTo(r.b)
			copied = &r.b
			hi += tail
		}
		held := slices.Clone(data[:n])
		held.Ref()
		return a.buf[lo:hi:hi], held, copied
	}
	return nil, nil, nil
}
