package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"runtime/debug"
	"sort"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// Shared memory for callers on the server's host, after Triton's system
// and CUDA shared-memory APIs: a caller creates a POSIX object (or a CUDA
// allocation), registers a slice of it under a name, and then points
// tensors (SharedMemoryRef) and the output (FusedMoERequest.output_shm)
// into it, so those bytes never travel in messages.
//
// Regions belong to the connection that registered them, tracked by the
// stats.Handler StatsHandler returns: a name means nothing on another
// connection, and a connection's regions are unmapped when it closes, so a
// caller that dies cannot leave mappings behind. A region is
// reference-counted like an expert set: unregistering (or the connection
// closing) forgets the name at once, and the mapping goes when the last call
// using it ends.
//
// A POSIX region is a mapping of the caller's object, which the backend
// page-locks when it can (HostPinner), so a GPU's copies from and to it
// are DMA; its tensors reach the backend as moe.Pinned memory. A CUDA IPC region is device memory the backend opened from the
// caller's cudaIpcMemHandle_t (IPCOpener): tensors there reach the backend
// as device addresses (moe.Device tensors, moe.Request.OutDev) and
// are never copied through the host. Only hidden_states, router_logits and
// the output may live there; every other tensor is read on the host
// (decoded scales, routing ids), so it must be in host memory.

// IPCOpener is a backend that opens device memory another process shared
// through CUDA IPC; the cuda backend implements it. A backend without it
// cannot serve SHARED_MEMORY_KIND_CUDA_IPC.
type IPCOpener interface {
	// OpenIPC opens the allocation handle (a 64-byte cudaIpcMemHandle_t)
	// names and returns [offset, offset+size) of it. Errors wrap
	// kernels.ErrUnsupported when the backend cannot open IPC memory at
	// all, and otherwise describe a bad handle or bounds.
	OpenIPC(handle []byte, offset, size int64) (kernels.DeviceRegion, error)
}

// HostPinner is a backend that page-locks host memory (cudaHostRegister),
// so its copies from and to it are DMA instead of going through a staging
// buffer; the cuda backend implements it. POSIX regions are pinned while
// registered.
type HostPinner interface {
	// PinHost page-locks b until unpin is called.
	PinHost(b []byte) (unpin func() error, err error)
}

// cudaIPCHandleSize is sizeof(cudaIpcMemHandle_t).
const cudaIPCHandleSize = 64

// maxRegionsPerConn bounds one connection's regions: each holds a file
// descriptor and a mapping, or a mapping of device memory.
const maxRegionsPerConn = 64

// Defaults of Config.MaxShmRegions and MaxShmBytes. A region holds a
// mapping, no file descriptor; 4096 mappings are far inside vm.max_map_count
// (65530), and 64 GiB is more than one host's callers share in practice
// (a 64-client bench uses 4 GiB) while bounding what the CUDA backend
// page-locks.
const (
	DefaultMaxShmRegions       = 4096
	DefaultMaxShmBytes   int64 = 64 << 30
)

// maxShmKey is NAME_MAX, the longest file name /dev/shm takes.
const maxShmKey = 255

// errShmDisabled answers the shared-memory RPCs on a server without
// Config.SharedMemory.
var errShmDisabled = codedf(codes.FailedPrecondition, "", "shared memory is disabled on this server; start expertd with -shared-memory, or send tensors inline")

// region is one registered slice of a shared-memory object or of a CUDA
// IPC allocation.
type region struct {
	name, key    string
	kind         pb.SharedMemoryKind
	offset, size int64
	registered   time.Time
	// m is a POSIX region's mapping (m.data() is its size bytes), nil for
	// CUDA IPC; unpin, when set, unlocks its pages.
	m     *mapping
	unpin func() error
	// dev is a CUDA IPC region's device memory, nil for POSIX.
	dev kernels.DeviceRegion
	// conn is the owning connection's id (for logs).
	conn uint64
	// refs counts calls using the region; gone is set once it is
	// unregistered. Both are guarded by shmTable.mu; the mapping is
	// released when gone && refs == 0.
	refs int
	gone bool
}

func (r *region) info() *pb.SharedMemoryRegion {
	return &pb.SharedMemoryRegion{
		Name: r.name, Kind: r.kind, Key: r.key,
		Offset: r.offset, ByteSize: r.size, CallsInFlight: int32(r.refs),
		RegisteredAt: timestamppb.New(r.registered),
	}
}

