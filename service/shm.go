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
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// Shared memory for callers on the server's host, after Triton's system
// shared-memory API: a caller creates a POSIX object, registers a slice of
// it under a name, and then points tensors (SharedMemoryRef) and the output
// (FusedMoERequest.output_shm) into it, so those bytes never travel in
// messages.
//
// Regions belong to the connection that registered them, tracked by the
// stats.Handler StatsHandler returns: a name means nothing on another
// connection, and a connection's regions are unmapped when it closes, so a
// caller that dies cannot leave mappings behind. A region is
// reference-counted like an expert set: unregistering (or the connection
// closing) forgets the name at once, and the mapping goes when the last call
// using it ends.
//
// The kinds are an enum so CUDA IPC regions (device memory opened by the
// kernel library) can join POSIX ones; only POSIX is served.

// maxRegionsPerConn bounds one connection's regions: each holds a file
// descriptor and a mapping.
const maxRegionsPerConn = 64

// maxShmKey is NAME_MAX, the longest file name /dev/shm takes.
const maxShmKey = 255

// errShmDisabled answers the shared-memory RPCs on a server without
// Config.SharedMemory.
var errShmDisabled = codedf(codes.FailedPrecondition, "", "shared memory is disabled on this server; start expertd with -shared-memory, or send tensors inline")

// region is one registered slice of a shared-memory object.
type region struct {
	name, key    string
	offset, size int64
	registered   time.Time
	// m is the mapping; m.data() is the region's size bytes.
	m *mapping
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
		Name: r.name, Kind: pb.SharedMemoryKind_SHARED_MEMORY_KIND_POSIX, Key: r.key,
		Offset: r.offset, ByteSize: r.size, CallsInFlight: int32(r.refs),
		RegisteredAt: timestamppb.New(r.registered),
	}
}

// shmTable holds every connection's regions. It is also the stats.Handler
// that learns when connections come and go.
type shmTable struct {
	log     *slog.Logger
	enabled bool

	mu     sync.Mutex
	nextID uint64
	// conns has an entry for every live connection (from TagConn to
	// ConnEnd), so a registration racing its connection's end cannot leave
	// a region nobody will clean up.
	conns  map[uint64]map[string]*region
	closed bool
	// mapped counts the regions mapped (registered, or unregistered but
	// still used by a call) and their bytes, for the gauges.
	mapped, mappedBytes int64
}

func newShmTable(enabled bool, log *slog.Logger) *shmTable {
	return &shmTable{log: log, enabled: enabled, conns: map[uint64]map[string]*region{}}
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
	names := t.dropLocked(regs)
	t.mu.Unlock()
	if len(names) > 0 {
		t.log.Info("shared memory unregistered: connection closed", slog.Uint64("conn", id), slog.Any("regions", names))
	}
}

// TagRPC and HandleRPC are not needed: a call finds its connection through
// TagConn's context.
func (t *shmTable) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }

// HandleRPC does nothing.
func (t *shmTable) HandleRPC(context.Context, stats.RPCStats) {}

// dropLocked marks regs gone, unmaps those no call uses, and returns their
// names, sorted.
func (t *shmTable) dropLocked(regs map[string]*region) []string {
	names := make([]string, 0, len(regs))
	for name, r := range regs {
		r.gone = true
		if r.refs == 0 {
			t.unmap(r)
		}
		names = append(names, name)
	}
	sort.Strings(names)
	return names
}

func (t *shmTable) unmap(r *region) {
	t.mapped--
	t.mappedBytes -= r.size
	if err := r.m.close(); err != nil {
		t.log.Error("unmapping shared memory", slog.String("region", r.name), slog.String("key", r.key), slog.Uint64("conn", r.conn), slog.Any("err", err))
	}
}

// closeAll unregisters every region and refuses new ones (Shutdown).
func (t *shmTable) closeAll() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	for id, regs := range t.conns {
		t.dropLocked(regs)
		delete(t.conns, id)
	}
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
func (s *Server) initShmMetrics(m metric.Meter) {
	t := s.shm
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
		s.log.Warn("metric not recorded", slog.String("metric", "expertd.shared_memory.regions"), slog.Any("err", err))
	}
	if _, err := m.Int64ObservableGauge("expertd.shared_memory.mapped_bytes",
		metric.WithDescription("Bytes of the shared-memory regions mapped."),
		metric.WithUnit("By"),
		metric.WithInt64Callback(observe(func() int64 { return t.mappedBytes }))); err != nil {
		s.log.Warn("metric not recorded", slog.String("metric", "expertd.shared_memory.mapped_bytes"), slog.Any("err", err))
	}
}

