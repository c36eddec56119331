package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/codec"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// Stream is an open FusedMoEStream: many calls over one gRPC stream,
// answered one for one in request order, so a caller can keep several
// requests in flight without a round trip each. One goroutine may Send
// while another Recvs. The first failing request ends the stream: Recv
// returns its status. A stream is not retried.
type Stream struct {
	s      pb.ExpertService_FusedMoEStreamClient
	cancel context.CancelFunc
	c      *Client
	// recv parses each response from a pooled buffer (see
	// FusedMoEResult.Release); only the goroutine in Recv uses it.
	recv *codec.Receiver
}

// FusedMoEStream opens a stream of FusedMoE calls; ctx bounds the whole
// stream. Close it with CloseSend, then Recv until io.EOF, or cancel ctx.
func (c *Client) FusedMoEStream(ctx context.Context) (*Stream, error) {
	ctx, cancel := c.callContext(ctx)
	recv := &codec.Receiver{}
	s, err := c.rpc.FusedMoEStream(ctx, grpc.ForceCodecV2(recv))
	if err != nil {
		cancel()
		return nil, wrap("FusedMoEStream", err)
	}
	return &Stream{s: s, cancel: cancel, c: c, recv: recv}, nil
}

// Send queues one request. A request the client refuses locally is an
// InvalidArgument error and is not sent; the stream stays usable. After
// the server has ended the stream, Send returns io.EOF and Recv says why.
// Send returns before the request is on the wire, and large tensors are
// sent without a copy: their Data must not change until Recv has returned
// this request's result.
func (s *Stream) Send(req *FusedMoERequest) error {
	p, err := req.proto()
	if err != nil {
		return invalid("FusedMoEStream", err)
	}
	if err := s.s.Send(p); err != nil {
		if errors.Is(err, io.EOF) {
			return io.EOF
		}
		return wrap("FusedMoEStream", err)
	}
	return nil
}

// Recv returns the result of the oldest unanswered request, or io.EOF
// once the stream ended cleanly after CloseSend.
func (s *Stream) Recv() (*FusedMoEResult, error) {
	resp, err := s.s.Recv()
	if errors.Is(err, io.EOF) {
		s.cancel()
		return nil, io.EOF
	}
	if err != nil {
		s.cancel()
		return nil, wrap("FusedMoEStream", err)
	}
	res, err := resultFromProto(resp)
	if err != nil {
		s.recv.Take().Release()
		return nil, wrap("FusedMoEStream", fmt.Errorf("malformed response: %w", err))
	}
	res.recv = s.recv.Take()
	s.c.viewOutputs(res)
	return res, nil
}

// CloseSend says no more requests will come; results still pending can
// be received.
func (s *Stream) CloseSend() error { return s.s.CloseSend() }

// Pipeline keeps up to a fixed number of FusedMoE calls in flight on one
// FusedMoEStream, for a caller with independent work to overlap (the
// micro-batches of a decode step, several sequences' layers): Go sends a
// call and returns at once while fewer than depth are unanswered, and
// each Call's Result waits for its answer. With depth 1 it is a
// sequential caller on one stream (Call), which skips the per-call
// stream set-up a unary call pays.
//
// Results are received by the goroutine that waits for one (Result, or
// Go waiting for room), never by a goroutine of the SDK's, so a lone
// call's answer reaches its caller with no extra hand-off. A Pipeline is
// safe for concurrent use; calls are sent in the order Go is called. The
// first call the server fails ends the pipeline: that call and every one
// after it fail with its status, as does any later Go. It is not retried.
type Pipeline struct {
	s     *Stream
	depth int
	// sendMu orders Go calls: a call is queued and sent under it.
	sendMu sync.Mutex
	// recv is a token of capacity 1: its holder is the one goroutine
	// receiving from the stream.
	recv chan struct{}

	mu sync.Mutex
	// queue holds the calls sent and not answered, oldest first.
	queue []*Call
	// err ends the pipeline: every queued and later call fails with it.
	err error
}

// Call is one FusedMoE call of a Pipeline.
type Call struct {
	p    *Pipeline
	done chan struct{}
	res  *FusedMoEResult
	err  error
}

// errPipelineClosed is what calls fail with after Close.
var errPipelineClosed = status.Error(codes.FailedPrecondition, "expertd FusedMoEStream: pipeline closed")

// Pipeline opens a FusedMoEStream that keeps up to depth calls in flight
// (depth >= 1; the server runs at most its -max-concurrent of one stream
// at once, so more only queue there). ctx bounds the whole stream:
// cancelling it fails every call not yet answered. Close it when done.
func (c *Client) Pipeline(ctx context.Context, depth int) (*Pipeline, error) {
	if depth < 1 {
		return nil, invalid("FusedMoEStream", fmt.Errorf("pipeline depth %d: want >= 1", depth))
	}
	s, err := c.FusedMoEStream(ctx)
	if err != nil {
		return nil, err
	}
	return &Pipeline{s: s, depth: depth, recv: make(chan struct{}, 1)}, nil
}

