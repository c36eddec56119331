package cuda

import "runtime"

// executor runs library calls on a fixed set of locked OS threads. The
// library's error string is thread-local, so a call and the read of its
// error must happen on one thread: each closure passed to do runs whole
// on one of them. Several threads let calls on different sets, and calls
// on one set's several streams (expertd_init), overlap; the library
// makes each call current on its set's device itself.
type executor struct {
	calls chan func()
	quit  chan struct{}
}

// newExecutor starts threads workers (at least one).
func newExecutor(threads int) *executor {
	x := &executor{calls: make(chan func()), quit: make(chan struct{})}
	for range max(threads, 1) {
		go x.loop()
	}
	return x
}

func (x *executor) loop() {
	runtime.LockOSThread() // never unlocked: the thread dies with the goroutine
	for {
		select {
		case f := <-x.calls:
			f()
		case <-x.quit:
			return
		}
	}
}

// do runs f on one of the executor's threads and waits for it. It reports
// false, without running f, once the executor is stopped.
func (x *executor) do(f func()) bool {
	done := make(chan struct{})
	select {
	case x.calls <- func() {
		defer close(done)
		f()
	}:
		<-done
		return true
	case <-x.quit:
		return false
	}
}

// stop ends the executor's goroutines; no call may follow.
func (x *executor) stop() { close(x.quit) }
