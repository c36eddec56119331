package service

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"google.golang.org/grpc"

	"github.com/expertd/expertd/codec"
	"github.com/expertd/expertd/internal/spans"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// FusedMoE runs one MoE layer.
func (s *Server) FusedMoE(ctx context.Context, req *pb.FusedMoERequest) (*pb.FusedMoEResponse, error) {
	start := time.Now()
	resp, out, err := s.fusedMoE(ctx, start, req)
	if resp.GetTimings() != nil {
		resp.Timings.ReceiveNanos = receiveNanos(ctx, start)
	}
	// gRPC marshals a handler's response whenever it returns one, so the
	// output buffer goes back to the pool once it is written.
	s.outputs.Lend(out)
	return resp, s.toStatus(ctx, "FusedMoE", err)
}

// FusedMoEStream answers each request in order. Up to MaxConcurrent
// requests of one stream run at once (so a GPU backend can overlap one
// call's copies with another's compute), but responses leave in request
// order. The first failure ends the stream with that request's status, so
// a client never has to match responses to requests.
//
// The stream is served by up to MaxConcurrent workers that take turns
// receiving (streamCalls): the worker that receives a request runs it and
// sends its response itself, after handing the receive to an idle one.
// A lone call in flight thus goes from the receive to the backend to the
// send on one goroutine, with no hand-off on its path, while pipelined
// calls still run side by side.
func (s *Server) FusedMoEStream(stream grpc.BidiStreamingServer[pb.FusedMoERequest, pb.FusedMoEResponse]) error {
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel() // stops the calls still running after a failure
	sc := &streamCalls{s: s, stream: stream, ctx: ctx, cancel: cancel, recv: make(chan struct{}, 1), done: make(chan struct{}), workers: 1}
	sc.turnCond.L = &sc.mu
	sc.idle.L = &sc.mu
	sc.recv <- struct{}{}
	// The handler's goroutine only waits: a worker may be blocked in
	// Recv when a call fails, and only the handler's return ends that
	// Recv, so the handler must never be that worker.
	go sc.work()
	sc.mu.Lock()
	defer sc.mu.Unlock()
	for !sc.ended || sc.active > 0 {
		sc.idle.Wait()
	}
	if sc.err != nil {
		return sc.err
	}
	return sc.recvErr
}

// streamCalls is the state of one FusedMoEStream's workers.
type streamCalls struct {
	s      *Server
	stream grpc.BidiStreamingServer[pb.FusedMoERequest, pb.FusedMoEResponse]
	ctx    context.Context
	cancel context.CancelFunc
	// recv is the receive token (capacity 1): only its holder calls
	// stream.Recv, and it numbers what it receives (next).
	recv chan struct{}
	next uint64

	mu sync.Mutex
	// turnCond signals a change of turn (the next response to send) or
	// a failure; idle signals the end, or active reaching 0 after it.
	turnCond, idle sync.Cond
	turn           uint64
	// workers counts the goroutines serving the stream (the handler's
	// is not one), active the calls received and not yet answered (or
	// dropped).
	workers, active int
	// ended is set once no more requests will be taken: the client
	// closed its side, receiving failed, or a call failed (err).
	ended bool
	// err is the status the stream ends with: the first failed call's,
	// or a send's error. recvErr is a failed receive's.
	err, recvErr error
	// done is closed when ended is set, to release idle workers.
	done     chan struct{}
	doneOnce sync.Once
}

// end stops taking requests; sc.mu must be held.
func (sc *streamCalls) end() {
	sc.ended = true
	sc.doneOnce.Do(func() { close(sc.done) })
	sc.turnCond.Broadcast()
	sc.idle.Broadcast()
}

