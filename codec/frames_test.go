package codec

import (
	"bytes"
	"math/rand/v2"
	"sync"
	"testing"
	"unsafe"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// receive hands wire to a codec as grpc-go's transport does: read into
// DATA frames of at most 16 KiB taken from p (a frame at or below
// grpc-go's pooling threshold allocated without it), the 5-byte gRPC
// message header consumed from the first frame. Between frames it takes
// a frame from p for every index in others, as frames of other streams
// on the connection would be.
func receive(p mem.BufferPool, wire []byte, others map[int]bool) (data mem.BufferSlice, interleaved []*[]byte) {
	wire = append([]byte{0, 0, 0, 0, 0}, wire...)
	for i := 0; len(wire) > 0; i++ {
		if others[i] {
			interleaved = append(interleaved, p.Get(maxFrameBytes))
		}
		n := min(len(wire), maxFrameBytes)
		if mem.IsBelowBufferPoolingThreshold(n) {
			data = append(data, mem.SliceBuffer(bytes.Clone(wire[:n])))
		} else {
			h := p.Get(n)
			copy(*h, wire[:n])
			data = append(data, mem.NewBuffer(h, p))
		}
		wire = wire[n:]
	}
	var hdr [5]byte
	_, data[0] = mem.ReadUnsafe(hdr[:], data[0])
	return data, interleaved
}

// pattern is n bytes that differ from those of another seed.
func pattern(seed uint64, n int) []byte {
	rng := rand.New(rand.NewPCG(seed, 7))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

func sameStart(a, b []byte) bool { return unsafe.SliceData(a) == unsafe.SliceData(b) }

// TestFramesInPlace: a message whose frames were read back to back is
// one slice of the arena, with its small last frame copied right after
// the rest, and stays intact while held however the pool is used
// meanwhile; once released, the arena starts again from its beginning.
func TestFramesInPlace(t *testing.T) {
	var p framePool
	for _, size := range []int{
		40 * maxFrameBytes,        // the last frame is full
		40*maxFrameBytes + 43,     // a last frame below the pooling threshold, copied
		40*maxFrameBytes + 5000,   // a pooled last frame, back to back
		maxFrameBytes + 1,         // two frames
		3*maxFrameBytes - 5 - 100, // no tail after the header's 5 bytes
	} {
		msg := pattern(uint64(size), size)
		data, _ := receive(&p, msg, nil)
		b, refs, tail := p.inPlace(data)
		if b == nil {
			t.Fatalf("size %d: frames back to back not found in place", size)
		}
		if !bytes.Equal(b, msg) {
			t.Fatalf("size %d: the in-place message differs from the one sent", size)
		}
		if !sameStart(b, data[0].ReadOnlyData()) {
			t.Errorf("size %d: the message does not start in its first frame", size)
		}
		data.Free() // as gRPC does after Unmarshal
		// Frames of later messages, written whole, while it is held.
		for range 3 {
			later, _ := receive(&p, pattern(1, 30*maxFrameBytes), nil)
			later.Free()
		}
		if !bytes.Equal(b, msg) {
			t.Fatalf("size %d: the held message changed while later frames came and went", size)
		}
		refs.Free()
		if tail != nil {
			p.Put(tail)
		}
		if got := p.cur.out.Load(); got != 0 {
			t.Fatalf("size %d: %d frames out after release, want 0", size, got)
		}
		h := p.Get(maxFrameBytes)
		if !sameStart(*h, p.cur.buf) {
			t.Errorf("size %d: after release the arena does not start again from its beginning", size)
		}
		p.Put(h)
	}
}

// interleaved receives msg with another stream's frame before its frame
// at, checks that it is not found in place, and returns every frame.
func interleaved(t *testing.T, p *framePool, msg []byte, at int) {
	t.Helper()
	data, others := receive(p, msg, map[int]bool{at: true})
	if b, _, _ := p.inPlace(data); b != nil {
		t.Error("interleaved frames found in place")
	}
	data.Free()
	for _, h := range others {
		p.Put(h)
	}
}

// TestFramesNotInPlace: messages whose frames are not back to back in
// one arena are not found in place, so the codec gathers them; above
// all bytes that are adjacent in memory but not an arena's.
func TestFramesNotInPlace(t *testing.T) {
	var p framePool
	msg := pattern(3, 20*maxFrameBytes+43)

	interleaved(t, &p, msg, 7)
	p.plain.Store(0) // each case below on arenas

	// Back to back in memory, but one plain allocation, not an arena:
	// a slice over them would keep only part of the memory alive.
	plain := bytes.Clone(msg)
	var adjacent mem.BufferSlice
	for b := plain; len(b) > 0; b = b[min(len(b), maxFrameBytes):] {
		adjacent = append(adjacent, mem.SliceBuffer(b[:min(len(b), maxFrameBytes)]))
	}
	if b, _, _ := p.inPlace(adjacent); b != nil {
		t.Error("adjacent frames outside any arena found in place")
	}

	// A small last frame when frames have been carved after the rest:
	// there is no room to copy it to.
	data, _ := receive(&p, msg, nil)
	after := p.Get(maxFrameBytes)
	if b, _, _ := p.inPlace(data); b != nil {
		t.Error("a tail found in place with the arena's next bytes taken")
	}
	data.Free()
	p.Put(after)
	p.plain.Store(0)

	// Straddling two arenas: fill the current arena to just before its end.
	var fill []*[]byte
	for i := 0; p.cur.next+2*maxFrameBytes < arenaBytes; i++ {
		if i > arenaBytes/maxFrameBytes {
			t.Fatal("the arena does not fill")
		}
		fill = append(fill, p.Get(maxFrameBytes))
	}
	data, _ = receive(&p, msg, nil)
	if b, _, _ := p.inPlace(data); b != nil {
		t.Error("a message straddling two arenas found in place")
	}
	data.Free()
	for _, h := range fill {
		p.Put(h)
	}
}

// inArena reports whether b was carved from an arena of p.
func inArena(p *framePool, b []byte) bool {
	at := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	for _, a := range p.recent {
		if a == nil {
			continue
		}
		base := uintptr(unsafe.Pointer(unsafe.SliceData(a.buf)))
		if at >= base && at < base+uintptr(len(a.buf)) {
			return true
		}
	}
	return false
}

// TestFramesPlainAfterMiss: once a carved message is found not back to
// back (concurrent calls' frames interleaving), the next plainFrames
// frames are recycled buffers rather than cold arena memory, and then
// arenas are tried again; a message received meanwhile is gathered, and
// does not prolong the pause.
func TestFramesPlainAfterMiss(t *testing.T) {
	var p framePool
	msg := pattern(8, 10*maxFrameBytes)
	interleaved(t, &p, msg, 3)
	data, _ := receive(&p, msg, nil)
	if inArena(&p, data[1].ReadOnlyData()) {
		t.Error("a frame right after the miss was carved from an arena")
	}
	if b, _, _ := p.inPlace(data); b != nil {
		t.Error("recycled frames found in place")
	}
	data.Free()
	for i := 0; p.plain.Load() > 0; i++ {
		if i >= plainFrames {
			t.Fatal("the pause after the miss does not end")
		}
		h := p.Get(maxFrameBytes)
		if inArena(&p, *h) {
			t.Fatal("a frame during the pause was carved from an arena")
		}
		p.Put(h)
	}
	h := p.Get(maxFrameBytes)
	if !inArena(&p, *h) {
		t.Error("after the pause frames are not carved from arenas again")
	}
	p.Put(h)
}

// TestFramesArenaReuse: an arena that fills while a frame of it is held
// is retired, frames come from another, and once its last frame is back
// it is reused rather than a new one allocated.
func TestFramesArenaReuse(t *testing.T) {
	var p framePool
	held := p.Get(maxFrameBytes)
	first := p.cur
	copy(*held, pattern(9, maxFrameBytes))
	var rest []*[]byte
	for i := 0; p.cur == first; i++ {
		if i > arenaBytes/maxFrameBytes {
			t.Fatal("the arena does not fill")
		}
		h := p.Get(maxFrameBytes)
		clear(*h)
		rest = append(rest, h)
	}
	if !bytes.Equal(*held, pattern(9, maxFrameBytes)) {
		t.Fatal("a held frame was overwritten")
	}
	for _, h := range rest {
		p.Put(h)
	}
	if len(p.free) != 0 {
		t.Fatal("an arena with a frame out went back for reuse")
	}
	p.Put(held)
	if len(p.free) != 1 || p.free[0] != first {
		t.Fatalf("the retired arena's last frame came back: %d free arenas, want it", len(p.free))
	}
}

// TestFramesConcurrent: frames handed out at once never share bytes,
// whatever goroutines take and return them (run with -race).
func TestFramesConcurrent(t *testing.T) {
	var p framePool
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			var out []*[]byte
			for i := range 2000 {
				h := p.Get(1024 + (g*131+i*17)%(maxFrameBytes-1024))
				for j := range *h {
					(*h)[j] = byte(g)
				}
				out = append(out, h)
				if len(out) > 30 || i%7 == 0 {
					for _, h := range out {
						for _, c := range *h {
							if c != byte(g) {
								t.Errorf("goroutine %d: a frame's bytes were written by another", g)
								return
							}
						}
						p.Put(h)
					}
					out = out[:0]
				}
			}
			for _, h := range out {
				p.Put(h)
			}
		})
	}
	wg.Wait()
	if p.cur.out.Load() != 0 {
		t.Errorf("%d frames out after every one came back", p.cur.out.Load())
	}
}

