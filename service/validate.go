package service

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/expertd/expertd/kernels"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
)

// This file is the one place requests are checked and turned into kernels
// types. Everything downstream trusts what it returns.

// maxElements bounds any declared tensor. It is far above a real layer
// (Nemotron's w13 is 6e8 elements) and keeps numel*itemsize and sums of
// several tensors well inside int64, so a hostile shape cannot overflow.
const maxElements = int64(1) << 40

// maxDim bounds K and N of an expert set.
const maxDim = 1 << 20

// dtypeOf maps the wire enum to the kernels type; the values mirror.
func dtypeOf(d pb.DataType) (kernels.DType, bool) {
	if d < pb.DataType_DATA_TYPE_FLOAT32 || d > pb.DataType_DATA_TYPE_INT32 {
		return 0, false
	}
	return kernels.DType(d), true
}

// wireDType maps a kernels type back to the wire enum.
func wireDType(d kernels.DType) pb.DataType { return pb.DataType(d) }

// tensorMeta is a tensor's declared type and size, checked.
type tensorMeta struct {
	dtype kernels.DType
	shape []int
	bytes int64
}

// checkMeta checks t's dtype against allowed and its shape for sign and
// size, without looking at data.
func checkMeta(field string, t *pb.Tensor, allowed ...kernels.DType) (tensorMeta, error) {
	dt, ok := dtypeOf(t.GetDtype())
	if !ok {
		return tensorMeta{}, invalidf(field, "dtype %v: want one of %v", t.GetDtype(), wireNames(allowed))
	}
	legal := false
	for _, a := range allowed {
		legal = legal || a == dt
	}
	if !legal {
		return tensorMeta{}, invalidf(field, "dtype %v: want one of %v", t.GetDtype(), wireNames(allowed))
	}
	n := int64(1)
	shape := make([]int, len(t.GetShape()))
	for i, d := range t.GetShape() {
		if d < 0 {
			return tensorMeta{}, invalidf(field, "shape %v: dimension %d is negative", t.GetShape(), i)
		}
		if d != 0 && n > maxElements/d {
			return tensorMeta{}, invalidf(field, "shape %v: more than 2^40 elements", t.GetShape())
		}
		n *= d
		shape[i] = int(d)
	}
	return tensorMeta{dtype: dt, shape: shape, bytes: n * int64(dt.Size())}, nil
}

func wireNames(ds []kernels.DType) []string {
	names := make([]string, len(ds))
	for i, d := range ds {
		names[i] = wireDType(d).String()
	}
	return names
}

// tensorBytes returns t's inline bytes, checked against m's size. The slice
// aliases the request: no copy.
func tensorBytes(field string, t *pb.Tensor, m tensorMeta) ([]byte, error) {
	switch src := t.GetSource().(type) {
	case *pb.Tensor_Data:
		if int64(len(src.Data)) != m.bytes {
			return nil, invalidf(field, "shape %v needs %d bytes, got %d", t.GetShape(), m.bytes, len(src.Data))
		}
		return src.Data, nil
	case *pb.Tensor_Shm:
		return nil, invalidf(field+".shm", "shared memory is not supported by this server; send data inline")
	}
	return nil, invalidf(field+".data", "is required")
}

// checkTensor is checkMeta followed by tensorBytes.
func checkTensor(field string, t *pb.Tensor, allowed ...kernels.DType) (tensorMeta, []byte, error) {
	return checkTensorOn(field, t, deviceTensor{}, allowed...)
}

// deviceTensor is a request tensor in a CUDA IPC region, as resolveShm
// found it: its device address and the byte_size of its reference. The
// zero value means the tensor is not in device memory.
type deviceTensor struct {
	addr  uintptr
	bytes int64
}

// deviceRefs are the request's tensors and output in device memory; the
// zero value has none. Only these fields may be there (resolveShm).
type deviceRefs struct {
	hidden, logits deviceTensor
	// out is output_shm's device address, 0 when the output goes to host
	// memory.
	out uintptr
}

