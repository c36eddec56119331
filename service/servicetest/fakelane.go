package servicetest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
)

// Lanes on fake device memory: the flags are an allocation of the
// FakeDevice, and a goroutine plays the lane's stream, running each rung
// call on the wrapped backend (FusedMoE, with the device tensors' bytes)
// and setting done, until the lane closes.

// Flag layout of a fake lane, as the cuda library's.
const (
	fakeLaneFlagsBytes = 256
	fakeLaneDoorbell   = 0
	fakeLaneDone       = 128
	fakeLaneStop       = 2
	// FakeMaxLaneDepth is the fake's largest lane depth.
	FakeMaxLaneDepth = 64
)

// fakeLanePoll is how often a fake lane looks at its doorbell.
const fakeLanePoll = 20 * time.Microsecond

// OpenLane implements service.LaneOpener.
func (d *FakeDevice) OpenLane(set kernels.Loaded, req *moe.Request, depth int) (kernels.Lane, error) {
	if d.OpenLaneErr != nil {
		return nil, d.OpenLaneErr
	}
	if depth < 1 || depth > FakeMaxLaneDepth {
		return nil, fmt.Errorf("fake device: lane depth %d", depth)
	}
	if req.Hidden.Dev == 0 || req.Logits.Dev == 0 || req.OutDev == 0 {
		return nil, errors.New("fake device: a lane's tensors must be device memory")
	}
	flags := d.Alloc(fakeLaneFlagsBytes)
	r := *req
	l := &fakeLane{d: d, flags: flags, set: set, req: &r, stopped: make(chan struct{})}
	d.mu.Lock()
	d.lanes++
	d.mu.Unlock()
	go l.run()
	return l, nil
}

// MaxLaneDepth implements service.LaneOpener.
func (d *FakeDevice) MaxLaneDepth() int { return FakeMaxLaneDepth }

// Lanes is the number of lanes open.
func (d *FakeDevice) Lanes() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.lanes
}

// flag is the 32-bit flag at byte off of allocation a.
func flag(a *Allocation, off int64) *atomic.Uint32 {
	return (*atomic.Uint32)(unsafe.Pointer(&a.Mem[off]))
}

// RingLane makes one call on the lane whose flags are the allocation
// handle names, as a caller's stream does: done = 0, doorbell = 1, then
// wait (up to timeout) for done.
func (d *FakeDevice) RingLane(handle []byte, doorbell, done int64, timeout time.Duration) error {
	var a *Allocation
	d.mu.Lock()
	for _, x := range d.allocs {
		if string(x.Handle) == string(handle) {
			a = x
		}
	}
	d.mu.Unlock()
	if a == nil || doorbell < 0 || done < 0 || doorbell+4 > int64(len(a.Mem)) || done+4 > int64(len(a.Mem)) {
		return errors.New("fake device: no lane flags at that handle and those offsets")
	}
	flag(a, done).Store(0)
	flag(a, doorbell).Store(1)
	deadline := time.Now().Add(timeout)
	for flag(a, done).Load() != 1 {
		if time.Now().After(deadline) {
			return errors.New("fake device: the lane never set done")
		}
		time.Sleep(fakeLanePoll)
	}
	return nil
}

// fakeLane is an open fake lane.
type fakeLane struct {
	d       *FakeDevice
	flags   *Allocation
	set     kernels.Loaded
	req     *moe.Request
	served  atomic.Uint64
	failed  atomic.Pointer[error]
	once    sync.Once
	stopped chan struct{}
}

func (l *fakeLane) run() {
	defer close(l.stopped)
	doorbell, done := flag(l.flags, fakeLaneDoorbell), flag(l.flags, fakeLaneDone)
	for {
		switch doorbell.Load() {
		case fakeLaneStop:
			return
		case 1:
			doorbell.Store(0)
			r := *l.req
			if _, err := l.d.FusedMoE(context.Background(), l.set, &r); err != nil {
				l.failed.Store(&err)
			}
			l.served.Add(1)
			done.Store(1)
			continue
		}
		time.Sleep(fakeLanePoll)
	}
}

func (l *fakeLane) Flags() kernels.LaneFlags {
	return kernels.LaneFlags{Handle: l.flags.Handle, Bytes: fakeLaneFlagsBytes, Doorbell: fakeLaneDoorbell, Done: fakeLaneDone}
}

func (l *fakeLane) Served() uint64     { return l.served.Load() }
func (l *fakeLane) MPS() bool          { return false }
func (l *fakeLane) SkipsOnClose() bool { return true }

// Close stops the lane's goroutine and reports the first call that failed.
func (l *fakeLane) Close() error {
	l.once.Do(func() {
		flag(l.flags, fakeLaneDoorbell).Store(fakeLaneStop)
		<-l.stopped
		l.d.mu.Lock()
		l.d.lanes--
		l.d.mu.Unlock()
	})
	if p := l.failed.Load(); p != nil {
		return *p
	}
	return nil
}
