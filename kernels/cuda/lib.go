//go:build (linux || darwin) && (amd64 || arm64)

package cuda

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
)

// libName is the shared library scripts/cuda-build.sh produces.
const libName = "libexpertd_cuda.so"

// library is the loaded libexpertd_cuda.so: one Go function per C entry
// point, bound with purego (no cgo). Calls go through Backend.call, which
// keeps each on one thread (the library's error string is per thread).
type library struct {
	path string

	abiVersion func() int32
	init       func(device, streams int32) int32
	deviceInfo func(device int32, buf *byte, n int32) int32
	setCreate  func(device, e, k, n, act int32, w13, w2 *byte, s13 *float32, n13 int32,
		s2 *float32, n2, blockN, blockK int32, a13, a2 float32, out *uint64) int32
	setFree func(h uint64) int32
	// moe's hidden, logits and out are addresses: of Go memory, of a
	// host mapping, or of device memory (the library tells them apart).
	moe func(h uint64, ip *int64, nip int32, fp *float32, nfp int32, hidden uintptr,
		hiddenScale *float32, logits uintptr, bias *float32, idsIn *int32, wIn *float32,
		out uintptr, idsOut *int32, wOut *float32, ms *float32) int32
	hostRegister   func(device int32, p unsafe.Pointer, n uint64) int32
	hostUnregister func(device int32, p unsafe.Pointer) int32
	ipcOpen        func(device int32, handle *byte, n int32, ptr, bytes *uint64) int32
	ipcClose       func(ptr uint64) int32
	devAlloc       func(device int32, n uint64, ptr *uint64) int32
	devFree        func(device int32, ptr uint64) int32
	ipcExport      func(device int32, ptr uint64, handle *byte, n int32) int32
	copyMem        func(device int32, dst, src, n uint64) int32
	lastError      func() string
}

var (
	libMu    sync.Mutex
	libCache = map[string]*library{}
)

// errNoLibrary marks a library that is not there: backend=auto falls back.
var errNoLibrary = errors.New("cuda: library not found")

// findLibrary resolves the library path: configured, then
// $EXPERTD_CUDA_LIB, then build/libexpertd_cuda.so next to the executable
// (or beside it, or ../lib beside it), then in the repository the working
// directory is in.
func findLibrary(configured string) (string, error) {
	if configured != "" {
		return configured, nil
	}
	if p := os.Getenv("EXPERTD_CUDA_LIB"); p != "" {
		return p, nil
	}
	var tried []string
	try := func(p string) bool {
		tried = append(tried, p)
		_, err := os.Stat(p)
		return err == nil
	}
	if exe, err := os.Executable(); err == nil {
		dir := filepath.Dir(exe)
		// ../lib is where an install (the container image) puts it:
		// /usr/local/bin/expertd finds /usr/local/lib/libexpertd_cuda.so.
		for _, p := range []string{filepath.Join(dir, "build", libName), filepath.Join(dir, libName),
			filepath.Join(dir, "..", "build", libName), filepath.Join(dir, "..", "lib", libName)} {
			if try(p) {
				return p, nil
			}
		}
	}
	if wd, err := os.Getwd(); err == nil {
		for dir := wd; ; dir = filepath.Dir(dir) {
			if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
				if p := filepath.Join(dir, "build", libName); try(p) {
					return p, nil
				}
				break
			}
			if filepath.Dir(dir) == dir {
				break
			}
		}
	}
	return "", fmt.Errorf("%w (set $EXPERTD_CUDA_LIB or run scripts/cuda-build.sh; tried %v)", errNoLibrary, tried)
}

// openLibrary loads (once per path) and binds the library and checks its
// ABI version.
func openLibrary(configured string) (*library, error) {
	path, err := findLibrary(configured)
	if err != nil {
		return nil, err
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("cuda: library path %q: %w", path, err)
	}
	libMu.Lock()
	defer libMu.Unlock()
	if l, ok := libCache[abs]; ok {
		return l, nil
	}
	if _, err := os.Stat(abs); err != nil {
		return nil, fmt.Errorf("%w: %v", errNoLibrary, err)
	}
	h, err := purego.Dlopen(abs, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return nil, fmt.Errorf("cuda: dlopen %s: %w", abs, err)
	}
	l := &library{path: abs}
	bind := func(fptr any, name string) (err error) {
		sym, err := purego.Dlsym(h, name)
		if err != nil {
			return fmt.Errorf("cuda: %s: missing symbol %s: %w", abs, name, err)
		}
		purego.RegisterFunc(fptr, sym)
		return nil
	}
	for _, b := range []struct {
		fptr any
		name string
	}{
		{&l.abiVersion, "expertd_abi_version"},
		{&l.init, "expertd_init"},
		{&l.deviceInfo, "expertd_device_info"},
		{&l.setCreate, "expertd_set_create"},
		{&l.setFree, "expertd_set_free"},
		{&l.moe, "expertd_moe"},
		{&l.hostRegister, "expertd_host_register"},
		{&l.hostUnregister, "expertd_host_unregister"},
		{&l.ipcOpen, "expertd_ipc_open"},
		{&l.ipcClose, "expertd_ipc_close"},
		{&l.devAlloc, "expertd_dev_alloc"},
		{&l.devFree, "expertd_dev_free"},
		{&l.ipcExport, "expertd_ipc_export"},
		{&l.copyMem, "expertd_copy"},
		{&l.lastError, "expertd_last_error"},
	} {
		if err := bind(b.fptr, b.name); err != nil {
			return nil, err
		}
	}
	if v := l.abiVersion(); v != abiVersion {
		return nil, fmt.Errorf("cuda: %s speaks ABI %d, this binary speaks %d: rebuild one of them", abs, v, abiVersion)
	}
	libCache[abs] = l
	return l, nil
}
