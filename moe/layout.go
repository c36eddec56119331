package moe

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"math"

	"github.com/expertd/expertd/scaling"
)

// This file holds every rule an expert set's declaration must satisfy,
// whoever declares it: a client's LoadExperts header or inline FusedMoE
// weights (converted by the service), or a safetensors file (package
// weights). CheckLayout runs before any data is read, so a chunked upload
// can preallocate and a bad header fails fast; Build turns the checked
// layout and the tensors' bytes into an ExpertSet.

// MaxExperts bounds an expert set's E, and expert counting in a file.
const MaxExperts = 1 << 16

// MaxDim bounds K and N of an expert set.
const MaxDim = 1 << 20

// Tensor indices within an expert set, in ExpertWeights field order; the
// fingerprint hashes them in this order.
const (
	SetW13 = iota
	SetW2
	SetW13Scale
	SetW2Scale
	SetA13Scale
	SetA2Scale
	SetW13Bias
	SetW2Bias
	SetTensors
)

// SetTensorNames are the ExpertWeights field names, as chunks name them.
var SetTensorNames = [SetTensors]string{"w13", "w2", "w13_scale", "w2_scale", "a13_scale", "a2_scale", "w13_bias", "w2_bias"}

// SetTensorIndex is the index of the tensor SetTensorNames calls name.
func SetTensorIndex(name string) (int, bool) {
	for i, n := range SetTensorNames {
		if n == name {
			return i, true
		}
	}
	return 0, false
}

// SetDecl is an expert set as declared, before any check. A nil tensor is
// one left unset; a tensor's Data is not looked at by CheckLayout.
type SetDecl struct {
	Activation Activation
	// SwigluLimit and SwigluAlpha are SwigluOAI's; 0 means the default.
	SwigluLimit, SwigluAlpha float32
	// BlockShape is [Bn, Bk] for block-scaled weights, empty otherwise.
	BlockShape []int
	Tensors    [SetTensors]*Tensor
}

// Declared is a tensor's declared type and size, checked.
type Declared struct {
	DType DType
	Shape []int
	Bytes int64
}

// Layout is an expert set's declared geometry, checked.
type Layout struct {
	Act     Activation
	E, K, N int
	Block   [2]int
	// Limit and Alpha are SWIGLU_OAI's, defaults filled in.
	Limit, Alpha float32
	// Tensors[i] is tensor i's declaration; Present[i] says whether it was
	// declared (the activation scales and biases are optional).
	Tensors [SetTensors]Declared
	Present [SetTensors]bool
}

// rows1 is GEMM1's output rows per expert.
func (l *Layout) rows1() int {
	if l.Act.Gated() {
		return 2 * l.N
	}
	return l.N
}

// TotalBytes is the sum of the declared tensors' sizes.
func (l *Layout) TotalBytes() int64 {
	var t int64
	for i, m := range l.Tensors {
		if l.Present[i] {
			t += m.Bytes
		}
	}
	return t
}

// CheckLayout validates d's activation, dtypes and shapes (prefix names the
// declaration in errors, e.g. "weights" or "header.weights"). Errors are
// *FieldError.
func CheckLayout(prefix string, d *SetDecl) (*Layout, error) {
	if d == nil {
		return nil, invalidf(prefix, "is required")
	}
	l := &Layout{Act: d.Activation}
	if !l.Act.Valid() {
		return nil, invalidf(prefix+".activation", "%v: want one of %v", l.Act.WireName(), activationWireNames())
	}
	var err error
	if l.Limit, err = swigluParam(prefix+".swiglu_limit", l.Act, d.SwigluLimit, DefaultSwigluLimit); err != nil {
		return nil, err
	}
	if l.Alpha, err = swigluParam(prefix+".swiglu_alpha", l.Act, d.SwigluAlpha, DefaultSwigluAlpha); err != nil {
		return nil, err
	}
	f := func(i int) string { return prefix + "." + SetTensorNames[i] }
	for _, i := range []int{SetW13, SetW2, SetW13Scale, SetW2Scale} {
		if d.Tensors[i] == nil {
			return nil, invalidf(f(i), "is required")
		}
	}
	for i, t := range d.Tensors {
		if t == nil {
			continue
		}
		allowed := []DType{Float32}
		switch i {
		case SetW13, SetW2:
			allowed = []DType{Float8E4M3FN}
		case SetW13Bias, SetW2Bias:
			allowed = []DType{Float32, BFloat16}
		}
		n, err := Meta(f(i), t, allowed...)
		if err != nil {
			return nil, err
		}
		l.Tensors[i] = Declared{DType: t.DType, Shape: t.Shape, Bytes: n}
		l.Present[i] = true
	}
	w13 := l.Tensors[SetW13].Shape
	if len(w13) != 3 || w13[0] < 1 || w13[1] < 1 || w13[2] < 1 {
		return nil, invalidf(f(SetW13), "shape %v: want [E, rows, K] with every dimension >= 1", w13)
	}
	l.E, l.K = w13[0], w13[2]
	l.N = w13[1]
	if l.Act.Gated() {
		if w13[1]%2 != 0 {
			return nil, invalidf(f(SetW13), "shape %v: %v needs [E, 2N, K] with an even middle dimension", w13, l.Act.WireName())
		}
		l.N = w13[1] / 2
	}
	if err := WantShape(f(SetW2), l.Tensors[SetW2].Shape, l.E, l.K, l.N); err != nil {
		return nil, err
	}
	// Far beyond any model (DeepSeek-V3 has E = 256, K = 7168), and keeps
	// the sizes in ExpertSetInfo's int32 fields.
	if l.E > MaxExperts || l.K > MaxDim || l.N > MaxDim {
		return nil, invalidf(f(SetW13), "shape %v: want E <= %d and K, N <= %d", w13, MaxExperts, MaxDim)
	}
	switch bs := d.BlockShape; len(bs) {
	case 0:
	case 2:
		if bs[0] < 1 || bs[1] < 1 {
			return nil, invalidf(prefix+".weight_block_shape", "%v: want [Bn, Bk] with both >= 1", bs)
		}
		l.Block = [2]int{bs[0], bs[1]}
	default:
		return nil, invalidf(prefix+".weight_block_shape", "%v: want [] or [Bn, Bk]", bs)
	}
	for _, b := range []struct{ i, rows int }{{SetW13Bias, l.rows1()}, {SetW2Bias, l.K}} {
		if l.Present[b.i] {
			if err := WantShape(f(b.i), l.Tensors[b.i].Shape, l.E, b.rows); err != nil {
				return nil, err
			}
		}
	}
	for _, i := range []int{SetA13Scale, SetA2Scale} {
		if !l.Present[i] {
			continue
		}
		s := l.Tensors[i].Shape
		if !(len(s) == 0 || (len(s) == 1 && (s[0] == 1 || s[0] == l.E))) {
			return nil, invalidf(f(i), "shape %v: want [] or [1] (per-tensor) or [%d] (per-expert)", s, l.E)
		}
	}
	return l, nil
}

