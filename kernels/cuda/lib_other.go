//go:build !((linux || darwin) && (amd64 || arm64))

package cuda

import (
	"errors"
	"unsafe"
)

// library is unavailable on this platform; openLibrary always fails.
type library struct {
	path       string
	abiVersion func() int32
	init       func(device int32) int32
	deviceInfo func(device int32, buf *byte, n int32) int32
	setCreate  func(device, e, k, n, act int32, w13, w2 *byte, s13 *float32, n13 int32,
		s2 *float32, n2 int32, a13, a2 float32, out *uint64) int32
	setFree func(h uint64) int32
	moe     func(h uint64, ip *int64, nip int32, fp *float32, nfp int32, hidden unsafe.Pointer,
		hiddenScale *float32, logits unsafe.Pointer, bias *float32, idsIn *int32, wIn *float32,
		out unsafe.Pointer, idsOut *int32, wOut *float32, ms *float32) int32
	lastError func() string
}

var errNoLibrary = errors.New("cuda: library not found")

func openLibrary(string) (*library, error) {
	return nil, errors.Join(errNoLibrary, errors.New("cuda: the CUDA backend needs linux or darwin on amd64 or arm64"))
}
