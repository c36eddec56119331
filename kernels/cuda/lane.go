package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"sync"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
)

// MaxLaneDepth bounds OpenLane's depth: the calls a lane keeps enqueued.
const MaxLaneDepth = maxLaneDepth

// OpenLane opens a GPU-ordered lane (kernels.Lane) for req's shape and
// buffers on set: hidden states, router logits and the output in device
// memory (CUDA IPC regions the caller shared), no hidden scales and no
// precomputed routing. depth calls stay enqueued, 1 to MaxLaneDepth. The
// device buffers must stay mapped until the lane is closed.
func (b *Backend) OpenLane(set kernels.Loaded, req *moe.Request, depth int) (kernels.Lane, error) {
	l, ok := set.(*loaded)
	if !ok || l.b != b {
		return nil, fmt.Errorf("cuda: expert set %T was not loaded by this backend", set)
	}
	if depth < 1 || depth > MaxLaneDepth {
		return nil, fmt.Errorf("cuda: lane depth %d: want 1 to %d", depth, MaxLaneDepth)
	}
	if req.Hidden.Dev == 0 || req.Logits.Dev == 0 || req.OutDev == 0 {
		return nil, errors.New("cuda: a lane's hidden states, router logits and output must be in device memory")
	}
	if len(req.HiddenScale) > 0 || req.TopKIDs != nil {
		return nil, errors.New("cuda: a lane takes no hidden scales and no precomputed routing")
	}
	r := *req
	r.NoRouting = true
	c, _, _, err := packCall(l.meta, &r, nil, b.gemm, false, nil)
	if err != nil {
		return nil, err
	}
	ln := &gpuLane{b: b, handle: make([]byte, ipcHandleBytes)}
	l.mu.RLock()
	if l.handle == 0 {
		l.mu.RUnlock()
		return nil, errors.New("cuda: expert set is closed")
	}
	h := l.handle
	err = b.call("lane_open", func() int32 {
		return b.lib.laneOpen(h, c, int32(depth), &ln.id, &ln.handle[0], int32(len(ln.handle)))
	})
	l.mu.RUnlock()
	runtime.KeepAlive(r.Routing.CorrectionBias)
	if err != nil {
		return nil, err
	}
	if err := b.call("lane_stats", func() int32 { return b.lib.laneStats(ln.id, new(uint64), &ln.mode) }); err != nil {
		b.lib.laneClose(ln.id)
		return nil, err
	}
	b.mu.Lock()
	if b.lanes == nil {
		b.lanes = map[*gpuLane]struct{}{}
	}
	b.lanes[ln] = struct{}{}
	b.mu.Unlock()
	return ln, nil
}

// gpuLane is an open lane of the library.
type gpuLane struct {
	b      *Backend
	id     uint64
	handle []byte
	mode   int32
	once   sync.Once
	// served is the count at close, read after it.
	mu     sync.Mutex
	closed bool
	served uint64
}

func (l *gpuLane) Flags() kernels.LaneFlags {
	return kernels.LaneFlags{Handle: l.handle, Bytes: laneFlagsBytes, Doorbell: laneDoorbell, Done: laneDone}
}

func (l *gpuLane) MPS() bool          { return l.mode&laneMPS != 0 }
func (l *gpuLane) SkipsOnClose() bool { return l.mode&laneSkips != 0 }

// Served reads the library's count while the lane is open, and the last
// count after.
func (l *gpuLane) Served() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return l.served
	}
	var n uint64
	var mode int32
	if l.b.call("lane_stats", func() int32 { return l.b.lib.laneStats(l.id, &n, &mode) }) != nil {
		return l.served
	}
	l.served = n
	return n
}

// Close closes the lane (once; later calls return nil).
func (l *gpuLane) Close() error {
	var err error
	l.once.Do(func() {
		l.Served()
		l.mu.Lock()
		l.closed = true
		l.mu.Unlock()
		err = l.b.closeLane(l)
	})
	return err
}

// closeLane closes l in the library, which a closed backend no longer
// answers: Backend.Close closes its lanes first.
func (b *Backend) closeLane(l *gpuLane) error {
	b.mu.Lock()
	delete(b.lanes, l)
	b.mu.Unlock()
	return b.call("lane_close", func() int32 { return b.lib.laneClose(l.id) })
}

// MaxLaneDepth is the largest depth OpenLane takes.
func (b *Backend) MaxLaneDepth() int { return MaxLaneDepth }