// shmTable holds every connection's regions. It is also the stats.Handler
// that learns when connections come and go.
type shmTable struct {
	log *slog.Logger
	// backend opens CUDA IPC memory (IPCOpener) and page-locks POSIX
	// regions (HostPinner) when it can.
	backend kernels.Backend
	enabled bool
	// pinWarn logs the first failure to pin a POSIX region; later ones
	// would only repeat it.
	pinWarn sync.Once

	mu     sync.Mutex
	nextID uint64
	// conns has an entry for every live connection (from TagConn to
	// ConnEnd), so a registration racing its connection's end cannot leave
	// a region nobody will clean up.
	conns  map[uint64]map[string]*region
	closed bool
	// mapped counts the regions mapped (registered, or unregistered but
	// still used by a call) and their bytes, for the gauges and the
	// daemon-wide caps maxRegions and maxBytes.
	mapped, mappedBytes  int64
	maxRegions, maxBytes int64
}

func newShmTable(cfg Config, backend kernels.Backend, log *slog.Logger) *shmTable {
	t := &shmTable{log: log, backend: backend, enabled: cfg.SharedMemory, conns: map[uint64]map[string]*region{},
		maxRegions: int64(cfg.MaxShmRegions), maxBytes: cfg.MaxShmBytes}
	if t.maxRegions <= 0 {
		t.maxRegions = DefaultMaxShmRegions
	}
	if t.maxBytes <= 0 {
		t.maxBytes = DefaultMaxShmBytes
	}
	return t
}

// limitRegions and limitBytes are the caps GetServerInfo reports: 0 with
// shared memory off.
func (t *shmTable) limitRegions() int64 {
	if !t.enabled {
		return 0
	}
	return t.maxRegions
}

func (t *shmTable) limitBytes() int64 {
	if !t.enabled {
		return 0
	}
	return t.maxBytes
}

// checkCapsLocked refuses a region of size bytes that would take the
// server past its daemon-wide caps; t.mu must be held.
func (t *shmTable) checkCapsLocked(size int64) error {
	if t.mapped >= t.maxRegions {
		return exhaustedf("name", "the server has %d shared-memory regions mapped, the most it may (expertd -max-shm-regions); unregister regions or retry later", t.mapped)
	}
	if size > t.maxBytes-t.mappedBytes {
		return exhaustedf("byte_size", "%d bytes would take the server's shared-memory regions past %d bytes (%d mapped; expertd -max-shm-bytes); unregister regions or register less",
			size, t.maxBytes, t.mappedBytes)
	}
	return nil
}

// connKey carries a connection's id in contexts derived from TagConn's.
type connKey struct{}

// TagConn gives each connection an id its RPCs' contexts carry.
func (t *shmTable) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	if !t.enabled {
		return ctx
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.nextID++
	id := t.nextID
	if !t.closed {
		t.conns[id] = map[string]*region{}
	}
	return context.WithValue(ctx, connKey{}, id)
}

// HandleConn unregisters a connection's regions when it ends.
func (t *shmTable) HandleConn(ctx context.Context, s stats.ConnStats) {
	if _, ok := s.(*stats.ConnEnd); !ok {
		return
	}
	id, ok := ctx.Value(connKey{}).(uint64)
	if !ok {
		return
	}
	t.mu.Lock()
	regs := t.conns[id]
	delete(t.conns, id)
	names, free := t.dropLocked(regs)
	t.mu.Unlock()
	t.free(free)
	if len(names) > 0 {
		t.log.Info("shared memory unregistered: connection closed", slog.Uint64("conn", id), slog.Any("regions", names))
	}
}

// TagRPC and HandleRPC are not needed: a call finds its connection through
// TagConn's context.
func (t *shmTable) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }

// HandleRPC does nothing.
func (t *shmTable) HandleRPC(context.Context, stats.RPCStats) {}

// dropLocked marks regs gone and returns their names, sorted, and those
// no call uses, for free once t.mu is released.
func (t *shmTable) dropLocked(regs map[string]*region) (names []string, free []*region) {
	names = make([]string, 0, len(regs))
	for name, r := range regs {
		r.gone = true
		if r.refs == 0 {
			free = append(free, t.forgetLocked(r))
		}
		names = append(names, name)
	}
	sort.Strings(names)
	return names, free
}

// forgetLocked takes r out of the gauges; free releases its memory.
func (t *shmTable) forgetLocked(r *region) *region {
	t.mapped--
	t.mappedBytes -= r.size
	return r
}

