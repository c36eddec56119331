package ring

import (
	"syscall"
	"time"
	"unsafe"
)

// Linux futex operations. The shared (non-PRIVATE) forms key the wait
// queue on the page, not the address space, so a waiter in one process
// is woken by a waker in another mapping the same object.
const (
	futexWait = 0
	futexWake = 1
)

// Wait sleeps while *addr == val, for at most timeout (> 0), or until a
// Wake on the same word in any process. Spurious returns are allowed:
// callers re-check their condition.
func Wait(addr *uint32, val uint32, timeout time.Duration) {
	ts := syscall.NsecToTimespec(max(timeout, time.Microsecond).Nanoseconds())
	// EAGAIN (the word changed), EINTR and ETIMEDOUT all mean: look again.
	syscall.Syscall6(syscall.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), futexWait, uintptr(val), uintptr(unsafe.Pointer(&ts)), 0, 0) //nolint:errcheck // see above
}

// Wake wakes up to n waiters on addr.
func Wake(addr *uint32, n int) {
	syscall.Syscall6(syscall.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), futexWake, uintptr(n), 0, 0, 0) //nolint:errcheck // nothing to do about it
}
