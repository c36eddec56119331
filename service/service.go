// Package service is expertd's gRPC edge: it implements
// expertd.v1.ExpertService. Its handlers resolve shared-memory references
// through shm (shm.go), convert each request from protobuf to moe once
// (validate.go; weights.go for checkpoint sources), map model, loader and
// table errors to gRPC statuses (errors.go), keep the registry of loaded
// expert sets (registry.go) and run calls through kernels/batch on the
// execution slots (fusedmoe.go, batch.go, slots.go). The rules themselves
// live in moe, shm and weights.
package service

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"

	"github.com/expertd/expertd/codec"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/batch"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/weights"
)

// Config bounds what the service accepts. The zero value is usable: no
// weights directory, no limits beyond a single concurrent call per core.
type Config struct {
	// Version is reported by GetServerInfo.
	Version string
	// WeightsDir is the only directory safetensors sources may read from;
	// empty disables safetensors loading.
	WeightsDir string
	// MaxMessageBytes is the gRPC message limit the daemon configured; the
	// service only reports it.
	MaxMessageBytes int64
	// MaxTokens bounds M per FusedMoE call; 0 means the backend's limit, or
	// none.
	MaxTokens int
	// MaxLoadedBytes bounds the memory of resident expert sets plus loads
	// and inline sets in flight; 0 means unlimited, and then an upload's
	// header alone can make the server allocate what it declares, so set
	// a limit on any server others can reach.
	MaxLoadedBytes int64
	// MaxConcurrent bounds FusedMoE calls running at once; more wait in
	// order of arrival. 0 means 1.
	MaxConcurrent int
	// MaxQueued bounds the FusedMoE calls waiting for one of the
	// MaxConcurrent slots (a batch of merged calls counts once); a call
	// beyond it is refused at once with ResourceExhausted, so a burst is
	// pushed back to callers (who can retry elsewhere) instead of piling
	// up requests and their memory here. 0 means 4 × MaxConcurrent; a
	// negative value means no queue.
	MaxQueued int
	// BatchWindow turns on dynamic batching (kernels/batch): compatible
	// FusedMoE calls on a loaded expert set merge into one backend call.
	// A call on an idle set starts at once; calls that arrive while a
	// batch of theirs runs wait for it and then this long for more to
	// join. 0 disables batching; SuggestedBatchWindow is the daemon's
	// default, chosen from the GPU measurements.
	BatchWindow time.Duration
	// BatchMaxTokens bounds the tokens of one merged backend call; a
	// call of that many tokens or more runs alone. 0 means
	// DefaultBatchMaxTokens; MaxTokens caps it.
	BatchMaxTokens int
	// Meter records the service's own instruments; nil records nothing.
	Meter metric.Meter
	// Tracer, when set, records child spans of each FusedMoE call's RPC
	// span: the wait for an execution slot (expertd.queue), a merged
	// batch (expertd.batch) and the backend call (expertd.kernel). nil
	// records none at no cost.
	Tracer trace.Tracer
	// SharedMemory serves RegisterSharedMemory and tensors in shared
	// memory (shm.go) to callers on this host: POSIX objects, and CUDA
	// IPC device memory when the backend is an IPCOpener. It needs the
	// grpc.Server built with ServerOptions, whose stats handler tracks
	// connections.
	SharedMemory bool
	// Ring serves AttachRing (ring.go): FusedMoE calls posted through a
	// call ring in a POSIX region; it needs SharedMemory.
	Ring bool
	// RingSpin is how long a ring's poller polls after its last call
	// before it sleeps on the doorbell; 0 sleeps at once. While it polls
	// the poller keeps one core busy. The daemon's default is
	// DefaultRingSpin.
	RingSpin time.Duration
	// RingMaxPerConn and RingMax bound the rings of one connection and of
	// the server; RingMaxSlotBytes bounds a ring's slot. 0 means
	// DefaultRingMaxPerConn, DefaultRingMax and DefaultRingMaxSlotBytes.
	RingMaxPerConn, RingMax int
	RingMaxSlotBytes        int64
	// Lanes serves OpenLane (with SharedMemory and a backend that opens
	// lanes). Off by default: a lane keeps stream memory waits pending on
	// the GPU between calls, and the daemon's device-wide synchronizations
	// (a workspace growing for a new shape, a set or region freed) wait
	// for them, so such an operation stalls until every lane is rung or
	// closed (docs/gpu-ordered.md, "Known limits").
	Lanes bool
	// MaxLanes bounds the GPU-ordered lanes (OpenLane, lane.go) open at
	// once on the server; 0 means DefaultLaneMax.
	MaxLanes int
	// MaxShmRegions bounds the shared-memory regions mapped at once over
	// all connections (registered, or unregistered but still used by a
	// call): the per-connection bound alone lets many connections hold
	// any number. 0 means DefaultMaxShmRegions. The daemon's flag is
	// -max-shm-regions, which refusals name.
	MaxShmRegions int
	// MaxShmBytes bounds the bytes of those regions (the daemon's
	// -max-shm-bytes); 0 means DefaultMaxShmBytes.
	MaxShmBytes int64
	// StreamWorkers, when > 0, is the pool of goroutines the daemon's
	// grpc.Server runs RPC handlers on instead of a new goroutine per
	// stream (grpc.NumStreamWorkers); the service only reports it.
	StreamWorkers int
	// KeepaliveMinTime is the shortest interval at which a client may
	// ping; one pinging more often is sent GOAWAY too_many_pings. The
	// daemon's grpc.Server enforces it; the service only reports it.
	KeepaliveMinTime time.Duration
	// KeepaliveTime and KeepaliveTimeout: the daemon pings a connection
	// idle for KeepaliveTime and closes it when no answer comes within
	// KeepaliveTimeout. The service only reports them.
	KeepaliveTime, KeepaliveTimeout time.Duration
	// MaxConnectionAge is how long a connection lives (±10% jitter) before
	// the daemon sends GOAWAY, so clients behind a load balancer spread
	// over new replicas; MaxConnectionAgeGrace is how long calls in
	// flight then have to finish. 0 means never. The service only
	// reports them.
	MaxConnectionAge, MaxConnectionAgeGrace time.Duration
	// Settings are the daemon's settings in force by flag name, as
	// GetServerInfo reports them; the service only reports them.
	Settings map[string]string
	// OnBackendFault, when set, is called when BackendFault starts
	// reporting a fault (with it) and when it clears (with nil), so the
	// daemon can take the replica out of health checks; it must not block.
	OnBackendFault func(fault error)
}

