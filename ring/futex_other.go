//go:build !linux

package ring

import (
	"sync/atomic"
	"time"
)

// pollInterval is how often Wait looks at the word where no futex
// exists: waiters then cost a wake-up per interval instead of none.
const pollInterval = 50 * time.Microsecond

// Wait sleeps in short steps while *addr == val, for at most timeout.
func Wait(addr *uint32, val uint32, timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for atomic.LoadUint32(addr) == val && time.Now().Before(deadline) {
		time.Sleep(pollInterval)
	}
}

// Wake does nothing: waiters poll.
func Wake(*uint32, int) {}
