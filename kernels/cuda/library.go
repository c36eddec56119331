package cuda

import (
	"errors"
	"unsafe"
)

// libName is the shared library scripts/cuda-build.sh produces.
const libName = "libexpertd_cuda.so"

// library is the loaded libexpertd_cuda.so: one Go function per C entry
// point, bound with purego (no cgo). Calls go through Backend.call, which
// keeps each on one thread (the library's error string is per thread).
type library struct {
	path string

	abiVersion func() int32
	init       func(device int32, opts *cOptions) int32
	deviceInfo func(device int32, buf *byte, n int32) int32
	setCreate  func(device int32, params *cSetParams, out *uint64) int32
	setFree    func(h uint64) int32
	// moe's buffers are addresses: of Go memory, of a host mapping, or of
	// device memory (each says which, or the library asks the driver).
	moe            func(h uint64, c *cCall) int32
	hostRegister   func(device int32, p unsafe.Pointer, n uint64) int32
	hostUnregister func(device int32, p unsafe.Pointer) int32
	ipcOpen        func(device int32, handle *byte, n int32, ptr, bytes *uint64) int32
	ipcClose       func(ptr uint64) int32
	devAlloc       func(device int32, n uint64, ptr *uint64) int32
	devFree        func(device int32, ptr uint64) int32
	ipcExport      func(device int32, ptr uint64, handle *byte, n int32) int32
	copyMem        func(device int32, dst, src, n uint64) int32
	lastError      func() string
	laneOpen       func(set uint64, c *cCall, depth int32, lane *uint64, handle *byte, n int32) int32
	laneStats      func(lane uint64, served *uint64, mode *int32) int32
	laneClose      func(lane uint64) int32
}

// errNoLibrary marks a library that is not there: backend=auto falls back.
var errNoLibrary = errors.New("cuda: library not found")
