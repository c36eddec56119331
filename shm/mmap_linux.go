package shm

import (
	"errors"
	"fmt"
	"os"
	"syscall"

	"google.golang.org/grpc/codes"
)

// Open opens Path(key) (a checked single file name, CheckKey) without
// following links and maps [off, off+size) of it shared, read-write.
func Open(key string, off, size int64) (*Mapping, error) {
	path := Path(key)
	fd, err := syscall.Open(path, syscall.O_RDWR|syscall.O_NOFOLLOW|syscall.O_CLOEXEC|syscall.O_NONBLOCK, 0)
	switch {
	case errors.Is(err, syscall.ENOENT):
		return nil, errorf(codes.NotFound, "key", "%s does not exist; create it with shm_open and size it with ftruncate first", path)
	case errors.Is(err, syscall.ELOOP):
		return nil, invalidf("key", "%s is a symbolic link; want the object itself", path)
	case errors.Is(err, syscall.EISDIR):
		return nil, invalidf("key", "%s is not a regular file", path)
	case errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EPERM):
		return nil, errorf(codes.PermissionDenied, "key", "the server may not open %s read-write; let its user read and write the object", path)
	case err != nil:
		return nil, errorf(codes.FailedPrecondition, "key", "opening %s: %v", path, err)
	}
	defer syscall.Close(fd) //nolint:errcheck // read-only use; the mapping outlives it
	m := &Mapping{size: size}
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

// Create creates Path(key) exclusively (as shm_open with O_CREAT|O_EXCL
// and mode 0600), sizes it and maps it whole, shared, read-write.
func Create(key string, size int64) (*Mapping, error) {
	path := Path(key)
	fd, err := syscall.Open(path, syscall.O_RDWR|syscall.O_CREAT|syscall.O_EXCL|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("creating %s: %w", path, err)
	}
	defer syscall.Close(fd) //nolint:errcheck // the mapping outlives it
	if err := syscall.Ftruncate(fd, size); err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("sizing %s to %d bytes: %w", path, size, err)
	}
	mem, err := syscall.Mmap(fd, 0, int(size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("mapping %s: %w", path, err)
	}
	return &Mapping{mem: mem, size: size}, nil
}

func unmap(mem []byte) error { return syscall.Munmap(mem) }
