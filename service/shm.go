package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"

	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/shm"
)

// Shared memory for callers on the server's host, after Triton's system
// and CUDA shared-memory APIs: a caller creates a POSIX object (or a CUDA
// allocation), registers a slice of it under a name, and then points
// tensors (SharedMemoryRef) and the output (FusedMoERequest.output_shm)
// into it, so those bytes never travel in messages.
//
// The regions themselves are package shm's table, which knows nothing of
// FusedMoE; this file is its gRPC edge. Regions belong to the connection
// that registered them, tracked by the stats.Handler StatsHandler returns:
// a name means nothing on another connection, and a connection's regions
// are unmapped when it closes, so a caller that dies cannot leave mappings
// behind. A region is reference-counted like an expert set: unregistering
// (or the connection closing) forgets the name at once, and the mapping
// goes when the last call using it ends.
//
// A POSIX region is a mapping of the caller's object, which the backend
// page-locks when it can (HostPinner), so a GPU's copies from and to it
// are DMA; its tensors reach the backend as moe.Pinned memory. A CUDA IPC
// region is device memory the backend opened from the caller's
// cudaIpcMemHandle_t (IPCOpener): tensors there reach the backend
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

// errShmDisabled answers the shared-memory RPCs on a server without
// Config.SharedMemory.
var errShmDisabled = codedf(codes.FailedPrecondition, "", "shared memory is disabled on this server; start expertd with -shared-memory, or send tensors inline")

// shmTable is the server's side of the region table (package shm): the
// stats.Handler that makes each connection an owner of regions and ends
// its regions with it, the shared-memory RPCs' conversion from and to
// protobuf, the backend's part in a registration (pinning, opening IPC
// memory), and the resolution of a FusedMoE request's references (resolve).
type shmTable struct {
	log *slog.Logger
	// backend opens CUDA IPC memory (IPCOpener) and page-locks POSIX
	// regions (HostPinner) when it can.
	backend kernels.Backend
	enabled bool
	// pinWarn logs the first failure to pin a POSIX region; later ones
	// would only repeat it.
	pinWarn sync.Once
	regions *shm.Table
	// maxRegions and maxBytes are the table's daemon-wide caps.
	maxRegions, maxBytes int64
}

func newShmTable(cfg Config, backend kernels.Backend, log *slog.Logger) *shmTable {
	t := &shmTable{log: log, backend: backend, enabled: cfg.SharedMemory,
		maxRegions: int64(cfg.MaxShmRegions), maxBytes: cfg.MaxShmBytes}
	if t.maxRegions <= 0 {
		t.maxRegions = DefaultMaxShmRegions
	}
	if t.maxBytes <= 0 {
		t.maxBytes = DefaultMaxShmBytes
	}
	t.regions = shm.New(shm.Config{MaxRegions: t.maxRegions, MaxBytes: t.maxBytes, MaxPerOwner: maxRegionsPerConn, Log: log})
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

// shmError is err from package shm as the service's: a refusal's field
// prefixed with where the request holds it (prefix, e.g.
// "hidden_states.shm."), a closed table as draining.
func shmError(prefix string, err error) error {
	var se *shm.Error
	switch {
	case errors.As(err, &se):
		field := se.Field
		if field != "" {
			field = prefix + field
		}
		return &requestError{code: se.Code, field: field, msg: se.Msg, quota: se.Quota, limit: se.Limit}
	case errors.Is(err, shm.ErrClosed):
		return errDraining
	}
	return err
}

// connKey carries a connection's id in contexts derived from TagConn's.
type connKey struct{}

// TagConn makes each connection an owner of regions, whose id its RPCs'
// contexts carry.
func (t *shmTable) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	if !t.enabled {
		return ctx
	}
	return context.WithValue(ctx, connKey{}, t.regions.Connect())
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
	if names := t.regions.Disconnect(id); len(names) > 0 {
		t.log.Info("shared memory unregistered: connection closed", slog.Uint64("conn", id), slog.Any("regions", names))
	}
}

