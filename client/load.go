package client

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"

	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// Progress is how far a LoadExperts upload got.
type Progress struct {
	// SentBytes of TotalBytes tensor bytes have been handed to the stream.
	SentBytes, TotalBytes int64
}

// LoadOption configures one LoadExperts call.
type LoadOption func(*loadOptions)

type loadOptions struct {
	overwrite  bool
	progress   func(Progress)
	chunkBytes int
	noChecksum bool
}

// Overwrite replaces a set of the same name; without it, a name in use
// fails with AlreadyExists. The old set serves until the new one is
// complete.
func Overwrite() LoadOption { return func(o *loadOptions) { o.overwrite = true } }

// OnProgress calls fn after each chunk is sent, from the calling
// goroutine, and once at the start with SentBytes 0.
func OnProgress(fn func(Progress)) LoadOption { return func(o *loadOptions) { o.progress = fn } }

// ChunkBytes sets this load's chunk size, as given. Without it the
// client's chunk size is used, lowered if needed to fit the server's
// message limit.
func ChunkBytes(n int) LoadOption { return func(o *loadOptions) { o.chunkBytes = n } }

// WithoutChecksum skips the SHA-256 that the server otherwise verifies
// the upload against (hashing is a CPU pass over every byte on the client).
func WithoutChecksum() LoadOption { return func(o *loadOptions) { o.noChecksum = true } }

// LoadExperts uploads w and makes it resident on the server under name.
// It sends a header declaring the tensors, then their bytes in chunks of
// at most the chunk size (so a layer of any size fits under the message
// limit), with a SHA-256 of the bytes that the server checks. The set
// becomes visible only once complete; a failed load changes nothing. It is
// never retried: retry a failed load yourself, with Overwrite if needed.
func (c *Client) LoadExperts(ctx context.Context, name string, w *ExpertWeights, opts ...LoadOption) (*ExpertSetInfo, error) {
	o := loadOptions{}
	for _, opt := range opts {
		opt(&o)
	}
	if o.chunkBytes == 0 {
		o.chunkBytes = c.defaultChunkBytes(ctx)
	}
	if w == nil {
		return nil, invalid("LoadExperts", errors.New("weights: required"))
	}
	if err := w.validate("weights"); err != nil {
		return nil, invalid("LoadExperts", err)
	}
	if o.chunkBytes < 1 {
		return nil, invalid("LoadExperts", fmt.Errorf("chunk size %d: want >= 1", o.chunkBytes))
	}
	hdr := &pb.LoadExpertsRequest_Header{Name: name, Weights: w.proto(true), Overwrite: o.overwrite}
	h := sha256.New()
	for _, nt := range w.tensors() {
		hdr.TotalBytes += int64(len(nt.t.Data))
		if !o.noChecksum {
			h.Write(nt.t.Data)
		}
	}
	if !o.noChecksum {
		hdr.Sha256 = hex.EncodeToString(h.Sum(nil))
	}

	ctx, cancel := c.callContext(ctx)
	defer cancel()
	stream, err := c.rpc.LoadExperts(ctx)
	if err != nil {
		return nil, wrap("LoadExperts", err)
	}
	// finish ends the stream and returns the server's verdict: when Send
	// fails the server has already answered, and CloseAndRecv says why.
	finish := func() (*ExpertSetInfo, error) {
		info, err := stream.CloseAndRecv()
		if err != nil {
			return nil, wrap("LoadExperts", err)
		}
		si := setInfoFromProto(info)
		return &si, nil
	}
	if err := stream.Send(&pb.LoadExpertsRequest{Payload: &pb.LoadExpertsRequest_Header_{Header: hdr}}); err != nil {
		return finish()
	}
	p := Progress{TotalBytes: hdr.TotalBytes}
	if o.progress != nil {
		o.progress(p)
	}
	for _, nt := range w.tensors() {
		data := nt.t.Data
		for off := 0; off < len(data); off += o.chunkBytes {
			chunk := data[off:min(off+o.chunkBytes, len(data))]
			err := stream.Send(&pb.LoadExpertsRequest{Payload: &pb.LoadExpertsRequest_Chunk_{Chunk: &pb.LoadExpertsRequest_Chunk{
				Tensor: nt.name, Offset: int64(off), Data: chunk,
			}}})
			if errors.Is(err, io.EOF) {
				return finish()
			}
			if err != nil {
				return nil, wrap("LoadExperts", err)
			}
			p.SentBytes += int64(len(chunk))
			if o.progress != nil {
				o.progress(p)
			}
		}
	}
	return finish()
}

// chunkHeadroom is what a chunk message needs beyond its data: the tensor
// name, offset and protobuf framing, with a wide margin.
const chunkHeadroom = 4 << 10

// defaultChunkBytes is the client's chunk size, lowered to fit the
// server's message limit, which it asks for once. If asking fails the
// configured size stands; the load then reports its own error.
func (c *Client) defaultChunkBytes(ctx context.Context) int {
	c.limitMu.Lock()
	defer c.limitMu.Unlock()
	if c.serverMaxMsg == 0 {
		if info, err := c.ServerInfo(ctx); err == nil && info.Limits.MaxMessageBytes > 0 {
			c.serverMaxMsg = info.Limits.MaxMessageBytes
		}
	}
	n := c.opts.chunkBytes
	if c.serverMaxMsg > 2*chunkHeadroom {
		n = int(min(int64(n), c.serverMaxMsg-chunkHeadroom))
	}
	return n
}

// NamingPreset maps a checkpoint's safetensors names to expert weights.
type NamingPreset int

