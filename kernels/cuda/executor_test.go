//go:build linux

package cuda

import (
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestExecutorThreads checks that calls run on the executor's threads only
// (the library's last-error string is per thread, so a call must not hop),
// that several run at once when there are several threads, and that calls
// after stop are refused, not hung.
func TestExecutorThreads(t *testing.T) {
	tests := []struct {
		threads, wantAtOnce int
	}{
		{1, 1},
		{3, 3},
	}
	for _, tt := range tests {
		x := newExecutor(tt.threads)
		var (
			mu            sync.Mutex
			tids          = map[int]bool{}
			now, atOnce   int
			wg            sync.WaitGroup
			callsPerRound = 12
		)
		for i := 0; i < callsPerRound; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ok := x.do(func() {
					tid := syscall.Gettid()
					mu.Lock()
					tids[tid] = true
					now++
					atOnce = max(atOnce, now)
					mu.Unlock()
					time.Sleep(20 * time.Millisecond)
					if syscall.Gettid() != tid {
						t.Errorf("a call moved from thread %d to %d", tid, syscall.Gettid())
					}
					mu.Lock()
					now--
					mu.Unlock()
				})
				if !ok {
					t.Errorf("call refused before stop")
				}
			}()
		}
		wg.Wait()
		if got := len(tids); got > tt.threads {
			t.Errorf("threads=%d: calls ran on %d threads", tt.threads, got)
		}
		if atOnce != tt.wantAtOnce {
			t.Errorf("threads=%d: %d calls ran at once, want %d", tt.threads, atOnce, tt.wantAtOnce)
		}
		x.stop()
		ran := false
		if x.do(func() { ran = true }) || ran {
			t.Errorf("threads=%d: do after stop: ran=%v, want refused", tt.threads, ran)
		}
	}
}
