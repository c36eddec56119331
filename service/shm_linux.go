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
// The descriptor stays open so check can see the object's current size.
type mapping struct {
	fd  int
	mem []byte
	// lo is the region's start within mem (mmap offsets are page-aligned);
	// end is the region's end within the object.
	lo, size, end int64
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
	m := &mapping{fd: fd, size: size, end: off + size}
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		syscall.Close(fd) //nolint:errcheck // failing already
		return nil, fmt.Errorf("fstat %s: %w", path, err)
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		syscall.Close(fd) //nolint:errcheck // failing already
		return nil, invalidf("key", "%s is not a regular file", path)
	}
	if m.end > st.Size {
		syscall.Close(fd) //nolint:errcheck // failing already
		return nil, invalidf("byte_size", "offset %d + byte_size %d exceeds %s's %d bytes", off, size, path, st.Size)
	}
	page := int64(os.Getpagesize())
	m.lo = off % page
	m.mem, err = syscall.Mmap(fd, off-m.lo, int(m.lo+size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		syscall.Close(fd) //nolint:errcheck // failing already
		return nil, exhaustedf("byte_size", "mapping %d bytes of %s: %v", size, path, err)
	}
	return m, nil
}

// data is the region's bytes.
func (m *mapping) data() []byte { return m.mem[m.lo : m.lo+m.size] }

// pages is the whole mapping: the region's bytes and, before them, the
// rest of the first page (what a backend page-locks).
func (m *mapping) pages() []byte { return m.mem }

// check fails if the object no longer covers the region: touching the
// missing pages would fault.
func (m *mapping) check() error {
	var st syscall.Stat_t
	if err := syscall.Fstat(m.fd, &st); err != nil {
		return fmt.Errorf("fstat: %w", err)
	}
	if st.Size < m.end {
		return fmt.Errorf("its object shrank to %d bytes, the region ends at %d", st.Size, m.end)
	}
	return nil
}

// close unmaps and closes.
func (m *mapping) close() error {
	return errors.Join(syscall.Munmap(m.mem), syscall.Close(m.fd))
}
