package main

import (
	"encoding/binary"
	"math"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/expertd/expertd/client"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// malformed is one way to break a good request, with the status the daemon
// must answer. They are built on the wire form because the SDK refuses
// most of them before sending, and the point is to try the server.
type malformed struct {
	name string
	want codes.Code
	// applies says whether the kind fits the entry and the server's token
	// limit (bias kinds need a set that takes one); nil means always.
	applies func(e *poolEntry, maxTokens int) bool
	// breakIt changes a clone of the entry's good wire request.
	breakIt func(p *pb.FusedMoERequest, e *poolEntry, maxTokens int)
}

// malformedKinds are the broken requests a soak mixes in: wrong names,
// dtypes, ranks, shapes and byte lengths, routing out of range, values the
// spec refuses, and a call over the token limit.
var malformedKinds = []malformed{
	{name: "unknown expert_set", want: codes.NotFound, breakIt: func(p *pb.FusedMoERequest, _ *poolEntry, _ int) {
		p.Experts = &pb.FusedMoERequest_ExpertSet{ExpertSet: "expertbench-no-such-set"}
	}},
	{name: "hidden_states one byte short", want: codes.InvalidArgument, breakIt: func(p *pb.FusedMoERequest, _ *poolEntry, _ int) {
		d := p.HiddenStates.GetData()
		p.HiddenStates.Source = &pb.Tensor_Data{Data: d[:len(d)-1]}
	}},
	{name: "hidden_states one byte long", want: codes.InvalidArgument, breakIt: func(p *pb.FusedMoERequest, _ *poolEntry, _ int) {
		p.HiddenStates.Source = &pb.Tensor_Data{Data: append(p.HiddenStates.GetData(), 0)}
	}},
	{name: "hidden_states [M, K+1]", want: codes.InvalidArgument, breakIt: func(p *pb.FusedMoERequest, e *poolEntry, _ int) {
		m := int64(e.req.M())
		p.HiddenStates.Shape = []int64{m, int64(e.set.K) + 1}
		p.HiddenStates.Source = &pb.Tensor_Data{Data: make([]byte, 2*m*(int64(e.set.K)+1))}
	}},
	{name: "hidden_states rank 1", want: codes.InvalidArgument, breakIt: func(p *pb.FusedMoERequest, e *poolEntry, _ int) {
		p.HiddenStates.Shape = []int64{int64(e.req.M() * e.set.K)}
	}},
	{name: "hidden_states negative dimension", want: codes.InvalidArgument, breakIt: func(p *pb.FusedMoERequest, e *poolEntry, _ int) {
		p.HiddenStates.Shape = []int64{-int64(e.req.M()), int64(e.set.K)}
	}},
	{name: "hidden_states unknown dtype", want: codes.InvalidArgument, breakIt: func(p *pb.FusedMoERequest, _ *poolEntry, _ int) {
		p.HiddenStates.Dtype = pb.DataType(99)
	}},
	{name: "hidden_states missing", want: codes.InvalidArgument, breakIt: func(p *pb.FusedMoERequest, _ *poolEntry, _ int) {
		p.HiddenStates = nil
	}},
	{name: "router_logits [M, E+1]", want: codes.InvalidArgument, breakIt: func(p *pb.FusedMoERequest, e *poolEntry, _ int) {
		m := int64(e.req.M())
		p.RouterLogits.Shape = []int64{m, int64(e.set.E) + 1}
		p.RouterLogits.Source = &pb.Tensor_Data{Data: make([]byte, 4*m*(int64(e.set.E)+1))}
	}},
	{name: "router_logits [M+1, E]", want: codes.InvalidArgument, breakIt: func(p *pb.FusedMoERequest, e *poolEntry, _ int) {
		m := int64(e.req.M())
		p.RouterLogits.Shape = []int64{m + 1, int64(e.set.E)}
		p.RouterLogits.Source = &pb.Tensor_Data{Data: append(p.RouterLogits.GetData(), make([]byte, 4*e.set.E)...)}
	}},
	{name: "router_logits +Inf", want: codes.InvalidArgument, breakIt: func(p *pb.FusedMoERequest, _ *poolEntry, _ int) {
		d := append([]byte(nil), p.RouterLogits.GetData()...)
		binary.LittleEndian.PutUint32(d[4*(len(d)/8):], math.Float32bits(float32(math.Inf(1))))
		p.RouterLogits.Source = &pb.Tensor_Data{Data: d}
	}},
	{name: "routing.top_k 0", want: codes.InvalidArgument, breakIt: func(p *pb.FusedMoERequest, _ *poolEntry, _ int) {
		p.Routing.TopK = 0
	}},
	{name: "routing.top_k E+1", want: codes.InvalidArgument, breakIt: func(p *pb.FusedMoERequest, e *poolEntry, _ int) {
		p.Routing.TopK = int32(e.set.E + 1)
	}},
	{name: "topk_ids out of range", want: codes.InvalidArgument, breakIt: func(p *pb.FusedMoERequest, e *poolEntry, _ int) {
		precomputed(p, e, func(ids []int32) { ids[len(ids)/2] = int32(e.set.E) })
	}},
	{name: "topk_ids negative", want: codes.InvalidArgument, breakIt: func(p *pb.FusedMoERequest, e *poolEntry, _ int) {
		precomputed(p, e, func(ids []int32) { ids[0] = -1 })
	}},
	{name: "topk_ids repeated in a token", want: codes.InvalidArgument, breakIt: func(p *pb.FusedMoERequest, e *poolEntry, _ int) {
		precomputed(p, e, func(ids []int32) { ids[1] = ids[0] })
	}},
	{name: "routing.correction_bias [E+1]", want: codes.InvalidArgument,
		applies: func(e *poolEntry, _ int) bool { return e.req.Routing.CorrectionBias != nil },
		breakIt: func(p *pb.FusedMoERequest, e *poolEntry, _ int) {
			p.Routing.CorrectionBias = client.FromFloat32(make([]float32, e.set.E+1), e.set.E+1).Proto()
		}},
	{name: "tokens over -max-tokens", want: codes.ResourceExhausted,
		// Only where the oversized call stays small (a default daemon
		// allows 8192 tokens).
		applies: func(e *poolEntry, maxTokens int) bool {
			return maxTokens > 0 && int64(maxTokens+1)*int64(2*e.set.K+4*e.set.E) <= 16<<20
		},
		breakIt: func(p *pb.FusedMoERequest, e *poolEntry, maxTokens int) {
			m := int64(maxTokens + 1)
			p.HiddenStates = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_BFLOAT16, Shape: []int64{m, int64(e.set.K)},
				Source: &pb.Tensor_Data{Data: make([]byte, 2*m*int64(e.set.K))}}
			p.RouterLogits = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT32, Shape: []int64{m, int64(e.set.E)},
				Source: &pb.Tensor_Data{Data: make([]byte, 4*m*int64(e.set.E))}}
		}},
}