// work is one worker: take the receive token, receive a request, pass
// the token on, run the request, send its response in its turn; repeat
// until the stream ends.
func (sc *streamCalls) work() {
	for {
		select {
		case <-sc.done:
			return
		default:
		}
		select {
		case <-sc.recv:
		case <-sc.done:
			return
		}
		req, err := sc.stream.Recv()
		start := time.Now()
		sc.mu.Lock()
		if err != nil || sc.ended {
			if err != nil && !errors.Is(err, io.EOF) && sc.recvErr == nil {
				sc.recvErr = err
			}
			sc.end()
			sc.mu.Unlock()
			if err == nil {
				codec.Release(req)
			}
			sc.recv <- struct{}{}
			return
		}
		seq := sc.next
		sc.next++
		sc.active++
		// Someone must be free to receive the next request while this
		// one runs: start a worker when every one is busy, up to the
		// stream's bound on calls in flight.
		spawn := sc.active == sc.workers && sc.workers < sc.s.cfg.MaxConcurrent
		if spawn {
			sc.workers++
		}
		sc.mu.Unlock()
		if spawn {
			go sc.work()
		}
		// The next receive may start only once this worker is done with
		// the stream's receive state: it is handed on here, before the
		// call, so the receive overlaps the call.
		sc.recv <- struct{}{}
		sc.answer(seq, start, req)
	}
}

// answer runs req (number seq of the stream) and sends its response when
// every earlier one has been sent.
func (sc *streamCalls) answer(seq uint64, start time.Time, req *pb.FusedMoERequest) {
	resp, out, err := sc.s.fusedMoE(sc.ctx, start, req)
	codec.Release(req) // the call is over: its buffer is free
	sc.mu.Lock()
	for sc.turn != seq && sc.err == nil {
		sc.turnCond.Wait()
	}
	failed := sc.err != nil
	sc.mu.Unlock()
	// Only the worker whose turn it is gets here with failed false, so
	// sends never overlap and leave in order.
	if !failed {
		if err != nil {
			err = sc.s.toStatus(sc.ctx, "FusedMoEStream", err)
		} else {
			sc.s.outputs.Lend(out)
			if err = sc.stream.Send(resp); err != nil {
				sc.s.outputs.Unlend(out) // not marshalled: drop it
			}
		}
	}
	// A response dropped after a failure keeps its buffer: the garbage
	// collector takes it, which is safe.
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if err != nil && sc.err == nil {
		sc.err = err
		sc.cancel()
		sc.end()
	}
	sc.turn++
	sc.turnCond.Broadcast()
	if sc.active--; sc.active == 0 {
		sc.idle.Broadcast()
	}
}

// fusedMoE is one call, in the steps every call takes: prepare (resolve
// shared memory and the experts, convert and validate), run (through the
// batcher or alone, on an execution slot), respond. out is the response's
// output buffer when it came from s.outputs (the caller lends it to the
// send), nil otherwise.
func (s *Server) fusedMoE(ctx context.Context, start time.Time, req *pb.FusedMoERequest) (resp *pb.FusedMoEResponse, out []byte, err error) {
	done, err := s.begin()
	if err != nil {
		return nil, nil, err
	}
	defer done()
	sh, err := s.shm.resolve(ctx, req)
	if err != nil {
		return nil, nil, err
	}
	defer sh.release()
	c, err := s.prepare(ctx, req, sh)
	if err != nil {
		return nil, nil, err
	}
	defer c.close()
	res, queued, out, err := s.runCall(ctx, c, sh)
	if err != nil {
		return nil, nil, err
	}
	resp, err = s.respond(ctx, start, req, c, res, queued, sh)
	if err != nil {
		return nil, nil, err
	}
	return resp, out, nil
}

// fusedCall is a validated call and what it holds until it finishes.
type fusedCall struct {
	// ent is the named set's registry entry, nil for inline weights;
	// setLabel is the set's expert_set label.
	ent      *entry
	setLabel string
	loaded   kernels.Loaded
	set      *moe.ExpertSet
	req      *moe.Request
	// decoded is when validation ended; loadNanos is an inline set's
	// Load, reported as host-to-device time.
	decoded   time.Time
	loadNanos int64
	// undo releases what the call holds, last first.
	undo []func()
}

func (c *fusedCall) close() {
	for i := len(c.undo) - 1; i >= 0; i-- {
		c.undo[i]()
	}
	c.undo = nil
}

