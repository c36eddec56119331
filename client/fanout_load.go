package client

import (
	"fmt"
	"math"

	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/shard"
)

// shardWeights is shard i's part of w under m: the experts m places on
// shard i, in local-id order.
//
//   - w13, w2, the biases and every weight scale with a leading expert
//     dimension (per-expert [E], per-channel [E, rows], block [E, rows/Bn,
//     cols/Bk]) are sliced by expert;
//   - per-tensor weight scales ([] or [1]) are sent whole to every shard;
//   - static activation scales are reduced to one value first: the server
//     takes the max of a per-expert [E] a13/a2 scale (vLLM's rule), and the
//     max over one shard's experts would quantize differently from the
//     single-daemon result, so every shard gets the max over all E experts.
//
// The server checks the rest (shapes against each other, scale values).
func shardWeights(w *ExpertWeights, m *shard.Map, i int) (*ExpertWeights, error) {
	e := m.NumExperts()
	for _, nt := range []namedTensor{{"w13", w.W13}, {"w2", w.W2}} {
		if len(nt.t.Shape) != 3 || nt.t.Shape[0] != e {
			return nil, fmt.Errorf("weights.%s: shape %v: want [%d, rows, cols] (E of the shard map)", nt.name, nt.t.Shape, e)
		}
	}
	ids := m.Experts(i)
	p := &ExpertWeights{
		Activation: w.Activation, BlockShape: w.BlockShape,
		W13: takeExperts(w.W13, ids), W2: takeExperts(w.W2, ids),
		SwigluLimit: w.SwigluLimit, SwigluAlpha: w.SwigluAlpha,
	}
	for _, b := range []struct {
		name string
		src  Tensor
		dst  *Tensor
	}{{"w13_bias", w.W13Bias, &p.W13Bias}, {"w2_bias", w.W2Bias, &p.W2Bias}} {
		if b.src.IsZero() {
			continue
		}
		if len(b.src.Shape) != 2 || b.src.Shape[0] != e {
			return nil, fmt.Errorf("weights.%s: shape %v: want [%d, rows] (E of the shard map)", b.name, b.src.Shape, e)
		}
		*b.dst = takeExperts(b.src, ids)
	}
	var err error
	if p.W13Scale, err = weightScalePart("w13_scale", w.W13Scale, e, ids); err != nil {
		return nil, err
	}
	if p.W2Scale, err = weightScalePart("w2_scale", w.W2Scale, e, ids); err != nil {
		return nil, err
	}
	if p.A13Scale, err = activationScalePart("a13_scale", w.A13Scale, e); err != nil {
		return nil, err
	}
	if p.A2Scale, err = activationScalePart("a2_scale", w.A2Scale, e); err != nil {
		return nil, err
	}
	return p, nil
}

// takeExperts gathers the given experts of t, whose leading dimension is
// the expert.
func takeExperts(t Tensor, ids []int) Tensor {
	stride := len(t.Data) / t.Shape[0]
	data := make([]byte, 0, stride*len(ids))
	for _, id := range ids {
		data = append(data, t.Data[id*stride:(id+1)*stride]...)
	}
	shape := append([]int{len(ids)}, t.Shape[1:]...)
	return Tensor{DType: t.DType, Shape: shape, Data: data}
}

func isPerTensor(t Tensor) bool {
	return len(t.Shape) == 0 || len(t.Shape) == 1 && t.Shape[0] == 1
}

// weightScalePart is shard ids' part of a weight scale: whole when
// per-tensor, sliced when it has a leading expert dimension.
func weightScalePart(name string, t Tensor, e int, ids []int) (Tensor, error) {
	switch {
	case t.IsZero() || isPerTensor(t):
		return t, nil
	case len(t.Shape) >= 1 && t.Shape[0] == e:
		return takeExperts(t, ids), nil
	}
	return Tensor{}, fmt.Errorf("weights.%s: shape %v: want [] or [1] (per-tensor) or [%d, ...] (per-expert, per-channel or block)", name, t.Shape, e)
}

// activationScalePart is the one static activation scale every shard gets:
// the given one when per-tensor, the max over the experts when per-expert.
func activationScalePart(name string, t Tensor, e int) (Tensor, error) {
	if t.IsZero() || isPerTensor(t) {
		return t, nil
	}
	if len(t.Shape) != 1 || t.Shape[0] != e || t.DType != moe.Float32 {
		return Tensor{}, fmt.Errorf("weights.%s: %v %v: want FP32 [] or [1] (per-tensor) or [%d] (per-expert)", name, t.DType, t.Shape, e)
	}
	v, err := t.Float32s()
	if err != nil {
		return Tensor{}, fmt.Errorf("weights.%s: %w", name, err)
	}
	var mx float32
	for i, x := range v {
		if !(x > 0) || math.IsInf(float64(x), 0) {
			return Tensor{}, fmt.Errorf("weights.%s: element %d is %v: scales must be finite and > 0", name, i, x)
		}
		mx = max(mx, x)
	}
	return FromFloat32([]float32{mx}), nil
}