// Server is the ExpertService implementation. Create it with New, attach it
// with Register, and stop it with Shutdown.
type Server struct {
	pb.UnimplementedExpertServiceServer

	cfg     Config
	backend kernels.Backend
	log     *slog.Logger
	reg     *registry
	// weights is where loads open safetensors files and checkpoints.
	weights weights.Dir
	// slots are the cfg.MaxConcurrent execution slots and their queue.
	slots  *execSlots
	faults faults
	shm    *shmTable
	rings  *rings
	lanes  *lanes
	// batch runs every FusedMoE call on the backend, merging compatible
	// calls when cfg.BatchWindow is set.
	batch *batch.Backend
	// outputs recycles unbatched calls' output buffers (codec.Pool).
	outputs codec.Pool

	mu       sync.Mutex
	draining bool
	// calls counts calls admitted by begin, running those not yet done,
	// for Activity.
	calls, running atomic.Int64
	// busy, guarded by mu, is made when a call begins on an idle server
	// and closed, then cleared, when running drops back to 0 (WaitIdle).
	busy chan struct{}

	tokens      metric.Int64Counter
	queuedCalls metric.Int64ObservableGauge
	kernelTime  metric.Float64Histogram
	queueTime   metric.Float64Histogram
	loadedBytes metric.Int64ObservableGauge
	// backendAttr and callAttrSets are the per-call metric attributes,
	// built once per activation and expert_set label: OpenTelemetry sorts
	// and copies a set each time one is made, a measurable share of a
	// small call's CPU time. callAttrSets holds at most maxCallAttrSets.
	backendAttr  metric.MeasurementOption
	callAttrSets sync.Map // callAttrKey -> metric.MeasurementOption
	callAttrN    atomic.Int64
}

// callAttrKey names a call's metric attribute set.
type callAttrKey struct {
	act moe.Activation
	set string
}

// maxCallAttrSets bounds the cached attribute sets: set names come and go
// with loads and unloads, and a long-lived daemon must not keep them all.
const maxCallAttrSets = 1024