// free unmaps POSIX regions (unpinning them first: their pages must still
// be mapped) and closes CUDA IPC ones. It runs without t.mu, since
// munmap, cudaHostUnregister and cudaIpcCloseMemHandle can take a while
// and every call that uses shared memory takes t.mu.
func (t *shmTable) free(rs []*region) {
	for _, r := range rs {
		var err error
		if r.dev != nil {
			err = r.dev.Close()
		} else {
			if r.unpin != nil {
				err = r.unpin()
			}
			err = errors.Join(err, r.m.close())
		}
		if err != nil {
			t.log.Error("releasing shared memory", slog.String("region", r.name), slog.String("kind", r.kind.String()),
				slog.String("key", r.key), slog.Uint64("conn", r.conn), slog.Any("err", err))
		}
	}
}

// closeAll unregisters every region and refuses new ones (Shutdown).
func (t *shmTable) closeAll() {
	t.mu.Lock()
	t.closed = true
	var free []*region
	for id, regs := range t.conns {
		_, f := t.dropLocked(regs)
		free = append(free, f...)
		delete(t.conns, id)
	}
	t.mu.Unlock()
	t.free(free)
}

// connRegions returns the calling connection's regions; t.mu must be held.
func (t *shmTable) connRegions(ctx context.Context) (uint64, map[string]*region, error) {
	id, ok := ctx.Value(connKey{}).(uint64)
	if !ok {
		// Config.SharedMemory without StatsHandler installed: our bug.
		return 0, nil, errors.New("shared memory: the call's connection is unknown (service.Server.StatsHandler is not installed on the grpc.Server)")
	}
	if t.closed {
		return 0, nil, errDraining
	}
	regs, ok := t.conns[id]
	if !ok {
		return 0, nil, codedf(codes.Canceled, "", "the connection has closed")
	}
	return id, regs, nil
}

// initShmMetrics observes the mapped regions, so a leak (mappings that
// outlive their connections) shows on a dashboard.
func (t *shmTable) initMetrics(m metric.Meter) {
	observe := func(get func() int64) metric.Int64Callback {
		return func(_ context.Context, o metric.Int64Observer) error {
			t.mu.Lock()
			v := get()
			t.mu.Unlock()
			o.Observe(v)
			return nil
		}
	}
	if _, err := m.Int64ObservableGauge("expertd.shared_memory.regions",
		metric.WithDescription("Shared-memory regions mapped: registered, or unregistered but still used by a call."),
		metric.WithUnit("{region}"),
		metric.WithInt64Callback(observe(func() int64 { return t.mapped }))); err != nil {
		t.log.Warn("metric not recorded", slog.String("metric", "expertd.shared_memory.regions"), slog.Any("err", err))
	}
	if _, err := m.Int64ObservableGauge("expertd.shared_memory.mapped_bytes",
		metric.WithDescription("Bytes of the shared-memory regions mapped."),
		metric.WithUnit("By"),
		metric.WithInt64Callback(observe(func() int64 { return t.mappedBytes }))); err != nil {
		t.log.Warn("metric not recorded", slog.String("metric", "expertd.shared_memory.mapped_bytes"), slog.Any("err", err))
	}
}

// RegisterSharedMemory maps a region of a POSIX shared-memory object, or
// opens one of a CUDA IPC allocation, for the calling connection.
func (s *Server) RegisterSharedMemory(ctx context.Context, req *pb.RegisterSharedMemoryRequest) (*pb.RegisterSharedMemoryResponse, error) {
	resp, err := s.shm.register(ctx, req, s.begin)
	return resp, s.toStatus(ctx, "RegisterSharedMemory", err)
}