// TagRPC and HandleRPC are not needed: a call finds its connection through
// TagConn's context.
func (t *shmTable) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }

// HandleRPC does nothing.
func (t *shmTable) HandleRPC(context.Context, stats.RPCStats) {}

// closeAll unregisters every region and refuses new ones (Shutdown).
func (t *shmTable) closeAll() { t.regions.Close() }

// owner is the calling connection's id.
func (t *shmTable) owner(ctx context.Context) (uint64, error) {
	id, ok := ctx.Value(connKey{}).(uint64)
	if !ok {
		// Config.SharedMemory without StatsHandler installed: our bug.
		return 0, errors.New("shared memory: the call's connection is unknown (service.Server.StatsHandler is not installed on the grpc.Server)")
	}
	return id, nil
}

// initShmMetrics observes the mapped regions, so a leak (mappings that
// outlive their connections) shows on a dashboard.
func (t *shmTable) initMetrics(m metric.Meter) {
	observe := func(get func(regions, bytes int64) int64) metric.Int64Callback {
		return func(_ context.Context, o metric.Int64Observer) error {
			o.Observe(get(t.regions.Usage()))
			return nil
		}
	}
	if _, err := m.Int64ObservableGauge("expertd.shared_memory.regions",
		metric.WithDescription("Shared-memory regions mapped: registered, or unregistered but still used by a call."),
		metric.WithUnit("{region}"),
		metric.WithInt64Callback(observe(func(regions, _ int64) int64 { return regions }))); err != nil {
		t.log.Warn("metric not recorded", slog.String("metric", "expertd.shared_memory.regions"), slog.Any("err", err))
	}
	if _, err := m.Int64ObservableGauge("expertd.shared_memory.mapped_bytes",
		metric.WithDescription("Bytes of the shared-memory regions mapped."),
		metric.WithUnit("By"),
		metric.WithInt64Callback(observe(func(_, bytes int64) int64 { return bytes }))); err != nil {
		t.log.Warn("metric not recorded", slog.String("metric", "expertd.shared_memory.mapped_bytes"), slog.Any("err", err))
	}
}

