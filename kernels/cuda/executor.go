package cuda

import "runtime"

// executor runs every library call for one GPU on a single locked OS
// thread. The library's error string is thread-local and the CUDA current
// device is per thread, so pinning both to one thread makes them coherent;
// it also serializes calls, which the library's per-set workspaces need.
type executor struct {
	calls chan func()
	quit  chan struct{}
}

func newExecutor() *executor {
	x := &executor{calls: make(chan func()), quit: make(chan struct{})}
	go x.loop()
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

// do runs f on the executor's thread and waits for it. It reports false,
// without running f, once the executor is stopped.
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

// stop ends the executor's goroutine; no call may follow.
func (x *executor) stop() { close(x.quit) }
