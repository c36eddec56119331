package client

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/shm"
)

// Shared memory: a caller on the daemon's host can keep tensors and
// outputs in a POSIX shared-memory object both processes map, so their
// bytes never travel in gRPC messages (the daemon must run with
// -shared-memory):
//
//	shm, err := client.CreateSharedMemory("", 64<<20) // /dev/shm/expertd-...
//	defer shm.Close()
//	region, err := c.RegisterSharedMemory(ctx, "acts", shm, 0, shm.Size())
//	hidden, err := region.Put(0, client.BFloat16FromFloat32(h, M, K))
//	res, err := c.FusedMoE(ctx, &client.FusedMoERequest{
//		ExpertSet: "layer0", Hidden: hidden, ...,
//		OutputShm: region.Ref(outOff, int64(M*K*2)),
//	})
//	out, err := res.Output.Float32s() // read straight from the region
//
// A caller whose tensors are already in GPU memory (a PyTorch process on
// the daemon's GPU) registers the allocation through CUDA IPC instead, with
// RegisterCUDASharedMemory: hidden states, router logits and the output
// then stay in its device memory, never copied through either host (the
// daemon must run the cuda backend).
//
// Regions belong to the client's connection: the server forgets them when
// it closes. Client.FusedMoE registers them again, once, if the connection
// was re-established meanwhile.

// SharedMemoryRef points at bytes in a region registered on the client's
// connection.
type SharedMemoryRef struct {
	// Region is the registered name.
	Region string
	// Offset and Size are the bytes' place within the region.
	Offset, Size int64
}

func (r *SharedMemoryRef) proto() *pb.SharedMemoryRef {
	if r == nil {
		return nil
	}
	return &pb.SharedMemoryRef{RegionName: r.Region, Offset: r.Offset, ByteSize: r.Size}
}

func refFromProto(p *pb.SharedMemoryRef) *SharedMemoryRef {
	return &SharedMemoryRef{Region: p.GetRegionName(), Offset: p.GetOffset(), Size: p.GetByteSize()}
}

// SharedMemory is a POSIX shared-memory object this process created and
// maps read-write, for an expertd on the same host to map too. Create it
// with CreateSharedMemory and release it with Close.
type SharedMemory struct {
	key string
	m   *shm.Mapping
	mem []byte

	mu               sync.Mutex
	closed, unlinked bool
}

// CreateSharedMemory creates the object /dev/shm/<key> of size bytes (as
// shm_open with O_CREAT|O_EXCL and mode 0600, then ftruncate) and maps it.
// An empty key picks a fresh random one. Only this user may open the
// object, so the daemon must run as the same user (or chmod it).
func CreateSharedMemory(key string, size int64) (*SharedMemory, error) {
	if key == "" {
		var b [8]byte
		rand.Read(b[:]) //nolint:errcheck // never fails
		key = fmt.Sprintf("expertd-%d-%s", os.Getpid(), hex.EncodeToString(b[:]))
	}
	key = strings.TrimPrefix(key, "/")
	if key == "" || strings.ContainsAny(key, "/\x00") || strings.Contains(key, "..") {
		return nil, fmt.Errorf("expertd shared memory: key %q: want one file name under /dev/shm", key)
	}
	if size < 1 {
		return nil, fmt.Errorf("expertd shared memory: size %d: want >= 1", size)
	}
	m, err := shm.Create(key, size)
	if err != nil {
		return nil, fmt.Errorf("expertd shared memory: %w", err)
	}
	return &SharedMemory{key: key, m: m, mem: m.Bytes()}, nil
}

// Key is the object's name under /dev/shm, what RegisterSharedMemory sends.
func (m *SharedMemory) Key() string { return m.key }

// Size is the object's size in bytes.
func (m *SharedMemory) Size() int64 { return int64(len(m.mem)) }

// Bytes is the mapping; nil after Close.
func (m *SharedMemory) Bytes() []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	return m.mem
}