func regionInfo(r shm.Info) *pb.SharedMemoryRegion {
	return &pb.SharedMemoryRegion{
		Name: r.Name, Kind: pb.SharedMemoryKind(r.Kind), Key: r.Key,
		Offset: r.Offset, ByteSize: r.Size, CallsInFlight: int32(r.CallsInFlight),
		RegisteredAt: timestamppb.New(r.Registered),
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
		if key, err = shm.CheckKey(req.GetKey()); err != nil {
			return nil, shmError("", err)
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
	id, err := t.owner(ctx)
	if err != nil {
		return nil, err
	}
	spec := shm.Spec{Name: req.GetName(), Kind: shm.Kind(kind), Key: key, Offset: off, Size: size}
	info, err := t.regions.Register(id, spec, func() (shm.Backing, error) {
		if kind == pb.SharedMemoryKind_SHARED_MEMORY_KIND_CUDA_IPC {
			return t.openIPC(spec, req.GetCudaIpcHandle())
		}
		return t.mapPOSIX(ctx, spec)
	})
	if err != nil {
		return nil, shmError("", err)
	}
	t.log.InfoContext(ctx, "shared memory registered", slog.String("region", spec.Name), slog.String("kind", kind.String()), slog.String("key", key),
		slog.Int64("offset", off), slog.Int64("bytes", size), slog.Bool("pinned", info.Pinned), slog.Uint64("conn", id))
	return &pb.RegisterSharedMemoryResponse{Region: regionInfo(info)}, nil
}

// mapPOSIX maps r's slice of its object and, when the backend can,
// page-locks it. Pinning only speeds up a GPU's copies, so a failure (a
// RLIMIT_MEMLOCK too low, say) is logged once and the region served
// unpinned.
func (t *shmTable) mapPOSIX(ctx context.Context, r shm.Spec) (shm.Backing, error) {
	m, err := shm.Open(r.Key, r.Offset, r.Size)
	if err != nil {
		return shm.Backing{}, err
	}
	b := shm.Backing{Mapping: m}
	p, ok := t.backend.(HostPinner)
	if !ok {
		return b, nil
	}
	// The whole mapping, which starts on a page boundary; the region may
	// not.
	if b.Unpin, err = p.PinHost(m.Pages()); err != nil {
		b.Unpin = nil
		t.pinWarn.Do(func() {
			t.log.WarnContext(ctx, "shared memory not page-locked: copies from and to POSIX regions go through staging buffers, and are slower (logged once)",
				slog.String("backend", t.backend.Name()), slog.String("region", r.Name), slog.String("key", r.Key), slog.Int64("bytes", r.Size), slog.Any("err", err))
		})
	}
	return b, nil
}

// openIPC opens r's slice of the allocation handle names on the backend's
// GPU, whose size the backend checks r against.
func (t *shmTable) openIPC(r shm.Spec, handle []byte) (shm.Backing, error) {
	dev, err := t.backend.(IPCOpener).OpenIPC(handle, r.Offset, r.Size)
	switch {
	case errors.Is(err, kernels.ErrUnsupported):
		return shm.Backing{}, codedf(codes.FailedPrecondition, "cuda_ipc_handle", "backend %s: %v", t.backend.Name(), err)
	case errors.Is(err, kernels.ErrOutOfMemory):
		return shm.Backing{}, exhaustedf("cuda_ipc_handle", "backend %s: %v", t.backend.Name(), err)
	case err != nil:
		return shm.Backing{}, invalidf("cuda_ipc_handle", "backend %s cannot open it: %v", t.backend.Name(), err)
	}
	if dev.Size() != r.Size || dev.Ptr() == 0 {
		dev.Close() //nolint:errcheck // failing already
		return shm.Backing{}, fmt.Errorf("backend %s opened %d bytes at %#x for a region of %d", t.backend.Name(), dev.Size(), dev.Ptr(), r.Size)
	}
	return shm.Backing{Device: dev}, nil
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
	id, err := t.owner(ctx)
	if err != nil {
		return nil, err
	}
	names, err := t.regions.Unregister(id, req.GetName())
	if err != nil {
		return nil, shmError("", err)
	}
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
	id, err := t.owner(ctx)
	if err != nil {
		return nil, err
	}
	infos, err := t.regions.List(id, req.GetName())
	if err != nil {
		return nil, shmError("", err)
	}
	resp := &pb.ListSharedMemoryResponse{Regions: make([]*pb.SharedMemoryRegion, len(infos))}
	for i, r := range infos {
		resp.Regions[i] = regionInfo(r)
	}
	return resp, nil
}

// shmCall is what one FusedMoE call holds in shared memory: the regions it
// references (each held once, by its lease) and where its shared-memory
// tensors and output are (placement, what conversion reads). A nil
// *shmCall holds nothing.
type shmCall struct {
	lease shm.Lease
	placement
	// out is a POSIX output_shm's bytes, nil for none or CUDA IPC.
	out []byte
}

// placed is where the call's tensors are, for conversion; nil for none.
func (c *shmCall) placed() *placement {
	if c == nil {
		return nil
	}
	return &c.placement
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
			ts = append(ts, shmTensor{"weights." + moe.SetTensorNames[i], t})
		}
	}
	return ts
}

