package service

import (
	"errors"

	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// This file converts protobuf to the request model (package moe) once:
// fromProto for a FusedMoE call, whose rules moe.Validate holds, and the
// expert-set layout checks of a load. Everything downstream trusts what
// they return.

// maxElements bounds any declared tensor (moe.MaxElements).
const maxElements = moe.MaxElements

// wireDType maps a model type to the wire enum; the values mirror.
func wireDType(d moe.DType) pb.DataType { return pb.DataType(d) }

// tensorMeta is a tensor's declared type and size, checked.
type tensorMeta struct {
	dtype moe.DType
	shape []int
	bytes int64
}

// declared is t's declaration in the model, without its bytes.
func declared(t *pb.Tensor) *moe.Tensor {
	shape := make([]int, len(t.GetShape()))
	for i, d := range t.GetShape() {
		shape[i] = int(d)
	}
	return &moe.Tensor{DType: moe.DType(t.GetDtype()), Shape: shape}
}

// checkMeta checks t's dtype against allowed and its shape for sign and
// size, without looking at data.
func checkMeta(field string, t *pb.Tensor, allowed ...moe.DType) (tensorMeta, error) {
	d := declared(t)
	n, err := moe.Meta(field, d, allowed...)
	if err != nil {
		return tensorMeta{}, fromModel(err)
	}
	return tensorMeta{dtype: d.DType, shape: d.Shape, bytes: n}, nil
}

// fromModel maps the model's validation errors to the service's, with
// their fields and messages unchanged.
func fromModel(err error) error {
	var fe *moe.FieldError
	if errors.As(err, &fe) {
		return invalidf(fe.Field, "%s", fe.Msg)
	}
	var le *moe.LimitError
	if errors.As(err, &le) {
		return limitf(le.Field, le.Quota, le.Limit, 0, "%s", le.Msg)
	}
	return err
}

// errNoShm refuses a shared-memory tensor that nothing placed: this
// server has shared memory disabled.
func errNoShm(field string) error {
	return invalidf(field+".shm", "shared memory is not supported by this server; send data inline")
}

// placement is where a call's shared-memory tensors are (host bytes of a
// POSIX region, or a CUDA IPC region's device address), by field, and
// where its output goes: what shmTable.resolve found, and conversion
// reads. A nil *placement places nothing (shared memory disabled).
type placement struct {
	tensors map[string]moe.Tensor
	// outRef is output_shm, which the response returns, nil without;
	// outDev is its address when it is in device memory.
	outRef *pb.SharedMemoryRef
	outDev uintptr
}

// memory is where field's shared-memory tensor is (Memory, and Data or
// Dev and DevBytes); ok is false when nothing placed it.
func (p *placement) memory(field string) (moe.Tensor, bool) {
	if p == nil {
		return moe.Tensor{}, false
	}
	t, ok := p.tensors[field]
	return t, ok
}

// outDevice is a CUDA IPC output_shm's device address, 0 for none.
func (p *placement) outDevice() uintptr {
	if p == nil {
		return 0
	}
	return p.outDev
}

// modelError is a validation error of the model's (fromModel), with a
// tensor whose bytes are the wrong size worded for its shared-memory
// reference when it has one: the reference's byte_size is what the caller
// got wrong.
func (p *placement) modelError(err error) error {
	var se *moe.SizeError
	if errors.As(err, &se) {
		if _, ok := p.memory(se.Field); ok {
			return invalidf(se.Field+".shm.byte_size", "%d: shape %v of %v needs %d bytes", se.Got, se.Shape, se.DType.WireName(), se.Need)
		}
	}
	return fromModel(err)
}

// checkOutput checks output_shm's size against the validated call's
// output, [M, K] in the output dtype.
func (p *placement) checkOutput(r *moe.Request, k int) error {
	if p == nil || p.outRef == nil {
		return nil
	}
	m := r.M()
	need := int64(m) * int64(k) * int64(r.OutDType.Size())
	if n := p.outRef.GetByteSize(); n != need {
		return invalidf("output_shm.byte_size", "%d: the output [%d %d] of %v needs %d bytes", n, m, k, r.OutDType.WireName(), need)
	}
	return nil
}

// tensorFromProto is t in the model, nil for an unset tensor: its bytes
// inline (aliasing the request, no copy) or where sh placed its
// shared-memory reference. A tensor without a source has nil Data, which
// moe.Check reports.
func tensorFromProto(field string, t *pb.Tensor, sh *placement) (*moe.Tensor, error) {
	if t == nil {
		return nil, nil
	}
	mt := declared(t)
	switch src := t.GetSource().(type) {
	case *pb.Tensor_Data:
		mt.Data = src.Data
		if mt.Data == nil {
			mt.Data = []byte{} // inline and empty is not missing
		}
	case *pb.Tensor_Shm:
		mem, ok := sh.memory(field)
		if !ok {
			return nil, errNoShm(field)
		}
		mt.Memory, mt.Data, mt.Dev, mt.DevBytes = mem.Memory, mem.Data, mem.Dev, mem.DevBytes
	}
	return mt, nil
}

// tensorBytes returns t's host bytes, checked against m's size.
func tensorBytes(field string, t *pb.Tensor, m tensorMeta, sh *placement) ([]byte, error) {
	mt, err := tensorFromProto(field, t, sh)
	if err != nil {
		return nil, err
	}
	if err := moe.Check(field, mt, m.dtype); err != nil {
		return nil, sh.modelError(err)
	}
	return mt.Data, nil
}

func weightTensors(w *pb.ExpertWeights) [moe.SetTensors]*pb.Tensor {
	return [moe.SetTensors]*pb.Tensor{w.GetW13(), w.GetW2(), w.GetW13Scale(), w.GetW2Scale(), w.GetA13Scale(), w.GetA2Scale(),
		w.GetW13Bias(), w.GetW2Bias()}
}

// setDecl is w's declaration in the model, nil for an unset one.
func setDecl(w *pb.ExpertWeights) *moe.SetDecl {
	if w == nil {
		return nil
	}
	d := &moe.SetDecl{Activation: moe.Activation(w.GetActivation()), SwigluLimit: w.GetSwigluLimit(), SwigluAlpha: w.GetSwigluAlpha()}
	for _, b := range w.GetWeightBlockShape() {
		d.BlockShape = append(d.BlockShape, int(b))
	}
	for i, t := range weightTensors(w) {
		if t != nil {
			d.Tensors[i] = declared(t)
		}
	}
	return d
}

// checkLayout validates w's activation, dtypes and shapes (prefix names the
// message in errors, e.g. "weights" or "header.weights").
func checkLayout(prefix string, w *pb.ExpertWeights) (*moe.Layout, error) {
	l, err := moe.CheckLayout(prefix, setDecl(w))
	return l, fromModel(err)
}

// inlineSet validates ExpertWeights carried in a FusedMoE request, whose
// tensors may be in shared memory (sh).
func inlineSet(w *pb.ExpertWeights, sh *placement) (*moe.ExpertSet, int64, error) {
	l, err := checkLayout("weights", w)
	if err != nil {
		return nil, 0, err
	}
	var data [moe.SetTensors][]byte
	for i, t := range weightTensors(w) {
		if !l.Present[i] {
			continue
		}
		m := tensorMeta{dtype: l.Tensors[i].DType, shape: l.Tensors[i].Shape, bytes: l.Tensors[i].Bytes}
		if data[i], err = tensorBytes("weights."+moe.SetTensorNames[i], t, m, sh); err != nil {
			return nil, 0, err
		}
	}
	set, err := l.Build("weights", data)
	return set, l.TotalBytes(), fromModel(err)
}

// fromProto is the FusedMoE call in the model, its tensors where they are:
// inline in the request or in the shared memory sh places. The request
// itself is never modified.
func fromProto(req *pb.FusedMoERequest, sh *placement) (*moe.Input, error) {
	in := &moe.Input{OutDType: moe.DType(req.GetOutputDtype())}
	for _, f := range []struct {
		field string
		t     *pb.Tensor
		dst   **moe.Tensor
	}{
		{"hidden_states", req.GetHiddenStates(), &in.Hidden},
		{"hidden_states_scale", req.GetHiddenStatesScale(), &in.HiddenScale},
		{"router_logits", req.GetRouterLogits(), &in.Logits},
		{"topk_ids", req.GetTopkIds(), &in.TopKIDs},
		{"topk_weights", req.GetTopkWeights(), &in.TopKWeights},
	} {
		var err error
		if *f.dst, err = tensorFromProto(f.field, f.t, sh); err != nil {
			return nil, err
		}
	}
	var err error
	in.Routing, err = routingFromProto(req.GetRouting(), sh)
	return in, err
}

// routingFromProto is rt in the model, nil when unset.
func routingFromProto(rt *pb.Routing, sh *placement) (*moe.RoutingInput, error) {
	if rt == nil {
		return nil, nil
	}
	bias, err := tensorFromProto("routing.correction_bias", rt.GetCorrectionBias(), sh)
	if err != nil {
		return nil, err
	}
	return &moe.RoutingInput{
		TopK:           int(rt.GetTopK()),
		Renormalize:    rt.GetRenormalize(),
		Scoring:        moe.Scoring(rt.GetScoring()),
		CorrectionBias: bias,
		NumGroups:      int(rt.GetNumExpertGroups()),
		TopKGroups:     int(rt.GetTopkGroups()),
		ScalingFactor:  rt.GetRoutedScalingFactor(),
	}, nil
}

// checkRequest converts a FusedMoE request (fromProto) and validates it
// against a loaded set (moe.Validate). Its output goes where sh says
// (device memory), or to a buffer the caller provides.
func checkRequest(req *pb.FusedMoERequest, set *moe.ExpertSet, lim moe.Limits, sh *placement) (*moe.Request, error) {
	in, err := fromProto(req, sh)
	if err != nil {
		return nil, err
	}
	r, err := moe.Validate(in, set, lim)
	if err != nil {
		return nil, sh.modelError(err)
	}
	if err := sh.checkOutput(r, set.K); err != nil {
		return nil, err
	}
	r.OutDev = sh.outDevice()
	r.NoRouting = !req.GetReturnRouting()
	return r, nil
}

// checkRouting validates routing for E experts.
func checkRouting(rt *pb.Routing, e int) (moe.Routing, error) {
	in, err := routingFromProto(rt, nil)
	if err != nil {
		return moe.Routing{}, err
	}
	r, err := moe.ValidateRouting(in, e)
	return r, fromModel(err)
}