// Unlink removes the object's name, as shm_unlink does: processes that
// have mapped it (this one, a daemon that registered it) keep the memory,
// no one else can open it, and it is freed when the last mapping goes. Call
// it once the regions over it are registered, so a crash leaves nothing
// behind in /dev/shm.
func (m *SharedMemory) Unlink() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.unlinked {
		return nil
	}
	m.unlinked = true
	return os.Remove(shm.Path(m.key))
}

// Close unmaps the object and unlinks it if Unlink was not called. Regions
// over it should be unregistered first (or their connection closed): the
// daemon keeps its own mapping until then.
func (m *SharedMemory) Close() error {
	var errs []error
	if err := m.Unlink(); err != nil && !os.IsNotExist(err) {
		errs = append(errs, err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.closed {
		m.closed = true
		if err := m.m.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("expertd shared memory %s: %v", m.key, errs)
	}
	return nil
}

// RegionKind is the memory a region is in. The values mirror
// expertd.v1.SharedMemoryKind.
type RegionKind int

const (
	// POSIXRegion is host memory: a SharedMemory (RegisterSharedMemory).
	POSIXRegion RegionKind = 1
	// CUDAIPCRegion is device memory shared through CUDA IPC
	// (RegisterCUDASharedMemory).
	CUDAIPCRegion RegionKind = 2
)

func (k RegionKind) String() string {
	if k == POSIXRegion || k == CUDAIPCRegion {
		return shm.Kind(k).String()
	}
	return fmt.Sprintf("RegionKind(%d)", int(k))
}

// Region is a slice of a SharedMemory, or of a CUDA allocation, registered
// with the server on the client's connection.
type Region struct {
	// Name is the registered name.
	Name string
	// shm is a POSIX region's object; handle a CUDA IPC region's
	// cudaIpcMemHandle_t. Exactly one is set.
	shm    *SharedMemory
	handle []byte
	// offset and size place the region within shm or the allocation.
	offset, size int64
}

// Kind is the memory the region is in.
func (r *Region) Kind() RegionKind {
	if r.shm == nil {
		return CUDAIPCRegion
	}
	return POSIXRegion
}

// Bytes is the region's bytes in this process; nil for a CUDA IPC region,
// whose bytes are on the device.
func (r *Region) Bytes() []byte {
	if r.shm == nil {
		return nil
	}
	b := r.shm.Bytes()
	if b == nil {
		return nil
	}
	return b[r.offset : r.offset+r.size : r.offset+r.size]
}

// Size is the region's length in bytes.
func (r *Region) Size() int64 { return r.size }

// Ref is the reference to size bytes at offset within the region, for
// FusedMoERequest.OutputShm.
func (r *Region) Ref(offset, size int64) *SharedMemoryRef {
	return &SharedMemoryRef{Region: r.Name, Offset: offset, Size: size}
}

// Tensor is a tensor of the given dtype and shape whose bytes are at offset
// in the region: sent as a reference, with Data viewing the region here
// (nil in a CUDA IPC region).
func (r *Region) Tensor(dtype moe.DType, offset int64, shape ...int) (Tensor, error) {
	t := Tensor{DType: dtype, Shape: shape}
	n := int64(t.Numel() * dtype.Size())
	if offset < 0 || n < 0 || offset > r.size || n > r.size-offset {
		return Tensor{}, fmt.Errorf("expertd region %s: %d bytes at offset %d do not fit in its %d bytes", r.Name, n, offset, r.size)
	}
	if r.shm == nil {
		t.Shm = r.Ref(offset, n)
		return t, t.Validate()
	}
	b := r.Bytes()
	if b == nil {
		return Tensor{}, fmt.Errorf("expertd region %s: its shared memory is closed", r.Name)
	}
	t.Shm = r.Ref(offset, n)
	t.Data = b[offset : offset+n : offset+n]
	return t, t.Validate()
}

// Put copies t's bytes into the region at offset and returns the tensor
// referencing them there. A CUDA IPC region's bytes are written on the
// device, by the process that owns them; Put refuses it.
func (r *Region) Put(offset int64, t Tensor) (Tensor, error) {
	if err := t.Validate(); err != nil {
		return Tensor{}, err
	}
	if r.shm == nil {
		return Tensor{}, fmt.Errorf("expertd region %s is CUDA device memory: write it on the device and reference it with Region.Tensor", r.Name)
	}
	dst, err := r.Tensor(t.DType, offset, t.Shape...)
	if err != nil {
		return Tensor{}, err
	}
	copy(dst.Data, t.Data)
	return dst, nil
}

// regions are the client's registrations, kept to give results a local
// view of shm outputs and to register again on a new connection.
type regions struct {
	mu     sync.Mutex
	byName map[string]*Region
}

func (rs *regions) get(name string) *Region {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return rs.byName[name]
}

func (rs *regions) all() []*Region {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	out := make([]*Region, 0, len(rs.byName))
	for _, r := range rs.byName {
		out = append(out, r)
	}
	return out
}

// RegisterSharedMemory registers size bytes at offset of shm with the
// server under name, for this client's calls. It is not retried.
func (c *Client) RegisterSharedMemory(ctx context.Context, name string, shm *SharedMemory, offset, size int64) (*Region, error) {
	if offset < 0 || size < 1 || offset > shm.Size() || size > shm.Size()-offset {
		return nil, invalid("RegisterSharedMemory", fmt.Errorf("%d bytes at offset %d do not fit in %s's %d bytes", size, offset, shm.Key(), shm.Size()))
	}
	return c.add(ctx, &Region{Name: name, shm: shm, offset: offset, size: size})
}

// CUDAIPCHandleSize is the length of a cudaIpcMemHandle_t.
const CUDAIPCHandleSize = 64

// RegisterCUDASharedMemory registers size bytes at offset of the device
// allocation handle names (a cudaIpcMemHandle_t from cudaIpcGetMemHandle)
// with the server under name, for this client's calls. The daemon, on
// this host and running the cuda backend, opens it on its GPU, and reads
// hidden states and router logits from it and writes outputs into it
// there: Region.Tensor and Region.Ref reference it as for a POSIX region,
// but the bytes never come to this process (Region.Bytes and result
// Output.Data are nil). Other tensors (scales, top-k ids and weights)
// must be sent inline or from a POSIX region. Finish writing the inputs
// (synchronize the stream that wrote them) before each call; keep the
// allocation alive while it is registered. It is not retried.
//
// From PyTorch, a tensor's storage gives the handle and where the storage
// starts within its allocation (the caching allocator carves storages
// out of larger allocations). The handle comes after a version byte and a
// type byte, b"c" for a cudaMalloc block; an expandable segment's (b"e",
// with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) cannot be
// registered:
//
//	_, h, size, storage_off, *_ = t.untyped_storage()._share_cuda_()
//	handle = h[-64:]  # len(h) == 66 and h[1:2] == b"c" in torch 2.x
//	# register (handle, storage_off, size); t's bytes start at
//	# t.storage_offset() * t.element_size() within the region
//	torch.cuda.current_stream().synchronize()  # before each call
func (c *Client) RegisterCUDASharedMemory(ctx context.Context, name string, handle []byte, offset, size int64) (*Region, error) {
	if len(handle) != CUDAIPCHandleSize {
		return nil, invalid("RegisterCUDASharedMemory", fmt.Errorf("handle is %d bytes, want the %d of a cudaIpcMemHandle_t (from PyTorch's _share_cuda_(), its last 64 bytes)", len(handle), CUDAIPCHandleSize))
	}
	if offset < 0 || size < 1 {
		return nil, invalid("RegisterCUDASharedMemory", fmt.Errorf("%d bytes at offset %d: want offset >= 0 and size >= 1", size, offset))
	}
	// Copied: it is sent again if the connection is re-established.
	return c.add(ctx, &Region{Name: name, handle: bytes.Clone(handle), offset: offset, size: size})
}

// add registers r and remembers it.
func (c *Client) add(ctx context.Context, r *Region) (*Region, error) {
	if err := c.register(ctx, r); err != nil {
		return nil, err
	}
	c.shm.mu.Lock()
	if c.shm.byName == nil {
		c.shm.byName = map[string]*Region{}
	}
	c.shm.byName[r.Name] = r
	c.shm.mu.Unlock()
	return r, nil
}

func (c *Client) register(ctx context.Context, r *Region) error {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	req := &pb.RegisterSharedMemoryRequest{Name: r.Name, Offset: r.offset, ByteSize: r.size}
	method := "RegisterSharedMemory"
	if r.shm == nil {
		req.Kind, req.CudaIpcHandle = pb.SharedMemoryKind_SHARED_MEMORY_KIND_CUDA_IPC, r.handle
		method = "RegisterCUDASharedMemory"
	} else {
		req.Kind, req.Key = pb.SharedMemoryKind_SHARED_MEMORY_KIND_POSIX, r.shm.Key()
	}
	if _, err := c.rpc.RegisterSharedMemory(ctx, req); err != nil {
		return wrap(method, err)
	}
	return nil
}

// UnregisterSharedMemory unregisters the named region, or all of the
// client's regions when name is "", and returns the names unregistered.
func (c *Client) UnregisterSharedMemory(ctx context.Context, name string) ([]string, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	resp, err := c.rpc.UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{Name: name})
	c.shm.mu.Lock()
	if name == "" {
		c.shm.byName = nil
	} else {
		delete(c.shm.byName, name)
	}
	c.shm.mu.Unlock()
	if err != nil {
		return nil, wrap("UnregisterSharedMemory", err)
	}
	return resp.GetNames(), nil
}

// RegionInfo is a region as the server holds it.
type RegionInfo struct {
	Name string
	Kind RegionKind
	// Key is a POSIX region's object name; empty for CUDA IPC.
	Key           string
	Offset, Size  int64
	CallsInFlight int
	RegisteredAt  time.Time
}

// ListSharedMemory reports the client's regions as the server has them,
// sorted by name.
func (c *Client) ListSharedMemory(ctx context.Context) ([]RegionInfo, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	resp, err := c.rpc.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{})
	if err != nil {
		return nil, wrap("ListSharedMemory", err)
	}
	out := make([]RegionInfo, 0, len(resp.GetRegions()))
	for _, r := range resp.GetRegions() {
		out = append(out, RegionInfo{Name: r.GetName(), Kind: RegionKind(r.GetKind()), Key: r.GetKey(), Offset: r.GetOffset(), Size: r.GetByteSize(),
			CallsInFlight: int(r.GetCallsInFlight()), RegisteredAt: r.GetRegisteredAt().AsTime()})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// reregister registers the client's regions again when err says the server
// does not know one of them, which happens after the connection was
// re-established; it reports whether the call is worth repeating.
func (c *Client) reregister(ctx context.Context, err error) bool {
	if status.Code(err) != codes.NotFound || !strings.Contains(status.Convert(err).Message(), "no shared-memory region") {
		return false
	}
	all := c.shm.all()
	ours := false
	for _, r := range all {
		ours = ours || strings.Contains(status.Convert(err).Message(), fmt.Sprintf("region %q", r.Name))
	}
	if !ours {
		return false
	}
	for _, r := range all {
		if err := c.register(ctx, r); err != nil && status.Code(err) != codes.AlreadyExists {
			return false
		}
	}
	return true
}

// viewOutputs points res's shm tensors at this process's view of their
// region, when the client registered it.
func (c *Client) viewOutputs(res *FusedMoEResult) {
	for _, t := range []*Tensor{&res.Output, &res.TopKIDs, &res.TopKWeights} {
		if t.Shm == nil {
			continue
		}
		r := c.shm.get(t.Shm.Region)
		if r == nil {
			continue
		}
		lo, n := t.Shm.Offset, t.Shm.Size
		if b := r.Bytes(); b != nil && lo >= 0 && n >= 0 && lo <= r.size && n <= r.size-lo {
			t.Data = b[lo : lo+n : lo+n]
		}
	}
}
