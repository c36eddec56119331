package moe

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/expertd/expertd/scaling"
)

// This file holds every rule a FusedMoE call must satisfy. The service
// converts a protobuf request to an Input once and calls Validate; the
// SDK's sharded fan-out calls it before routing on the client; nothing
// downstream checks a request again.

// MaxElements bounds any declared tensor. It is far above a real layer
// (Nemotron's w13 is 6e8 elements) and keeps numel*itemsize and sums of
// several tensors well inside int64, so a hostile shape cannot overflow.
const MaxElements = int64(1) << 40

// FieldError is a request field that breaks a rule. Field is named as the
// wire contract names it ("hidden_states", "routing.top_k"), so the
// service reports it unchanged.
type FieldError struct {
	Field string
	Msg   string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Msg }

func invalidf(field, format string, args ...any) error {
	return &FieldError{Field: field, Msg: fmt.Sprintf(format, args...)}
}

// LimitError is a valid request over a limit of the server's (Limits).
// Quota names the daemon flag that sets it and Limit is its value.
type LimitError struct {
	Field, Quota string
	Limit        int64
	Msg          string
}

func (e *LimitError) Error() string { return e.Field + ": " + e.Msg }

// Input is a FusedMoE call as it arrives, before any check: a nil tensor
// is one the caller left unset. Device tensors (Memory Device) are checked
// for dtype, shape and size (DevBytes) only, since their bytes are in
// memory this process cannot read.
type Input struct {
	Hidden, HiddenScale  *Tensor
	Logits               *Tensor
	TopKIDs, TopKWeights *Tensor
	Routing              *RoutingInput
	// OutDType is the requested output type; 0 means the default (BF16).
	OutDType DType
}

// RoutingInput is the caller's routing configuration, unchecked; zero
// Scoring and ScalingFactor mean their defaults (softmax, 1).
type RoutingInput struct {
	TopK                  int
	Renormalize           bool
	Scoring               Scoring
	CorrectionBias        *Tensor
	NumGroups, TopKGroups int
	ScalingFactor         float32
}

// Limits are the server's bounds on a valid call; zero means none.
type Limits struct {
	MaxTokens int
}

// Meta checks t's declaration, dtype against allowed and shape for sign
// and size, without looking at data, and returns its size in bytes.
func Meta(field string, t *Tensor, allowed ...DType) (int64, error) {
	legal := false
	for _, a := range allowed {
		legal = legal || (a == t.DType && t.DType.Valid())
	}
	if !legal {
		return 0, invalidf(field, "dtype %v: want one of %v", t.DType.WireName(), wireNames(allowed))
	}
	n := int64(1)
	for i, d := range t.Shape {
		if d < 0 {
			return 0, invalidf(field, "shape %v: dimension %d is negative", t.Shape, i)
		}
		if d != 0 && n > MaxElements/int64(d) {
			return 0, invalidf(field, "shape %v: more than 2^40 elements", t.Shape)
		}
		n *= int64(d)
	}
	return n * int64(t.DType.Size()), nil
}

func wireNames(ds []DType) []string {
	names := make([]string, len(ds))
	for i, d := range ds {
		names[i] = d.WireName()
	}
	return names
}

// SizeError is a tensor whose bytes are not the size its declaration
// needs. It unwraps to the FieldError that words it for bytes sent with
// the request; a server words it for where the bytes came from instead
// (a shared-memory reference's byte_size, say).
type SizeError struct {
	FieldError
	Shape     []int
	DType     DType
	Need, Got int64
}

// Unwrap is the FieldError.
func (e *SizeError) Unwrap() error { return &e.FieldError }

// Check is Meta followed by the bytes: a tensor must hold exactly the
// declared size, in Data or, on the device, at Dev (DevBytes).
func Check(field string, t *Tensor, allowed ...DType) error {
	if t == nil {
		return invalidf(field, "is required")
	}
	n, err := Meta(field, t, allowed...)
	if err != nil {
		return err
	}
	return checkBytes(field, t, n)
}