const (
	// NemotronH names backbone.layers.{L}.mixer.experts.{e}.up_proj/down_proj (Relu2).
	NemotronH NamingPreset = iota + 1
	// Qwen3MoE names model.layers.{L}.mlp.experts.{e}.gate_proj/up_proj/down_proj (SiluGated).
	Qwen3MoE
	// CustomNames uses SafetensorsSource's templates.
	CustomNames
	// DeepSeekV3 names model.layers.{L}.mlp.experts.{e}.gate_proj/up_proj/down_proj
	// with block scales (also Kimi-K2).
	DeepSeekV3
	// Mixtral names model.layers.{L}.block_sparse_moe.experts.{e}.w1/w3/w2.
	Mixtral
	// AutoPreset picks the preset from a checkpoint directory's config.json.
	AutoPreset
	// GptOss names gpt-oss's stacked experts (SwigluOAI with both biases):
	// model.layers.{L}.mlp.experts.gate_up_proj [E, K, 2N] and down_proj
	// [E, N, K] with their _bias siblings, from its BF16 or F16 releases,
	// which the server quantizes to FP8 as it reads them
	// (SafetensorsSource.WeightQuantization). The MXFP4 release does not
	// load.
	GptOss
)

// WeightQuantization is the granularity of the FP8 weight scales the
// server computes as it quantizes BF16 or F16 checkpoint weights. The zero
// value is the server's default, per channel.
type WeightQuantization int

const (
	// QuantizePerTensor is one scale per expert and matrix (gate and up
	// stacked as w13, and w2), as vLLM's --quantization fp8.
	QuantizePerTensor WeightQuantization = iota + 1
	// QuantizePerChannel is one scale per output row of each expert's
	// matrices.
	QuantizePerChannel
	// QuantizeBlock is one scale per [Bn, Bk] tile (BlockShape, else
	// [128, 128]); FusedMoE then quantizes activations per token and group
	// of Bk.
	QuantizeBlock
)

// SafetensorsSource is a layer in a .safetensors file or a Hugging Face
// checkpoint directory in the server's weights directory (the daemon's
// -weights-dir).
type SafetensorsSource struct {
	// Path is relative to the server's weights directory.
	Path string
	// Layer is substituted for {L} in tensor names.
	Layer  int
	Preset NamingPreset
	// NumExperts is 0 to count them from the file.
	NumExperts int
	// Templates with {L} and {e} placeholders and the activation, for
	// CustomNames only.
	W13Template, W2Template, W13ScaleTemplate, W2ScaleTemplate string
	Activation                                                 moe.Activation
	// BlockShape is [Bn, Bk] for block-scaled checkpoints; zero means
	// config.json's weight_block_size, else [128, 128], when the scales are
	// tile grids.
	BlockShape [2]int
	// TensorPrefix replaces the preset's "model." or "backbone." before
	// "layers.{L}" (e.g. "model.language_model." for Qwen3-VL).
	TensorPrefix string
	// Per-projection templates for CustomNames (see
	// expertd.v1.LoadExpertsRequest.SafetensorsSource).
	GateTemplate, UpTemplate, GateScaleTemplate, UpScaleTemplate string
	W13InputScaleTemplate, W2InputScaleTemplate                  string
	// WeightQuantization applies to BF16 and F16 weights only; FP8 weights
	// keep their checkpoint's scales.
	WeightQuantization WeightQuantization
	// SwigluLimit and SwigluAlpha are a SwigluOAI layout's clamp limit and
	// sigmoid slope (GptOss, or CustomNames with SwigluOAI); 0 means
	// config.json's swiglu_limit and swiglu_alpha (of a checkpoint
	// directory), else gpt-oss's 7 and 1.702.
	SwigluLimit, SwigluAlpha float32
}

// LoadSafetensors makes the server read a layer from a safetensors file
// it can see, instead of uploading the bytes. Only Overwrite applies of
// the load options. It is not retried.
func (c *Client) LoadSafetensors(ctx context.Context, name string, src SafetensorsSource, opts ...LoadOption) (*ExpertSetInfo, error) {
	var o loadOptions
	for _, opt := range opts {
		opt(&o)
	}
	msg := &pb.LoadExpertsRequest_SafetensorsSource{
		Name: name, Path: src.Path, Layer: int32(src.Layer), Preset: pb.NamingPreset(src.Preset),
		W13Template: src.W13Template, W2Template: src.W2Template,
		W13ScaleTemplate: src.W13ScaleTemplate, W2ScaleTemplate: src.W2ScaleTemplate,
		Activation: pb.Activation(src.Activation), NumExperts: int32(src.NumExperts), Overwrite: o.overwrite,
		TensorPrefix: src.TensorPrefix, GateTemplate: src.GateTemplate, UpTemplate: src.UpTemplate,
		GateScaleTemplate: src.GateScaleTemplate, UpScaleTemplate: src.UpScaleTemplate,
		W13InputScaleTemplate: src.W13InputScaleTemplate, W2InputScaleTemplate: src.W2InputScaleTemplate,
		WeightQuantization: pb.WeightQuantization(src.WeightQuantization),
		SwigluLimit:        src.SwigluLimit, SwigluAlpha: src.SwigluAlpha,
	}
	if src.BlockShape != [2]int{} {
		msg.WeightBlockShape = []int32{int32(src.BlockShape[0]), int32(src.BlockShape[1])}
	}
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	stream, err := c.rpc.LoadExperts(ctx)
	if err != nil {
		return nil, wrap("LoadExperts", err)
	}
	// A Send error means the server answered already; CloseAndRecv has it.
	_ = stream.Send(&pb.LoadExpertsRequest{Payload: &pb.LoadExpertsRequest_Safetensors{Safetensors: msg}})
	info, err := stream.CloseAndRecv()
	if err != nil {
		return nil, wrap("LoadExperts", err)
	}
	si := setInfoFromProto(info)
	return &si, nil
}