// checkTensorOn is checkTensor for a tensor that may be in device memory
// (dev set): its declaration is checked against the reference's size and
// there are no bytes to return, nor to scan.
func checkTensorOn(field string, t *pb.Tensor, dev deviceTensor, allowed ...kernels.DType) (tensorMeta, []byte, error) {
	if t == nil {
		return tensorMeta{}, nil, invalidf(field, "is required")
	}
	m, err := checkMeta(field, t, allowed...)
	if err != nil {
		return m, nil, err
	}
	if dev.addr != 0 {
		if m.bytes != dev.bytes {
			return m, nil, invalidf(field+".shm.byte_size", "%d: shape %v of %v needs %d bytes", dev.bytes, t.GetShape(), t.GetDtype(), m.bytes)
		}
		return m, nil, nil
	}
	b, err := tensorBytes(field, t, m)
	return m, b, err
}

func wantShape(field string, got []int, want ...int) error {
	if len(got) != len(want) {
		return invalidf(field, "shape %v: want %v", got, want)
	}
	for i := range got {
		if got[i] != want[i] {
			return invalidf(field, "shape %v: want %v", got, want)
		}
	}
	return nil
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
	numTensors
)

// tensorNames are the ExpertWeights field names, as chunks name them.
var tensorNames = [numTensors]string{"w13", "w2", "w13_scale", "w2_scale", "a13_scale", "a2_scale"}

func tensorIndex(name string) (int, bool) {
	for i, n := range tensorNames {
		if n == name {
			return i, true
		}
	}
	return 0, false
}

func weightTensors(w *pb.ExpertWeights) [numTensors]*pb.Tensor {
	return [numTensors]*pb.Tensor{w.GetW13(), w.GetW2(), w.GetW13Scale(), w.GetW2Scale(), w.GetA13Scale(), w.GetA2Scale()}
}

// layout is an expert set's declared geometry, checked before any data is
// read, so a chunked upload can preallocate and a bad header fails fast.
type layout struct {
	act     kernels.Activation
	e, k, n int
	block   [2]int
	// metas[i] is tensor i's declaration; present[i] says whether it was
	// declared (the activation scales are optional).
	metas   [numTensors]tensorMeta
	present [numTensors]bool
}

