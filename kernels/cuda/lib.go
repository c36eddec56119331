//go:build (linux || darwin) && (amd64 || arm64)

package cuda

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/ebitengine/purego"
)

var (
	libMu    sync.Mutex
	libCache = map[string]*library{}
)

// findLibrary resolves the library path: configured (the daemon's
// -library-path, which also reads $EXPERTD_LIBRARY_PATH), then
// build/libexpertd_cuda.so next to the executable (or beside it, or ../lib
// beside it), then in the repository the working directory is in. The
// backend reads no environment: a process's configuration does.
func findLibrary(configured string) (string, error) {
	if configured != "" {
		return configured, nil
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
	return "", fmt.Errorf("%w (set -library-path or $EXPERTD_LIBRARY_PATH, or run scripts/cuda-build.sh; tried %v)", errNoLibrary, tried)
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
		{&l.laneOpen, "expertd_lane_open"},
		{&l.laneStats, "expertd_lane_stats"},
		{&l.laneClose, "expertd_lane_close"},
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
