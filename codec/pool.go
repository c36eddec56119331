package codec

import (
	"math/bits"
	"sync"
	"unsafe"

	"google.golang.org/grpc/mem"
)

// Pool recycles the large byte buffers of sent messages, FusedMoE outputs
// above all: a backend writes a call's output into a buffer from Get, the
// response refers to it, and once gRPC has written the response, Marshal's
// buffer goes back to the pool instead of to the garbage collector.
//
// Why: a fresh multi-megabyte Go allocation is memory the runtime has
// just taken from (or given back to) the OS, so the first write to each
// page faults, and for a decode-sized output those faults cost several
// times the copy itself (docs/perf-notes.md has the figures;
// EXPERTD_CUDA_HOST_TRACE shows them on a given host).
//
// Ownership: a buffer from Get belongs to the caller until it calls Put
// (done with it) or Lend (the next Marshal that sends it takes it, and
// gRPC's release of the encoded message Puts it). A buffer that is
// neither is simply garbage, which is safe. Never Put or Lend a buffer
// something else still refers to, or a slice of a larger one.
//
// The zero Pool is ready to use.
type Pool struct {
	classes [maxClass + 1]sync.Pool
}

const (
	// minClass is the smallest pooled capacity (2^minClass bytes), 1 KiB:
	// grpc-go allocates smaller transport buffers without a pool, and an
	// output below AliasBytes, copied by Marshal anyway, is never lent.
	minClass = 10
	// maxClass is the largest pooled capacity, 2^30 bytes; larger
	// buffers are allocated and dropped.
	maxClass = 30
)

// lent maps the data pointer of each lent buffer to a lentBuf.
var lent sync.Map

// lentBuf is a lent buffer as Get returned it: protobuf's reflection may
// hand Marshal the field with its capacity cut to its length, and Put
// needs the capacity to find the buffer's class.
type lentBuf struct {
	p *Pool
	b []byte
}

// class is the size class holding n bytes, or -1 when n is not pooled.
func class(n int) int {
	if n < 1<<minClass || n > 1<<maxClass {
		return -1
	}
	return bits.Len(uint(n - 1))
}

// Get returns a buffer of length n; its contents are undefined.
func (p *Pool) Get(n int) []byte { return *p.get(n) }

// get is Get keeping the pointer the pool stores, so that a user of
// pointers (mem.BufferPool) allocates nothing per buffer.
func (p *Pool) get(n int) *[]byte {
	c := class(n)
	if c < 0 {
		b := make([]byte, n)
		return &b
	}
	if b, ok := p.classes[c].Get().(*[]byte); ok {
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n, 1<<c)
	return &b
}

// putHook, when set (tests), sees every buffer Put keeps: sync.Pool may
// drop a Put (always may, and does at random under the race detector),
// so a test cannot observe a return through Get.
var putHook func([]byte)

// Put returns b, which the caller no longer uses, to the pool.
func (p *Pool) Put(b []byte) { p.put(&b) }

// put is Put of a pointer that the pool may keep.
func (p *Pool) put(b *[]byte) {
	c := class(cap(*b))
	if c < 0 || cap(*b) != 1<<c {
		return // not one of Get's
	}
	*b = (*b)[:cap(*b)]
	if putHook != nil {
		putHook(*b)
	}
	p.classes[c].Put(b)
}

// Lend hands b to the next Marshal that sends it: gRPC returns it to p
// once the message is written. b must come from p.Get and be sent whole
// as one bytes field of a message passed to Marshal.
func (p *Pool) Lend(b []byte) {
	if class(cap(b)) < 0 || len(b) < aliasBytes {
		return // Marshal copies it or it is not pooled: nothing to return
	}
	lent.Store(unsafe.Pointer(unsafe.SliceData(b)), lentBuf{p, b})
}

// Unlend takes back a lent buffer that was not sent (the send failed
// before Marshal); it reports whether b was still lent. The caller must
// then Put it or drop it.
func (p *Pool) Unlend(b []byte) bool {
	if len(b) == 0 {
		return false
	}
	_, ok := lent.LoadAndDelete(unsafe.Pointer(unsafe.SliceData(b)))
	return ok
}

// sendBuffer wraps a large bytes field for Marshal's output: the lent
// buffer's own release hook when it was lent, else a plain reference.
func sendBuffer(b []byte) mem.Buffer {
	if v, ok := lent.LoadAndDelete(unsafe.Pointer(unsafe.SliceData(b))); ok {
		if l := v.(lentBuf); len(l.b) == len(b) {
			return mem.NewBuffer(&l.b, returner{l.p})
		}
		// Sent with another length than lent: not the contract; send it
		// but never recycle it.
	}
	return mem.SliceBuffer(b)
}

// returner is the mem.BufferPool that gRPC releases a lent buffer to.
type returner struct{ p *Pool }

func (r returner) Get(n int) *[]byte { return r.p.get(n) }

func (r returner) Put(b *[]byte) { r.p.put(b) }