// RegisterSharedMemory maps a region of a POSIX shared-memory object for
// the calling connection.
func (s *Server) RegisterSharedMemory(ctx context.Context, req *pb.RegisterSharedMemoryRequest) (*pb.RegisterSharedMemoryResponse, error) {
	resp, err := s.registerShm(ctx, req)
	return resp, s.toStatus(ctx, "RegisterSharedMemory", err)
}

func (s *Server) registerShm(ctx context.Context, req *pb.RegisterSharedMemoryRequest) (*pb.RegisterSharedMemoryResponse, error) {
	t := s.shm
	if !t.enabled {
		return nil, errShmDisabled
	}
	done, err := s.begin()
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
	switch req.GetKind() {
	case pb.SharedMemoryKind_SHARED_MEMORY_KIND_UNSPECIFIED, pb.SharedMemoryKind_SHARED_MEMORY_KIND_POSIX:
	default:
		return nil, invalidf("kind", "%v: want SHARED_MEMORY_KIND_POSIX", req.GetKind())
	}
	key, err := checkShmKey(req.GetKey())
	if err != nil {
		return nil, err
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
	// Check the name before the file: a refused registration should cost
	// no open or mapping. It is checked again on insertion.
	t.mu.Lock()
	_, regs, err := t.connRegions(ctx)
	if err == nil {
		err = checkFree(regs, req.GetName())
	}
	t.mu.Unlock()
	if err != nil {
		return nil, err
	}

	m, err := mapShm(key, off, size)
	if err != nil {
		return nil, err
	}
	r := &region{name: req.GetName(), key: key, offset: off, size: size, registered: time.Now(), m: m}
	t.mu.Lock()
	id, regs, err := t.connRegions(ctx)
	if err == nil {
		err = checkFree(regs, r.name)
	}
	if err != nil {
		t.mu.Unlock()
		m.close() //nolint:errcheck // never shared
		return nil, err
	}
	r.conn = id
	regs[r.name] = r
	t.mapped++
	t.mappedBytes += r.size
	info := r.info()
	t.mu.Unlock()
	s.log.InfoContext(ctx, "shared memory registered", slog.String("region", r.name), slog.String("key", key),
		slog.Int64("offset", off), slog.Int64("bytes", size), slog.Uint64("conn", id))
	return &pb.RegisterSharedMemoryResponse{Region: info}, nil
}

func checkFree(regs map[string]*region, name string) error {
	if _, dup := regs[name]; dup {
		return codedf(codes.AlreadyExists, "name", "%q: this connection already has a region of that name; unregister it first", name)
	}
	if len(regs) >= maxRegionsPerConn {
		return exhaustedf("name", "this connection has %d regions, the most it may have; unregister one first", len(regs))
	}
	return nil
}

// checkShmKey returns the object name of a POSIX key ("/name" or "name"):
// one file name, so the server opens /dev/shm/<name> and nothing else.
func checkShmKey(key string) (string, error) {
	k := strings.TrimPrefix(key, "/")
	if len(k) < 1 || len(k) > maxShmKey {
		return "", invalidf("key", "%q: want 1-%d characters after an optional leading /", key, maxShmKey)
	}
	for _, c := range k {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.ContainsRune("._-", c)) {
			return "", invalidf("key", "%q: character %q is not in [A-Za-z0-9._-]; the key is one name under /dev/shm", key, c)
		}
	}
	if strings.Contains(k, "..") || k == "." {
		return "", invalidf("key", "%q: must not be \".\" or contain \"..\"", key)
	}
	return k, nil
}

// UnregisterSharedMemory forgets one of the calling connection's regions,
// or all of them when the name is empty.
func (s *Server) UnregisterSharedMemory(ctx context.Context, req *pb.UnregisterSharedMemoryRequest) (*pb.UnregisterSharedMemoryResponse, error) {
	resp, err := s.unregisterShm(ctx, req)
	return resp, s.toStatus(ctx, "UnregisterSharedMemory", err)
}