// register maps or opens the region req describes; begin is the server's
// admission (refused while it drains), taken once the request is known to
// be for this component.
func (t *shmTable) register(ctx context.Context, req *pb.RegisterSharedMemoryRequest, begin func() (func(), error)) (*pb.RegisterSharedMemoryResponse, error) {
	if !t.enabled {
		return nil, errShmDisabled
	}
	done, err := begin()
	if err != nil {
		return nil, err
	}
	defer done()
	if p, ok := peer.FromContext(ctx); ok {
		// Unix sockets and in-process listeners are local by nature; only
		// TCP can come from another host, which could not share memory
		// anyway and should not get to make this process open files.
		if a, ok := p.Addr.(*net.TCPAddr); ok && !a.IP.IsLoopback() {
			return nil, codedf(codes.PermissionDenied, "", "shared memory is for callers on the server's host; %v is not loopback", a.IP)
		}
	}
	if err := checkName("name", req.GetName()); err != nil {
		return nil, err
	}
	kind := req.GetKind()
	var key string
	switch kind {
	case pb.SharedMemoryKind_SHARED_MEMORY_KIND_UNSPECIFIED, pb.SharedMemoryKind_SHARED_MEMORY_KIND_POSIX:
		kind = pb.SharedMemoryKind_SHARED_MEMORY_KIND_POSIX
		if n := len(req.GetCudaIpcHandle()); n != 0 {
			return nil, invalidf("cuda_ipc_handle", "%d bytes: must be empty for SHARED_MEMORY_KIND_POSIX", n)
		}
		if key, err = checkShmKey(req.GetKey()); err != nil {
			return nil, err
		}
	case pb.SharedMemoryKind_SHARED_MEMORY_KIND_CUDA_IPC:
		if _, ok := t.backend.(IPCOpener); !ok {
			return nil, codedf(codes.FailedPrecondition, "kind", "the %s backend cannot open CUDA IPC memory; run expertd with -backend cuda", t.backend.Name())
		}
		if req.GetKey() != "" {
			return nil, invalidf("key", "%s: must be empty for SHARED_MEMORY_KIND_CUDA_IPC (cuda_ipc_handle names the memory)", Quote(req.GetKey()))
		}
		if h := req.GetCudaIpcHandle(); len(h) != cudaIPCHandleSize {
			hint := ""
			if len(h) == cudaIPCHandleSize+2 && h[1] == 'c' {
				hint = "; PyTorch's _share_cuda_() puts a version and a type byte before it: send the last 64"
			}
			return nil, invalidf("cuda_ipc_handle", "%d bytes: want the %d bytes of a cudaIpcMemHandle_t%s", len(h), cudaIPCHandleSize, hint)
		}
	default:
		return nil, invalidf("kind", "%v: want SHARED_MEMORY_KIND_POSIX or SHARED_MEMORY_KIND_CUDA_IPC", req.GetKind())
	}
	off, size := req.GetOffset(), req.GetByteSize()
	if off < 0 {
		return nil, invalidf("offset", "%d: want >= 0", off)
	}
	if size < 1 {
		return nil, invalidf("byte_size", "%d: want >= 1", size)
	}
	if size > maxElements-off {
		return nil, invalidf("byte_size", "offset %d + byte_size %d: want at most 2^40 bytes", off, size)
	}
	// Check the name before the memory: a refused registration should
	// cost no open or mapping. It is checked again on insertion.
	t.mu.Lock()
	_, regs, err := t.connRegions(ctx)
	if err == nil {
		err = checkFree(regs, req.GetName())
	}
	if err == nil {
		err = t.checkCapsLocked(size)
	}
	t.mu.Unlock()
	if err != nil {
		return nil, err
	}

	r := &region{name: req.GetName(), kind: kind, key: key, offset: off, size: size, registered: time.Now()}
	if kind == pb.SharedMemoryKind_SHARED_MEMORY_KIND_CUDA_IPC {
		err = t.openIPC(r, req.GetCudaIpcHandle())
	} else {
		err = t.mapPOSIX(ctx, r)
	}
	if err != nil {
		return nil, err
	}
	t.mu.Lock()
	id, regs, err := t.connRegions(ctx)
	if err == nil {
		err = checkFree(regs, r.name)
	}
	if err == nil {
		err = t.checkCapsLocked(r.size) // registrations may have raced
	}
	if err != nil {
		t.mu.Unlock()
		t.free([]*region{r}) // never shared
		return nil, err
	}
	r.conn = id
	regs[r.name] = r
	t.mapped++
	t.mappedBytes += r.size
	info := r.info()
	t.mu.Unlock()
	t.log.InfoContext(ctx, "shared memory registered", slog.String("region", r.name), slog.String("kind", kind.String()), slog.String("key", key),
		slog.Int64("offset", off), slog.Int64("bytes", size), slog.Bool("pinned", r.unpin != nil), slog.Uint64("conn", id))
	return &pb.RegisterSharedMemoryResponse{Region: info}, nil
}

// mapPOSIX maps r's slice of its object and, when the backend can,
// page-locks it. Pinning only speeds up a GPU's copies, so a failure (a
// RLIMIT_MEMLOCK too low, say) is logged once and the region served
// unpinned.
func (t *shmTable) mapPOSIX(ctx context.Context, r *region) error {
	m, err := mapShm(r.key, r.offset, r.size)
	if err != nil {
		return err
	}
	r.m = m
	p, ok := t.backend.(HostPinner)
	if !ok {
		return nil
	}
	// The whole mapping, which starts on a page boundary; the region may
	// not.
	if r.unpin, err = p.PinHost(m.pages()); err != nil {
		r.unpin = nil
		t.pinWarn.Do(func() {
			t.log.WarnContext(ctx, "shared memory not page-locked: copies from and to POSIX regions go through staging buffers, and are slower (logged once)",
				slog.String("backend", t.backend.Name()), slog.String("region", r.name), slog.String("key", r.key), slog.Int64("bytes", r.size), slog.Any("err", err))
		})
	}
	return nil
}

