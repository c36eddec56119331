package service

import (
	"context"
	"sync/atomic"
	"time"
)

// execSlots are the server's MaxConcurrent execution slots, with a
// bounded queue of calls waiting for one: every backend call holds a slot
// (a merged batch holds one for all its calls), and kernels/batch takes
// them through its Slots interface.
type execSlots struct {
	// ch is a semaphore of MaxConcurrent places.
	ch chan struct{}
	// queued counts calls waiting for a slot, bounded by maxQueued.
	queued    atomic.Int64
	maxQueued int
	// callNanos is a moving average of a backend call's wall time, which
	// sizes the retry delay of a call refused by a full queue.
	callNanos atomic.Int64
}

func newExecSlots(cfg Config) *execSlots {
	return &execSlots{ch: make(chan struct{}, cfg.MaxConcurrent), maxQueued: cfg.MaxQueued}
}

// Acquire takes an execution slot, waiting in the bounded queue if none
// is free; Release gives it back.
func (q *execSlots) Acquire(ctx context.Context) error {
	if q.TryAcquire() {
		return nil
	}
	if n := q.queued.Add(1); n > int64(q.maxQueued) {
		q.queued.Add(-1)
		return limitf("", "max-queued", int64(q.maxQueued), q.busyRetry(), "server busy: %d calls running, %d queued (max queued %d); retry with backoff",
			len(q.ch), n-1, q.maxQueued)
	}
	defer q.queued.Add(-1)
	select {
	case q.ch <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// TryAcquire takes an execution slot if one is free now.
func (q *execSlots) TryAcquire() bool {
	select {
	case q.ch <- struct{}{}:
		return true
	default:
		return false
	}
}

// Release frees a slot Acquire or TryAcquire took.
func (q *execSlots) Release() { <-q.ch }

// Bounds of the retry delay a full queue answers with: below a millisecond
// a retry would only meet the same queue; beyond a second the caller is
// better served by another replica.
const (
	minBusyRetry = time.Millisecond
	maxBusyRetry = time.Second
)

// busyRetry is how long a call refused by a full queue should wait before
// it is tried again: about one backend call, by when each running call has
// finished once and the queue has moved by MaxConcurrent places.
func (q *execSlots) busyRetry() time.Duration {
	return min(max(time.Duration(q.callNanos.Load()), minBusyRetry), maxBusyRetry)
}

// noteCall adds one backend call's wall time to the moving average (weight
// 1/8: a few calls follow a change of load). Racing updates may lose one
// sample, which an average tolerates.
func (q *execSlots) noteCall(d time.Duration) {
	old := q.callNanos.Load()
	q.callNanos.Store(old + (d.Nanoseconds()-old)/8)
}
