//go:build !linux

package client

import "errors"

// POSIX shared memory under /dev/shm is Linux's; elsewhere the SDK sends
// tensors inline.
func createShm(string, int64) ([]byte, error) {
	return nil, errors.New("POSIX shared memory is supported on Linux only")
}

func unmapShm([]byte) error { return nil }
