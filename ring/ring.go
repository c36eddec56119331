// Package ring is the layout of an expertd call ring: a block of shared
// memory through which a caller on the daemon's host posts FusedMoE calls
// and the daemon completes them, with no socket and no system call on the
// hot path while both sides are polling. It knows nothing of protobuf:
// a slot carries opaque request and response bytes, which service/ and
// client/ encode. docs/ring.md specifies the layout for other languages.
//
// A ring is a header of HeaderSize bytes followed by SlotCount slots of
// SlotSize bytes each; every word is little-endian and naturally aligned,
// and the ring must start on a 64-byte boundary of its object, so the
// header's words and each slot's header sit on their own cache lines.
//
// Each slot moves through one cycle, every transition made by exactly one
// side:
//
//	Free --caller writes the request, stores Posted--> Posted
//	Posted --daemon CAS--> Running  (the daemon copies the request out)
//	Running --daemon writes the response, stores Done--> Done
//	Done --caller reads the response, stores Free--> Free
//
// The daemon touches a slot only in the Posted -> Running -> Done part,
// and a slot in any state it does not own is left alone, so a caller that
// writes garbage into its own ring can only get error completions.
package ring

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"
)

// Layout constants (docs/ring.md).
const (
	// Magic is the header's first word: the bytes "EXRG".
	Magic uint32 = 0x47525845
	// Version is the layout version this package reads and writes.
	Version uint32 = 1
	// HeaderSize is the ring header's size; slots follow it.
	HeaderSize = 256
	// SlotHeaderSize is a slot's header; its payload follows it.
	SlotHeaderSize = 64
	// Align is the alignment the ring's start needs within its object.
	Align = 64
	// MinSlotSize is the smallest slot: a header and 64 payload bytes.
	MinSlotSize = SlotHeaderSize + 64
	// MaxSlots bounds the slot count a ring may declare.
	MaxSlots = 1024
)

// Header word offsets.
const (
	offMagic     = 0
	offVersion   = 4
	offSlotCount = 8
	offSlotSize  = 12
	offFlags     = 16
	// offDoorbell is incremented by the caller after every post; the
	// daemon futex-waits on it while it sleeps.
	offDoorbell = 64
	// offSleeping is 1 while the daemon's poller sleeps (or is about to):
	// a caller that sees it wakes the doorbell.
	offSleeping = 128
	// offClosed is set to 1 by the daemon when it detaches the ring.
	offClosed = 192
)

// Slot header word offsets.
const (
	slotState        = 0
	slotWaiting      = 4
	slotSeq          = 8
	slotReqLen       = 16
	slotRespLen      = 20
	slotRespKind     = 24
	slotTimeoutNanos = 32
	slotRespSeq      = 40
)

// Slot states (the first word of a slot).
const (
	Free    uint32 = 0
	Posted  uint32 = 1
	Running uint32 = 2
	Done    uint32 = 3
)

// Response kinds of a Done slot.
const (
	// KindResponse: the payload is a serialized expertd.v1.FusedMoEResponse.
	KindResponse uint32 = 1
	// KindStatus: the payload is a serialized google.rpc.Status.
	KindStatus uint32 = 2
)

// Size is the bytes a ring of slots slots of slotSize bytes occupies.
func Size(slots, slotSize int) int64 {
	return HeaderSize + int64(slots)*int64(slotSize)
}

// Ring is a view of a ring in shared memory. Its geometry is fixed when it
// is made (Init or Attach) and never read from the memory again, which a
// peer could change at any time.
type Ring struct {
	mem      []byte
	slots    int
	slotSize int
	payload  int
}

// CheckGeometry reports whether slots slots of slotSize bytes are a legal
// ring; the error names the offending value.
func CheckGeometry(slots, slotSize int) error {
	if slots < 1 || slots > MaxSlots {
		return fmt.Errorf("slot_count %d: want 1 to %d", slots, MaxSlots)
	}
	if slotSize < MinSlotSize || slotSize%Align != 0 || slotSize > 1<<31-Align {
		return fmt.Errorf("slot_size %d: want a multiple of %d, at least %d and below 2 GiB", slotSize, Align, MinSlotSize)
	}
	return nil
}

