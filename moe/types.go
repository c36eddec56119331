// Package moe is expertd's request model: the element types, tensors (with
// the memory they are in), expert sets, routing, a FusedMoE request and its
// result, the one place a request is validated (Validate), and the routing
// math (Route). It imports no protobuf and no engine, so the service, every
// backend, the float64 reference and the Go SDK share it.
package moe

import (
	"fmt"
	"strconv"

	"github.com/expertd/expertd/scaling"
)

// DType is the element type of a tensor's bytes.
type DType int

// The element types expertd moves. Values mirror expertd.v1.DataType.
const (
	Float32 DType = iota + 1
	BFloat16
	Float16
	Float8E4M3FN
	Float8E5M2
	Int32
)

// Size is the bytes per element.
func (d DType) Size() int {
	switch d {
	case Float32, Int32:
		return 4
	case BFloat16, Float16:
		return 2
	case Float8E4M3FN, Float8E5M2:
		return 1
	}
	return 0
}

// dtypeNames are each DType's name and its expertd.v1.DataType spelling.
var dtypeNames = [...]struct{ name, wire string }{
	0:            {"", "DATA_TYPE_UNSPECIFIED"},
	Float32:      {"float32", "DATA_TYPE_FLOAT32"},
	BFloat16:     {"bfloat16", "DATA_TYPE_BFLOAT16"},
	Float16:      {"float16", "DATA_TYPE_FLOAT16"},
	Float8E4M3FN: {"float8_e4m3fn", "DATA_TYPE_FLOAT8_E4M3FN"},
	Float8E5M2:   {"float8_e5m2", "DATA_TYPE_FLOAT8_E5M2"},
	Int32:        {"int32", "DATA_TYPE_INT32"},
}

func (d DType) String() string {
	if d.Valid() {
		return dtypeNames[d].name
	}
	return fmt.Sprintf("DType(%d)", int(d))
}

// Valid reports whether d is one of the element types above.
func (d DType) Valid() bool { return d >= Float32 && d <= Int32 }

// WireName is d as expertd.v1.DataType spells it, which is how error
// messages name a dtype (the service's tests check the two agree).
func (d DType) WireName() string {
	if d >= 0 && int(d) < len(dtypeNames) {
		return dtypeNames[d].wire
	}
	return strconv.Itoa(int(d))
}

// OutputDType is the output element type a requested one (0 for unset)
// stands for; ok is false for a type the output cannot have.
func OutputDType(d DType) (out DType, ok bool) {
	switch d {
	case 0, BFloat16:
		return BFloat16, true
	case Float32:
		return Float32, true
	}
	return 0, false
}

// Memory is where a tensor's bytes are.
type Memory int

const (
	// Host memory this process reads: Data holds the bytes (a request
	// buffer or a mapped POSIX shared-memory region).
	Host Memory = iota
	// Pinned is page-locked host memory (a POSIX region the backend
	// registered): Data holds the bytes, which a device backend copies by
	// DMA without staging.
	Pinned
	// Device memory, shared by a same-host caller through CUDA IPC: Dev
	// holds the address and Data is nil.
	Device
)

func (m Memory) String() string {
	switch m {
	case Host:
		return "host"
	case Pinned:
		return "pinned"
	case Device:
		return "device"
	}
	return fmt.Sprintf("Memory(%d)", int(m))
}

// Tensor is a row-major, little-endian view of tensor bytes. Once
// validated, len(Data) == numel(Shape) * DType.Size() holds, except for a
// device tensor. Data may alias a request buffer: backends must not retain
// it past the call.
type Tensor struct {
	DType DType
	Shape []int
	Data  []byte
	// Memory says where the bytes are; Device tensors have Dev, the others
	// Data.
	Memory Memory
	// Dev, when non-zero, is the device address of the tensor's bytes
	// (numel(Shape) * DType.Size() of them) and Data is nil: memory a
	// same-host caller shared through CUDA IPC, opened with a backend's
	// OpenIPC. Only backends that open such memory are given device
	// tensors, and only as Request.Hidden and Request.Logits.
	Dev uintptr
	// DevBytes is how many bytes at Dev the caller lent, which Check holds
	// to the declared size as it holds len(Data) for the other memories.
	DevBytes int64
}