// openIPC opens r's slice of the allocation handle names on the backend's
// GPU, whose size the backend checks r against.
func (t *shmTable) openIPC(r *region, handle []byte) error {
	dev, err := t.backend.(IPCOpener).OpenIPC(handle, r.offset, r.size)
	switch {
	case errors.Is(err, kernels.ErrUnsupported):
		return codedf(codes.FailedPrecondition, "cuda_ipc_handle", "backend %s: %v", t.backend.Name(), err)
	case errors.Is(err, kernels.ErrOutOfMemory):
		return exhaustedf("cuda_ipc_handle", "backend %s: %v", t.backend.Name(), err)
	case err != nil:
		return invalidf("cuda_ipc_handle", "backend %s cannot open it: %v", t.backend.Name(), err)
	}
	if dev.Size() != r.size || dev.Ptr() == 0 {
		dev.Close() //nolint:errcheck // failing already
		return fmt.Errorf("backend %s opened %d bytes at %#x for a region of %d", t.backend.Name(), dev.Size(), dev.Ptr(), r.size)
	}
	r.dev = dev
	return nil
}

func checkFree(regs map[string]*region, name string) error {
	if _, dup := regs[name]; dup {
		return codedf(codes.AlreadyExists, "name", "%s: this connection already has a region of that name; unregister it first", Quote(name))
	}
	if len(regs) >= maxRegionsPerConn {
		return limitf("name", "regions-per-connection", maxRegionsPerConn, 0, "this connection has %d regions, the most it may have; unregister one first", len(regs))
	}
	return nil
}

// checkShmKey returns the object name of a POSIX key ("/name" or "name"):
// one file name, so the server opens /dev/shm/<name> and nothing else.
func checkShmKey(key string) (string, error) {
	k := strings.TrimPrefix(key, "/")
	if len(k) < 1 || len(k) > maxShmKey {
		return "", invalidf("key", "%s: want 1-%d characters after an optional leading /", Quote(key), maxShmKey)
	}
	for _, c := range k {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.ContainsRune("._-", c)) {
			return "", invalidf("key", "%s: character %q is not in [A-Za-z0-9._-]; the key is one name under /dev/shm", Quote(key), c)
		}
	}
	if strings.Contains(k, "..") || k == "." {
		return "", invalidf("key", "%s: must not be \".\" or contain \"..\"", Quote(key))
	}
	return k, nil
}

// UnregisterSharedMemory forgets one of the calling connection's regions,
// or all of them when the name is empty.
func (s *Server) UnregisterSharedMemory(ctx context.Context, req *pb.UnregisterSharedMemoryRequest) (*pb.UnregisterSharedMemoryResponse, error) {
	resp, err := s.shm.unregister(ctx, req)
	return resp, s.toStatus(ctx, "UnregisterSharedMemory", err)
}

func (t *shmTable) unregister(ctx context.Context, req *pb.UnregisterSharedMemoryRequest) (*pb.UnregisterSharedMemoryResponse, error) {
	if !t.enabled {
		return nil, errShmDisabled
	}
	if err := checkLen("name", req.GetName(), maxNameBytes); err != nil {
		return nil, err
	}
	t.mu.Lock()
	id, regs, err := t.connRegions(ctx)
	if err != nil {
		t.mu.Unlock()
		return nil, err
	}
	drop := regs
	if name := req.GetName(); name != "" {
		r, ok := regs[name]
		if !ok {
			t.mu.Unlock()
			return nil, codedf(codes.NotFound, "name", "no shared-memory region %s on this connection", Quote(name))
		}
		drop = map[string]*region{name: r}
	}
	// drop may be regs itself: mark before deleting.
	names, free := t.dropLocked(drop)
	for _, name := range names {
		delete(regs, name)
	}
	t.mu.Unlock()
	t.free(free)
	t.log.InfoContext(ctx, "shared memory unregistered", slog.Any("regions", names), slog.Uint64("conn", id))
	return &pb.UnregisterSharedMemoryResponse{Names: names}, nil
}

// ListSharedMemory reports the calling connection's regions.
func (s *Server) ListSharedMemory(ctx context.Context, req *pb.ListSharedMemoryRequest) (*pb.ListSharedMemoryResponse, error) {
	resp, err := s.shm.list(ctx, req)
	return resp, s.toStatus(ctx, "ListSharedMemory", err)
}