func ones(m Declared) []float32 {
	v := make([]float32, m.Bytes/4)
	for i := range v {
		v[i] = 1
	}
	return v
}

// CheckScaleShapes classifies the weight-scale shapes with stand-in ones,
// so a chunked upload fails on a bad scale before its weights arrive. Call
// it only once the declared sizes are known to fit the server's limits: it
// allocates one float per declared scale element.
func (l *Layout) CheckScaleShapes(prefix string) error {
	for _, si := range []int{SetW13Scale, SetW2Scale} {
		if _, err := l.weightScale(prefix, si, ones(l.Tensors[si])); err != nil {
			return err
		}
	}
	return nil
}

// weightScale classifies scale tensor si (SetW13Scale or SetW2Scale) with
// the given values.
func (l *Layout) weightScale(prefix string, si int, values []float32) (scaling.WeightScale, error) {
	rows, cols := l.rows1(), l.K
	if si == SetW2Scale {
		rows, cols = l.K, l.N
	}
	ws, err := scaling.NewWeightScale(l.Tensors[si].Shape, values, l.E, rows, cols, l.Block)
	if err != nil {
		return ws, invalidf(prefix+"."+SetTensorNames[si], "%v", err)
	}
	return ws, nil
}

// Build turns a checked layout and its tensors' bytes (data[i] for each
// present tensor, already of the declared length) into an ExpertSet. The
// weight slices alias data.
func (l *Layout) Build(prefix string, data [SetTensors][]byte) (*ExpertSet, error) {
	set := &ExpertSet{
		Activation: l.Act, E: l.E, K: l.K, N: l.N,
		W13: data[SetW13], W2: data[SetW2], Block: l.Block,
		SwigluLimit: l.Limit, SwigluAlpha: l.Alpha,
	}
	var err error
	for _, i := range []int{SetW13Scale, SetW2Scale} {
		v, err := DecodeScales(prefix+"."+SetTensorNames[i], data[i])
		if err != nil {
			return nil, err
		}
		ws, err := l.weightScale(prefix, i, v)
		if err != nil {
			return nil, err
		}
		if i == SetW13Scale {
			set.W13Scale = ws
		} else {
			set.W2Scale = ws
		}
	}
	if set.A13Scale, err = staticScale(prefix+".a13_scale", l.Present[SetA13Scale], data[SetA13Scale]); err != nil {
		return nil, err
	}
	if set.A2Scale, err = staticScale(prefix+".a2_scale", l.Present[SetA2Scale], data[SetA2Scale]); err != nil {
		return nil, err
	}
	for _, b := range []struct {
		i   int
		dst *[]float32
	}{{SetW13Bias, &set.W13Bias}, {SetW2Bias, &set.W2Bias}} {
		if l.Present[b.i] {
			if *b.dst, err = DecodeFinite(prefix+"."+SetTensorNames[b.i], l.Tensors[b.i].DType, data[b.i]); err != nil {
				return nil, err
			}
		}
	}
	return set, nil
}

// swigluParam checks one of SWIGLU_OAI's parameters (v, 0 meaning def):
// finite and >= 0, and only set with that activation.
func swigluParam(field string, act Activation, v, def float32) (float32, error) {
	switch {
	case v == 0 && act == SwigluOAI:
		return def, nil
	case v == 0:
		return 0, nil
	case act != SwigluOAI:
		return 0, invalidf(field, "%v: only valid with ACTIVATION_SWIGLU_OAI", v)
	case !(v > 0) || math.IsInf(float64(v), 0):
		return 0, invalidf(field, "%v: want finite and >= 0 (0 means %v)", v, def)
	}
	return v, nil
}

// activationWireNames lists the activations the contract names.
func activationWireNames() []string {
	var names []string
	for a := SiluGated; a.Valid(); a++ {
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
	v, err := DecodeScales(field, b)
	if err != nil {
		return nil, err
	}
	s := scaling.ReduceExpertScale(v)
	return &s, nil
}

// Fingerprint hashes an expert set's tensors' bytes in SetTensorNames
// order: ExpertSetInfo.fingerprint, and what a header's sha256 must match.
func Fingerprint(data [SetTensors][]byte) string {
	h := sha256.New()
	for _, b := range data {
		h.Write(b)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// Float32Bytes encodes v as the little-endian FP32 bytes a Float32
// tensor holds.
func Float32Bytes(v []float32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}