// Go sends req and returns its Call. When depth calls are unanswered it
// first waits for the oldest one's result. A request the client refuses
// locally is an InvalidArgument error and is not sent; the pipeline stays
// usable. req's tensors are sent without a copy: their Data must not
// change until this call's Result has returned.
func (p *Pipeline) Go(req *FusedMoERequest) (*Call, error) {
	msg, err := req.proto()
	if err != nil {
		return nil, invalid("FusedMoEStream", err)
	}
	p.sendMu.Lock()
	defer p.sendMu.Unlock()
	for {
		p.mu.Lock()
		err, n := p.err, len(p.queue)
		var oldest *Call
		if n > 0 {
			oldest = p.queue[0]
		}
		p.mu.Unlock()
		if err != nil {
			return nil, err
		}
		if n < p.depth {
			break
		}
		oldest.wait()
	}
	call := &Call{p: p, done: make(chan struct{})}
	// Queued before it is sent, so its answer always finds it.
	p.mu.Lock()
	p.queue = append(p.queue, call)
	p.mu.Unlock()
	if err := p.s.s.Send(msg); err != nil && !errors.Is(err, io.EOF) {
		p.fail(wrap("FusedMoEStream", err))
	}
	// On io.EOF the server has ended the stream; receiving says why, and
	// fails this call with it.
	return call, nil
}

// Call sends req and waits for its result: Go, then Result.
func (p *Pipeline) Call(req *FusedMoERequest) (*FusedMoEResult, error) {
	call, err := p.Go(req)
	if err != nil {
		return nil, err
	}
	return call.Result()
}

// Close ends the stream: it waits for the calls in flight (their Results
// stay readable), then closes it. It returns the error that ended the
// pipeline early, if one did.
func (p *Pipeline) Close() error {
	p.sendMu.Lock()
	defer p.sendMu.Unlock()
	p.mu.Lock()
	err := p.err
	p.mu.Unlock()
	if err == nil {
		p.s.CloseSend() //nolint:errcheck // receiving reports the stream's end
		for {
			p.mu.Lock()
			var oldest *Call
			if len(p.queue) > 0 {
				oldest = p.queue[0]
			}
			p.mu.Unlock()
			if oldest == nil {
				break
			}
			oldest.wait()
		}
		// The server answers io.EOF once every call is answered.
		p.recv <- struct{}{}
		if _, rerr := p.s.Recv(); !errors.Is(rerr, io.EOF) {
			if rerr == nil {
				rerr = wrap("FusedMoEStream", status.Error(codes.Internal, "a response without a request"))
			}
			err = rerr
		}
		<-p.recv
	}
	p.fail(errPipelineClosed)
	p.s.cancel()
	if errors.Is(err, errPipelineClosed) {
		return nil
	}
	return err
}

// fail ends the pipeline with err (the first error wins) and fails every
// call not yet answered.
func (p *Pipeline) fail(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err == nil {
		p.err = err
	}
	for _, c := range p.queue {
		c.err = p.err
		close(c.done)
	}
	p.queue = nil
}

// Done is closed once the call's result (or error) is known. Result
// still has to be called to receive it: until then nothing may.
func (c *Call) Done() <-chan struct{} { return c.done }

// Result waits for the call's answer, receiving the answers of the calls
// before it on the way.
func (c *Call) Result() (*FusedMoEResult, error) {
	c.wait()
	return c.res, c.err
}

// wait returns once c is answered, receiving from the stream whenever no
// other goroutine does.
func (c *Call) wait() {
	p := c.p
	for {
		select {
		case <-c.done:
			return
		case p.recv <- struct{}{}:
		}
		select {
		case <-c.done:
		default:
			p.receiveOne()
		}
		<-p.recv
	}
}

// receiveOne receives the oldest call's answer; the caller holds p.recv.
func (p *Pipeline) receiveOne() {
	res, err := p.s.Recv()
	if errors.Is(err, io.EOF) {
		err = wrap("FusedMoEStream", status.Error(codes.Internal, "the server ended the stream before answering every call"))
	}
	if err != nil {
		p.fail(err)
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.queue) == 0 {
		// Unreachable from a conforming server; failing is all that
		// keeps later answers matched to their calls.
		p.err = wrap("FusedMoEStream", status.Error(codes.Internal, "a response without a request"))
		return
	}
	c := p.queue[0]
	p.queue = p.queue[1:]
	c.res = res
	close(c.done)
}
