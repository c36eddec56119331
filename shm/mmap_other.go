//go:build !linux

package shm

import (
	"errors"

	"google.golang.org/grpc/codes"
)

// Open is unavailable: POSIX shared memory is served on Linux only.
func Open(string, int64, int64) (*Mapping, error) {
	return nil, errorf(codes.Unimplemented, "kind", "POSIX shared memory is served on Linux only")
}

// Create is unavailable: POSIX shared memory under /dev/shm is Linux's;
// elsewhere the SDK sends tensors inline.
func Create(string, int64) (*Mapping, error) {
	return nil, errors.New("POSIX shared memory is supported on Linux only")
}

// unmap has nothing to do: no Mapping is ever made here.
func unmap([]byte) error { return nil }