// Numel is the number of elements.
func (t Tensor) Numel() int {
	n := 1
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// Activation is the expert MLP's nonlinearity.
type Activation int

const (
	// SiluGated is silu(h[:, :N]) * h[:, N:] over GEMM1's 2N outputs
	// (rows [0,N) of w13 are gate, [N,2N) up, as in vLLM).
	SiluGated Activation = iota + 1
	// Relu2 is relu(h)^2 over GEMM1's N outputs (Nemotron-H, no up branch).
	Relu2
	// SwigluOAI is gpt-oss's clamped SwiGLU over GEMM1's 2N outputs, whose
	// w13 rows interleave gate and up (GateUp): with g = min(gate, limit)
	// and u = clamp(up, -limit, limit), g * sigmoid(alpha * g) * (u + 1).
	SwigluOAI
	// GeluTanhGated is gelu_tanh(h[:, :N]) * h[:, N:] (Gemma's GeGLU).
	GeluTanhGated
	// GeluGated is gelu(h[:, :N]) * h[:, N:] with the exact, erf-based gelu.
	GeluGated
)

// gpt-oss's SwiGLU constants (transformers' GptOssConfig defaults), which
// an expert set's zero SwigluLimit and SwigluAlpha stand for.
const (
	DefaultSwigluLimit = 7.0
	DefaultSwigluAlpha = 1.702
)

// activationNames are each Activation's name and its expertd.v1.Activation
// spelling.
var activationNames = [...]struct{ name, wire string }{
	0:             {"", "ACTIVATION_UNSPECIFIED"},
	SiluGated:     {"silu_gated", "ACTIVATION_SILU_GATED"},
	Relu2:         {"relu2", "ACTIVATION_RELU2"},
	SwigluOAI:     {"swiglu_oai", "ACTIVATION_SWIGLU_OAI"},
	GeluTanhGated: {"gelu_tanh_gated", "ACTIVATION_GELU_TANH_GATED"},
	GeluGated:     {"gelu_gated", "ACTIVATION_GELU_GATED"},
}

func (a Activation) String() string {
	if a.Valid() {
		return activationNames[a].name
	}
	return fmt.Sprintf("Activation(%d)", int(a))
}

// Valid reports whether a is one of the activations above.
func (a Activation) Valid() bool { return a >= SiluGated && a <= GeluGated }

// WireName is a as expertd.v1.Activation spells it.
func (a Activation) WireName() string {
	if a >= 0 && int(a) < len(activationNames) {
		return activationNames[a].wire
	}
	return strconv.Itoa(int(a))
}

// Gated reports whether GEMM1 yields a gate and an up row per channel
// (2N rows); only Relu2 has one row per channel.
func (a Activation) Gated() bool { return a.Valid() && a != Relu2 }

// Scoring is how router logits become expert scores.
type Scoring int

const (
	// Softmax scoring: p = softmax(logits), then top-k.
	Softmax Scoring = iota + 1
	// Sigmoid scoring: s = sigmoid(logits); selection uses s + bias, weights
	// the unbiased s (DeepSeek-V3, Nemotron-H).
	Sigmoid
)

// WireName is s as expertd.v1.Scoring spells it.
func (s Scoring) WireName() string {
	switch s {
	case 0:
		return "SCORING_UNSPECIFIED"
	case Softmax:
		return "SCORING_SOFTMAX"
	case Sigmoid:
		return "SCORING_SIGMOID"
	}
	return strconv.Itoa(int(s))
}

// ExpertSet is one MoE layer's weights, validated.
type ExpertSet struct {
	Activation Activation
	// E experts, hidden size K, intermediate size N.
	E, K, N int
	// W13 is FP8 E4M3FN [E, Rows1(), K]; W2 is FP8 E4M3FN [E, K, N].
	W13, W2 []byte
	// W13Scale and W2Scale dequantize the weights; their granularity is
	// per-tensor, per-expert, per-channel or block.
	W13Scale, W2Scale scaling.WeightScale
	// A13Scale and A2Scale are static activation scales (per-tensor, or
	// per-expert reduced to the max); nil means dynamic quantization.
	A13Scale, A2Scale *float32
	// Block is [Bn, Bk] in block mode, zero otherwise; it also sets the
	// group size of dynamic per-group activation quantization.
	Block [2]int
	// W13Bias [E, Rows1()] (in w13's row order) is added to GEMM1's
	// dequantized output before the activation, and W2Bias [E, K] to
	// GEMM2's before the router weight; nil means no bias.
	W13Bias, W2Bias []float32
	// SwigluLimit and SwigluAlpha are SwigluOAI's clamp limit and sigmoid
	// slope, > 0 once validated (zero on the wire means gpt-oss's).
	SwigluLimit, SwigluAlpha float32
}

// Rows1 is the number of GEMM1 output rows per expert: 2N gated, N for ReLU².
func (s *ExpertSet) Rows1() int {
	if s.Activation.Gated() {
		return 2 * s.N
	}
	return s.N
}

// GateUp is the GEMM1 rows of channel j's gate and up (gated activations
// only): rows j and N+j, except SwigluOAI's, which interleave them as
// gpt-oss checkpoints store gate_up_proj (2j and 2j+1).
func (s *ExpertSet) GateUp(j int) (gate, up int) {
	if s.Activation == SwigluOAI {
		return 2 * j, 2*j + 1
	}
	return j, s.N + j
}

// Groups is the number of Bk-column groups of a hidden row in block mode
// (the per-group scales of a row), 1 otherwise.
func (s *ExpertSet) Groups() int {
	if bk := s.Block[1]; bk > 0 {
		return (s.K + bk - 1) / bk
	}
	return 1
}

// Bytes is the weight and scale memory the set occupies.
func (s *ExpertSet) Bytes() int64 {
	return int64(len(s.W13)+len(s.W2)) + 4*int64(len(s.W13Scale.Values)+len(s.W2Scale.Values)+len(s.W13Bias)+len(s.W2Bias))
}

// Routing configures top-k expert selection.
type Routing struct {
	TopK        int
	Renormalize bool
	Scoring     Scoring
	// CorrectionBias [E] is added to sigmoid scores for selection only; nil
	// means none.
	CorrectionBias []float32
	// NumGroups and TopKGroups restrict selection to the best TopKGroups of
	// NumGroups expert groups (DeepSeek-V3); 0 or 1 groups means no grouping.
	NumGroups, TopKGroups int
	// ScalingFactor multiplies the final weights; validated to be > 0.
	ScalingFactor float32
}

// Request is one validated FusedMoE call on a loaded expert set.
type Request struct {
	// Hidden is [M, K] FP8 E4M3FN, BF16 or FP32.
	Hidden Tensor
	// HiddenScale dequantizes FP8 Hidden: one value (per-tensor), M values
	// (per-token) or M*ceil(K/Bk) values (per-group, block mode). Unused
	// when Hidden is not FP8.
	HiddenScale []float32
	// Logits is [M, E] FP32 or BF16; ignored when TopKIDs is set.
	Logits  Tensor
	Routing Routing
	// TopKIDs [M, TopK] and TopKWeights [M, TopK] bypass routing when set.
	TopKIDs     []int32
	TopKWeights []float32
	// OutDType is BFloat16 or Float32.
	OutDType DType
	// Out, when set, is where the backend writes the output ([M, K] of
	// OutDType, exactly that long), and Result.Output is Out; nil lets the
	// backend allocate. The service passes recycled buffers: writing a
	// fresh allocation faults in every page.
	Out []byte
	// OutDev, when non-zero, is the device address the output goes to
	// instead (a CUDA IPC region's); Out is then nil and so is
	// Result.Output.
	OutDev uintptr
	// NoRouting says the caller does not want the routing back: a backend
	// may leave Result.TopKIDs and TopKWeights nil. The CUDA backend then
	// skips copying them off the device, a copy of its own on the critical
	// path when the output stays in device memory.
	NoRouting bool
}

// M is the number of tokens.
func (r *Request) M() int { return r.Hidden.Shape[0] }

// HiddenScaleAt is the dequantization scale of FP8 Hidden's token t in
// column group g (columns [g*Bk, (g+1)*Bk) in block mode; any g
// otherwise), clamped to scaling.MinScale. Without a HiddenScale it is the
// set's static A13Scale, else 1. Every backend and the reference index the
// scale through here.
func (r *Request) HiddenScaleAt(set *ExpertSet, t, g int) float32 {
	hs := r.HiddenScale
	var v float32
	switch {
	case len(hs) == 0 && set.A13Scale != nil:
		v = *set.A13Scale
	case len(hs) == 0:
		v = 1
	case len(hs) == 1:
		v = hs[0]
	case len(hs) == r.M():
		v = hs[t]
	default: // M*ceil(K/Bk), block mode
		v = hs[t*set.Groups()+g]
	}
	return scaling.ClampScale(v)
}

// Result is what a FusedMoE call produces.
type Result struct {
	// Output is [M, K] in the request's OutDType.
	Output []byte
	// TopKIDs and TopKWeights are the routing actually used, [M, TopK],
	// or both nil when the request's NoRouting let the backend skip them.
	TopKIDs     []int32
	TopKWeights []float32
	// KernelNanos is time spent in the backend's compute, excluding queueing.
	KernelNanos int64
}
