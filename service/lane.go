package service

import (
	"context"
	"errors"
	"log/slog"
	"sync"

	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/batch"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// GPU-ordered lanes (OpenLane, docs/gpu-ordered.md): a caller whose
// tensors live on the server's GPU registers them as CUDA IPC regions,
// then opens a lane for one call shape over them. The backend keeps calls
// enqueued on a stream of its own, each waiting for a doorbell in device
// memory the caller rings from its own stream; the service validates the
// call once, as a FusedMoE request, holds what it uses (the regions, the
// expert set) and a lane slot while the OpenLane stream lasts, and closes
// the lane when it ends: the caller cancelling, its connection closing, or
// the server draining.

// LaneOpener is a backend that serves lanes; the cuda backend implements
// it.
type LaneOpener interface {
	// OpenLane opens a lane running req (device tensors and output, no
	// hidden scales or precomputed routing) on set, with depth calls
	// enqueued ahead. Errors wrap kernels.ErrUnsupported when the device
	// cannot serve lanes.
	OpenLane(set kernels.Loaded, req *moe.Request, depth int) (kernels.Lane, error)
	// MaxLaneDepth is the largest depth OpenLane takes.
	MaxLaneDepth() int
}

// DefaultLaneMax bounds the lanes open at once: each holds a stream, a
// workspace and a launcher thread in the backend, and its calls' graphs
// enqueued on the GPU.
const DefaultLaneMax = 8

// defaultLaneDepth is OpenLaneRequest.depth 0: calls enough that a chain
// of decode-sized layers (tens of microseconds each) never waits for the
// launcher thread, whose wake-up after a call takes about as long.
const defaultLaneDepth = 8

// lanes counts the open lanes against the cap and keeps what the metrics
// report.
type lanes struct {
	mu   sync.Mutex
	open map[*servedLane]struct{}
	// servedClosed is the calls served by lanes since closed.
	servedClosed uint64
	// closing is closed when the server drains; wg counts the lanes'
	// handlers, which Shutdown waits for.
	closing chan struct{}
	closed  bool
	wg      sync.WaitGroup
}

func newLanes() *lanes { return &lanes{open: map[*servedLane]struct{}{}, closing: make(chan struct{})} }

// servedLane is one open lane.
type servedLane struct {
	lane kernels.Lane
	set  string
}

// laneMax is Config.MaxLanes with its default applied.
func (c Config) laneMax() int {
	if c.MaxLanes < 1 {
		return DefaultLaneMax
	}
	return c.MaxLanes
}

// closeAll makes every lane's handler close it (Shutdown).
func (ls *lanes) closeAll() {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if !ls.closed {
		ls.closed = true
		close(ls.closing)
	}
}

// wait waits for the lanes' handlers to end, or for ctx.
func (ls *lanes) wait(ctx context.Context) error {
	done := make(chan struct{})
	go func() {
		ls.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// usage is the lanes open and the calls all lanes have served.
func (ls *lanes) usage() (open int64, served uint64) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	served = ls.servedClosed
	for l := range ls.open {
		served += l.lane.Served()
	}
	return int64(len(ls.open)), served
}

func (s *Server) initLaneMetrics(m metric.Meter) {
	if _, err := m.Int64ObservableGauge("expertd.lane.open",
		metric.WithDescription("GPU-ordered lanes open (OpenLane)."),
		metric.WithUnit("{lane}"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			n, _ := s.lanes.usage()
			o.Observe(n)
			return nil
		})); err != nil {
		s.log.Warn("metric not recorded", slog.String("metric", "expertd.lane.open"), slog.Any("err", err))
	}
	if _, err := m.Int64ObservableCounter("expertd.lane.calls",
		metric.WithDescription("Calls GPU-ordered lanes have run (rung from the callers' streams; no RPC each)."),
		metric.WithUnit("{call}"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			_, n := s.lanes.usage()
			o.Observe(int64(n))
			return nil
		})); err != nil {
		s.log.Warn("metric not recorded", slog.String("metric", "expertd.lane.calls"), slog.Any("err", err))
	}
}

// laneInfo is GetServerInfo's view of the lane settings.
func (s *Server) laneInfo() *pb.ServerInfo_LaneInfo {
	info := &pb.ServerInfo_LaneInfo{MaxLanes: int32(s.cfg.laneMax())}
	if lo, ok := s.backend.(LaneOpener); ok {
		info.Enabled = s.cfg.SharedMemory && s.cfg.Lanes
		info.MaxDepth = uint32(lo.MaxLaneDepth())
	}
	return info
}

// OpenLane serves a lane until the stream ends.
func (s *Server) OpenLane(req *pb.OpenLaneRequest, stream grpc.ServerStreamingServer[pb.OpenLaneResponse]) error {
	return s.toStatus(stream.Context(), "OpenLane", s.openLane(req, stream))
}

// callField makes a refusal of the lane's call name the field as the
// OpenLaneRequest holds it (call.<field>).
func callField(err error) error {
	var re *requestError
	if errors.As(err, &re) && re.field != "" {
		c := *re
		c.field = "call." + re.field
		return &c
	}
	return err
}