func view(mem []byte, slots, slotSize int) (*Ring, error) {
	if err := CheckGeometry(slots, slotSize); err != nil {
		return nil, err
	}
	if need := Size(slots, slotSize); int64(len(mem)) < need {
		return nil, fmt.Errorf("%d slots of %d bytes need %d bytes, the memory has %d", slots, slotSize, need, len(mem))
	}
	if !aligned(mem) {
		return nil, fmt.Errorf("the ring must start on a %d-byte boundary of its object", Align)
	}
	return &Ring{mem: mem[:Size(slots, slotSize)], slots: slots, slotSize: slotSize, payload: slotSize - SlotHeaderSize}, nil
}

// Init lays out a fresh ring in mem (the caller's side): it writes the
// header and frees every slot. Nobody else may use mem meanwhile.
func Init(mem []byte, slots, slotSize int) (*Ring, error) {
	r, err := view(mem, slots, slotSize)
	if err != nil {
		return nil, err
	}
	clear(r.mem)
	binary.LittleEndian.PutUint32(r.mem[offVersion:], Version)
	binary.LittleEndian.PutUint32(r.mem[offSlotCount:], uint32(slots))
	binary.LittleEndian.PutUint32(r.mem[offSlotSize:], uint32(slotSize))
	binary.LittleEndian.PutUint32(r.mem[offFlags:], 0)
	// The magic last, so a ring is recognisable only once complete.
	atomic.StoreUint32(r.word(offMagic), Magic)
	return r, nil
}

// ErrLayout is wrapped by Attach's errors about the header's contents.
var ErrLayout = errors.New("ring layout")

// Attach opens the ring the caller laid out in mem (the daemon's side),
// checking that its header declares this version and the geometry the
// caller announced out of band. Only the daemon's own copy of the
// geometry is used afterwards.
func Attach(mem []byte, slots, slotSize int) (*Ring, error) {
	r, err := view(mem, slots, slotSize)
	if err != nil {
		return nil, err
	}
	if m := atomic.LoadUint32(r.word(offMagic)); m != Magic {
		return nil, fmt.Errorf("%w: magic %#x, want %#x (\"EXRG\"); lay the ring out before attaching it", ErrLayout, m, Magic)
	}
	if v := atomic.LoadUint32(r.word(offVersion)); v != Version {
		return nil, fmt.Errorf("%w: version %d, this server reads version %d", ErrLayout, v, Version)
	}
	if n, s := atomic.LoadUint32(r.word(offSlotCount)), atomic.LoadUint32(r.word(offSlotSize)); n != uint32(slots) || s != uint32(slotSize) {
		return nil, fmt.Errorf("%w: header declares %d slots of %d bytes, the request %d of %d", ErrLayout, n, s, slots, slotSize)
	}
	return r, nil
}

// Slots is the slot count.
func (r *Ring) Slots() int { return r.slots }

// Payload is the bytes a slot's request or response may take.
func (r *Ring) Payload() int { return r.payload }

func (r *Ring) word(off int) *uint32 { return (*uint32)(unsafe.Pointer(&r.mem[off])) }

func (r *Ring) slotWord(i, off int) *uint32 { return r.word(HeaderSize + i*r.slotSize + off) }

func (r *Ring) slotWord64(i, off int) *uint64 {
	return (*uint64)(unsafe.Pointer(&r.mem[HeaderSize+i*r.slotSize+off]))
}

// payloadOf is slot i's payload area, capped so no append escapes it.
func (r *Ring) payloadOf(i int) []byte {
	lo := HeaderSize + i*r.slotSize + SlotHeaderSize
	hi := lo + r.payload
	return r.mem[lo:hi:hi]
}

// State is slot i's state word.
func (r *Ring) State(i int) uint32 { return atomic.LoadUint32(r.slotWord(i, slotState)) }