func (t *shmTable) list(ctx context.Context, req *pb.ListSharedMemoryRequest) (*pb.ListSharedMemoryResponse, error) {
	if !t.enabled {
		return nil, errShmDisabled
	}
	if err := checkLen("name", req.GetName(), maxNameBytes); err != nil {
		return nil, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	_, regs, err := t.connRegions(ctx)
	if err != nil {
		return nil, err
	}
	resp := &pb.ListSharedMemoryResponse{}
	if name := req.GetName(); name != "" {
		r, ok := regs[name]
		if !ok {
			return nil, codedf(codes.NotFound, "name", "no shared-memory region %s on this connection", Quote(name))
		}
		resp.Regions = append(resp.Regions, r.info())
		return resp, nil
	}
	for _, r := range regs {
		resp.Regions = append(resp.Regions, r.info())
	}
	sort.Slice(resp.Regions, func(i, j int) bool { return resp.Regions[i].GetName() < resp.Regions[j].GetName() })
	return resp, nil
}

// shmCall is what one FusedMoE call holds in shared memory: the regions it
// references (each acquired once), where each of its shared-memory tensors
// is, and where its output goes. A nil *shmCall holds nothing.
type shmCall struct {
	t    *shmTable
	used []*region
	// mem are the request's shared-memory tensors by field, resolved:
	// host bytes of a POSIX region, or a CUDA IPC region's device address.
	mem map[string]moe.Tensor
	// out is a POSIX output_shm's bytes, or outDev a CUDA IPC one's
	// address; outRef is the reference the response returns. All are
	// unset without output_shm.
	out    []byte
	outDev uintptr
	outRef *pb.SharedMemoryRef
}

// memory is where field's shared-memory tensor is (Memory and Data or
// Dev); ok is false when nothing resolved it (shared memory disabled).
func (c *shmCall) memory(field string) (moe.Tensor, bool) {
	if c == nil {
		return moe.Tensor{}, false
	}
	t, ok := c.mem[field]
	return t, ok
}

// outDevice is a CUDA IPC output_shm's device address, 0 for none.
func (c *shmCall) outDevice() uintptr {
	if c == nil {
		return 0
	}
	return c.outDev
}

// deviceFields are the only request fields a CUDA IPC region may hold,
// with output_shm: the backend reads the others on the host (scales are
// decoded, routing ids checked), so they could not stay on the device.
var deviceFields = map[string]bool{"hidden_states": true, "router_logits": true}

// shmTensor is one request tensor that may live in shared memory.
type shmTensor struct {
	field string
	t     *pb.Tensor
}

func requestTensors(req *pb.FusedMoERequest) []shmTensor {
	ts := []shmTensor{
		{"hidden_states", req.GetHiddenStates()},
		{"hidden_states_scale", req.GetHiddenStatesScale()},
		{"router_logits", req.GetRouterLogits()},
		{"topk_ids", req.GetTopkIds()},
		{"topk_weights", req.GetTopkWeights()},
		{"routing.correction_bias", req.GetRouting().GetCorrectionBias()},
	}
	if w := req.GetWeights(); w != nil {
		for i, t := range weightTensors(w) {
			ts = append(ts, shmTensor{"weights." + tensorNames[i], t})
		}
	}
	return ts
}

// allDTypes lets checkMeta size a tensor of any known dtype; whether the
// dtype suits the field is validate.go's business.
var allDTypes = []moe.DType{moe.Float32, moe.BFloat16, moe.Float16, moe.Float8E4M3FN, moe.Float8E5M2, moe.Int32}

// resolve finds where the request's shared-memory tensors are: views
// of the caller's POSIX regions (so validation and the backend read them
// with no copy) or device addresses in its CUDA IPC regions, and where
// output_shm is. The request is left as it came; fromProto reads the
// answers (shmCall.memory). It runs before validation and holds every
// region it touches until release, so none is unmapped under the call.
// References are checked here (region known, offset and byte_size within
// it and equal to the tensor's size, device memory only where allowed);
// all else is left to validation, which refuses shm tensors when this is
// disabled.
func (t *shmTable) resolve(ctx context.Context, req *pb.FusedMoERequest) (*shmCall, error) {
	if !t.enabled {
		if req.GetOutputShm() != nil {
			return nil, invalidf("output_shm", "shared memory is not enabled on this server (expertd -shared-memory); leave output_shm unset")
		}
		return nil, nil // validation refuses the shm tensors
	}
	ts := requestTensors(req)
	uses := req.GetOutputShm() != nil
	for _, x := range ts {
		uses = uses || x.t.GetShm() != nil
	}
	if !uses {
		return nil, nil
	}
	c := &shmCall{t: t}
	views, out, err := c.acquire(ctx, req, ts)
	if err == nil {
		err = c.checkMappings()
	}
	if err != nil {
		c.release()
		return nil, err
	}
	c.place(req, views, out)
	return c, nil
}

// shmView is a request tensor's reference into an acquired region.
type shmView struct {
	x   shmTensor
	r   *region
	ref *pb.SharedMemoryRef
}

// acquire checks the references of ts and output_shm against the
// connection's regions and takes a reference on each region used (c.used,
// which release gives back, on failure too). out is output_shm's region,
// nil without one.
func (c *shmCall) acquire(ctx context.Context, req *pb.FusedMoERequest, ts []shmTensor) (views []shmView, out *region, err error) {
	t := c.t
	t.mu.Lock()
	defer t.mu.Unlock()
	_, regs, err := t.connRegions(ctx)
	if err != nil {
		return nil, nil, err
	}
	take := func(field string, ref *pb.SharedMemoryRef) (*region, error) {
		if err := checkLen(field+".region_name", ref.GetRegionName(), maxNameBytes); err != nil {
			return nil, err
		}
		r, ok := regs[ref.GetRegionName()]
		if !ok {
			return nil, codedf(codes.NotFound, field+".region_name", "no shared-memory region %s on this connection; register it first", Quote(ref.GetRegionName()))
		}
		if off := ref.GetOffset(); off < 0 || off > r.size {
			return nil, invalidf(field+".offset", "%d: want in [0, %d] (region %s has %d bytes)", off, r.size, Quote(r.name), r.size)
		}
		if n := ref.GetByteSize(); n < 0 || n > r.size-ref.GetOffset() {
			return nil, invalidf(field+".byte_size", "%d at offset %d runs past the end of region %s (%d bytes)", n, ref.GetOffset(), Quote(r.name), r.size)
		}
		if !slicesContain(c.used, r) {
			r.refs++
			c.used = append(c.used, r)
		}
		return r, nil
	}
	for _, x := range ts {
		ref := x.t.GetShm()
		if ref == nil {
			continue
		}
		field := x.field + ".shm"
		r, err := take(field, ref)
		if err == nil && r.dev != nil && !deviceFields[x.field] {
			err = invalidf(field, "region %s is CUDA IPC device memory; only hidden_states, router_logits and output_shm may live there", Quote(r.name))
		}
		if err == nil {
			// Only a well-formed declaration has a size to compare; a bad
			// dtype or shape is reported by validation.
			if m, merr := checkMeta(x.field, x.t, allDTypes...); merr == nil && m.bytes != ref.GetByteSize() {
				err = invalidf(field+".byte_size", "%d: shape %v of %v needs %d bytes", ref.GetByteSize(), x.t.GetShape(), x.t.GetDtype(), m.bytes)
			}
		}
		if err != nil {
			return nil, nil, err
		}
		views = append(views, shmView{x, r, ref})
	}
	if ref := req.GetOutputShm(); ref != nil {
		if out, err = take("output_shm", ref); err == nil {
			err = checkOutputShm(req, ref, func(r *region, lo, hi int64) (string, bool) {
				for _, v := range views {
					if v.r == r && lo < v.ref.GetOffset()+v.ref.GetByteSize() && v.ref.GetOffset() < hi {
						return v.x.field, true
					}
				}
				return "", false
			}, out)
		}
		if err != nil {
			return nil, nil, err
		}
	}
	return views, out, nil
}

// checkMappings checks that no POSIX region the call uses was shrunk
// under its mapping, which would make reads past the new end fault
// (SIGBUS); once per call, outside the table's lock. The check cannot
// close the race with a truncation while the call runs: the backend reads
// the inputs, and for an unbatched call writes the output, straight from
// and to the mapping (README, "Security").
func (c *shmCall) checkMappings() error {
	for _, r := range c.used {
		if r.m == nil {
			continue // device memory: freeing it is the caller's to avoid
		}
		if err := r.m.check(); err != nil {
			return codedf(codes.FailedPrecondition, "", "shared-memory region %s: %v; unregister and register it again", Quote(r.name), err)
		}
	}
	return nil
}

// place records where each view's tensor and the output are: what
// memory answers and the output goes to.
func (c *shmCall) place(req *pb.FusedMoERequest, views []shmView, out *region) {
	c.mem = make(map[string]moe.Tensor, len(views))
	for _, v := range views {
		lo, hi := v.ref.GetOffset(), v.ref.GetOffset()+v.ref.GetByteSize()
		if v.r.dev != nil {
			c.mem[v.x.field] = moe.Tensor{Memory: moe.Device, Dev: v.r.dev.Ptr() + uintptr(lo)}
			continue
		}
		kind := moe.Host
		if v.r.unpin != nil {
			kind = moe.Pinned
		}
		// The capacity stops an append from writing past the view.
		c.mem[v.x.field] = moe.Tensor{Memory: kind, Data: v.r.m.data()[lo:hi:hi]}
	}
	if out != nil {
		ref := req.GetOutputShm()
		lo, hi := ref.GetOffset(), ref.GetOffset()+ref.GetByteSize()
		if out.dev != nil {
			c.outDev = out.dev.Ptr() + uintptr(lo)
		} else {
			c.out = out.m.data()[lo:hi:hi]
		}
		c.outRef = proto.Clone(ref).(*pb.SharedMemoryRef)
	}
}

// checkOutputShm checks output_shm's size against [M, K] in the output
// dtype, as far as the request declares them (a malformed hidden_states or
// output_dtype is left to validation), and that it overlaps no input.
func checkOutputShm(req *pb.FusedMoERequest, ref *pb.SharedMemoryRef, overlaps func(*region, int64, int64) (string, bool), r *region) error {
	if in, ok := overlaps(r, ref.GetOffset(), ref.GetOffset()+ref.GetByteSize()); ok {
		// The CPU backend finishes reading before the output is copied
		// in, but a device backend may write it while reading the
		// inputs: refuse rather than promise an order.
		return invalidf("output_shm", "[%d, %d) of region %s overlaps %s.shm; use a separate slice", ref.GetOffset(), ref.GetOffset()+ref.GetByteSize(), Quote(r.name), in)
	}
	hm, err := checkMeta("hidden_states", req.GetHiddenStates(), allDTypes...)
	if err != nil || len(hm.shape) != 2 {
		return nil
	}
	outType, ok := moe.OutputDType(moe.DType(req.GetOutputDtype()))
	if !ok {
		return nil
	}
	out := hm.bytes / int64(hm.dtype.Size()) * int64(outType.Size())
	if ref.GetByteSize() != out {
		return invalidf("output_shm.byte_size", "%d: the output [%d %d] of %v needs %d bytes", ref.GetByteSize(), hm.shape[0], hm.shape[1], outType.WireName(), out)
	}
	return nil
}

func slicesContain(rs []*region, r *region) bool {
	for _, x := range rs {
		if x == r {
			return true
		}
	}
	return false
}

// release lets go of the call's regions, releasing any unregistered
// meanwhile.
func (c *shmCall) release() {
	if c == nil {
		return
	}
	var free []*region
	c.t.mu.Lock()
	for _, r := range c.used {
		r.refs--
		if r.gone && r.refs == 0 {
			free = append(free, c.t.forgetLocked(r))
		}
	}
	c.used = nil
	c.t.mu.Unlock()
	c.t.free(free)
}

// outBuffer is where an unbatched call's backend should write the output
// itself: a POSIX output_shm's bytes, which saves writeOutput's copy of
// M*K output elements; nil otherwise.
func (c *shmCall) outBuffer() []byte {
	if c == nil {
		return nil
	}
	return c.out
}

// writeOutput makes resp carry the output_shm reference instead of inline
// bytes, when the request set one. Into a POSIX region it first copies the
// output, unless the backend wrote it there (outBuffer, unbatched calls);
// into a CUDA IPC region the backend wrote it (moe.Request.OutDev).
func (c *shmCall) writeOutput(resp *pb.FusedMoEResponse) error {
	if c == nil || c.outRef == nil {
		return nil
	}
	if c.out != nil {
		src := resp.GetOutput().GetData()
		if len(src) != len(c.out) {
			return fmt.Errorf("output is %d bytes, output_shm %d", len(src), len(c.out))
		}
		if &src[0] != &c.out[0] {
			if err := copyGuarded(c.out, src); err != nil {
				return codedf(codes.FailedPrecondition, "output_shm", "writing region %s: %v (was its object shrunk?)", Quote(c.outRef.GetRegionName()), err)
			}
		}
	}
	resp.Output.Source = &pb.Tensor_Shm{Shm: c.outRef}
	return nil
}

// copyGuarded copies, turning a fault (a mapping whose object was shrunk
// after the per-call check) into an error instead of a crash.
func copyGuarded(dst, src []byte) error {
	return guard(func() { copy(dst, src) })
}

// guard runs f, turning a panic in it, a memory fault included (touching
// a shared mapping past its object's end), into an error instead of a
// crash.
func guard(f func()) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("memory fault: %v", p)
		}
	}()
	f()
	return nil
}