// New returns a Server running calls on backend. A nil logger discards.
func New(cfg Config, backend kernels.Backend, logger *slog.Logger) *Server {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if cfg.MaxConcurrent < 1 {
		cfg.MaxConcurrent = 1
	}
	switch {
	case cfg.MaxQueued == 0:
		cfg.MaxQueued = 4 * cfg.MaxConcurrent
	case cfg.MaxQueued < 0:
		cfg.MaxQueued = 0
	}
	if mt := backend.Capabilities().MaxTokens; mt > 0 && (cfg.MaxTokens == 0 || cfg.MaxTokens > mt) {
		cfg.MaxTokens = mt
	}
	if cfg.Version == "" {
		cfg.Version = "dev"
	}
	s := &Server{
		cfg:     cfg,
		weights: weights.Dir(cfg.WeightsDir),
		backend: backend,
		log:     logger,
		reg:     newRegistry(cfg.MaxLoadedBytes),
		slots:   newExecSlots(cfg),
		shm:     newShmTable(cfg, backend, logger),
		rings:   newRings(),
		lanes:   newLanes(),
	}
	s.reg.closeFn = s.free
	s.initMetrics(cfg.Meter)
	s.batch = newBatch(s, cfg)
	return s
}

// initMetrics creates the service's instruments. Instrument errors only
// degrade telemetry, so they are logged, never fatal.
func (s *Server) initMetrics(m metric.Meter) {
	if m == nil {
		m = noop.NewMeterProvider().Meter("")
	}
	backend := attribute.String("backend", s.backend.Name())
	s.backendAttr = metric.WithAttributeSet(attribute.NewSet(backend))
	var err error
	if s.tokens, err = m.Int64Counter("expertd.tokens",
		metric.WithDescription("Tokens processed by FusedMoE calls."),
		metric.WithUnit("{token}")); err != nil {
		s.log.Warn("metric not recorded", slog.String("metric", "expertd.tokens"), slog.Any("err", err))
		s.tokens, _ = noop.NewMeterProvider().Meter("").Int64Counter("")
	}
	if s.faults.counter, err = m.Int64Counter("expertd.backend.errors",
		metric.WithDescription("Backend Load and FusedMoE failures, by op and kind (out_of_memory, unsupported, canceled, internal)."),
		metric.WithUnit("{error}")); err != nil {
		s.log.Warn("metric not recorded", slog.String("metric", "expertd.backend.errors"), slog.Any("err", err))
		s.faults.counter, _ = noop.NewMeterProvider().Meter("").Int64Counter("")
	}
	if s.kernelTime, err = m.Float64Histogram("expertd.kernel.duration",
		metric.WithDescription("Backend compute time of one FusedMoE call."),
		metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(LatencyBuckets...)); err != nil {
		s.log.Warn("metric not recorded", slog.String("metric", "expertd.kernel.duration"), slog.Any("err", err))
		s.kernelTime, _ = noop.NewMeterProvider().Meter("").Float64Histogram("")
	}
	if s.queueTime, err = m.Float64Histogram("expertd.queue.duration",
		metric.WithDescription("Time a FusedMoE call waits, after validation, for an execution slot or for its merged batch to start."),
		metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(LatencyBuckets...)); err != nil {
		s.log.Warn("metric not recorded", slog.String("metric", "expertd.queue.duration"), slog.Any("err", err))
		s.queueTime, _ = noop.NewMeterProvider().Meter("").Float64Histogram("")
	}
	if s.loadedBytes, err = m.Int64ObservableGauge("expertd.loaded_expert_bytes",
		metric.WithDescription("Bytes of resident expert sets, including loads in flight."),
		metric.WithUnit("By"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			o.Observe(s.reg.usedBytes(), s.backendAttr)
			return nil
		})); err != nil {
		s.log.Warn("metric not recorded", slog.String("metric", "expertd.loaded_expert_bytes"), slog.Any("err", err))
	}
	if s.queuedCalls, err = m.Int64ObservableGauge("expertd.queued_calls",
		metric.WithDescription("FusedMoE calls waiting for an execution slot."),
		metric.WithUnit("{call}"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			o.Observe(s.slots.queued.Load())
			return nil
		})); err != nil {
		s.log.Warn("metric not recorded", slog.String("metric", "expertd.queued_calls"), slog.Any("err", err))
	}
	if _, err = m.Int64ObservableGauge("expertd.calls.running",
		metric.WithDescription("Calls admitted and not yet finished (FusedMoE, stream requests, loads); a drain waits for them."),
		metric.WithUnit("{call}"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			o.Observe(s.running.Load())
			return nil
		})); err != nil {
		s.log.Warn("metric not recorded", slog.String("metric", "expertd.calls.running"), slog.Any("err", err))
	}
	if _, err = m.Int64ObservableGauge("expertd.backend.faulty",
		metric.WithDescription("1 while the backend keeps failing (health NOT_SERVING until a call succeeds), else 0."),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			var v int64
			if s.BackendFault() != nil {
				v = 1
			}
			o.Observe(v, metric.WithAttributes(attribute.String("backend", s.backend.Name())))
			return nil
		})); err != nil {
		s.log.Warn("metric not recorded", slog.String("metric", "expertd.backend.faulty"), slog.Any("err", err))
	}
	s.shm.initMetrics(m)
	s.initRingMetrics(m)
	s.initLaneMetrics(m)
}