func checkBytes(field string, t *Tensor, n int64) error {
	got := int64(len(t.Data))
	switch {
	case t.Memory == Device:
		got = t.DevBytes
	case t.Data == nil:
		return invalidf(field+".data", "is required")
	}
	if got != n {
		return &SizeError{FieldError: FieldError{Field: field, Msg: fmt.Sprintf("shape %v needs %d bytes, got %d", t.Shape, n, got)},
			Shape: t.Shape, DType: t.DType, Need: n, Got: got}
	}
	return nil
}

// WantShape checks that a tensor's shape is exactly want.
func WantShape(field string, got []int, want ...int) error {
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

// Validate checks in against a loaded set (set.E, set.K and set.Block are
// all it reads) and returns the request backends run. Tensors alias in's
// bytes. Errors are *FieldError or *LimitError.
func Validate(in *Input, set *ExpertSet, lim Limits) (*Request, error) {
	const hf = "hidden_states"
	if err := Check(hf, in.Hidden, Float8E4M3FN, BFloat16, Float32); err != nil {
		return nil, err
	}
	h := *in.Hidden
	if len(h.Shape) != 2 || h.Shape[1] != set.K {
		return nil, invalidf(hf, "shape %v: want [M, %d] (K of the expert set)", h.Shape, set.K)
	}
	m := h.Shape[0]
	if m < 1 {
		return nil, invalidf(hf, "shape %v: want M >= 1 tokens", h.Shape)
	}
	if lim.MaxTokens > 0 && m > lim.MaxTokens {
		return nil, &LimitError{Field: hf, Quota: "max-tokens", Limit: int64(lim.MaxTokens),
			Msg: fmt.Sprintf("M = %d tokens exceeds the server's max tokens per call %d; split the batch", m, lim.MaxTokens)}
	}
	r := &Request{Hidden: h}

	var err error
	if h.DType == Float8E4M3FN {
		if r.HiddenScale, err = hiddenScale(in.HiddenScale, m, set); err != nil {
			return nil, err
		}
	} else if in.HiddenScale != nil {
		return nil, invalidf("hidden_states_scale", "only FLOAT8_E4M3FN hidden_states take a scale; %v is quantized by the server", h.DType.WireName())
	}

	var ok bool
	if r.OutDType, ok = OutputDType(in.OutDType); !ok {
		return nil, invalidf("output_dtype", "%v: want DATA_TYPE_BFLOAT16 (default) or DATA_TYPE_FLOAT32", in.OutDType.WireName())
	}

	if in.TopKIDs != nil || in.TopKWeights != nil {
		return r, precomputed(in, r, m, set.E)
	}

	const lf = "router_logits"
	if err := Check(lf, in.Logits, Float32, BFloat16); err != nil {
		return nil, err
	}
	if err := WantShape(lf, in.Logits.Shape, m, set.E); err != nil {
		return nil, err
	}
	if r.Routing, err = ValidateRouting(in.Routing, set.E); err != nil {
		return nil, err
	}
	r.Logits = *in.Logits
	// Logits in device memory go unscanned: the contract says a NaN or
	// +Inf, or a softmax row of -Inf, there leaves its token's routing
	// unspecified.
	if r.Logits.Memory != Device {
		if err := CheckLogits(r.Logits.DType, r.Logits.Data, set.E, r.Routing.Scoring); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// precomputed fills r from topk_ids and topk_weights, which bypass routing.
func precomputed(in *Input, r *Request, m, e int) error {
	if err := Check("topk_ids", in.TopKIDs, Int32); err != nil {
		return err
	}
	if err := Check("topk_weights", in.TopKWeights, Float32); err != nil {
		return err
	}
	is, ws := in.TopKIDs.Shape, in.TopKWeights.Shape
	if len(is) != 2 || is[0] != m || is[1] < 1 || is[1] > e {
		return invalidf("topk_ids", "shape %v: want [%d, k] with k in [1, %d]", is, m, e)
	}
	k := is[1]
	if err := WantShape("topk_weights", ws, m, k); err != nil {
		return err
	}
	if in.Routing != nil {
		if tk := in.Routing.TopK; tk != 0 && tk != k {
			return invalidf("routing.top_k", "%d disagrees with topk_ids' k = %d", tk, k)
		}
	}
	ib, wb := in.TopKIDs.Data, in.TopKWeights.Data
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
	r.Routing = Routing{TopK: k, Scoring: Softmax, ScalingFactor: 1}
	return nil
}

// hiddenScale decodes the scale of FP8 hidden states: per-tensor, per-token
// or per-group (block mode only).
func hiddenScale(t *Tensor, m int, set *ExpertSet) ([]float32, error) {
	const field = "hidden_states_scale"
	if t == nil {
		return nil, invalidf(field, "is required for FLOAT8_E4M3FN hidden_states")
	}
	if err := Check(field, t, Float32); err != nil {
		return nil, err
	}
	s := t.Shape
	ok := len(s) == 0 || (len(s) == 1 && (s[0] == 1 || s[0] == m))
	want := fmt.Sprintf("[] or [1] (per-tensor) or [%d] (per-token)", m)
	if bk := set.Block[1]; bk > 0 {
		g := set.Groups()
		ok = ok || (len(s) == 2 && s[0] == m && s[1] == g)
		want += fmt.Sprintf(" or [%d, %d] (per-group of %d)", m, g, bk)
	}
	if !ok {
		return nil, invalidf(field, "shape %v: want %s", s, want)
	}
	return DecodeScales(field, t.Data)
}

// DecodeScales decodes little-endian FP32 scales, requiring each to be
// finite and > 0, then clamps them to scaling.MinScale (near-zero scales
// give NaN in FP8 kernels).
func DecodeScales(field string, b []byte) ([]float32, error) {
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

// DecodeFinite decodes FP32 or BF16 elements (a bias), requiring each to
// be finite.
func DecodeFinite(field string, dt DType, b []byte) ([]float32, error) {
	v := make([]float32, len(b)/dt.Size())
	for i := range v {
		x := Element(dt, b, i)
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			return nil, invalidf(field, "element %d is %v: want finite", i, x)
		}
		v[i] = x
	}
	return v, nil
}

// ValidateRouting checks rt for E experts and returns the routing Route
// runs, defaults filled in.
func ValidateRouting(rt *RoutingInput, e int) (Routing, error) {
	if rt == nil {
		return Routing{}, invalidf("routing", "is required with router_logits")
	}
	r := Routing{TopK: rt.TopK, Renormalize: rt.Renormalize}
	if r.TopK < 1 || r.TopK > e {
		return r, invalidf("routing.top_k", "%d: want in [1, %d] (E of the expert set)", rt.TopK, e)
	}
	switch rt.Scoring {
	case 0, Softmax:
		r.Scoring = Softmax
	case Sigmoid:
		r.Scoring = Sigmoid
	default:
		return r, invalidf("routing.scoring", "%v: want SCORING_SOFTMAX or SCORING_SIGMOID", rt.Scoring.WireName())
	}
	if b := rt.CorrectionBias; b != nil {
		const field = "routing.correction_bias"
		if r.Scoring != Sigmoid {
			return r, invalidf(field, "only valid with SCORING_SIGMOID")
		}
		if err := Check(field, b, Float32, BFloat16); err != nil {
			return r, err
		}
		if err := WantShape(field, b.Shape, e); err != nil {
			return r, err
		}
		var err error
		if r.CorrectionBias, err = DecodeFinite(field, b.DType, b.Data); err != nil {
			return r, err
		}
	}
	if g := rt.NumGroups; g > 1 {
		if g > e || e%g != 0 {
			return r, invalidf("routing.num_expert_groups", "%d does not divide E = %d", g, e)
		}
		tg := rt.TopKGroups
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
	switch sf := rt.ScalingFactor; {
	case sf == 0:
		r.ScalingFactor = 1
	case sf > 0 && !math.IsInf(float64(sf), 0):
		r.ScalingFactor = sf
	default:
		return r, invalidf("routing.routed_scaling_factor", "%v: want finite and > 0 (0 means 1)", sf)
	}
	return r, nil
}

// Element decodes element i of FP32 or BF16 bytes.
func Element(d DType, b []byte, i int) float32 {
	if d == BFloat16 {
		return scaling.BF16ToFloat32(binary.LittleEndian.Uint16(b[2*i:]))
	}
	return math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
}

// CheckLogits scans FP32 or BF16 logits of rows of e experts. -Inf is
// legal (it masks an expert), but NaN would make top-k selection
// meaningless and +Inf turns a softmax row into NaN (inf - inf); and a
// softmax row needs one finite logit, since softmax of a row of -Inf is
// 0/0. Sigmoid scores a -Inf as 0, so a sigmoid row may be all -Inf (its
// weights are 0).
func CheckLogits(d DType, b []byte, e int, scoring Scoring) error {
	if logitsClean(d, b, e, scoring) {
		return nil
	}
	return logitsError(d, b, e, scoring)
}

// logitsError finds the first element or row CheckLogits refuses and
// says which.
func logitsError(d DType, b []byte, e int, scoring Scoring) error {
	n := len(b) / d.Size()
	for row := 0; row*e < n; row++ {
		finite := false
		for i := row * e; i < (row+1)*e; i++ {
			x := Element(d, b, i)
			if x != x || math.IsInf(float64(x), 1) {
				return invalidf("router_logits", "element %d is %v: want finite or -Inf", i, x)
			}
			finite = finite || !math.IsInf(float64(x), -1)
		}
		if !finite && scoring == Softmax {
			return invalidf("router_logits", "row %d is all -Inf; softmax routing needs at least one finite logit", row)
		}
	}
	return nil
}

// logitsClean is CheckLogits' verdict without its message, from the bits:
// the scan runs on every call over M·E logits (256 × 128 at a prefill
// chunk), where converting each to a float costs more than the rest of
// validation. With the sign cleared, an exponent of all ones is NaN or
// ±Inf, and of those only -Inf (sign set, mantissa clear) is legal.
func logitsClean(d DType, b []byte, e int, scoring Scoring) bool {
	if d == BFloat16 {
		if !anySpecial(b, 0x7f807f807f807f80, 0x0001000100010001, 0x8000800080008000) {
			return true
		}
		return rowsClean(b, e, 2, 0x7fff, 0x7f80, 0xff80, scoring == Softmax)
	}
	if !anySpecial(b, 0x7f8000007f800000, 0x0000000100000001, 0x8000000080000000) {
		return true
	}
	return rowsClean(b, e, 4, 0x7fffffff, 0x7f800000, 0xff800000, scoring == Softmax)
}

// anySpecial reports whether any element of b (little-endian lanes of a
// 64-bit word, with exp the exponent field of each lane, one its lowest
// bit and high its highest) has an exponent of all ones: a NaN or an
// infinity. With none, every row has a finite logit and nothing else need
// be looked at. It tests a word at a time (a lane of (x & exp) ^ exp is
// zero exactly when its exponent is all ones, and (v - one) &^ v & high
// is non-zero exactly when some lane of v is zero), four words per step.
func anySpecial(b []byte, exp, one, high uint64) bool {
	zero := func(x uint64) uint64 {
		v := x&exp ^ exp
		return (v - one) &^ v & high
	}
	var acc uint64
	i := 0
	for ; i+32 <= len(b); i += 32 {
		w := b[i : i+32 : i+32]
		acc |= zero(binary.LittleEndian.Uint64(w)) | zero(binary.LittleEndian.Uint64(w[8:])) |
			zero(binary.LittleEndian.Uint64(w[16:])) | zero(binary.LittleEndian.Uint64(w[24:]))
	}
	for ; i+8 <= len(b); i += 8 {
		acc |= zero(binary.LittleEndian.Uint64(b[i:]))
	}
	if i < len(b) {
		// Fewer than eight bytes left: pad them with zeros, which are not
		// special in any lane.
		var tail [8]byte
		copy(tail[:], b[i:])
		acc |= zero(binary.LittleEndian.Uint64(tail[:]))
	}
	return acc != 0
}

// rowsClean is logitsClean for little-endian elements of size bytes.
func rowsClean(b []byte, e, size int, abs, expOnes, negInf uint32, softmax bool) bool {
	for row := 0; (row+1)*e*size <= len(b); row++ {
		r := b[row*e*size : (row+1)*e*size]
		finite := false
		for i := 0; i < len(r); i += size {
			var u uint32
			if size == 2 {
				u = uint32(binary.LittleEndian.Uint16(r[i:]))
			} else {
				u = binary.LittleEndian.Uint32(r[i:])
			}
			if u&abs < expOnes {
				finite = true
			} else if u != negInf {
				return false
			}
		}
		if !finite && softmax {
			return false
		}
	}
	return true
}
