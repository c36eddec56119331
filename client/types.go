package client

import (
	"fmt"
	"time"

	"github.com/expertd/expertd/codec"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// Activation is the expert MLP's nonlinearity: moe.Activation.
//
// Deprecated: use moe.Activation, the type's one name.
type Activation = moe.Activation

const (
	// SiluGated is silu(h[:, :N]) * h[:, N:]; W13 is [E, 2N, K] with the
	// gate rows first (vLLM order). Qwen3-MoE, Mixtral, DeepSeek-V3.
	//
	// Deprecated: use moe.SiluGated.
	SiluGated = moe.SiluGated
	// Relu2 is relu(h)^2; W13 holds w1, [E, N, K]. Nemotron-H.
	//
	// Deprecated: use moe.Relu2.
	Relu2 = moe.Relu2
	// SwigluOAI is gpt-oss's clamped SwiGLU, g * sigmoid(alpha * g) *
	// (u + 1) with g = min(gate, limit) and u = clamp(up, -limit, limit)
	// (ExpertWeights.SwigluLimit and SwigluAlpha); W13 is [E, 2N, K] with
	// gate and up rows interleaved (row 2j gate, 2j+1 up), as gpt-oss
	// checkpoints store them.
	//
	// Deprecated: use moe.SwigluOAI.
	SwigluOAI = moe.SwigluOAI
	// GeluTanhGated is gelu_tanh(h[:, :N]) * h[:, N:] (Gemma's GeGLU); W13
	// as for SiluGated.
	//
	// Deprecated: use moe.GeluTanhGated.
	GeluTanhGated = moe.GeluTanhGated
	// GeluGated is the exact, erf-based gelu(h[:, :N]) * h[:, N:]; W13 as
	// for SiluGated.
	//
	// Deprecated: use moe.GeluGated.
	GeluGated = moe.GeluGated
)

// Scoring is how router logits become expert scores: moe.Scoring.
//
// Deprecated: use moe.Scoring, the type's one name.
type Scoring = moe.Scoring

const (
	// Softmax is the default: p = softmax(logits), then top-k.
	//
	// Deprecated: use moe.Softmax.
	Softmax = moe.Softmax
	// Sigmoid ranks sigmoid(logits) + CorrectionBias and weights by the
	// unbiased sigmoid (DeepSeek-V3, Nemotron-H).
	//
	// Deprecated: use moe.Sigmoid.
	Sigmoid = moe.Sigmoid
)

// ExpertWeights is one MoE layer's FP8 weights and their FP32 scales. The
// shape of a scale says its granularity: [] or [1] per-tensor, [E]
// per-expert, [E, rows] per-channel, [E, ceil(rows/Bn), ceil(cols/Bk)]
// block (with BlockShape set).
type ExpertWeights struct {
	Activation moe.Activation
	// W13 is FP8 [E, 2N, K] (gated activations) or [E, N, K] (Relu2); W2
	// is FP8 [E, K, N].
	W13, W2 Tensor
	// W13Scale and W2Scale dequantize the weights; required.
	W13Scale, W2Scale Tensor
	// A13Scale and A2Scale are optional static activation scales ([] or
	// [1] or [E]); the zero Tensor means dynamic per-token quantization.
	A13Scale, A2Scale Tensor
	// BlockShape is [Bn, Bk] for block-scaled weights, zero otherwise.
	BlockShape [2]int
	// W13Bias (FP32 or BF16 [E, 2N] in W13's row order, or [E, N] for
	// Relu2) and W2Bias ([E, K]) are optional per-expert biases added to
	// GEMM1's output before the activation and to GEMM2's before the
	// router weight (gpt-oss); the zero Tensor means none.
	W13Bias, W2Bias Tensor
	// SwigluLimit and SwigluAlpha are SwigluOAI's clamp limit and sigmoid
	// slope; 0 means gpt-oss's (7 and 1.702).
	SwigluLimit, SwigluAlpha float32
}

// tensors lists the weights with the names LoadExperts chunks use, in
// the order the fingerprint hashes them.
func (w *ExpertWeights) tensors() []namedTensor {
	return []namedTensor{
		{"w13", w.W13}, {"w2", w.W2}, {"w13_scale", w.W13Scale},
		{"w2_scale", w.W2Scale}, {"a13_scale", w.A13Scale}, {"a2_scale", w.A2Scale},
		{"w13_bias", w.W13Bias}, {"w2_bias", w.W2Bias},
	}
}

type namedTensor struct {
	name string
	t    Tensor
}

// validate checks every set tensor locally; the server checks the rest
// (shapes against each other, scale values).
func (w *ExpertWeights) validate(prefix string) error {
	for _, nt := range w.tensors() {
		if nt.t.IsZero() {
			continue
		}
		if err := nt.t.Validate(); err != nil {
			return fmt.Errorf("%s.%s: %w", prefix, nt.name, err)
		}
	}
	return nil
}

// proto is w's wire form; meta leaves the bytes out (a LoadExperts header).
func (w *ExpertWeights) proto(meta bool) *pb.ExpertWeights {
	conv := Tensor.Proto
	if meta {
		conv = Tensor.meta
	}
	p := &pb.ExpertWeights{
		Activation: pb.Activation(w.Activation),
		W13:        conv(w.W13), W2: conv(w.W2),
		W13Scale: conv(w.W13Scale), W2Scale: conv(w.W2Scale),
		A13Scale: conv(w.A13Scale), A2Scale: conv(w.A2Scale),
		W13Bias: conv(w.W13Bias), W2Bias: conv(w.W2Bias),
		SwigluLimit: w.SwigluLimit, SwigluAlpha: w.SwigluAlpha,
	}
	if w.BlockShape != [2]int{} {
		p.WeightBlockShape = []int32{int32(w.BlockShape[0]), int32(w.BlockShape[1])}
	}
	return p
}

// Routing configures top-k expert selection from router logits.
type Routing struct {
	// TopK experts per token, in [1, E]. Required with RouterLogits.
	TopK int
	// Renormalize divides the chosen weights by their sum.
	Renormalize bool
	// Scoring defaults to Softmax.
	Scoring moe.Scoring
	// CorrectionBias is an optional FP32 or BF16 [E] selection bias
	// (Sigmoid only).
	CorrectionBias Tensor
	// NumGroups and TopKGroups keep the best TopKGroups of NumGroups expert
	// groups (DeepSeek-V3: 8 and 4); 0 means no grouping.
	NumGroups, TopKGroups int
	// ScalingFactor multiplies the final weights; 0 means 1.
	ScalingFactor float32
}

// FusedMoERequest is one MoE layer call. Set ExpertSet (a set loaded with
// LoadExperts) or Weights (inline, for this call only), and route either
// with RouterLogits + Routing or with precomputed TopKIDs + TopKWeights.
type FusedMoERequest struct {
	ExpertSet string
	Weights   *ExpertWeights
	// Hidden is [M, K]: FP32 or BF16 (the server quantizes), or FP8 with
	// HiddenScale.
	Hidden      Tensor
	HiddenScale Tensor
	// RouterLogits is FP32 or BF16 [M, E].
	RouterLogits Tensor
	Routing      Routing
	// TopKIDs (INT32 [M, k]) and TopKWeights (FP32 [M, k]) bypass routing.
	TopKIDs, TopKWeights Tensor
	// OutputDType is BFloat16 (the default when 0) or Float32.
	OutputDType moe.DType
	// ReturnRouting asks for the routing used in the result.
	ReturnRouting bool
	// OutputShm, when set, has the server write the output ([M, K] in
	// OutputDType) into this slice of a registered shared-memory region
	// (Region.Ref) instead of sending it; the result's Output then views
	// those bytes (in a POSIX region; a CUDA IPC region's stay on the
	// device, and Output.Data is nil).
	OutputShm *SharedMemoryRef
}

// proto validates r locally and returns its wire form.
func (r *FusedMoERequest) proto() (*pb.FusedMoERequest, error) {
	if (r.ExpertSet == "") == (r.Weights == nil) {
		return nil, fmt.Errorf("experts: set exactly one of ExpertSet and Weights")
	}
	p := &pb.FusedMoERequest{
		OutputDtype:   pb.DataType(r.OutputDType),
		ReturnRouting: r.ReturnRouting,
		OutputShm:     r.OutputShm.proto(),
	}
	if r.Weights != nil {
		if err := r.Weights.validate("weights"); err != nil {
			return nil, err
		}
		p.Experts = &pb.FusedMoERequest_Weights{Weights: r.Weights.proto(false)}
	} else {
		p.Experts = &pb.FusedMoERequest_ExpertSet{ExpertSet: r.ExpertSet}
	}
	for _, f := range []struct {
		name string
		t    Tensor
		dst  **pb.Tensor
	}{
		{"hidden_states", r.Hidden, &p.HiddenStates},
		{"hidden_states_scale", r.HiddenScale, &p.HiddenStatesScale},
		{"router_logits", r.RouterLogits, &p.RouterLogits},
		{"topk_ids", r.TopKIDs, &p.TopkIds},
		{"topk_weights", r.TopKWeights, &p.TopkWeights},
		{"routing.correction_bias", r.Routing.CorrectionBias, nil},
	} {
		if f.t.IsZero() {
			continue
		}
		if err := f.t.Validate(); err != nil {
			return nil, fmt.Errorf("%s: %w", f.name, err)
		}
		if f.dst != nil {
			*f.dst = f.t.Proto()
		}
	}
	if r.Hidden.IsZero() {
		return nil, fmt.Errorf("hidden_states: required")
	}
	rt := r.Routing
	if rt.TopK != 0 || rt.Renormalize || rt.Scoring != 0 || !rt.CorrectionBias.IsZero() ||
		rt.NumGroups != 0 || rt.TopKGroups != 0 || rt.ScalingFactor != 0 {
		p.Routing = &pb.Routing{
			TopK: int32(rt.TopK), Renormalize: rt.Renormalize, Scoring: pb.Scoring(rt.Scoring),
			CorrectionBias:  rt.CorrectionBias.Proto(),
			NumExpertGroups: int32(rt.NumGroups), TopkGroups: int32(rt.TopKGroups),
			RoutedScalingFactor: rt.ScalingFactor,
		}
	}
	return p, nil
}

// Timings break down one call's server-side time.
type Timings struct {
	// Decode is validating and converting the request; Queue waiting for an
	// execution slot; H2D, Kernel and D2H the copies and compute (H2D and
	// D2H are 0 on the CPU backend); Total from receipt to response.
	Decode, Queue, H2D, Kernel, D2H, Total time.Duration
	// Receive, before Total, is reading and unmarshalling the request on
	// the server; 0 when the server did not observe it.
	Receive time.Duration
}

// FusedMoEResult is one MoE layer's output.
type FusedMoEResult struct {
	// Output is [M, K] in the request's output dtype; Output.Float32s()
	// decodes it.
	Output Tensor
	// TopKIDs (INT32 [M, k]) and TopKWeights (FP32 [M, k]) are set when the
	// request asked for ReturnRouting.
	TopKIDs, TopKWeights Tensor
	Timings              Timings
	// Backend names what ran the call ("cpu", "cuda").
	Backend string

	recv codec.Held // the receive buffer the tensors alias; see Release
}

func resultFromProto(p *pb.FusedMoEResponse) (*FusedMoEResult, error) {
	r := &FusedMoEResult{Backend: p.GetBackend()}
	var err error
	if r.Output, err = TensorFromProto(p.GetOutput()); err != nil {
		return nil, fmt.Errorf("output: %w", err)
	}
	if r.TopKIDs, err = TensorFromProto(p.GetTopkIds()); err != nil {
		return nil, fmt.Errorf("topk_ids: %w", err)
	}
	if r.TopKWeights, err = TensorFromProto(p.GetTopkWeights()); err != nil {
		return nil, fmt.Errorf("topk_weights: %w", err)
	}
	t := p.GetTimings()
	r.Timings = Timings{
		Decode: time.Duration(t.GetDecodeNanos()), Queue: time.Duration(t.GetQueueNanos()),
		H2D: time.Duration(t.GetH2DNanos()), Kernel: time.Duration(t.GetKernelNanos()),
		D2H: time.Duration(t.GetD2HNanos()), Total: time.Duration(t.GetTotalNanos()),
		Receive: time.Duration(t.GetReceiveNanos()),
	}
	return r, nil
}

// ExpertSetInfo describes a loaded expert set.
type ExpertSetInfo struct {
	Name       string
	Activation moe.Activation
	// NumExperts E, HiddenSize K, IntermediateSize N.
	NumExperts, HiddenSize, IntermediateSize int
	// TopKHint is the model's top_k when the server knows it, else 0.
	TopKHint int
	// W13ScaleGranularity and W2ScaleGranularity are "per-tensor",
	// "per-expert", "per-channel" or "block".
	W13ScaleGranularity, W2ScaleGranularity string
	// BlockShape is [Bn, Bk] in block mode.
	BlockShape [2]int
	// StaticA13Scale and StaticA2Scale say whether activation scales are
	// static.
	StaticA13Scale, StaticA2Scale bool
	// Bytes of weights and scales resident on the server.
	Bytes int64
	// Fingerprint is the hex SHA-256 of the tensor bytes (w13, w2,
	// w13_scale, w2_scale, a13_scale, a2_scale, w13_bias, w2_bias).
	Fingerprint string
	Backend     string
	LoadedAt    time.Time
	// Routing is the routing a checkpoint's config.json gives a set loaded
	// from a checkpoint directory (send it as FusedMoERequest.Routing); nil
	// otherwise.
	Routing *Routing
}

func setInfoFromProto(p *pb.ExpertSetInfo) ExpertSetInfo {
	info := ExpertSetInfo{
		Name: p.GetName(), Activation: moe.Activation(p.GetActivation()),
		NumExperts: int(p.GetNumExperts()), HiddenSize: int(p.GetHiddenSize()),
		IntermediateSize: int(p.GetIntermediateSize()), TopKHint: int(p.GetTopKHint()),
		W13ScaleGranularity: p.GetW13ScaleGranularity(), W2ScaleGranularity: p.GetW2ScaleGranularity(),
		StaticA13Scale: p.GetStaticA13Scale(), StaticA2Scale: p.GetStaticA2Scale(),
		Bytes: p.GetBytes(), Fingerprint: p.GetFingerprint(), Backend: p.GetBackend(),
	}
	if bs := p.GetWeightBlockShape(); len(bs) == 2 {
		info.BlockShape = [2]int{int(bs[0]), int(bs[1])}
	}
	if p.GetLoadedAt() != nil {
		info.LoadedAt = p.GetLoadedAt().AsTime()
	}
	if r := p.GetRouting(); r != nil {
		info.Routing = &Routing{TopK: int(r.GetTopK()), Renormalize: r.GetRenormalize(), Scoring: moe.Scoring(r.GetScoring()),
			NumGroups: int(r.GetNumExpertGroups()), TopKGroups: int(r.GetTopkGroups()), ScalingFactor: r.GetRoutedScalingFactor()}
		if r.GetCorrectionBias() != nil {
			// The server sends the bias inline and validated, so decoding
			// cannot fail on a well-behaved server; a bad one leaves it unset.
			info.Routing.CorrectionBias, _ = TensorFromProto(r.GetCorrectionBias())
		}
	}
	return info
}

// ServerInfo describes a server and its limits.
type ServerInfo struct {
	Version string
	// Backends are the available backends; the first serves calls.
	Backends []BackendInfo
	Devices  []string
	Limits   Limits
	// Ring is the call-ring service (OpenRing) as the server runs it.
	Ring RingInfo
	// Transport is the server's connection handling.
	Transport Transport
	// Settings are the daemon's settings in force by flag name, as the
	// flags spell them (security settings only as set or empty).
	Settings map[string]string
}

// RingInfo is a server's call-ring settings.
type RingInfo struct {
	// Enabled: the server attaches rings (-shared-memory -ring).
	Enabled bool
	// Version is the ring layout version it reads.
	Version uint32
	// Spin is how long its poller polls after a ring's last call.
	Spin time.Duration
	// MaxPerConn, MaxRings and MaxSlotBytes are its ring limits.
	MaxPerConn, MaxRings int
	MaxSlotBytes         int64
}

// BackendInfo is one backend's capabilities.
type BackendInfo struct {
	Name          string
	Activations   []moe.Activation
	Granularities []string
	Devices       []string
	// MaxTokens is the largest M per call; 0 means no backend limit.
	MaxTokens int
}

// Limits are a server's configured bounds.
type Limits struct {
	// MaxMessageBytes is the largest gRPC message the server accepts.
	MaxMessageBytes int64
	// MaxTokens is the largest M per FusedMoE call.
	MaxTokens int
	// MaxLoadedBytes bounds resident expert sets; 0 means unlimited.
	MaxLoadedBytes int64
	// MaxConcurrent calls execute at once; more queue.
	MaxConcurrent int
	// MaxShmRegions and MaxShmBytes bound the shared-memory regions of
	// all connections together; 0 when the server has shared memory off.
	MaxShmRegions int
	MaxShmBytes   int64
	// MaxQueued calls may wait for an execution slot; more are refused
	// with ResourceExhausted.
	MaxQueued int
	// BatchWindow is how long a merged batch waits for more compatible
	// calls (0: no dynamic batching); BatchMaxTokens bounds its tokens
	// (0: the server's default).
	BatchWindow    time.Duration
	BatchMaxTokens int
}

// Transport is a server's connection handling.
type Transport struct {
	// StreamWorkers run RPC handlers; 0 means a goroutine per call.
	StreamWorkers int
	// KeepaliveMinTime is the shortest client ping interval the server
	// allows; KeepaliveTime and KeepaliveTimeout are its own pings of
	// idle connections.
	KeepaliveMinTime, KeepaliveTime, KeepaliveTimeout time.Duration
	// MaxConnectionAge and MaxConnectionAgeGrace age connections (0:
	// never, and no limit).
	MaxConnectionAge, MaxConnectionAgeGrace time.Duration
}

func serverInfoFromProto(p *pb.ServerInfo) *ServerInfo {
	info := &ServerInfo{Version: p.GetVersion(), Devices: p.GetDevices()}
	for _, b := range p.GetBackends() {
		bi := BackendInfo{Name: b.GetName(), Granularities: b.GetGranularities(), Devices: b.GetDevices(), MaxTokens: int(b.GetMaxTokens())}
		for _, a := range b.GetActivations() {
			bi.Activations = append(bi.Activations, moe.Activation(a))
		}
		info.Backends = append(info.Backends, bi)
	}
	l := p.GetLimits()
	info.Limits = Limits{MaxMessageBytes: l.GetMaxMessageBytes(), MaxTokens: int(l.GetMaxTokens()),
		MaxLoadedBytes: l.GetMaxLoadedBytes(), MaxConcurrent: int(l.GetMaxConcurrent()),
		MaxShmRegions: int(l.GetMaxShmRegions()), MaxShmBytes: l.GetMaxShmBytes(),
		MaxQueued: int(l.GetMaxQueued()), BatchWindow: time.Duration(l.GetBatchWindowNanos()), BatchMaxTokens: int(l.GetBatchMaxTokens())}
	r := p.GetRing()
	info.Ring = RingInfo{Enabled: r.GetEnabled(), Version: r.GetVersion(), Spin: time.Duration(r.GetSpinNanos()),
		MaxPerConn: int(r.GetMaxPerConn()), MaxRings: int(r.GetMaxRings()), MaxSlotBytes: r.GetMaxSlotBytes()}
	t := p.GetTransport()
	info.Transport = Transport{StreamWorkers: int(t.GetStreamWorkers()), KeepaliveMinTime: time.Duration(t.GetKeepaliveMinTimeNanos()),
		KeepaliveTime: time.Duration(t.GetKeepaliveTimeNanos()), KeepaliveTimeout: time.Duration(t.GetKeepaliveTimeoutNanos()),
		MaxConnectionAge: time.Duration(t.GetMaxConnectionAgeNanos()), MaxConnectionAgeGrace: time.Duration(t.GetMaxConnectionAgeGraceNanos())}
	info.Settings = p.GetSettings()
	return info
}
