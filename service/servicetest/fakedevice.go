package servicetest

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/service"
)

// FakeDevice wraps a host backend with simulated CUDA IPC device memory,
// so that code registering SHARED_MEMORY_KIND_CUDA_IPC regions can be
// tested without a GPU. It implements service.IPCOpener and
// service.HostPinner.
//
// Device memory is host memory here. Alloc returns an allocation's handle
// and the bytes standing in for it, which a test writes and reads as a
// CUDA caller would copy to and from its device. Allocations sit at fake
// device addresses that alias nothing in the process, and FusedMoE turns
// the Dev and OutDev addresses the service hands it back into the
// allocations' bytes before calling the wrapped backend, so an address
// off by a region's offset reads the wrong bytes or fails, as on a GPU,
// and results are the wrapped backend's.
type FakeDevice struct {
	kernels.Backend

	// OpenErr, when set, is what OpenIPC returns; PinErr, what PinHost
	// returns.
	OpenErr, PinErr error
	// OnUnpin, when set, is called with the pinned bytes by each unpin
	// before it unpins them.
	OnUnpin func(b []byte)
	// OpenLaneErr, when set, is what OpenLane returns.
	OpenLaneErr error

	mu     sync.Mutex
	allocs []*Allocation
	// open counts regions opened and not closed; pinned, bytes pinned.
	open   int
	pinned int64
	calls  []*moe.Request
	// lanes counts lanes opened and not closed.
	lanes int
}

var (
	_ service.IPCOpener  = (*FakeDevice)(nil)
	_ service.HostPinner = (*FakeDevice)(nil)
	_ service.LaneOpener = (*FakeDevice)(nil)
)

// NewFakeDevice gives b fake device memory.
func NewFakeDevice(b kernels.Backend) *FakeDevice { return &FakeDevice{Backend: b} }

// Allocation is fake device memory, what cudaMalloc and
// cudaIpcGetMemHandle give a CUDA caller.
type Allocation struct {
	// Handle is its 64-byte cudaIpcMemHandle_t.
	Handle []byte
	// Addr is its device address.
	Addr uintptr
	// Mem is the host memory standing in for it.
	Mem []byte
}

// fakeHandleMagic starts every handle a FakeDevice hands out; the
// allocation's address follows it.
var fakeHandleMagic = []byte("expertd-fakeipc\x00")

// fakeDeviceBase is the first allocation's address, far from anything Go
// maps; each allocation gets its own 4 GiB.
const fakeDeviceBase = uintptr(0x7e00_0000_0000)

// Alloc allocates size bytes of fake device memory.
func (d *FakeDevice) Alloc(size int) *Allocation {
	if size < 1 || size >= 1<<32 {
		panic(fmt.Sprintf("servicetest: FakeDevice.Alloc(%d): want 1 to 4 GiB - 1", size))
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	a := &Allocation{Addr: fakeDeviceBase + uintptr(len(d.allocs))<<32, Mem: make([]byte, size), Handle: make([]byte, 64)}
	copy(a.Handle, fakeHandleMagic)
	binary.LittleEndian.PutUint64(a.Handle[len(fakeHandleMagic):], uint64(a.Addr))
	d.allocs = append(d.allocs, a)
	return a
}

// OpenIPC implements service.IPCOpener, checking the bounds as the cuda
// backend does.
func (d *FakeDevice) OpenIPC(handle []byte, offset, size int64) (kernels.DeviceRegion, error) {
	if d.OpenErr != nil {
		return nil, d.OpenErr
	}
	if len(handle) != 64 || !bytes.HasPrefix(handle, fakeHandleMagic) {
		return nil, errors.New("fake device: invalid IPC handle")
	}
	addr := uintptr(binary.LittleEndian.Uint64(handle[len(fakeHandleMagic):]))
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, a := range d.allocs {
		if a.Addr != addr {
			continue
		}
		if offset < 0 || size < 1 || offset > int64(len(a.Mem)) || size > int64(len(a.Mem))-offset {
			return nil, fmt.Errorf("fake device: [%d, %d+%d) is outside the allocation's %d bytes", offset, offset, size, len(a.Mem))
		}
		d.open++
		return &fakeRegion{d: d, ptr: addr + uintptr(offset), size: size}, nil
	}
	return nil, fmt.Errorf("fake device: no allocation at %#x", addr)
}

// Open is the number of regions OpenIPC opened that are not closed.
func (d *FakeDevice) Open() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.open
}

