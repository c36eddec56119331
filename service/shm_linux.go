package service

import (
	"errors"
	"fmt"
	"os"
	"syscall"

	"google.golang.org/grpc/codes"
)

// shmDir is where POSIX shm_open objects live on Linux.
const shmDir = "/dev/shm"

// mapping is a read-write shared mapping of [off, off+size) of one object.
// The descriptor is closed once the object is mapped (the mapping keeps
// the object), so a region costs no file descriptor: regions are bounded
// by Config.MaxShmRegions, descriptors by nothing the daemon controls.
type mapping struct {
	mem []byte
	// lo is the region's start within mem (mmap offsets are page-aligned).
	lo, size int64
}

// mapShm opens /dev/shm/<key> (a checked single file name) without
// following links and maps [off, off+size) of it shared, read-write.
func mapShm(key string, off, size int64) (*mapping, error) {
	path := shmDir + "/" + key
	fd, err := syscall.Open(path, syscall.O_RDWR|syscall.O_NOFOLLOW|syscall.O_CLOEXEC|syscall.O_NONBLOCK, 0)
	switch {
	case errors.Is(err, syscall.ENOENT):
		return nil, codedf(codes.NotFound, "key", "%s does not exist; create it with shm_open and size it with ftruncate first", path)
	case errors.Is(err, syscall.ELOOP):
		return nil, invalidf("key", "%s is a symbolic link; want the object itself", path)
	case errors.Is(err, syscall.EISDIR):
		return nil, invalidf("key", "%s is not a regular file", path)
	case errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EPERM):
		return nil, codedf(codes.PermissionDenied, "key", "the server may not open %s read-write; let its user read and write the object", path)
	case err != nil:
		return nil, codedf(codes.FailedPrecondition, "key", "opening %s: %v", path, err)
	}
	defer syscall.Close(fd) //nolint:errcheck // read-only use; the mapping outlives it
	m := &mapping{size: size}
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("fstat %s: %w", path, err)
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return nil, invalidf("key", "%s is not a regular file", path)
	}
	if off+size > st.Size {
		return nil, invalidf("byte_size", "offset %d + byte_size %d exceeds %s's %d bytes", off, size, path, st.Size)
	}
	page := int64(os.Getpagesize())
	m.lo = off % page
	m.mem, err = syscall.Mmap(fd, off-m.lo, int(m.lo+size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return nil, exhaustedf("byte_size", "mapping %d bytes of %s: %v", size, path, err)
	}
	return m, nil
}

// data is the region's bytes.
func (m *mapping) data() []byte { return m.mem[m.lo : m.lo+m.size] }

// pages is the whole mapping: the region's bytes and, before them, the
// rest of the first page (what a backend page-locks).
func (m *mapping) pages() []byte { return m.mem }

// check fails if the object no longer backs the region's last page:
// touching a page past the object's end faults (SIGBUS), and the last
// page is the first to go when the object shrinks, so while it reads the
// whole region does. (A shrink within that page only zeroes its tail.)
// It reads one byte, under guard, where fstat would need the descriptor
// kept open.
func (m *mapping) check() error {
	if err := guard(func() { readByte(m.mem[len(m.mem)-1:]) }); err != nil {
		return fmt.Errorf("its object no longer covers the region (%v); was it shrunk?", err)
	}
	return nil
}

// readByte loads b[0]; noinline keeps the load from being optimized away.
//
//go:noinline
func readByte(b []byte) byte { return b[0] }

// close unmaps.
func (m *mapping) close() error {
	return syscall.Munmap(m.mem)
}
