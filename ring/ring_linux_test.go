package ring

import (
	"bytes"
	"os"
	"syscall"
	"testing"
	"time"
)

// defaultTestTimeout bounds every wait a test makes.
const defaultTestTimeout = 10 * time.Second

// twoMappings maps one fresh shared object twice, as the caller and the
// daemon do.
func twoMappings(t *testing.T, size int) (a, b []byte) {
	t.Helper()
	dir := "/dev/shm"
	if _, err := os.Stat(dir); err != nil {
		dir = t.TempDir()
	}
	f, err := os.CreateTemp(dir, "ring-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(f.Name()); f.Close() })
	if err := f.Truncate(int64(size)); err != nil {
		t.Fatal(err)
	}
	m := func() []byte {
		mem, err := syscall.Mmap(int(f.Fd()), 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { syscall.Munmap(mem) })
		return mem
	}
	return m(), m()
}

// pair lays a ring out in one mapping (the caller's) and attaches it in
// the other (the daemon's).
func pair(t *testing.T, slots, slotSize int) (caller, daemon *Ring) {
	t.Helper()
	a, b := twoMappings(t, int(Size(slots, slotSize)))
	caller, err := Init(a, slots, slotSize)
	if err != nil {
		t.Fatal(err)
	}
	if daemon, err = Attach(b, slots, slotSize); err != nil {
		t.Fatal(err)
	}
	return caller, daemon
}

func TestRoundTripAcrossMappings(t *testing.T) {
	const slots, slotSize = 4, 256
	caller, daemon := pair(t, slots, slotSize)
	req := []byte("request bytes")
	if err := caller.Post(2, 7, req, time.Second); err != nil {
		t.Fatal(err)
	}
	got, seq, timeout, ok, err := daemon.Take(2, nil)
	if !ok || err != nil || !bytes.Equal(got, req) || seq != 7 || timeout != time.Second {
		t.Fatalf("Take = %q, %d, %v, %v, %v; want %q, 7, 1s, true, nil", got, seq, timeout, ok, err, req)
	}
	if _, _, _, ok, _ := daemon.Take(2, nil); ok {
		t.Fatal("a Running slot was taken twice")
	}
	// The caller sleeps on the futex (no spin); the daemon's Complete in
	// the other mapping must wake it.
	done := make(chan bool)
	go func() { done <- caller.WaitDone(2, 0, defaultTestTimeout, func() bool { return false }) }()
	time.Sleep(20 * time.Millisecond) // let it reach the futex
	start := time.Now()
	n := copy(daemon.CompletionBuffer(2)[:cap(daemon.CompletionBuffer(2))], "response")
	daemon.Complete(2, seq, KindResponse, n)
	select {
	case ok := <-done:
		if !ok {
			t.Fatal("WaitDone = false, want true")
		}
	case <-time.After(defaultTestTimeout):
		t.Fatal("the waiter was not woken")
	}
	if d := time.Since(start); d > defaultTestTimeout/2 {
		t.Errorf("woken after %v: the wake did not reach the other mapping", d)
	}
	kind, rseq, payload, err := caller.Response(2)
	if kind != KindResponse || rseq != 7 || string(payload) != "response" || err != nil {
		t.Fatalf("Response = %d, %d, %q, %v", kind, rseq, payload, err)
	}
	caller.Release(2)
	if s := daemon.State(2); s != Free {
		t.Fatalf("state %d after Release, want Free", s)
	}
}

func TestSleepingPollerIsWoken(t *testing.T) {
	const slots, slotSize = 1, MinSlotSize
	caller, daemon := pair(t, slots, slotSize)
	seen := daemon.Doorbell()
	woke := make(chan uint32)
	go func() { woke <- daemon.Sleep(seen, defaultTestTimeout) }()
	time.Sleep(20 * time.Millisecond)
	start := time.Now()
	if err := caller.Post(0, 1, []byte("x"), 0); err != nil {
		t.Fatal(err)
	}
	select {
	case d := <-woke:
		if d == seen {
			t.Errorf("Sleep returned doorbell %d, want it moved", d)
		}
	case <-time.After(defaultTestTimeout):
		t.Fatal("the poller was not woken")
	}
	if d := time.Since(start); d > defaultTestTimeout/2 {
		t.Errorf("woken after %v", d)
	}
}

func TestCloseWakesWaiters(t *testing.T) {
	const slots, slotSize = 2, MinSlotSize
	caller, daemon := pair(t, slots, slotSize)
	caller.Post(1, 1, nil, 0) //nolint:errcheck // fits
	done := make(chan bool)
	go func() { done <- caller.WaitDone(1, 0, defaultTestTimeout, func() bool { return false }) }()
	time.Sleep(20 * time.Millisecond)
	daemon.Close()
	select {
	case ok := <-done:
		if ok {
			t.Fatal("WaitDone = true on a closed ring with no completion")
		}
	case <-time.After(defaultTestTimeout / 2):
		t.Fatal("Close did not wake the waiter")
	}
}

func TestAttachChecks(t *testing.T) {
	const slots, slotSize = 2, 128
	good := func() []byte {
		mem := alignedMem(int(Size(slots, slotSize)))
		if _, err := Init(mem, slots, slotSize); err != nil {
			t.Fatal(err)
		}
		return mem
	}
	tests := []struct {
		name   string
		mangle func([]byte) []byte
		slots  int
		size   int
	}{
		{"magic", func(m []byte) []byte { m[0] ^= 1; return m }, slots, slotSize},
		{"version", func(m []byte) []byte { m[offVersion]++; return m }, slots, slotSize},
		{"declared slots", func(m []byte) []byte { m[offSlotCount]++; return m }, slots, slotSize},
		{"declared slot size", func(m []byte) []byte { m[offSlotSize] += 64; return m }, slots, slotSize},
		{"too small", func(m []byte) []byte { return m[:len(m)-1] }, slots, slotSize},
		{"zero slots", func(m []byte) []byte { return m }, 0, slotSize},
		{"unaligned slot size", func(m []byte) []byte { return m }, slots, slotSize + 8},
		{"slot size below the minimum", func(m []byte) []byte { return m }, slots, 64},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Attach(tc.mangle(good()), tc.slots, tc.size); err == nil {
				t.Fatal("Attach accepted it")
			}
		})
	}
	if _, err := Attach(good(), slots, slotSize); err != nil {
		t.Fatalf("Attach(good) = %v", err)
	}
}

func TestTakeBoundsLength(t *testing.T) {
	const slots, slotSize = 1, MinSlotSize
	caller, daemon := pair(t, slots, slotSize)
	caller.Post(0, 3, []byte("x"), 0) //nolint:errcheck // fits
	// The caller scribbles a length past the slot.
	*caller.slotWord(0, slotReqLen) = 1 << 30
	_, seq, _, ok, err := daemon.Take(0, nil)
	if !ok || err == nil || seq != 3 {
		t.Fatalf("Take = ok %v, err %v, seq %d; want the slot taken with an error", ok, err, seq)
	}
	if err := caller.Post(0, 4, make([]byte, slotSize), 0); err == nil {
		t.Fatal("Post accepted a request larger than the payload")
	}
}