// precomputed replaces logits routing with valid top-k ids and weights (the
// first top_k experts for every token), then lets spoil break the ids.
func precomputed(p *pb.FusedMoERequest, e *poolEntry, spoil func([]int32)) {
	m, k := e.req.M(), e.req.Routing.TopK
	ids := make([]int32, m*k)
	w := make([]float32, m*k)
	for i := range ids {
		ids[i] = int32(i % k)
		w[i] = 1 / float32(k)
	}
	spoil(ids)
	p.RouterLogits = nil
	p.TopkIds = client.FromInt32(ids, m, k).Proto()
	p.TopkWeights = client.FromFloat32(w, m, k).Proto()
}

// breakRequest is e's good wire request broken the way kind says.
func breakRequest(kind *malformed, e *poolEntry, maxTokens int) *pb.FusedMoERequest {
	p := proto.Clone(e.wire).(*pb.FusedMoERequest)
	kind.breakIt(p, e, maxTokens)
	return p
}

// wireRequest is the wire form of a good SDK request, built only from
// exported SDK pieces (the SDK's own conversion is internal).
func wireRequest(r *client.FusedMoERequest) *pb.FusedMoERequest {
	rt := r.Routing
	return &pb.FusedMoERequest{
		Experts:           &pb.FusedMoERequest_ExpertSet{ExpertSet: r.ExpertSet},
		HiddenStates:      r.Hidden.Proto(),
		HiddenStatesScale: r.HiddenScale.Proto(),
		RouterLogits:      r.RouterLogits.Proto(),
		TopkIds:           r.TopKIDs.Proto(),
		TopkWeights:       r.TopKWeights.Proto(),
		OutputDtype:       pb.DataType(r.OutputDType),
		Routing: &pb.Routing{
			TopK: int32(rt.TopK), Renormalize: rt.Renormalize, Scoring: pb.Scoring(rt.Scoring),
			CorrectionBias:  rt.CorrectionBias.Proto(),
			NumExpertGroups: int32(rt.NumGroups), TopkGroups: int32(rt.TopKGroups),
			RoutedScalingFactor: rt.ScalingFactor,
		},
	}
}
