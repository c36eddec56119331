package client

import (
	"context"
	"errors"
	"fmt"
	"io"

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
}

// FusedMoEStream opens a stream of FusedMoE calls; ctx bounds the whole
// stream. Close it with CloseSend, then Recv until io.EOF, or cancel ctx.
func (c *Client) FusedMoEStream(ctx context.Context) (*Stream, error) {
	ctx, cancel := c.callContext(ctx)
	s, err := c.rpc.FusedMoEStream(ctx)
	if err != nil {
		cancel()
		return nil, wrap("FusedMoEStream", err)
	}
	return &Stream{s: s, cancel: cancel, c: c}, nil
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
		return nil, wrap("FusedMoEStream", fmt.Errorf("malformed response: %w", err))
	}
	s.c.viewOutputs(res)
	return res, nil
}

// CloseSend says no more requests will come; results still pending can
// be received.
func (s *Stream) CloseSend() error { return s.s.CloseSend() }
