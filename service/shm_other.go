//go:build !linux

package service

import "google.golang.org/grpc/codes"

// mapping is unavailable: POSIX shared memory is served on Linux only.
type mapping struct{}

func mapShm(string, int64, int64) (*mapping, error) {
	return nil, codedf(codes.Unimplemented, "kind", "POSIX shared memory is served on Linux only")
}

func (*mapping) data() []byte  { return nil }
func (*mapping) pages() []byte { return nil }
func (*mapping) check() error  { return nil }
func (*mapping) close() error  { return nil }