// prepare finds the call's experts (a loaded set, or inline weights it
// loads for this call) and validates the request against them.
func (s *Server) prepare(ctx context.Context, req *pb.FusedMoERequest, sh *shmCall) (_ *fusedCall, err error) {
	c := &fusedCall{setLabel: inlineLabel}
	// On failure, give back what the call took so far.
	defer func() {
		if err != nil {
			c.close()
		}
	}()
	lim := moe.Limits{MaxTokens: s.cfg.MaxTokens}
	switch ex := req.GetExperts().(type) {
	case *pb.FusedMoERequest_ExpertSet:
		if err := checkLen("expert_set", ex.ExpertSet, maxNameBytes); err != nil {
			return nil, err
		}
		ent, err := s.reg.acquire(ex.ExpertSet)
		if err != nil {
			return nil, err
		}
		c.undo = append(c.undo, func() { s.reg.done(ent) })
		c.ent, c.setLabel = ent, ex.ExpertSet
		c.loaded, c.set = ent.loaded, ent.loaded.Set()
		if c.req, err = checkRequest(req, c.set, lim, sh.placed()); err != nil {
			return nil, err
		}
		c.decoded = time.Now()
	case *pb.FusedMoERequest_Weights:
		// Validate the whole call before Load: a device backend copies the
		// weights to the GPU, which a bad request should never cost.
		var n int64
		if c.set, n, err = inlineSet(ex.Weights, sh.placed()); err != nil {
			return nil, err
		}
		if c.req, err = checkRequest(req, c.set, lim, sh.placed()); err != nil {
			return nil, err
		}
		if err := s.reg.reserve("weights", n); err != nil {
			return nil, err
		}
		c.undo = append(c.undo, func() { s.reg.release(n) })
		c.decoded = time.Now()
		loaded, err := s.backend.Load(ctx, c.set)
		if err = s.backendDone(ctx, "load", err); err != nil {
			return nil, err
		}
		c.loaded, c.loadNanos = loaded, time.Since(c.decoded).Nanoseconds()
		c.undo = append(c.undo, func() {
			if err := loaded.Close(); err != nil {
				s.log.ErrorContext(ctx, "closing inline expert set", "err", err)
			}
		})
	default:
		return nil, invalidf("experts", "set expert_set (a loaded set's name) or weights (inline)")
	}
	return c, nil
}

// runCall places the call's output and runs it through s.batch (merged
// with other calls, or alone, on an execution slot). queued is when the
// backend call started; out is the pooled output buffer the response
// lends, nil when the output is elsewhere.
func (s *Server) runCall(ctx context.Context, c *fusedCall, sh *shmCall) (res *moe.Result, queued time.Time, out []byte, err error) {
	kreq := c.req
	// The backend writes the output where it is going: device memory
	// (kreq.OutDev, from output_shm), a POSIX output_shm (no copy
	// afterwards), or a recycled buffer, since fresh memory costs a page
	// fault per 4 KiB on first write (codec.Pool). A batch of one call
	// runs that call's own request, so this holds for it too; a merged
	// batch writes its own output and hands out views of it.
	pooled := false
	switch {
	case kreq.OutDev != 0:
	case sh.outBuffer() != nil:
		kreq.Out = sh.outBuffer()
	default:
		kreq.Out = s.outputs.Get(kreq.M() * c.set.K * kreq.OutDType.Size())
		pooled = true
	}
	res, queued, err = s.batch.Run(withSetLabel(ctx, c.setLabel), c.loaded, kreq)
	// A failed call's buffer is dropped, never reused: the backend may
	// have been stopped mid-write.
	if err != nil {
		return nil, queued, nil, err
	}
	if pooled {
		out = kreq.Out
		if len(res.Output) == 0 || &res.Output[0] != &out[0] {
			// A merged batch's view: the buffer was never written.
			s.outputs.Put(out)
			out = nil
		}
	}
	return res, queued, out, nil
}

