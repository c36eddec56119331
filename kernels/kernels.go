// Package kernels defines what the service needs from a compute engine: the
// Backend interface, the validated tensor and expert-set types it consumes,
// and a registry through which backends make themselves available.
//
// Everything here is already checked at the service edge; backends trust
// shapes and byte lengths and never see a protobuf message.
package kernels

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"

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

func (d DType) String() string {
	switch d {
	case Float32:
		return "float32"
	case BFloat16:
		return "bfloat16"
	case Float16:
		return "float16"
	case Float8E4M3FN:
		return "float8_e4m3fn"
	case Float8E5M2:
		return "float8_e5m2"
	case Int32:
		return "int32"
	}
	return fmt.Sprintf("DType(%d)", int(d))
}

// Tensor is a validated, row-major, little-endian view of tensor bytes.
// len(Data) == numel(Shape) * DType.Size() always holds, except for a
// device tensor. Data may alias a request buffer: backends must not retain
// it past the call.
type Tensor struct {
	DType DType
	Shape []int
	Data  []byte
	// Dev, when non-zero, is the device address of the tensor's bytes
	// (numel(Shape) * DType.Size() of them) and Data is nil: memory a
	// same-host caller shared through CUDA IPC, opened with a backend's
	// OpenIPC. Only backends that open such memory are given device
	// tensors, and only as Request.Hidden and Request.Logits.
	Dev uintptr
}

// DeviceRegion is device memory another process shared through CUDA IPC,
// opened by a backend.
type DeviceRegion interface {
	// Ptr is the device address of the region's first byte.
	Ptr() uintptr
	// Size is the region's length in bytes.
	Size() int64
	// Close unmaps the region; no call may use its addresses afterwards.
	Close() error
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
)

func (a Activation) String() string {
	switch a {
	case SiluGated:
		return "silu_gated"
	case Relu2:
		return "relu2"
	}
	return fmt.Sprintf("Activation(%d)", int(a))
}

// Scoring is how router logits become expert scores.
type Scoring int

const (
	// Softmax scoring: p = softmax(logits), then top-k.
	Softmax Scoring = iota + 1
	// Sigmoid scoring: s = sigmoid(logits); selection uses s + bias, weights
	// the unbiased s (DeepSeek-V3, Nemotron-H).
	Sigmoid
)

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
}

// Rows1 is the number of GEMM1 output rows per expert: 2N gated, N for ReLU².
func (s *ExpertSet) Rows1() int {
	if s.Activation == SiluGated {
		return 2 * s.N
	}
	return s.N
}

// Bytes is the weight and scale memory the set occupies.
func (s *ExpertSet) Bytes() int64 {
	return int64(len(s.W13)+len(s.W2)) + 4*int64(len(s.W13Scale.Values)+len(s.W2Scale.Values))
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
}

// M is the number of tokens.
func (r *Request) M() int { return r.Hidden.Shape[0] }

// Result is what a FusedMoE call produces.
type Result struct {
	// Output is [M, K] in the request's OutDType.
	Output []byte
	// TopKIDs and TopKWeights are the routing actually used, [M, TopK].
	TopKIDs     []int32
	TopKWeights []float32
	// KernelNanos is time spent in the backend's compute, excluding queueing.
	KernelNanos int64
}

// Capabilities say what a backend can run.
type Capabilities struct {
	// Activations and Granularities the backend supports.
	Activations   []Activation
	Granularities []scaling.Granularity
	// Devices describes the hardware, e.g. "NVIDIA H200 (sm_90, 132 SMs)".
	Devices []string
	// MaxTokens is the largest M per call the backend accepts, 0 for no limit.
	MaxTokens int
	// Details are the backend's settings in force, by name, for
	// GetServerInfo (the cuda backend reports its Options).
	Details map[string]string
}

// Loaded is an expert set resident in a backend (host or device memory).
type Loaded interface {
	// Set is the expert set's metadata (weights may have been released from
	// host memory by device backends, so W13/W2 can be nil).
	Set() *ExpertSet
	// Close frees the set's memory; calls in flight finish first.
	Close() error
}

// Backend runs fused MoE layers.
type Backend interface {
	// Name is the backend's registry name ("cpu", "cuda").
	Name() string
	// Capabilities reports what the backend supports.
	Capabilities() Capabilities
	// Load makes an expert set resident. The backend may keep set's slices.
	Load(ctx context.Context, set *ExpertSet) (Loaded, error)
	// FusedMoE runs req through a loaded set. It is safe for concurrent use.
	FusedMoE(ctx context.Context, set Loaded, req *Request) (*Result, error)
	// Close releases the backend.
	Close() error
}

// ErrUnsupported marks a valid request this backend cannot run (an
// activation or granularity it lacks); the service maps it to
// FailedPrecondition or falls back.
var ErrUnsupported = errors.New("unsupported by backend")

// ErrOutOfMemory marks an allocation the backend could not make; the
// service maps it to ResourceExhausted.
var ErrOutOfMemory = errors.New("backend out of memory")

// Factory opens a backend from the daemon's configuration.
type Factory func(cfg Config) (Backend, error)

// Config is what the daemon passes to backend factories.
type Config struct {
	// LibraryPath locates a native kernel library, when the backend has one.
	LibraryPath string
	// Device is the GPU ordinal for device backends.
	Device int
	// Threads bounds CPU parallelism; 0 means GOMAXPROCS.
	Threads int
	// Options are switches of the backend being opened, by name (the cuda
	// backend's are cuda.OptionKeys, and it refuses others).
	Options map[string]string
}

var (
	regMu     sync.Mutex
	factories = map[string]Factory{}
)

// Register makes a backend available by name; backends call it from init.
func Register(name string, f Factory) {
	regMu.Lock()
	defer regMu.Unlock()
	if _, dup := factories[name]; dup {
		panic("kernels: backend registered twice: " + name)
	}
	factories[name] = f
}

// Open opens the named backend.
func Open(name string, cfg Config) (Backend, error) {
	regMu.Lock()
	f, ok := factories[name]
	regMu.Unlock()
	if !ok {
		return nil, fmt.Errorf("kernels: no backend %q (have %v)", name, Names())
	}
	return f(cfg)
}

// Names lists the registered backends.
func Names() []string {
	regMu.Lock()
	defer regMu.Unlock()
	names := make([]string, 0, len(factories))
	for n := range factories {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}
