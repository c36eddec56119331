package client

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
)

// DType is the element type of a tensor's bytes: moe.DType, the request
// model's type, which the server uses too.
//
// Deprecated: use moe.DType, the type's one name.
type DType = moe.DType

// The element types of the wire contract.
//
// Deprecated: use moe's names (moe.Float32, ...).
const (
	// Deprecated: use moe.Float32.
	Float32 = moe.Float32
	// Deprecated: use moe.BFloat16.
	BFloat16 = moe.BFloat16
	// Deprecated: use moe.Float16.
	Float16 = moe.Float16
	// Deprecated: use moe.Float8E4M3FN.
	Float8E4M3FN = moe.Float8E4M3FN
	// Deprecated: use moe.Float8E5M2.
	Float8E5M2 = moe.Float8E5M2
	// Deprecated: use moe.Int32.
	Int32 = moe.Int32
)

// Tensor is a dense, row-major, little-endian array: the SDK's form of
// expertd.v1.Tensor. Build one with FromFloat32, FromBFloat16, FromFP8 or
// FromInt32; the zero Tensor means "not set" wherever a tensor is
// optional. Data is sent as is, without a copy, so it must not change
// while a call that uses it runs.
type Tensor struct {
	DType moe.DType
	// Shape is outermost first; empty means a scalar.
	Shape []int
	// Data holds Numel()*DType.Size() bytes. With Shm set it is the local
	// view of the region's bytes, or nil when the client has none.
	Data []byte
	// Shm, when set, sends the tensor as a reference into a shared-memory
	// region registered on the client's connection instead of inline
	// bytes (Region.Tensor builds one).
	Shm *SharedMemoryRef
}

// FromFloat32 is an FP32 tensor of the given shape holding v.
func FromFloat32(v []float32, shape ...int) Tensor {
	return Tensor{DType: moe.Float32, Shape: shape, Data: moe.Float32Bytes(v)}
}

// FromBFloat16 is a BF16 tensor of the given shape holding the raw bf16
// bit patterns v (the top 16 bits of a float32).
func FromBFloat16(v []uint16, shape ...int) Tensor {
	b := make([]byte, 2*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint16(b[2*i:], x)
	}
	return Tensor{DType: moe.BFloat16, Shape: shape, Data: b}
}

// BFloat16FromFloat32 rounds v to bfloat16 (to nearest even) and returns
// it as a BF16 tensor: half the bytes of FromFloat32 on the wire.
func BFloat16FromFloat32(v []float32, shape ...int) Tensor {
	h := make([]uint16, len(v))
	for i, x := range v {
		h[i] = scaling.Float32ToBF16(x)
	}
	return FromBFloat16(h, shape...)
}

// FromFP8 is an FP8 E4M3FN tensor of the given shape over codes, which
// it uses without copying. Quantize with a scale first: the server
// dequantizes with the tensor's companion scale (w13_scale, ...).
func FromFP8(codes []byte, shape ...int) Tensor {
	return Tensor{DType: moe.Float8E4M3FN, Shape: shape, Data: codes}
}

// QuantizeFP8 quantizes v, rows×cols row-major, to FP8 E4M3FN the way
// the server quantizes activations itself: dynamically, each group of
// group consecutive values in a row (the last one may be shorter) scaled
// by its amax/448. group = cols gives one scale per token (per-token
// hidden_states_scale, shape [rows]); group = Bk of a block-scaled set
// gives DeepSeek-style per-token-group scales (shape [rows, ceil(cols/Bk)]).
// Sending FP8 hidden states halves the request of BF16 ones.
func QuantizeFP8(v []float32, rows, cols, group int) (codes, scales Tensor, err error) {
	if rows < 1 || cols < 1 || group < 1 || len(v) != rows*cols {
		return Tensor{}, Tensor{}, fmt.Errorf("expertd client: QuantizeFP8 of %d values as %d×%d in groups of %d", len(v), rows, cols, group)
	}
	groups := (cols + group - 1) / group
	q, sc := make([]byte, len(v)), make([]float32, rows*groups)
	scaling.QuantizeDynamic(q, sc, v, rows, cols, group)
	codes = FromFP8(q, rows, cols)
	if groups == 1 {
		return codes, FromFloat32(sc, rows), nil
	}
	return codes, FromFloat32(sc, rows, groups), nil
}

// FromInt32 is an INT32 tensor of the given shape holding v (topk_ids).
func FromInt32(v []int32, shape ...int) Tensor {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(x))
	}
	return Tensor{DType: moe.Int32, Shape: shape, Data: b}
}

// IsZero reports whether t is the zero Tensor, which means "not set".
func (t Tensor) IsZero() bool { return t.DType == 0 && t.Shape == nil && t.Data == nil && t.Shm == nil }