// fakeRegion is an opened slice of an allocation.
type fakeRegion struct {
	d      *FakeDevice
	ptr    uintptr
	size   int64
	closed bool // guarded by d.mu
}

func (r *fakeRegion) Ptr() uintptr { return r.ptr }
func (r *fakeRegion) Size() int64  { return r.size }

// Close fails when called twice, which the service must never do.
func (r *fakeRegion) Close() error {
	r.d.mu.Lock()
	defer r.d.mu.Unlock()
	if r.closed {
		return fmt.Errorf("fake device: region at %#x closed twice", r.ptr)
	}
	r.closed = true
	r.d.open--
	return nil
}

// PinHost implements service.HostPinner, counting the bytes pinned.
func (d *FakeDevice) PinHost(b []byte) (func() error, error) {
	if d.PinErr != nil {
		return nil, d.PinErr
	}
	d.mu.Lock()
	d.pinned += int64(len(b))
	d.mu.Unlock()
	var once sync.Once
	return func() error {
		err := fmt.Errorf("fake device: %d bytes unpinned twice", len(b))
		once.Do(func() {
			if d.OnUnpin != nil {
				d.OnUnpin(b)
			}
			d.mu.Lock()
			d.pinned -= int64(len(b))
			d.mu.Unlock()
			err = nil
		})
		return err
	}, nil
}

// Pinned is the number of bytes pinned now.
func (d *FakeDevice) Pinned() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.pinned
}

// Calls are the requests FusedMoE was given, device addresses and all.
func (d *FakeDevice) Calls() []*moe.Request {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]*moe.Request(nil), d.calls...)
}

// bytesAt is the memory of n bytes at device address addr; d.mu must be
// held.
func (d *FakeDevice) bytesAt(addr uintptr, n int) ([]byte, error) {
	for _, a := range d.allocs {
		if addr >= a.Addr && addr-a.Addr <= uintptr(len(a.Mem)) && uintptr(n) <= uintptr(len(a.Mem))-(addr-a.Addr) {
			lo := int(addr - a.Addr)
			return a.Mem[lo : lo+n : lo+n], nil
		}
	}
	return nil, fmt.Errorf("fake device: %d bytes at %#x are in no allocation", n, addr)
}

// FusedMoE runs req on the wrapped backend with its device tensors and
// output replaced by the allocations' bytes, and returns no Output when
// the output went to device memory, as moe.Request.OutDev requires.
func (d *FakeDevice) FusedMoE(ctx context.Context, l kernels.Loaded, req *moe.Request) (*moe.Result, error) {
	host := *req
	d.mu.Lock()
	d.calls = append(d.calls, req)
	err := d.toHost(&host.Hidden)
	if err == nil {
		err = d.toHost(&host.Logits)
	}
	if err == nil && req.OutDev != 0 {
		if req.Out != nil {
			err = errors.New("fake device: both Out and OutDev are set")
		} else {
			host.Out, err = d.bytesAt(req.OutDev, req.M()*l.Set().K*req.OutDType.Size())
			host.OutDev = 0
		}
	}
	d.mu.Unlock()
	if err != nil {
		return nil, err
	}
	res, err := d.Backend.FusedMoE(ctx, l, &host)
	if err != nil || req.OutDev == 0 {
		return res, err
	}
	if len(res.Output) != len(host.Out) {
		return nil, fmt.Errorf("fake device: the backend returned %d output bytes, want %d", len(res.Output), len(host.Out))
	}
	// A backend that ignores Out (a test fake) wrote its own buffer; a
	// device backend would have written the device's.
	copy(host.Out, res.Output)
	res.Output = nil
	return res, nil
}

// toHost points a device tensor's Data at its allocation's bytes; d.mu
// must be held.
func (d *FakeDevice) toHost(t *moe.Tensor) error {
	if t.Dev == 0 {
		return nil
	}
	if t.Data != nil {
		return fmt.Errorf("fake device: tensor at %#x also has %d host bytes", t.Dev, len(t.Data))
	}
	var err error
	t.Data, err = d.bytesAt(t.Dev, t.Numel()*t.DType.Size())
	t.Dev = 0
	return err
}