// Register attaches the service to a gRPC server.
func (s *Server) Register(r grpc.ServiceRegistrar) { pb.RegisterExpertServiceServer(r, s) }

// begin admits a call, or refuses it while draining; the caller must call
// the returned function when the call ends.
func (s *Server) begin() (func(), error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.draining {
		return nil, errDraining
	}
	s.calls.Add(1)
	s.running.Add(1)
	if s.busy == nil {
		s.busy = make(chan struct{})
	}
	return func() {
		if s.running.Add(-1) > 0 {
			return
		}
		// A call may have begun since the count hit 0; its end closes
		// busy then.
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.running.Load() == 0 && s.busy != nil {
			close(s.busy)
			s.busy = nil
		}
	}, nil
}

// WaitIdle waits until no call admitted by begin is running, or ctx
// ends. A call's status can reach its client before the call has ended:
// grpc-go sends the status of a failed receive (a message over the size
// limit, say) itself, from inside the handler's Recv, so the handler's
// clean-up (an upload's reservation, its buffers) runs after the client
// has its answer. Whoever reads the server's state after such an error
// waits here first.
func (s *Server) WaitIdle(ctx context.Context) error {
	s.mu.Lock()
	busy := s.busy
	s.mu.Unlock()
	if busy == nil {
		return nil
	}
	select {
	case <-busy:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Activity reports the calls admitted so far (FusedMoE, each request of a
// FusedMoEStream, LoadExperts, UnloadExperts, RegisterSharedMemory) and
// those still running: admitted unchanged between two looks, and none
// running, means the server was idle in between.
func (s *Server) Activity() (admitted, running int64) {
	return s.calls.Load(), s.running.Load()
}

// Queued is the number of FusedMoE calls waiting for an execution slot.
func (s *Server) Queued() int { return int(s.slots.queued.Load()) }

// LoadedBytes is the memory of resident expert sets plus the reservations
// of loads and inline sets in flight: what MaxLoadedBytes bounds.
func (s *Server) LoadedBytes() int64 { return s.reg.usedBytes() }

// Draining reports whether Shutdown has begun.
func (s *Server) Draining() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.draining
}

// Shutdown refuses new calls with Unavailable, waits for calls in flight
// until ctx ends, then unloads every expert set and unregisters every
// shared-memory region. It returns ctx's error if calls were still running;
// the sets and regions go regardless (one still in use is freed when its
// last call ends). The backend is the caller's to close.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.draining = true
	s.mu.Unlock()
	s.rings.closeAll()
	s.lanes.closeAll()
	s.batch.Flush()
	err := s.WaitIdle(ctx)
	if err == nil {
		err = s.lanes.wait(ctx)
	}
	s.reg.removeAll()
	s.shm.closeAll()
	return err
}

// free releases a set's backend memory once nothing uses it.
func (s *Server) free(e *entry) {
	if err := e.loaded.Close(); err != nil {
		s.log.Error("closing expert set", slog.String("name", e.info.GetName()), slog.Any("err", err))
	}
}

// ListExperts reports the loaded expert sets, sorted by name.
func (s *Server) ListExperts(ctx context.Context, _ *pb.ListExpertsRequest) (*pb.ListExpertsResponse, error) {
	return &pb.ListExpertsResponse{ExpertSets: s.reg.list()}, nil
}

// UnloadExperts removes a set; its memory is freed when running calls end.
func (s *Server) UnloadExperts(ctx context.Context, req *pb.UnloadExpertsRequest) (*pb.UnloadExpertsResponse, error) {
	done, err := s.begin()
	if err != nil {
		return nil, s.toStatus(ctx, "UnloadExperts", err)
	}
	defer done()
	if err := checkLen("name", req.GetName(), maxNameBytes); err != nil {
		return nil, s.toStatus(ctx, "UnloadExperts", err)
	}
	e, err := s.reg.remove(req.GetName())
	if err != nil {
		return nil, s.toStatus(ctx, "UnloadExperts", err)
	}
	s.log.InfoContext(ctx, "expert set unloaded", slog.String("name", req.GetName()), slog.Int64("bytes", e.bytes))
	return &pb.UnloadExpertsResponse{FreedBytes: e.bytes}, nil
}

// GetServerInfo reports the version, backend capabilities and limits.
func (s *Server) GetServerInfo(ctx context.Context, _ *pb.GetServerInfoRequest) (*pb.ServerInfo, error) {
	caps := s.backend.Capabilities()
	bi := &pb.ServerInfo_BackendInfo{
		Name:      s.backend.Name(),
		Devices:   caps.Devices,
		MaxTokens: int32(caps.MaxTokens),
		Details:   caps.Details,
	}
	for _, a := range caps.Activations {
		bi.Activations = append(bi.Activations, wireActivation(a))
	}
	for _, g := range caps.Granularities {
		bi.Granularities = append(bi.Granularities, g.String())
	}
	return &pb.ServerInfo{
		Version:  s.cfg.Version,
		Backends: []*pb.ServerInfo_BackendInfo{bi},
		Devices:  caps.Devices,
		Limits: &pb.ServerInfo_Limits{
			MaxMessageBytes:  s.cfg.MaxMessageBytes,
			MaxTokens:        int32(s.cfg.MaxTokens),
			MaxLoadedBytes:   s.cfg.MaxLoadedBytes,
			MaxConcurrent:    int32(s.cfg.MaxConcurrent),
			MaxShmRegions:    int32(s.shm.limitRegions()),
			MaxShmBytes:      s.shm.limitBytes(),
			MaxQueued:        int32(s.cfg.MaxQueued),
			BatchWindowNanos: s.cfg.BatchWindow.Nanoseconds(),
			BatchMaxTokens:   int32(batchMaxTokens(s.cfg)),
		},
		Ring: s.ringInfo(),
		Lane: s.laneInfo(),
		Transport: &pb.ServerInfo_Transport{
			StreamWorkers:              int32(s.cfg.StreamWorkers),
			KeepaliveMinTimeNanos:      s.cfg.KeepaliveMinTime.Nanoseconds(),
			KeepaliveTimeNanos:         s.cfg.KeepaliveTime.Nanoseconds(),
			KeepaliveTimeoutNanos:      s.cfg.KeepaliveTimeout.Nanoseconds(),
			MaxConnectionAgeNanos:      s.cfg.MaxConnectionAge.Nanoseconds(),
			MaxConnectionAgeGraceNanos: s.cfg.MaxConnectionAgeGrace.Nanoseconds(),
		},
		Settings: s.cfg.Settings,
	}, nil
}

// wireActivation is a as the contract numbers it (the model mirrors the
// wire enum's values; TestModelWireNames checks they agree).
func wireActivation(a moe.Activation) pb.Activation {
	if !a.Valid() {
		return pb.Activation_ACTIVATION_UNSPECIFIED
	}
	return pb.Activation(a)
}

// callAttrs are the metric attributes of a call of activation a on the
// set labelled set (a loaded set's name, or inlineLabel); a == 0 leaves
// the activation out (queueAttrs).
func (s *Server) callAttrs(a moe.Activation, set string) metric.MeasurementOption {
	k := callAttrKey{a, set}
	if o, ok := s.callAttrSets.Load(k); ok {
		return o.(metric.MeasurementOption)
	}
	kv := []attribute.KeyValue{attribute.String("backend", s.backend.Name()), attribute.String("expert_set", set)}
	if a != 0 {
		kv = append(kv, attribute.String("activation", a.String()))
	}
	o := metric.WithAttributeSet(attribute.NewSet(kv...))
	if s.callAttrN.Add(1) <= maxCallAttrSets {
		s.callAttrSets.Store(k, o)
	}
	return o
}

// queueAttrs are the queue-time histogram's attributes, cached as
// callAttrs are; the histogram does not split by activation.
func (s *Server) queueAttrs(set string) metric.MeasurementOption { return s.callAttrs(0, set) }
