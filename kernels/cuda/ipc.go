package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"unsafe"

	"github.com/expertd/expertd/kernels"
)

// Memory shared by same-host callers: page-locked host mappings (POSIX
// shared memory, so the library copies them by DMA with no staging) and
// device allocations other processes export as CUDA IPC handles (so their
// tensors never leave the GPU). The service finds these methods through
// interfaces of its own.

// IPCHandleBytes is the length of a CUDA IPC handle (cudaIpcMemHandle_t).
const IPCHandleBytes = ipcHandleBytes

// PinHost page-locks b (host memory that outlives the pin, such as a
// shared-memory mapping; never Go-allocated memory, which the garbage
// collector may reuse) and returns the function that unlocks it.
func (b *Backend) PinHost(mem []byte) (unpin func() error, err error) {
	if len(mem) == 0 {
		return nil, errors.New("cuda: PinHost: empty range")
	}
	p := unsafe.Pointer(&mem[0])
	if err := b.call("host_register", func() int32 { return b.lib.hostRegister(int32(b.device), p, uint64(len(mem))) }); err != nil {
		return nil, err
	}
	var once sync.Once
	return func() error {
		err := errors.New("cuda: already unpinned")
		once.Do(func() {
			err = b.call("host_unregister", func() int32 { return b.lib.hostUnregister(int32(b.device), p) })
		})
		return err
	}, nil
}

// OpenIPC maps the device allocation another process exported as handle
// and returns [offset, offset+size) of it. Errors describe a bad handle or
// bounds; on a backend that is closed they say so.
func (b *Backend) OpenIPC(handle []byte, offset, size int64) (kernels.DeviceRegion, error) {
	if len(handle) != IPCHandleBytes {
		return nil, fmt.Errorf("cuda: CUDA IPC handle has %d bytes, want %d", len(handle), IPCHandleBytes)
	}
	if offset < 0 || size < 1 {
		return nil, fmt.Errorf("cuda: CUDA IPC region [%d, +%d): want offset >= 0 and size >= 1", offset, size)
	}
	var base, n uint64
	err := b.call("ipc_open", func() int32 {
		return b.lib.ipcOpen(int32(b.device), &handle[0], int32(len(handle)), &base, &n)
	})
	runtime.KeepAlive(handle)
	if err != nil {
		return nil, err
	}
	r := &ipcRegion{b: b, base: base, ptr: uintptr(base) + uintptr(offset), size: size}
	if uint64(offset) > n || uint64(size) > n-uint64(offset) {
		r.Close()
		return nil, fmt.Errorf("cuda: CUDA IPC region [%d, %d) runs past the end of its allocation (%d bytes)", offset, offset+size, n)
	}
	return r, nil
}

// ipcRegion is an opened CUDA IPC allocation's slice.
type ipcRegion struct {
	b    *Backend
	base uint64
	ptr  uintptr
	size int64
	once sync.Once
}

func (r *ipcRegion) Ptr() uintptr { return r.ptr }
func (r *ipcRegion) Size() int64  { return r.size }

// Close unmaps the allocation (once).
func (r *ipcRegion) Close() error {
	err := errors.New("cuda: CUDA IPC region already closed")
	r.once.Do(func() { err = r.b.call("ipc_close", func() int32 { return r.b.lib.ipcClose(r.base) }) })
	return err
}

// DeviceBuffer is device memory allocated through the library, for
// same-host callers that have no CUDA framework of their own (expertbench,
// tests): fill it, hand its IPCHandle to the daemon
// (client.RegisterCUDASharedMemory), read results back.
type DeviceBuffer struct {
	b    *Backend
	ptr  uint64
	size int64
}

// AllocDevice allocates size bytes on the backend's GPU.
func (b *Backend) AllocDevice(size int64) (*DeviceBuffer, error) {
	if size < 1 {
		return nil, fmt.Errorf("cuda: AllocDevice(%d): want >= 1 byte", size)
	}
	d := &DeviceBuffer{b: b, size: size}
	if err := b.call("dev_alloc", func() int32 { return b.lib.devAlloc(int32(b.device), uint64(size), &d.ptr) }); err != nil {
		return nil, err
	}
	return d, nil
}

// Ptr is the buffer's device address.
func (d *DeviceBuffer) Ptr() uintptr { return uintptr(d.ptr) }

// Size is the buffer's length in bytes.
func (d *DeviceBuffer) Size() int64 { return d.size }

// IPCHandle exports the buffer for another process (IPCHandleBytes bytes).
func (d *DeviceBuffer) IPCHandle() ([]byte, error) {
	h := make([]byte, IPCHandleBytes)
	err := d.b.call("ipc_export", func() int32 { return d.b.lib.ipcExport(int32(d.b.device), d.ptr, &h[0], int32(len(h))) })
	return h, err
}

// CopyIn copies src to the buffer at byte offset off.
func (d *DeviceBuffer) CopyIn(off int64, src []byte) error {
	if err := d.check(off, len(src)); err != nil || len(src) == 0 {
		return err
	}
	err := d.b.call("copy", func() int32 {
		return d.b.lib.copyMem(int32(d.b.device), d.ptr+uint64(off), uint64(uintptr(unsafe.Pointer(&src[0]))), uint64(len(src)))
	})
	runtime.KeepAlive(src)
	return err
}

// CopyOut copies len(dst) bytes from the buffer at byte offset off.
func (d *DeviceBuffer) CopyOut(dst []byte, off int64) error {
	if err := d.check(off, len(dst)); err != nil || len(dst) == 0 {
		return err
	}
	err := d.b.call("copy", func() int32 {
		return d.b.lib.copyMem(int32(d.b.device), uint64(uintptr(unsafe.Pointer(&dst[0]))), d.ptr+uint64(off), uint64(len(dst)))
	})
	runtime.KeepAlive(dst)
	return err
}

func (d *DeviceBuffer) check(off int64, n int) error {
	if off < 0 || int64(n) > d.size-off {
		return fmt.Errorf("cuda: [%d, %d) is outside the %d-byte device buffer", off, off+int64(n), d.size)
	}
	return nil
}

// Free releases the buffer; it must not be used afterwards.
func (d *DeviceBuffer) Free() error {
	return d.b.call("dev_free", func() int32 { return d.b.lib.devFree(int32(d.b.device), d.ptr) })
}
