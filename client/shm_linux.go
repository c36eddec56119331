package client

import (
	"fmt"
	"os"
	"syscall"
)

// createShm creates /dev/shm/<key> exclusively, sizes it and maps it
// shared; the descriptor is closed, the mapping keeps the object.
func createShm(key string, size int64) ([]byte, error) {
	path := shmPath(key)
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
	return mem, nil
}

func unmapShm(mem []byte) error { return syscall.Munmap(mem) }