// Doorbell is the doorbell's current count.
func (r *Ring) Doorbell() uint32 { return atomic.LoadUint32(r.word(offDoorbell)) }

// Closed reports whether the daemon has detached the ring.
func (r *Ring) Closed() bool { return atomic.LoadUint32(r.word(offClosed)) != 0 }

// --- the caller's side ---

// Post publishes req in slot i, which the caller owns (Free, or Done and
// read): it copies req into the payload, stores Posted, rings the
// doorbell and wakes the daemon if it sleeps. timeout bounds the call on
// the daemon's side (0: none). seq is echoed in the completion.
func (r *Ring) Post(i int, seq uint64, req []byte, timeout time.Duration) error {
	if len(req) > r.payload {
		return fmt.Errorf("request of %d bytes exceeds the slot payload of %d bytes", len(req), r.payload)
	}
	copy(r.payloadOf(i), req)
	r.PostWritten(i, seq, len(req), timeout)
	return nil
}

// RequestBuffer is slot i's payload, for the caller to encode a request
// into (appending: its capacity is the payload) before PostWritten, so
// the request is written once, in place. The slot must be the caller's
// (Free, or Done and read).
func (r *Ring) RequestBuffer(i int) []byte { return r.payloadOf(i)[:0] }

// PostWritten posts slot i as Post does, with the request of n bytes
// (at most Payload) already in RequestBuffer(i).
func (r *Ring) PostWritten(i int, seq uint64, n int, timeout time.Duration) {
	atomic.StoreUint32(r.slotWord(i, slotReqLen), uint32(n))
	atomic.StoreUint32(r.slotWord(i, slotRespLen), 0)
	atomic.StoreUint32(r.slotWord(i, slotRespKind), 0)
	atomic.StoreUint32(r.slotWord(i, slotWaiting), 0)
	atomic.StoreUint64(r.slotWord64(i, slotSeq), seq)
	atomic.StoreUint64(r.slotWord64(i, slotTimeoutNanos), uint64(max(timeout, 0)))
	// The state store publishes everything above (Go's atomics are
	// sequentially consistent).
	atomic.StoreUint32(r.slotWord(i, slotState), Posted)
	r.Ring()
}

// Ring rings the doorbell: it counts one post and wakes the daemon's
// poller if it sleeps. The increment before the check pairs with the
// poller's store of the sleeping flag before its last look at the
// doorbell: one of the two sides always sees the other.
func (r *Ring) Ring() {
	atomic.AddUint32(r.word(offDoorbell), 1)
	if atomic.LoadUint32(r.word(offSleeping)) != 0 {
		Wake(r.word(offDoorbell), 1)
	}
}

// WaitDone waits for slot i to be Done: it polls for spin, then sleeps on
// the slot's state word in rounds of at most tick so that stop (the
// caller's context, say) is seen. It returns true when the slot is Done,
// false when stop returned true or the ring closed first.
func (r *Ring) WaitDone(i int, spin, tick time.Duration, stop func() bool) bool {
	st := r.slotWord(i, slotState)
	if spin > 0 {
		deadline := time.Now().Add(spin)
		for n := 0; ; n++ {
			if atomic.LoadUint32(st) == Done {
				return true
			}
			// time.Now costs more than a load; look at the clock now and
			// then.
			if n%64 == 63 && (time.Now().After(deadline) || stop()) {
				break
			}
		}
	}
	w := r.slotWord(i, slotWaiting)
	for {
		atomic.StoreUint32(w, 1)
		s := atomic.LoadUint32(st)
		if s == Done {
			return true
		}
		if stop() || r.Closed() {
			return false
		}
		Wait(st, s, tick)
	}
}

// Response is slot i's completion, valid while the caller owns the slot
// (until it posts again): the kind, the sequence number echoed and the
// payload, which aliases shared memory.
func (r *Ring) Response(i int) (kind uint32, seq uint64, payload []byte, err error) {
	kind = atomic.LoadUint32(r.slotWord(i, slotRespKind))
	seq = atomic.LoadUint64(r.slotWord64(i, slotRespSeq))
	n := atomic.LoadUint32(r.slotWord(i, slotRespLen))
	if int64(n) > int64(r.payload) {
		return kind, seq, nil, fmt.Errorf("response length %d exceeds the slot payload of %d bytes", n, r.payload)
	}
	return kind, seq, r.payloadOf(i)[:n], nil
}

