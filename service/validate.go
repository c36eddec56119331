package service

import (
	"errors"
	"math"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
)

// This file converts protobuf to the request model (package moe) once:
// fromProto for a FusedMoE call, whose rules moe.Validate holds, and the
// expert-set layout checks of a load. Everything downstream trusts what
// they return.

// maxElements bounds any declared tensor (moe.MaxElements).
const maxElements = moe.MaxElements

// maxDim bounds K and N of an expert set.
const maxDim = 1 << 20

// wireDType maps a model type to the wire enum; the values mirror.
func wireDType(d kernels.DType) pb.DataType { return pb.DataType(d) }

// tensorMeta is a tensor's declared type and size, checked.
type tensorMeta struct {
	dtype kernels.DType
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
func checkMeta(field string, t *pb.Tensor, allowed ...kernels.DType) (tensorMeta, error) {
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
func (p *placement) checkOutput(r *kernels.Request, k int) error {
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

// Tensor indices within an expert set, in ExpertWeights field order; the
// fingerprint hashes them in this order.
const (
	tW13 = iota
	tW2
	tW13Scale
	tW2Scale
	tA13Scale
	tA2Scale
	tW13Bias
	tW2Bias
	numTensors
)

// tensorNames are the ExpertWeights field names, as chunks name them.
var tensorNames = [numTensors]string{"w13", "w2", "w13_scale", "w2_scale", "a13_scale", "a2_scale", "w13_bias", "w2_bias"}

func tensorIndex(name string) (int, bool) {
	for i, n := range tensorNames {
		if n == name {
			return i, true
		}
	}
	return 0, false
}

func weightTensors(w *pb.ExpertWeights) [numTensors]*pb.Tensor {
	return [numTensors]*pb.Tensor{w.GetW13(), w.GetW2(), w.GetW13Scale(), w.GetW2Scale(), w.GetA13Scale(), w.GetA2Scale(),
		w.GetW13Bias(), w.GetW2Bias()}
}

// layout is an expert set's declared geometry, checked before any data is
// read, so a chunked upload can preallocate and a bad header fails fast.
type layout struct {
	act     kernels.Activation
	e, k, n int
	block   [2]int
	// limit and alpha are SWIGLU_OAI's, defaults filled in.
	limit, alpha float32
	// metas[i] is tensor i's declaration; present[i] says whether it was
	// declared (the activation scales are optional).
	metas   [numTensors]tensorMeta
	present [numTensors]bool
}

// rows1 is GEMM1's output rows per expert.
func (l *layout) rows1() int {
	if l.act.Gated() {
		return 2 * l.n
	}
	return l.n
}

// totalBytes is the sum of the declared tensors' sizes.
func (l *layout) totalBytes() int64 {
	var t int64
	for i, m := range l.metas {
		if l.present[i] {
			t += m.bytes
		}
	}
	return t
}

// checkLayout validates w's activation, dtypes and shapes (prefix names the
// message in errors, e.g. "weights" or "header.weights").
func checkLayout(prefix string, w *pb.ExpertWeights) (*layout, error) {
	if w == nil {
		return nil, invalidf(prefix, "is required")
	}
	l := &layout{act: kernels.Activation(w.GetActivation())}
	if !l.act.Valid() {
		return nil, invalidf(prefix+".activation", "%v: want one of %v", w.GetActivation(), activationWireNames())
	}
	var err error
	if l.limit, err = swigluParam(prefix+".swiglu_limit", l.act, w.GetSwigluLimit(), moe.DefaultSwigluLimit); err != nil {
		return nil, err
	}
	if l.alpha, err = swigluParam(prefix+".swiglu_alpha", l.act, w.GetSwigluAlpha(), moe.DefaultSwigluAlpha); err != nil {
		return nil, err
	}
	ts := weightTensors(w)
	f := func(i int) string { return prefix + "." + tensorNames[i] }
	for _, i := range []int{tW13, tW2, tW13Scale, tW2Scale} {
		if ts[i] == nil {
			return nil, invalidf(f(i), "is required")
		}
	}
	for i, t := range ts {
		if t == nil {
			continue
		}
		allowed := []kernels.DType{kernels.Float32}
		switch i {
		case tW13, tW2:
			allowed = []kernels.DType{kernels.Float8E4M3FN}
		case tW13Bias, tW2Bias:
			allowed = []kernels.DType{kernels.Float32, kernels.BFloat16}
		}
		if l.metas[i], err = checkMeta(f(i), t, allowed...); err != nil {
			return nil, err
		}
		l.present[i] = true
	}
	w13 := l.metas[tW13].shape
	if len(w13) != 3 || w13[0] < 1 || w13[1] < 1 || w13[2] < 1 {
		return nil, invalidf(f(tW13), "shape %v: want [E, rows, K] with every dimension >= 1", w13)
	}
	l.e, l.k = w13[0], w13[2]
	l.n = w13[1]
	if l.act.Gated() {
		if w13[1]%2 != 0 {
			return nil, invalidf(f(tW13), "shape %v: %v needs [E, 2N, K] with an even middle dimension", w13, l.act.WireName())
		}
		l.n = w13[1] / 2
	}
	if err := moe.WantShape(f(tW2), l.metas[tW2].shape, l.e, l.k, l.n); err != nil {
		return nil, fromModel(err)
	}
	// Far beyond any model (DeepSeek-V3 has E = 256, K = 7168), and keeps
	// the sizes in ExpertSetInfo's int32 fields.
	if l.e > maxExperts || l.k > maxDim || l.n > maxDim {
		return nil, invalidf(f(tW13), "shape %v: want E <= %d and K, N <= %d", w13, maxExperts, maxDim)
	}
	switch bs := w.GetWeightBlockShape(); len(bs) {
	case 0:
	case 2:
		if bs[0] < 1 || bs[1] < 1 {
			return nil, invalidf(prefix+".weight_block_shape", "%v: want [Bn, Bk] with both >= 1", bs)
		}
		l.block = [2]int{int(bs[0]), int(bs[1])}
	default:
		return nil, invalidf(prefix+".weight_block_shape", "%v: want [] or [Bn, Bk]", bs)
	}
	for _, b := range []struct{ i, rows int }{{tW13Bias, l.rows1()}, {tW2Bias, l.k}} {
		if l.present[b.i] {
			if err := moe.WantShape(f(b.i), l.metas[b.i].shape, l.e, b.rows); err != nil {
				return nil, fromModel(err)
			}
		}
	}
	for _, i := range []int{tA13Scale, tA2Scale} {
		if !l.present[i] {
			continue
		}
		s := l.metas[i].shape
		if !(len(s) == 0 || (len(s) == 1 && (s[0] == 1 || s[0] == l.e))) {
			return nil, invalidf(f(i), "shape %v: want [] or [1] (per-tensor) or [%d] (per-expert)", s, l.e)
		}
	}
	return l, nil
}

func ones(m tensorMeta) []float32 {
	v := make([]float32, m.bytes/4)
	for i := range v {
		v[i] = 1
	}
	return v
}

// checkScaleShapes classifies the weight-scale shapes with stand-in ones,
// so a chunked upload fails on a bad scale before its weights arrive. Call
// it only once the declared sizes are known to fit the server's limits: it
// allocates one float per declared scale element.
func (l *layout) checkScaleShapes(prefix string) error {
	for _, si := range []int{tW13Scale, tW2Scale} {
		if _, err := l.weightScale(prefix, si, ones(l.metas[si])); err != nil {
			return err
		}
	}
	return nil
}

// weightScale classifies scale tensor si (tW13Scale or tW2Scale) with the
// given values.
func (l *layout) weightScale(prefix string, si int, values []float32) (scaling.WeightScale, error) {
	rows, cols := l.rows1(), l.k
	if si == tW2Scale {
		rows, cols = l.k, l.n
	}
	ws, err := scaling.NewWeightScale(l.metas[si].shape, values, l.e, rows, cols, l.block)
	if err != nil {
		return ws, invalidf(prefix+"."+tensorNames[si], "%v", err)
	}
	return ws, nil
}

// decodeScales is moe.DecodeScales with the service's errors.
func decodeScales(field string, b []byte) ([]float32, error) {
	v, err := moe.DecodeScales(field, b)
	return v, fromModel(err)
}

// buildSet turns a checked layout and its tensors' bytes (data[i] for each
// present tensor, already of the declared length) into an ExpertSet. The
// weight slices alias data.
func buildSet(prefix string, l *layout, data [numTensors][]byte) (*kernels.ExpertSet, error) {
	set := &kernels.ExpertSet{
		Activation: l.act, E: l.e, K: l.k, N: l.n,
		W13: data[tW13], W2: data[tW2], Block: l.block,
		SwigluLimit: l.limit, SwigluAlpha: l.alpha,
	}
	var err error
	for _, i := range []int{tW13Scale, tW2Scale} {
		v, err := decodeScales(prefix+"."+tensorNames[i], data[i])
		if err != nil {
			return nil, err
		}
		ws, err := l.weightScale(prefix, i, v)
		if err != nil {
			return nil, err
		}
		if i == tW13Scale {
			set.W13Scale = ws
		} else {
			set.W2Scale = ws
		}
	}
	if set.A13Scale, err = staticScale(prefix+".a13_scale", l.present[tA13Scale], data[tA13Scale]); err != nil {
		return nil, err
	}
	if set.A2Scale, err = staticScale(prefix+".a2_scale", l.present[tA2Scale], data[tA2Scale]); err != nil {
		return nil, err
	}
	for _, b := range []struct {
		i   int
		dst *[]float32
	}{{tW13Bias, &set.W13Bias}, {tW2Bias, &set.W2Bias}} {
		if l.present[b.i] {
			if *b.dst, err = moe.DecodeFinite(prefix+"."+tensorNames[b.i], l.metas[b.i].dtype, data[b.i]); err != nil {
				return nil, fromModel(err)
			}
		}
	}
	return set, nil
}

// swigluParam checks one of SWIGLU_OAI's parameters (v, 0 meaning def):
// finite and >= 0, and only set with that activation.
func swigluParam(field string, act kernels.Activation, v, def float32) (float32, error) {
	switch {
	case v == 0 && act == kernels.SwigluOAI:
		return def, nil
	case v == 0:
		return 0, nil
	case act != kernels.SwigluOAI:
		return 0, invalidf(field, "%v: only valid with ACTIVATION_SWIGLU_OAI", v)
	case !(v > 0) || math.IsInf(float64(v), 0):
		return 0, invalidf(field, "%v: want finite and >= 0 (0 means %v)", v, def)
	}
	return v, nil
}

// activationWireNames lists the activations the contract names.
func activationWireNames() []string {
	var names []string
	for a := kernels.SiluGated; a.Valid(); a++ {
		names = append(names, a.WireName())
	}
	return names
}

// staticScale reduces a per-tensor or per-expert activation scale to the
// one value kernels use (per-expert takes the max, as vLLM does, so no
// expert's inputs saturate).
func staticScale(field string, present bool, b []byte) (*float32, error) {
	if !present {
		return nil, nil
	}
	v, err := decodeScales(field, b)
	if err != nil {
		return nil, err
	}
	s := scaling.ReduceExpertScale(v)
	return &s, nil
}

// inlineSet validates ExpertWeights carried in a FusedMoE request, whose
// tensors may be in shared memory (sh).
func inlineSet(w *pb.ExpertWeights, sh *placement) (*kernels.ExpertSet, int64, error) {
	l, err := checkLayout("weights", w)
	if err != nil {
		return nil, 0, err
	}
	var data [numTensors][]byte
	for i, t := range weightTensors(w) {
		if !l.present[i] {
			continue
		}
		if data[i], err = tensorBytes("weights."+tensorNames[i], t, l.metas[i], sh); err != nil {
			return nil, 0, err
		}
	}
	set, err := buildSet("weights", l, data)
	return set, l.totalBytes(), err
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
func checkRequest(req *pb.FusedMoERequest, set *kernels.ExpertSet, lim moe.Limits, sh *placement) (*kernels.Request, error) {
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
func checkRouting(rt *pb.Routing, e int) (kernels.Routing, error) {
	in, err := routingFromProto(rt, nil)
	if err != nil {
		return kernels.Routing{}, err
	}
	r, err := moe.ValidateRouting(in, e)
	return r, fromModel(err)
}