// Numel is the number of elements the shape holds.
func (t Tensor) Numel() int { return moe.Tensor{Shape: t.Shape}.Numel() }

// Validate checks that the dtype is known, the shape legal (moe.Meta's
// rules, which the server applies too) and the bytes match it, so that a
// malformed tensor fails before it is sent.
func (t Tensor) Validate() error {
	if !t.DType.Valid() {
		return fmt.Errorf("unknown dtype %v", t.DType)
	}
	n, err := moe.Meta("", &moe.Tensor{DType: t.DType, Shape: t.Shape}, t.DType)
	if fe := (*moe.FieldError)(nil); errors.As(err, &fe) {
		// The caller names the field; the model's message says the rest.
		return errors.New(fe.Msg)
	} else if err != nil {
		return err
	}
	if t.Shm != nil {
		if t.Shm.Size != n {
			return fmt.Errorf("%v shape %v needs %d bytes, shared-memory reference has %d", t.DType, t.Shape, n, t.Shm.Size)
		}
		if t.Data == nil {
			return nil
		}
	}
	if int64(len(t.Data)) != n {
		return fmt.Errorf("%v shape %v needs %d bytes, got %d", t.DType, t.Shape, n, len(t.Data))
	}
	return nil
}

// Float32s decodes the elements of an FP32, BF16, FP16 or FP8 tensor to
// float32. FP8 values are the raw codes' values, without any scale.
func (t Tensor) Float32s() ([]float32, error) {
	if err := t.Validate(); err != nil {
		return nil, err
	}
	out := make([]float32, t.Numel())
	b := t.Data
	switch t.DType {
	case moe.Float32:
		for i := range out {
			out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
		}
	case moe.BFloat16:
		for i := range out {
			out[i] = scaling.BF16ToFloat32(binary.LittleEndian.Uint16(b[2*i:]))
		}
	case moe.Float16:
		for i := range out {
			out[i] = scaling.FP16ToFloat32(binary.LittleEndian.Uint16(b[2*i:]))
		}
	case moe.Float8E4M3FN:
		for i := range out {
			out[i] = scaling.E4M3ToFloat32(b[i])
		}
	case moe.Float8E5M2:
		for i := range out {
			out[i] = scaling.E5M2ToFloat32(b[i])
		}
	default:
		return nil, fmt.Errorf("cannot decode %v as float32", t.DType)
	}
	return out, nil
}

// Int32s decodes the elements of an INT32 tensor.
func (t Tensor) Int32s() ([]int32, error) {
	if err := t.Validate(); err != nil {
		return nil, err
	}
	if t.DType != moe.Int32 {
		return nil, fmt.Errorf("cannot decode %v as int32", t.DType)
	}
	out := make([]int32, t.Numel())
	for i := range out {
		out[i] = int32(binary.LittleEndian.Uint32(t.Data[4*i:]))
	}
	return out, nil
}

// Proto is t's wire form; nil for the zero Tensor.
func (t Tensor) Proto() *pb.Tensor {
	if t.IsZero() {
		return nil
	}
	shape := make([]int64, len(t.Shape))
	for i, d := range t.Shape {
		shape[i] = int64(d)
	}
	if t.Shm != nil {
		return &pb.Tensor{Dtype: pb.DataType(t.DType), Shape: shape, Source: &pb.Tensor_Shm{Shm: t.Shm.proto()}}
	}
	return &pb.Tensor{Dtype: pb.DataType(t.DType), Shape: shape, Source: &pb.Tensor_Data{Data: t.Data}}
}

// TensorFromProto converts a wire tensor; nil gives the zero Tensor. The
// bytes are shared, not copied. A tensor in shared memory comes back with
// Shm set and Data nil (Client.FusedMoE fills Data in from the region).
func TensorFromProto(p *pb.Tensor) (Tensor, error) {
	if p == nil {
		return Tensor{}, nil
	}
	shape := make([]int, len(p.GetShape()))
	for i, d := range p.GetShape() {
		shape[i] = int(d)
	}
	if ref := p.GetShm(); ref != nil {
		t := Tensor{DType: moe.DType(p.GetDtype()), Shape: shape, Shm: refFromProto(ref)}
		return t, t.Validate()
	}
	t := Tensor{DType: moe.DType(p.GetDtype()), Shape: shape, Data: p.GetData()}
	if t.Data == nil {
		t.Data = []byte{}
	}
	return t, t.Validate()
}

// meta is t's declaration in a LoadExperts header: dtype and shape, no
// bytes.
func (t Tensor) meta() *pb.Tensor {
	p := t.Proto()
	if p != nil {
		p.Source = nil
	}
	return p
}