func (s *Server) unregisterShm(ctx context.Context, req *pb.UnregisterSharedMemoryRequest) (*pb.UnregisterSharedMemoryResponse, error) {
	t := s.shm
	if !t.enabled {
		return nil, errShmDisabled
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
			return nil, codedf(codes.NotFound, "name", "no shared-memory region %q on this connection", name)
		}
		drop = map[string]*region{name: r}
	}
	// drop may be regs itself: mark before deleting.
	names := t.dropLocked(drop)
	for _, name := range names {
		delete(regs, name)
	}
	t.mu.Unlock()
	s.log.InfoContext(ctx, "shared memory unregistered", slog.Any("regions", names), slog.Uint64("conn", id))
	return &pb.UnregisterSharedMemoryResponse{Names: names}, nil
}

// ListSharedMemory reports the calling connection's regions.
func (s *Server) ListSharedMemory(ctx context.Context, req *pb.ListSharedMemoryRequest) (*pb.ListSharedMemoryResponse, error) {
	resp, err := s.listShm(ctx, req)
	return resp, s.toStatus(ctx, "ListSharedMemory", err)
}

func (s *Server) listShm(ctx context.Context, req *pb.ListSharedMemoryRequest) (*pb.ListSharedMemoryResponse, error) {
	t := s.shm
	if !t.enabled {
		return nil, errShmDisabled
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
			return nil, codedf(codes.NotFound, "name", "no shared-memory region %q on this connection", name)
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
// references (each acquired once) and where its output goes. A nil
// *shmCall holds nothing.
type shmCall struct {
	t    *shmTable
	used []*region
	// out is the output's destination, and outRef the reference the
	// response returns; nil without output_shm.
	out    []byte
	outRef *pb.SharedMemoryRef
}

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
var allDTypes = []kernels.DType{kernels.Float32, kernels.BFloat16, kernels.Float16, kernels.Float8E4M3FN, kernels.Float8E5M2, kernels.Int32}

// resolveShm turns the request's shared-memory tensors into inline views of
// the caller's regions, so validation (validate.go) and the backend see
// plain bytes with no copy, and checks output_shm. It runs before
// validation and holds every region it touches until release, so none is
// unmapped under the call. References are checked here (region known,
// offset and byte_size within it and equal to the tensor's size); all else
// is left to validation, which refuses shm tensors when this is disabled.
func (s *Server) resolveShm(ctx context.Context, req *pb.FusedMoERequest) (*shmCall, error) {
	t := s.shm
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
	t.mu.Lock()
	_, regs, err := t.connRegions(ctx)
	if err != nil {
		t.mu.Unlock()
		return nil, err
	}
	acquire := func(field string, ref *pb.SharedMemoryRef) (*region, error) {
		r, ok := regs[ref.GetRegionName()]
		if !ok {
			return nil, codedf(codes.NotFound, field+".region_name", "no shared-memory region %q on this connection; register it first", ref.GetRegionName())
		}
		if off := ref.GetOffset(); off < 0 || off > r.size {
			return nil, invalidf(field+".offset", "%d: want in [0, %d] (region %q has %d bytes)", off, r.size, r.name, r.size)
		}
		if n := ref.GetByteSize(); n < 0 || n > r.size-ref.GetOffset() {
			return nil, invalidf(field+".byte_size", "%d at offset %d runs past the end of region %q (%d bytes)", n, ref.GetOffset(), r.name, r.size)
		}
		if !slicesContain(c.used, r) {
			r.refs++
			c.used = append(c.used, r)
		}
		return r, nil
	}
	type view struct {
		x   shmTensor
		r   *region
		ref *pb.SharedMemoryRef
	}
	var views []view
	for _, x := range ts {
		ref := x.t.GetShm()
		if ref == nil {
			continue
		}
		field := x.field + ".shm"
		r, err := acquire(field, ref)
		if err == nil {
			// Only a well-formed declaration has a size to compare; a bad
			// dtype or shape is reported by validation.
			if m, merr := checkMeta(x.field, x.t, allDTypes...); merr == nil && m.bytes != ref.GetByteSize() {
				err = invalidf(field+".byte_size", "%d: shape %v of %v needs %d bytes", ref.GetByteSize(), x.t.GetShape(), x.t.GetDtype(), m.bytes)
			}
		}
		if err != nil {
			t.mu.Unlock()
			c.release()
			return nil, err
		}
		views = append(views, view{x, r, ref})
	}
	var out *region
	if ref := req.GetOutputShm(); ref != nil {
		if out, err = acquire("output_shm", ref); err == nil {
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
			t.mu.Unlock()
			c.release()
			return nil, err
		}
	}
	t.mu.Unlock()

	// A caller that shrinks an object under a mapping makes reads past
	// the new end fault (SIGBUS); check once per call, outside the lock.
	for _, r := range c.used {
		if err := r.m.check(); err != nil {
			c.release()
			return nil, codedf(codes.FailedPrecondition, "", "shared-memory region %q: %v; unregister and register it again", r.name, err)
		}
	}
	for _, v := range views {
		lo, hi := v.ref.GetOffset(), v.ref.GetOffset()+v.ref.GetByteSize()
		// The capacity stops an append from writing past the view.
		v.x.t.Source = &pb.Tensor_Data{Data: v.r.m.data()[lo:hi:hi]}
	}
	if out != nil {
		ref := req.GetOutputShm()
		lo, hi := ref.GetOffset(), ref.GetOffset()+ref.GetByteSize()
		c.out = out.m.data()[lo:hi:hi]
		c.outRef = proto.Clone(ref).(*pb.SharedMemoryRef)
	}
	return c, nil
}

// checkOutputShm checks output_shm's size against [M, K] in the output
// dtype, as far as the request declares them (a malformed hidden_states or
// output_dtype is left to validation), and that it overlaps no input.
func checkOutputShm(req *pb.FusedMoERequest, ref *pb.SharedMemoryRef, overlaps func(*region, int64, int64) (string, bool), r *region) error {
	if in, ok := overlaps(r, ref.GetOffset(), ref.GetOffset()+ref.GetByteSize()); ok {
		// The CPU backend finishes reading before the output is copied
		// in, but a device backend may write it while reading the
		// inputs: refuse rather than promise an order.
		return invalidf("output_shm", "[%d, %d) of region %q overlaps %s.shm; use a separate slice", ref.GetOffset(), ref.GetOffset()+ref.GetByteSize(), r.name, in)
	}
	hm, err := checkMeta("hidden_states", req.GetHiddenStates(), allDTypes...)
	if err != nil || len(hm.shape) != 2 {
		return nil
	}
	var size int64
	switch req.GetOutputDtype() {
	case pb.DataType_DATA_TYPE_UNSPECIFIED, pb.DataType_DATA_TYPE_BFLOAT16:
		size = 2
	case pb.DataType_DATA_TYPE_FLOAT32:
		size = 4
	default:
		return nil
	}
	out := hm.bytes / int64(hm.dtype.Size()) * size
	if ref.GetByteSize() != out {
		outType := pb.DataType_DATA_TYPE_BFLOAT16
		if size == 4 {
			outType = pb.DataType_DATA_TYPE_FLOAT32
		}
		return invalidf("output_shm.byte_size", "%d: the output [%d %d] of %v needs %d bytes", ref.GetByteSize(), hm.shape[0], hm.shape[1], outType, out)
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

// release lets go of the call's regions, unmapping any unregistered
// meanwhile.
func (c *shmCall) release() {
	if c == nil {
		return
	}
	c.t.mu.Lock()
	defer c.t.mu.Unlock()
	for _, r := range c.used {
		r.refs--
		if r.gone && r.refs == 0 {
			c.t.unmap(r)
		}
	}
	c.used = nil
}

// writeOutput moves resp's inline output into output_shm, when the request
// set one, and makes the response carry the reference instead.
func (c *shmCall) writeOutput(resp *pb.FusedMoEResponse) error {
	if c == nil || c.out == nil {
		return nil
	}
	src := resp.GetOutput().GetData()
	if len(src) != len(c.out) {
		return fmt.Errorf("output is %d bytes, output_shm %d", len(src), len(c.out))
	}
	if err := copyGuarded(c.out, src); err != nil {
		return codedf(codes.FailedPrecondition, "output_shm", "writing region %q: %v (was its object shrunk?)", c.outRef.GetRegionName(), err)
	}
	resp.Output.Source = &pb.Tensor_Shm{Shm: c.outRef}
	return nil
}

// copyGuarded copies, turning a fault (a mapping whose object was shrunk
// after the per-call check) into an error instead of a crash.
func copyGuarded(dst, src []byte) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("memory fault: %v", p)
		}
	}()
	copy(dst, src)
	return nil
}
