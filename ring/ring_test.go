package ring

import "testing"

// alignedMem is n bytes starting on an Align boundary.
func alignedMem(n int) []byte {
	mem := make([]byte, n+Align)
	off := 0
	for !aligned(mem[off:]) {
		off++
	}
	return mem[off : off+n : off+n]
}

// inMemory is a ring laid out in ordinary memory, mem, with its caller's
// and its daemon's views.
func inMemory(t *testing.T, slots, slotSize int) (mem []byte, caller, daemon *Ring) {
	t.Helper()
	mem = alignedMem(int(Size(slots, slotSize)))
	caller, err := Init(mem, slots, slotSize)
	if err != nil {
		t.Fatal(err)
	}
	if daemon, err = Attach(mem, slots, slotSize); err != nil {
		t.Fatal(err)
	}
	return mem, caller, daemon
}

// FuzzSlot fills a slot with arbitrary bytes, as a caller may, and checks
// that the daemon's side stays within the slot: Take copies at most the
// payload or reports the length, and a completion reads back as written.
func FuzzSlot(f *testing.F) {
	f.Add([]byte{1, 0, 0, 0}, uint32(10))
	f.Add(make([]byte, SlotHeaderSize+64), uint32(1<<31))
	f.Fuzz(func(t *testing.T, slot []byte, respLen uint32) {
		const slots, slotSize = 2, MinSlotSize
		mem, caller, daemon := inMemory(t, slots, slotSize)
		copy(mem[HeaderSize:HeaderSize+slotSize], slot)
		state := daemon.State(0)
		req, seq, timeout, ok, err := daemon.Take(0, nil)
		if ok != (state == Posted) {
			t.Fatalf("Take ok = %v for state %d", ok, state)
		}
		if !ok {
			if daemon.State(0) != state {
				t.Fatalf("Take changed a slot in state %d", state)
			}
			return
		}
		if len(req) > daemon.Payload() || timeout < 0 || (err != nil && req != nil) {
			t.Fatalf("Take = %d bytes, timeout %v, err %v", len(req), timeout, err)
		}
		n := int(respLen % uint32(daemon.Payload()+1))
		copy(daemon.CompletionBuffer(0)[:n], slot)
		daemon.Complete(0, seq, KindStatus, n)
		kind, got, payload, err := caller.Response(0)
		if kind != KindStatus || got != seq || len(payload) != n || err != nil || caller.State(0) != Done {
			t.Fatalf("Response = %d, %d, %d bytes, %v", kind, got, len(payload), err)
		}
		// The other slot is untouched.
		if caller.State(1) != Free {
			t.Fatal("slot 1 changed")
		}
	})
}

// TestPostWritten: a request encoded into RequestBuffer and posted in
// place reads back as Post's would, and the buffer cannot be appended
// past the slot's payload into the next slot.
func TestPostWritten(t *testing.T) {
	_, caller, daemon := inMemory(t, 2, MinSlotSize)
	buf := caller.RequestBuffer(0)
	if len(buf) != 0 || cap(buf) != caller.Payload() {
		t.Fatalf("RequestBuffer: len %d, cap %d; want 0, %d", len(buf), cap(buf), caller.Payload())
	}
	req := append(buf, "in place"...)
	caller.PostWritten(0, 3, len(req), 0)
	got, seq, _, ok, err := daemon.Take(0, nil)
	if !ok || err != nil || string(got) != "in place" || seq != 3 {
		t.Fatalf("Take = %q, %d, %v, %v; want \"in place\", 3, true, nil", got, seq, ok, err)
	}
	full := append(caller.RequestBuffer(1), make([]byte, caller.Payload())...)
	if grown := append(full, 1); &grown[0] == &full[0] {
		t.Fatal("appending past the payload wrote into the ring")
	}
}