func (s *Server) openLane(req *pb.OpenLaneRequest, stream grpc.ServerStreamingServer[pb.OpenLaneResponse]) error {
	ctx := stream.Context()
	if !s.cfg.SharedMemory {
		return errShmDisabled
	}
	if !s.cfg.Lanes {
		return codedf(codes.FailedPrecondition, "", "GPU-ordered lanes are off: run expertd with -lanes (experimental, docs/gpu-ordered.md), or use a call ring or FusedMoE")
	}
	lo, ok := s.backend.(LaneOpener)
	if !ok {
		return codedf(codes.FailedPrecondition, "", "the %s backend serves no GPU-ordered lanes; run expertd with -backend cuda, or use a call ring or FusedMoE", s.backend.Name())
	}
	if s.Draining() {
		return errDraining
	}
	depth := int(req.GetDepth())
	if depth == 0 {
		depth = defaultLaneDepth
	}
	if max := lo.MaxLaneDepth(); depth > max {
		return invalidf("depth", "%d: want 1 to %d", depth, max)
	}
	call := req.GetCall()
	switch {
	case call == nil:
		return invalidf("call", "missing: the FusedMoE call the lane runs")
	case call.GetWeights() != nil:
		return invalidf("call.weights", "a lane runs a loaded set: set call.expert_set")
	case call.GetReturnRouting():
		return invalidf("call.return_routing", "a lane returns no routing; leave it false")
	case call.GetHiddenStatesScale() != nil:
		return invalidf("call.hidden_states_scale", "a lane takes no per-call hidden scales: send BF16 or FP32 hidden states, or FP8 with the set's static scale")
	case call.GetTopkIds() != nil || call.GetTopkWeights() != nil:
		return invalidf("call.topk_ids", "a lane routes from router_logits; leave topk_ids and topk_weights unset")
	}
	sh, err := s.shm.resolve(ctx, call)
	if err != nil {
		return callField(err)
	}
	defer sh.release()
	c, err := s.prepare(ctx, call, sh)
	if err != nil {
		return callField(err)
	}
	defer c.close()
	const onDevice = "must be in a SHARED_MEMORY_KIND_CUDA_IPC region registered on this connection"
	switch {
	case c.req.Hidden.Dev == 0:
		return invalidf("call.hidden_states.shm", "a lane's hidden states %s", onDevice)
	case c.req.Logits.Dev == 0:
		return invalidf("call.router_logits.shm", "a lane's router logits %s", onDevice)
	case c.req.OutDev == 0:
		return invalidf("call.output_shm", "a lane's output %s", onDevice)
	}

	ls := s.lanes
	ls.mu.Lock()
	switch {
	case ls.closed:
		err = errDraining
	case len(ls.open) >= s.cfg.laneMax():
		err = limitf("", "lane-max", int64(s.cfg.laneMax()), 0, "the server already serves %d lanes (-lane-max %d); close one, or use a call ring", len(ls.open), s.cfg.laneMax())
	}
	if err != nil {
		ls.mu.Unlock()
		return err
	}
	// A placeholder holds the slot while the backend opens the lane.
	sl := &servedLane{set: c.setLabel, lane: pendingLane{}}
	ls.open[sl] = struct{}{}
	ls.wg.Add(1)
	ls.mu.Unlock()
	defer ls.wg.Done()
	lane, err := lo.OpenLane(batch.Inner(c.loaded), c.req, depth)
	ls.mu.Lock()
	if err != nil {
		delete(ls.open, sl)
	} else {
		sl.lane = lane
	}
	ls.mu.Unlock()
	if err != nil {
		if errors.Is(err, kernels.ErrUnsupported) {
			return codedf(codes.FailedPrecondition, "", "backend %s cannot serve a lane on this device: %v", s.backend.Name(), err)
		}
		return s.backendDone(ctx, "open_lane", err)
	}
	// Closed before the deferred releases of the regions and the set: the
	// lane's calls read and write both until it is closed.
	defer func() {
		if err := lane.Close(); err != nil {
			s.log.ErrorContext(ctx, "closing a lane", slog.String("expert_set", sl.set), slog.Any("err", err))
		}
		ls.mu.Lock()
		delete(ls.open, sl)
		ls.servedClosed += lane.Served()
		ls.mu.Unlock()
	}()
	f := lane.Flags()
	if err := stream.Send(&pb.OpenLaneResponse{
		FlagsCudaIpcHandle: f.Handle, FlagsByteSize: f.Bytes, DoorbellOffset: f.Doorbell, DoneOffset: f.Done,
		Depth: uint32(depth), Mps: lane.MPS(), SkipsOnClose: lane.SkipsOnClose(),
	}); err != nil {
		return err
	}
	id, _ := s.shm.owner(ctx)
	s.log.InfoContext(ctx, "lane opened", slog.String("expert_set", sl.set), slog.Int("tokens", c.req.M()),
		slog.Int("depth", depth), slog.Bool("mps", lane.MPS()), slog.Uint64("conn", id))
	var cause error
	select {
	case <-ctx.Done():
		cause = codedf(codes.Canceled, "", "the lane's stream ended: %v", ctx.Err())
	case <-ls.closing:
		cause = errDraining
	}
	s.log.InfoContext(ctx, "lane closed", slog.String("expert_set", sl.set), slog.Uint64("calls", lane.Served()),
		slog.Uint64("conn", id), slog.Any("cause", cause))
	return cause
}

// pendingLane stands in for a lane the backend is still opening: it has
// served nothing.
type pendingLane struct{ kernels.Lane }

func (pendingLane) Served() uint64 { return 0 }
