//go:build linux

package cuda

import (
	"sync"
	"syscall"
	"testing"
)

// TestExecutorOneThread checks that every call runs on the same OS thread
// (the library's last-error string and CUDA's current device are per
// thread) and that calls after stop are refused, not hung.
func TestExecutorOneThread(t *testing.T) {
	x := newExecutor()
	var wg sync.WaitGroup
	tids := make([]int, 16)
	for i := range tids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if !x.do(func() { tids[i] = syscall.Gettid() }) {
				t.Errorf("call %d refused before stop", i)
			}
		}()
	}
	wg.Wait()
	for i, tid := range tids {
		if tid != tids[0] {
			t.Errorf("call %d ran on thread %d, call 0 on %d", i, tid, tids[0])
		}
	}
	x.stop()
	ran := false
	if x.do(func() { ran = true }) || ran {
		t.Errorf("do after stop: ran=%v, want refused", ran)
	}
}
