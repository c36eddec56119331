package servicetest

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/expertd/expertd/internal/safetensorstest"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
)

// Tensor names WriteSafetensorsLayer uses, with {L} the layer and {e} the
// expert, as NAMING_PRESET_CUSTOM templates.
const (
	stW13      = "layers.{L}.experts.{e}.w13.weight"
	stW2       = "layers.{L}.experts.{e}.w2.weight"
	stW13Scale = "layers.{L}.experts.{e}.w13.weight_scale"
	stW2Scale  = "layers.{L}.experts.{e}.w2.weight_scale"
)

// WriteSafetensorsLayer writes set as layer of a .safetensors file at
// path, one tensor per expert and projection, and returns the source
// that loads it (name and path relative to the weights directory left for
// the caller to fill). Weight scales must be per-tensor, per-expert or
// per-channel, and activation scales dynamic: what the custom naming
// preset reads.
func WriteSafetensorsLayer(path string, set *moe.ExpertSet, layer int) (*pb.LoadExpertsRequest_SafetensorsSource, error) {
	if set.A13Scale != nil || set.A2Scale != nil {
		return nil, fmt.Errorf("static activation scales cannot be named by the custom preset")
	}
	rows := set.Rows1()
	type tensor = safetensorstest.Tensor
	tensors := map[string]tensor{}
	name := func(tmpl string, e int) string {
		return strings.NewReplacer("{L}", strconv.Itoa(layer), "{e}", strconv.Itoa(e)).Replace(tmpl)
	}
	scale := func(ws scaling.WeightScale, e, r int) (tensor, error) {
		var v []float32
		switch ws.Granularity {
		case scaling.PerTensor:
			v = ws.Values[:1]
		case scaling.PerExpert:
			v = ws.Values[e : e+1]
		case scaling.PerChannel:
			v = ws.Values[e*r : (e+1)*r]
		default:
			return tensor{}, fmt.Errorf("weight scale granularity %v: want per-tensor, per-expert or per-channel", ws.Granularity)
		}
		b := moe.Float32Bytes(v)
		shape := []int64{}
		if len(v) > 1 {
			shape = []int64{int64(len(v))}
		}
		return tensor{DType: "F32", Shape: shape, Data: b}, nil
	}
	for e := range set.E {
		w13 := set.W13[e*rows*set.K : (e+1)*rows*set.K]
		w2 := set.W2[e*set.K*set.N : (e+1)*set.K*set.N]
		tensors[name(stW13, e)] = tensor{DType: "F8_E4M3", Shape: []int64{int64(rows), int64(set.K)}, Data: w13}
		tensors[name(stW2, e)] = tensor{DType: "F8_E4M3", Shape: []int64{int64(set.K), int64(set.N)}, Data: w2}
		s13, err := scale(set.W13Scale, e, rows)
		if err != nil {
			return nil, err
		}
		s2, err := scale(set.W2Scale, e, set.K)
		if err != nil {
			return nil, err
		}
		tensors[name(stW13Scale, e)], tensors[name(stW2Scale, e)] = s13, s2
	}
	if err := safetensorstest.Write(path, tensors, nil); err != nil {
		return nil, err
	}
	act := pb.Activation_ACTIVATION_SILU_GATED
	if set.Activation == moe.Relu2 {
		act = pb.Activation_ACTIVATION_RELU2
	}
	return &pb.LoadExpertsRequest_SafetensorsSource{
		Layer: int32(layer), Preset: pb.NamingPreset_NAMING_PRESET_CUSTOM, Activation: act,
		W13Template: stW13, W2Template: stW2, W13ScaleTemplate: stW13Scale, W2ScaleTemplate: stW2Scale,
	}, nil
}