// TestParsedInPlace: a large FusedMoE message received into the
// transport's frames back to back is parsed where it lies, by the
// server's recycling codec and by the SDK's Receiver: the tensors alias
// the frames, which go back to the pool on release, not before.
func TestParsedInPlace(t *testing.T) {
	req := &pb.FusedMoERequest{HiddenStates: &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_BFLOAT16, Shape: []int64{64, 2688},
		Source: &pb.Tensor_Data{Data: pattern(4, 2*64*2688)}}, RouterLogits: &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT32,
		Shape: []int64{64, 128}, Source: &pb.Tensor_Data{Data: pattern(5, 4*64*128)}}}
	wire, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	server := Codec{Recycle: func(m proto.Message) bool { _, ok := m.(*pb.FusedMoERequest); return ok }}
	frames.plain.Store(0)
	for _, v := range []struct {
		name      string
		unmarshal func(mem.BufferSlice, proto.Message) (Held, error)
	}{
		{"server", func(d mem.BufferSlice, m proto.Message) (Held, error) {
			if err := server.Unmarshal(d, m); err != nil {
				return Held{}, err
			}
			h, _ := held.Load(m)
			hh, _ := h.(Held)
			return hh, nil
		}},
		{"receiver", func(d mem.BufferSlice, m proto.Message) (Held, error) {
			r := &Receiver{}
			err := r.Unmarshal(d, m)
			return r.Take(), err
		}},
	} {
		t.Run(v.name, func(t *testing.T) {
			data, _ := receive(BufferPool(), wire, nil)
			var got pb.FusedMoERequest
			h, err := v.unmarshal(data, &got)
			data.Free()
			if err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(&got, req) {
				t.Fatal("the message parsed in place differs from the one sent")
			}
			if h.frames == nil {
				t.Fatal("the message was copied, not parsed in place")
			}
			hidden := got.GetHiddenStates().GetData()
			if !h.Contains(hidden) || !h.Contains(got.GetRouterLogits().GetData()) {
				t.Error("the tensors do not alias the frames")
			}
			arena := frames.cur
			if arena.out.Load() == 0 {
				t.Fatal("the frames went back to the pool while the message holds them")
			}
			if v.name == "server" {
				Release(&got)
			} else {
				h.Release()
			}
			if n := arena.out.Load(); n != 0 {
				t.Errorf("%d frames out after release, want 0", n)
			}
		})
	}
}