// resolve finds where the request's shared-memory tensors are: views
// of the caller's POSIX regions (so validation and the backend read them
// with no copy) or device addresses in its CUDA IPC regions, and where
// output_shm is. The request is left as it came; fromProto reads the
// answers (placement.memory). It runs before validation and holds every
// region it touches until release, so none is unmapped under the call.
// References are checked here (region known, offset and byte_size within
// it, device memory only where allowed, output apart from the inputs);
// whether byte_size is the size a tensor's declaration needs is
// validation's, which sizes each declaration once (modelError words its
// refusal for the reference, checkOutput sizes output_shm), and which
// refuses shm tensors when this is disabled.
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
	id, err := t.owner(ctx)
	if err != nil {
		return nil, err
	}
	c := &shmCall{lease: t.regions.Lease(id)}
	err = c.acquire(req, ts)
	if err == nil {
		err = shmError("", c.lease.Check())
	}
	if err != nil {
		c.release()
		return nil, err
	}
	return c, nil
}

// shmView is a request tensor's reference into a held region.
type shmView struct {
	field string
	r     *shm.Region
	ref   *pb.SharedMemoryRef
}

// acquire resolves the references of ts and output_shm in the
// connection's regions, holding each region used (c.lease, which release
// gives back, on failure too), and records where each tensor and the
// output are.
func (c *shmCall) acquire(req *pb.FusedMoERequest, ts []shmTensor) error {
	take := func(field string, ref *pb.SharedMemoryRef) (shm.Memory, *shm.Region, error) {
		if err := checkLen(field+".region_name", ref.GetRegionName(), maxNameBytes); err != nil {
			return shm.Memory{}, nil, err
		}
		mem, r, err := c.lease.Resolve(ref.GetRegionName(), ref.GetOffset(), ref.GetByteSize())
		return mem, r, shmError(field+".", err)
	}
	var views []shmView
	for _, x := range ts {
		ref := x.t.GetShm()
		if ref == nil {
			continue
		}
		field := x.field + ".shm"
		mem, r, err := take(field, ref)
		if err == nil && r.Kind == shm.CUDAIPC && !deviceFields[x.field] {
			err = invalidf(field, "region %s is CUDA IPC device memory; only hidden_states, router_logits and output_shm may live there", Quote(r.Name))
		}
		if err != nil {
			return err
		}
		views = append(views, shmView{x.field, r, ref})
		if c.tensors == nil {
			c.tensors = make(map[string]moe.Tensor, len(ts))
		}
		c.tensors[x.field] = memTensor(mem, ref.GetByteSize())
	}
	if ref := req.GetOutputShm(); ref != nil {
		mem, out, err := take("output_shm", ref)
		if err == nil {
			err = checkOverlap(ref, out, views)
		}
		if err != nil {
			return err
		}
		c.out, c.outDev = mem.Host, mem.Dev
		c.outRef = proto.Clone(ref).(*pb.SharedMemoryRef)
	}
	return nil
}

// memTensor is resolved shared memory of size bytes as a tensor's place.
func memTensor(mem shm.Memory, size int64) moe.Tensor {
	switch {
	case mem.Host == nil:
		return moe.Tensor{Memory: moe.Device, Dev: mem.Dev, DevBytes: size}
	case mem.Pinned:
		return moe.Tensor{Memory: moe.Pinned, Data: mem.Host}
	}
	return moe.Tensor{Memory: moe.Host, Data: mem.Host}
}

// checkOverlap refuses an output_shm over an input's reference.
func checkOverlap(ref *pb.SharedMemoryRef, r *shm.Region, views []shmView) error {
	lo, hi := ref.GetOffset(), ref.GetOffset()+ref.GetByteSize()
	for _, v := range views {
		if v.r == r && lo < v.ref.GetOffset()+v.ref.GetByteSize() && v.ref.GetOffset() < hi {
			// The CPU backend finishes reading before the output is
			// copied in, but a device backend may write it while reading
			// the inputs: refuse rather than promise an order.
			return invalidf("output_shm", "[%d, %d) of region %s overlaps %s.shm; use a separate slice", lo, hi, Quote(r.Name), v.field)
		}
	}
	return nil
}

// release lets go of the call's regions, releasing any unregistered
// meanwhile.
func (c *shmCall) release() {
	if c == nil {
		return
	}
	c.lease.Release()
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
	return shm.Guard(func() { copy(dst, src) })
}