// respond builds the response of a call that ran and records its metrics.
func (s *Server) respond(ctx context.Context, start time.Time, req *pb.FusedMoERequest, c *fusedCall, res *moe.Result, queued time.Time, sh *shmCall) (*pb.FusedMoEResponse, error) {
	m, k := int64(c.req.M()), int64(c.set.K)
	topk := int64(c.req.Routing.TopK)
	s.tokens.Add(ctx, m, s.callAttrs(c.set.Activation, c.setLabel))

	resp := &pb.FusedMoEResponse{
		Output:  &pb.Tensor{Dtype: wireDType(c.req.OutDType), Shape: []int64{m, k}, Source: &pb.Tensor_Data{Data: res.Output}},
		Backend: s.backend.Name(),
	}
	// writeOutput changes only calls with output_shm, which have no pooled
	// buffer: nothing goes back to the pool here.
	if err := sh.writeOutput(resp); err != nil {
		return nil, err
	}
	if req.GetReturnRouting() {
		resp.TopkIds = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_INT32, Shape: []int64{m, topk}, Source: &pb.Tensor_Data{Data: int32Bytes(res.TopKIDs)}}
		resp.TopkWeights = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT32, Shape: []int64{m, topk}, Source: &pb.Tensor_Data{Data: moe.Float32Bytes(res.TopKWeights)}}
	}
	resp.Timings = &pb.Timings{
		DecodeNanos: c.decoded.Sub(start).Nanoseconds(),
		QueueNanos:  queued.Sub(c.decoded).Nanoseconds() - c.loadNanos,
		H2DNanos:    c.loadNanos,
		KernelNanos: res.KernelNanos,
		TotalNanos:  time.Since(start).Nanoseconds(),
	}
	s.queueTime.Record(ctx, float64(resp.Timings.QueueNanos)/1e9, s.queueAttrs(c.setLabel))
	return resp, nil
}

// compute is one backend call on req, made by s.batch holding an
// execution slot. It checks the result's sizes and records the call's
// outcome and kernel time (labelled with setLabel), once per backend call
// however many FusedMoE calls a batch merged into it.
func (s *Server) compute(ctx context.Context, setLabel string, loaded kernels.Loaded, req *moe.Request) (*moe.Result, error) {
	ctx, span := s.startSpan(ctx, spanKernel)
	defer span.End()
	spans.SetAttrs(span, func() []attribute.KeyValue {
		return []attribute.KeyValue{attribute.String("expertd.backend", s.backend.Name()), attribute.String("expertd.expert_set", setLabel),
			attribute.Int("expertd.tokens", req.M())}
	})
	res, err := s.run(ctx, loaded, req)
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
		return nil, s.backendDone(ctx, "fused_moe", err)
	}
	set := loaded.Set()
	m, k := int64(req.M()), int64(set.K)
	topk := int64(req.Routing.TopK)
	outBytes := m * k * int64(req.OutDType.Size())
	if req.OutDev != 0 {
		outBytes = 0 // written to device memory
	}
	if int64(len(res.Output)) != outBytes || !kernels.RoutingSized(req, res) {
		return nil, s.backendDone(ctx, "fused_moe", fmt.Errorf("backend %s returned %d output bytes and %d/%d routing values for [%d %d] %v, top-k %d",
			s.backend.Name(), len(res.Output), len(res.TopKIDs), len(res.TopKWeights), m, k, req.OutDType, topk))
	}
	s.backendDone(ctx, "fused_moe", nil) //nolint:errcheck // nil in, nil out
	s.kernelTime.Record(ctx, float64(res.KernelNanos)/1e9, s.callAttrs(set.Activation, setLabel))
	return res, nil
}

// run calls the backend and times the call for the queue's retry delay.
func (s *Server) run(ctx context.Context, loaded kernels.Loaded, req *moe.Request) (*moe.Result, error) {
	start := time.Now()
	defer func() { s.slots.noteCall(time.Since(start)) }()
	defer func() {
		// A panic counts as a backend fault; the middleware still turns
		// it into Internal.
		if p := recover(); p != nil {
			s.backendDone(ctx, "fused_moe", fmt.Errorf("backend %s panicked: %v", s.backend.Name(), p)) //nolint:errcheck // re-panicking
			panic(p)
		}
	}()
	return s.backend.FusedMoE(ctx, loaded, req)
}

func int32Bytes(v []int32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(x))
	}
	return b
}