// rows1 is GEMM1's output rows per expert.
func (l *layout) rows1() int {
	if l.act == kernels.SiluGated {
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
	l := &layout{}
	switch w.GetActivation() {
	case pb.Activation_ACTIVATION_SILU_GATED:
		l.act = kernels.SiluGated
	case pb.Activation_ACTIVATION_RELU2:
		l.act = kernels.Relu2
	default:
		return nil, invalidf(prefix+".activation", "%v: want ACTIVATION_SILU_GATED or ACTIVATION_RELU2", w.GetActivation())
	}
	ts := weightTensors(w)
	f := func(i int) string { return prefix + "." + tensorNames[i] }
	for _, i := range []int{tW13, tW2, tW13Scale, tW2Scale} {
		if ts[i] == nil {
			return nil, invalidf(f(i), "is required")
		}
	}
	var err error
	fp8, f32 := kernels.Float8E4M3FN, kernels.Float32
	for i, t := range ts {
		if t == nil {
			continue
		}
		allowed := f32
		if i == tW13 || i == tW2 {
			allowed = fp8
		}
		if l.metas[i], err = checkMeta(f(i), t, allowed); err != nil {
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
	if l.act == kernels.SiluGated {
		if w13[1]%2 != 0 {
			return nil, invalidf(f(tW13), "shape %v: ACTIVATION_SILU_GATED needs [E, 2N, K] with an even middle dimension", w13)
		}
		l.n = w13[1] / 2
	}
	if err := wantShape(f(tW2), l.metas[tW2].shape, l.e, l.k, l.n); err != nil {
		return nil, err
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

// decodeScales decodes little-endian FP32 scales, requiring each to be
// finite and > 0, then clamps them to scaling.MinScale (near-zero scales
// give NaN in FP8 kernels).
func decodeScales(field string, b []byte) ([]float32, error) {
	v := make([]float32, len(b)/4)
	for i := range v {
		x := math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
		if !(x > 0) || math.IsInf(float64(x), 0) {
			return nil, invalidf(field, "element %d is %v: scales must be finite and > 0", i, x)
		}
		v[i] = scaling.ClampScale(x)
	}
	return v, nil
}

// buildSet turns a checked layout and its tensors' bytes (data[i] for each
// present tensor, already of the declared length) into an ExpertSet. The
// weight slices alias data.
func buildSet(prefix string, l *layout, data [numTensors][]byte) (*kernels.ExpertSet, error) {
	set := &kernels.ExpertSet{
		Activation: l.act, E: l.e, K: l.k, N: l.n,
		W13: data[tW13], W2: data[tW2], Block: l.block,
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
	return set, nil
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

// inlineSet validates ExpertWeights carried in a FusedMoE request.
func inlineSet(w *pb.ExpertWeights) (*kernels.ExpertSet, int64, error) {
	l, err := checkLayout("weights", w)
	if err != nil {
		return nil, 0, err
	}
	var data [numTensors][]byte
	for i, t := range weightTensors(w) {
		if !l.present[i] {
			continue
		}
		if data[i], err = tensorBytes("weights."+tensorNames[i], t, l.metas[i]); err != nil {
			return nil, 0, err
		}
	}
	set, err := buildSet("weights", l, data)
	return set, l.totalBytes(), err
}

// limits are the bounds checkRequest enforces.
type limits struct {
	maxTokens int
}

// checkRequest validates a FusedMoE request against a loaded set and
// converts it. Tensors alias the request's bytes; those in dev become
// device tensors (kernels.Tensor.Dev), checked for dtype, shape and size
// but not for values, which are in memory this process cannot read.
func checkRequest(req *pb.FusedMoERequest, set *kernels.ExpertSet, lim limits, dev deviceRefs) (*kernels.Request, error) {
	fp8, bf16, f32, i32 := kernels.Float8E4M3FN, kernels.BFloat16, kernels.Float32, kernels.Int32
	hm, hb, err := checkTensorOn("hidden_states", req.GetHiddenStates(), dev.hidden, fp8, bf16, f32)
	if err != nil {
		return nil, err
	}
	if len(hm.shape) != 2 || hm.shape[1] != set.K {
		return nil, invalidf("hidden_states", "shape %v: want [M, %d] (K of the expert set)", hm.shape, set.K)
	}
	m := hm.shape[0]
	if m < 1 {
		return nil, invalidf("hidden_states", "shape %v: want M >= 1 tokens", hm.shape)
	}
	if lim.maxTokens > 0 && m > lim.maxTokens {
		return nil, limitf("hidden_states", "max-tokens", int64(lim.maxTokens), 0, "M = %d tokens exceeds the server's max tokens per call %d; split the batch", m, lim.maxTokens)
	}
	r := &kernels.Request{Hidden: kernels.Tensor{DType: hm.dtype, Shape: hm.shape, Data: hb, Dev: dev.hidden.addr}, OutDev: dev.out}

	if hm.dtype == fp8 {
		if r.HiddenScale, err = hiddenScale(req.GetHiddenStatesScale(), m, set); err != nil {
			return nil, err
		}
	} else if req.GetHiddenStatesScale() != nil {
		return nil, invalidf("hidden_states_scale", "only FLOAT8_E4M3FN hidden_states take a scale; %v is quantized by the server", req.GetHiddenStates().GetDtype())
	}

	switch req.GetOutputDtype() {
	case pb.DataType_DATA_TYPE_UNSPECIFIED, pb.DataType_DATA_TYPE_BFLOAT16:
		r.OutDType = bf16
	case pb.DataType_DATA_TYPE_FLOAT32:
		r.OutDType = f32
	default:
		return nil, invalidf("output_dtype", "%v: want DATA_TYPE_BFLOAT16 (default) or DATA_TYPE_FLOAT32", req.GetOutputDtype())
	}

	if req.GetTopkIds() != nil || req.GetTopkWeights() != nil {
		return r, precomputed(req, r, m, set.E, i32, f32)
	}

	lm, lb, err := checkTensorOn("router_logits", req.GetRouterLogits(), dev.logits, f32, bf16)
	if err != nil {
		return nil, err
	}
	if err := wantShape("router_logits", lm.shape, m, set.E); err != nil {
		return nil, err
	}
	if r.Routing, err = checkRouting(req.GetRouting(), set.E); err != nil {
		return nil, err
	}
	// Logits in device memory go unscanned (lb is nil): the proto says a
	// NaN or +Inf, or a softmax row of -Inf, there leaves its token's
	// routing unspecified.
	if err := checkLogits(lm.dtype, lb, set.E, r.Routing.Scoring); err != nil {
		return nil, err
	}
	r.Logits = kernels.Tensor{DType: lm.dtype, Shape: lm.shape, Data: lb, Dev: dev.logits.addr}
	return r, nil
}

// precomputed fills r from topk_ids and topk_weights, which bypass routing.
func precomputed(req *pb.FusedMoERequest, r *kernels.Request, m, e int, i32, f32 kernels.DType) error {
	im, ib, err := checkTensor("topk_ids", req.GetTopkIds(), i32)
	if err != nil {
		return err
	}
	wm, wb, err := checkTensor("topk_weights", req.GetTopkWeights(), f32)
	if err != nil {
		return err
	}
	if len(im.shape) != 2 || im.shape[0] != m || im.shape[1] < 1 || im.shape[1] > e {
		return invalidf("topk_ids", "shape %v: want [%d, k] with k in [1, %d]", im.shape, m, e)
	}
	k := im.shape[1]
	if err := wantShape("topk_weights", wm.shape, m, k); err != nil {
		return err
	}
	if tk := req.GetRouting().GetTopK(); tk != 0 && int(tk) != k {
		return invalidf("routing.top_k", "%d disagrees with topk_ids' k = %d", tk, k)
	}
	r.TopKIDs = make([]int32, m*k)
	r.TopKWeights = make([]float32, m*k)
	for i := range r.TopKIDs {
		id := int32(binary.LittleEndian.Uint32(ib[4*i:]))
		if id < 0 || int(id) >= e {
			return invalidf("topk_ids", "element %d is %d: want an expert id in [0, %d)", i, id, e)
		}
		// An expert chosen twice for one token would run twice and count
		// double; no router produces that, so it is a caller's bug.
		for j := i - i%k; j < i; j++ {
			if r.TopKIDs[j] == id {
				return invalidf("topk_ids", "element %d repeats expert %d of token %d: want distinct ids per token", i, id, i/k)
			}
		}
		w := math.Float32frombits(binary.LittleEndian.Uint32(wb[4*i:]))
		if math.IsNaN(float64(w)) || math.IsInf(float64(w), 0) {
			return invalidf("topk_weights", "element %d is %v: want finite", i, w)
		}
		r.TopKIDs[i], r.TopKWeights[i] = id, w
	}
	r.Routing = kernels.Routing{TopK: k, Scoring: kernels.Softmax, ScalingFactor: 1}
	return nil
}

// hiddenScale decodes the scale of FP8 hidden states: per-tensor, per-token
// or per-group (block mode only).
func hiddenScale(t *pb.Tensor, m int, set *kernels.ExpertSet) ([]float32, error) {
	const field = "hidden_states_scale"
	if t == nil {
		return nil, invalidf(field, "is required for FLOAT8_E4M3FN hidden_states")
	}
	sm, sb, err := checkTensor(field, t, kernels.Float32)
	if err != nil {
		return nil, err
	}
	s := sm.shape
	ok := len(s) == 0 || (len(s) == 1 && (s[0] == 1 || s[0] == m))
	want := fmt.Sprintf("[] or [1] (per-tensor) or [%d] (per-token)", m)
	if bk := set.Block[1]; bk > 0 {
		g := (set.K + bk - 1) / bk
		ok = ok || (len(s) == 2 && s[0] == m && s[1] == g)
		want += fmt.Sprintf(" or [%d, %d] (per-group of %d)", m, g, bk)
	}
	if !ok {
		return nil, invalidf(field, "shape %v: want %s", s, want)
	}
	return decodeScales(field, sb)
}

// checkRouting validates routing for E experts.
func checkRouting(rt *pb.Routing, e int) (kernels.Routing, error) {
	if rt == nil {
		return kernels.Routing{}, invalidf("routing", "is required with router_logits")
	}
	r := kernels.Routing{TopK: int(rt.GetTopK()), Renormalize: rt.GetRenormalize()}
	if r.TopK < 1 || r.TopK > e {
		return r, invalidf("routing.top_k", "%d: want in [1, %d] (E of the expert set)", rt.GetTopK(), e)
	}
	switch rt.GetScoring() {
	case pb.Scoring_SCORING_UNSPECIFIED, pb.Scoring_SCORING_SOFTMAX:
		r.Scoring = kernels.Softmax
	case pb.Scoring_SCORING_SIGMOID:
		r.Scoring = kernels.Sigmoid
	default:
		return r, invalidf("routing.scoring", "%v: want SCORING_SOFTMAX or SCORING_SIGMOID", rt.GetScoring())
	}
	if b := rt.GetCorrectionBias(); b != nil {
		if r.Scoring != kernels.Sigmoid {
			return r, invalidf("routing.correction_bias", "only valid with SCORING_SIGMOID")
		}
		bm, bb, err := checkTensor("routing.correction_bias", b, kernels.Float32, kernels.BFloat16)
		if err != nil {
			return r, err
		}
		if err := wantShape("routing.correction_bias", bm.shape, e); err != nil {
			return r, err
		}
		r.CorrectionBias = make([]float32, e)
		for i := range r.CorrectionBias {
			x := element(bm.dtype, bb, i)
			if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
				return r, invalidf("routing.correction_bias", "element %d is %v: want finite", i, x)
			}
			r.CorrectionBias[i] = x
		}
	}
	if g := int(rt.GetNumExpertGroups()); g > 1 {
		if g > e || e%g != 0 {
			return r, invalidf("routing.num_expert_groups", "%d does not divide E = %d", g, e)
		}
		tg := int(rt.GetTopkGroups())
		if tg < 1 || tg > g {
			return r, invalidf("routing.topk_groups", "%d: want in [1, %d] (num_expert_groups)", tg, g)
		}
		if tg*(e/g) < r.TopK {
			return r, invalidf("routing.topk_groups", "%d groups of %d experts cannot supply top_k = %d", tg, e/g, r.TopK)
		}
		r.NumGroups, r.TopKGroups = g, tg
	} else if g < 0 {
		return r, invalidf("routing.num_expert_groups", "%d: want >= 0", g)
	}
	sf := rt.GetRoutedScalingFactor()
	switch {
	case sf == 0:
		r.ScalingFactor = 1
	case sf > 0 && !math.IsInf(float64(sf), 0):
		r.ScalingFactor = sf
	default:
		return r, invalidf("routing.routed_scaling_factor", "%v: want finite and > 0 (0 means 1)", sf)
	}
	return r, nil
}

// element decodes element i of FP32 or BF16 bytes.
func element(d kernels.DType, b []byte, i int) float32 {
	if d == kernels.BFloat16 {
		return scaling.BF16ToFloat32(binary.LittleEndian.Uint16(b[2*i:]))
	}
	return math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
}

// checkLogits scans FP32 or BF16 logits of rows of e experts. -Inf is
// legal (it masks an expert), but NaN would make top-k selection
// meaningless and +Inf turns a softmax row into NaN (inf - inf); and a
// softmax row needs one finite logit, since softmax of a row of -Inf is
// 0/0. Sigmoid scores a -Inf as 0, so a sigmoid row may be all -Inf (its
// weights are 0).
func checkLogits(d kernels.DType, b []byte, e int, scoring kernels.Scoring) error {
	n := len(b) / d.Size()
	for row := 0; row*e < n; row++ {
		finite := false
		for i := row * e; i < (row+1)*e; i++ {
			x := element(d, b, i)
			if x != x || math.IsInf(float64(x), 1) {
				return invalidf("router_logits", "element %d is %v: want finite or -Inf", i, x)
			}
			finite = finite || !math.IsInf(float64(x), -1)
		}
		if !finite && scoring == kernels.Softmax {
			return invalidf("router_logits", "row %d is all -Inf; softmax routing needs at least one finite logit", row)
		}
	}
	return nil
}
