package shm

import (
	"errors"
	"testing"

	"google.golang.org/grpc/codes"
)

// fakeDevice is device memory whose Close the tests count.
type fakeDevice struct {
	ptr    uintptr
	size   int64
	closed *int
}

func (d fakeDevice) Ptr() uintptr { return d.ptr }
func (d fakeDevice) Size() int64  { return d.size }
func (d fakeDevice) Close() error { *d.closed++; return nil }
func device(closed *int, size int64) func() (Backing, error) {
	return func() (Backing, error) { return Backing{Device: fakeDevice{0x1000, size, closed}}, nil }
}

func wantCode(t *testing.T, err error, code codes.Code, field string) {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) || e.Code != code || e.Field != field {
		t.Fatalf("err = %v, want %v on field %q", err, code, field)
	}
}

// TestTableHeldRegion: a region unregistered while a call holds it is
// forgotten at once (its name is free, List no longer shows it) but its
// memory goes only when the last call lets go.
func TestTableHeldRegion(t *testing.T) {
	tab := New(Config{MaxRegions: 4, MaxBytes: 1 << 20, MaxPerOwner: 4})
	owner := tab.Connect()
	closed := 0
	if _, err := tab.Register(owner, Spec{Name: "r", Kind: CUDAIPC, Size: 100}, device(&closed, 100)); err != nil {
		t.Fatal(err)
	}
	l := tab.Lease(owner)
	mem, r, err := l.Resolve("r", 10, 20)
	if err != nil || mem.Dev != 0x1000+10 || mem.Host != nil || r.Name != "r" {
		t.Fatalf("Resolve = %+v, %v, %v", mem, r, err)
	}
	if _, _, err := l.Resolve("r", 30, 70); err != nil {
		t.Fatalf("second reference into the same region: %v", err)
	}
	if infos, _ := tab.List(owner, "r"); infos[0].CallsInFlight != 1 {
		t.Fatalf("calls in flight = %d, want 1 (a call holds a region once)", infos[0].CallsInFlight)
	}
	if names, err := tab.Unregister(owner, ""); err != nil || len(names) != 1 {
		t.Fatalf("Unregister = %v, %v", names, err)
	}
	if n, b := tab.Usage(); closed != 0 || n != 1 || b != 100 {
		t.Fatalf("after Unregister under a call: closed %d, usage %d regions %d bytes; want 0, 1, 100", closed, n, b)
	}
	if _, err := tab.List(owner, "r"); err == nil {
		t.Fatal("List finds an unregistered region")
	}
	l.Release()
	if n, b := tab.Usage(); closed != 1 || n != 0 || b != 0 {
		t.Fatalf("after Release: closed %d, usage %d regions %d bytes; want 1, 0, 0", closed, n, b)
	}
}

// TestTableRefusals: names, caps and references are checked, and a
// refused registration never opens memory.
func TestTableRefusals(t *testing.T) {
	tab := New(Config{MaxRegions: 2, MaxBytes: 150, MaxPerOwner: 1})
	a, b := tab.Connect(), tab.Connect()
	closed := 0
	if _, err := tab.Register(a, Spec{Name: "r", Kind: CUDAIPC, Size: 100}, device(&closed, 100)); err != nil {
		t.Fatal(err)
	}
	never := func() (Backing, error) { t.Fatal("open called for a refused registration"); return Backing{}, nil }
	_, err := tab.Register(a, Spec{Name: "r", Size: 1}, never)
	wantCode(t, err, codes.AlreadyExists, "name")
	_, err = tab.Register(a, Spec{Name: "s", Size: 1}, never)
	wantCode(t, err, codes.ResourceExhausted, "name")
	if e := (*Error)(nil); !errors.As(err, &e) || e.Quota != "regions-per-connection" || e.Limit != 1 {
		t.Fatalf("per-owner refusal %v: want quota regions-per-connection of 1", err)
	}
	_, err = tab.Register(b, Spec{Name: "r", Size: 51}, never)
	wantCode(t, err, codes.ResourceExhausted, "byte_size")
	if _, err := tab.Register(b, Spec{Name: "r", Kind: CUDAIPC, Size: 50}, device(&closed, 50)); err != nil {
		t.Fatalf("a name is per owner: %v", err)
	}
	_, err = tab.Register(tab.Connect(), Spec{Name: "x", Size: 0}, never)
	wantCode(t, err, codes.ResourceExhausted, "name")

	l := tab.Lease(a)
	defer l.Release()
	_, _, err = l.Resolve("nope", 0, 1)
	wantCode(t, err, codes.NotFound, "region_name")
	_, _, err = l.Resolve("r", 101, 0)
	wantCode(t, err, codes.InvalidArgument, "offset")
	_, _, err = l.Resolve("r", -1, 0)
	wantCode(t, err, codes.InvalidArgument, "offset")
	_, _, err = l.Resolve("r", 1, 100)
	wantCode(t, err, codes.InvalidArgument, "byte_size")
	_, _, err = l.Resolve("r", 0, -1)
	wantCode(t, err, codes.InvalidArgument, "byte_size")
}

// TestTableOwnersEnd: an owner's disconnection releases its regions, and
// a closed table refuses everything.
func TestTableOwnersEnd(t *testing.T) {
	tab := New(Config{MaxRegions: 4, MaxBytes: 1 << 20, MaxPerOwner: 4})
	a, b := tab.Connect(), tab.Connect()
	closed := 0
	for _, o := range []uint64{a, b} {
		if _, err := tab.Register(o, Spec{Name: "r", Kind: CUDAIPC, Size: 8}, device(&closed, 8)); err != nil {
			t.Fatal(err)
		}
	}
	if names := tab.Disconnect(a); len(names) != 1 || closed != 1 {
		t.Fatalf("Disconnect = %v with %d closed, want [r] and 1", names, closed)
	}
	la := tab.Lease(a)
	_, err := la.Hold("r")
	wantCode(t, err, codes.Canceled, "")
	tab.Close()
	if closed != 2 {
		t.Fatalf("%d regions closed after Close, want 2", closed)
	}
	lb := tab.Lease(b)
	if _, err := lb.Hold("r"); !errors.Is(err, ErrClosed) {
		t.Fatalf("Hold after Close = %v, want ErrClosed", err)
	}
	if _, err := tab.Register(tab.Connect(), Spec{Name: "s", Size: 1}, device(&closed, 1)); !errors.Is(err, ErrClosed) {
		t.Fatalf("Register after Close = %v, want ErrClosed", err)
	}
}