// Release frees slot i after its response was read.
func (r *Ring) Release(i int) { atomic.StoreUint32(r.slotWord(i, slotState), Free) }

// --- the daemon's side ---

// Take claims slot i if it is Posted (Posted -> Running) and returns a
// copy of its request, in a buffer from alloc (nil means make), with its
// sequence number and timeout. ok is false when the slot was not Posted.
// A request length beyond the payload is reported as err with the slot
// Running: the daemon must still Complete it (with that error).
func (r *Ring) Take(i int, alloc func(n int) []byte) (req []byte, seq uint64, timeout time.Duration, ok bool, err error) {
	if !atomic.CompareAndSwapUint32(r.slotWord(i, slotState), Posted, Running) {
		return nil, 0, 0, false, nil
	}
	seq = atomic.LoadUint64(r.slotWord64(i, slotSeq))
	t := atomic.LoadUint64(r.slotWord64(i, slotTimeoutNanos))
	if t > 0 && t <= 1<<62 {
		timeout = time.Duration(t)
	}
	n := atomic.LoadUint32(r.slotWord(i, slotReqLen))
	if int64(n) > int64(r.payload) {
		return nil, seq, timeout, true, fmt.Errorf("request length %d exceeds the slot payload of %d bytes", n, r.payload)
	}
	if alloc == nil {
		alloc = func(n int) []byte { return make([]byte, n) }
	}
	// A copy: the caller may write the slot while the call runs.
	req = alloc(int(n))[:n]
	copy(req, r.payloadOf(i)[:n])
	return req, seq, timeout, true, nil
}

// CompletionBuffer is slot i's payload for the daemon to encode a
// response into before Complete; it is the caller's memory.
func (r *Ring) CompletionBuffer(i int) []byte { return r.payloadOf(i)[:0] }

// Complete finishes slot i with a response of n bytes already in its
// payload (CompletionBuffer) and wakes the caller if it waits. The
// daemon owns the slot while it is Running, so a plain store suffices.
func (r *Ring) Complete(i int, seq uint64, kind uint32, n int) {
	atomic.StoreUint32(r.slotWord(i, slotRespKind), kind)
	atomic.StoreUint32(r.slotWord(i, slotRespLen), uint32(n))
	atomic.StoreUint64(r.slotWord64(i, slotRespSeq), seq)
	atomic.StoreUint32(r.slotWord(i, slotState), Done)
	// The store of Done before the look at the flag pairs with the
	// caller's store of the flag before its last look at the state.
	if atomic.LoadUint32(r.slotWord(i, slotWaiting)) != 0 {
		Wake(r.slotWord(i, slotState), 1)
	}
}

// Sleep parks the daemon's poller until the doorbell moves past seen or
// timeout passes, announcing it first so a poster wakes it. It returns
// the doorbell's count.
func (r *Ring) Sleep(seen uint32, timeout time.Duration) uint32 {
	atomic.StoreUint32(r.word(offSleeping), 1)
	if d := atomic.LoadUint32(r.word(offDoorbell)); d == seen {
		Wait(r.word(offDoorbell), seen, timeout)
	}
	atomic.StoreUint32(r.word(offSleeping), 0)
	return atomic.LoadUint32(r.word(offDoorbell))
}

// Close marks the ring detached and wakes every sleeper on it: a caller
// waiting on a slot sees Closed and gives up.
func (r *Ring) Close() {
	atomic.StoreUint32(r.word(offClosed), 1)
	Wake(r.word(offDoorbell), 1<<30)
	for i := range r.slots {
		Wake(r.slotWord(i, slotState), 1<<30)
	}
}

func aligned(b []byte) bool { return uintptr(unsafe.Pointer(unsafe.SliceData(b)))%Align == 0 }
