package service

import (
	"testing"

	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/weights"
)

// TestWeightsEnumsMirrorTheWire: sourceFromProto converts the loader's
// enums by value, and the loader's messages spell them as the contract
// does, so every value (and one past them) must agree.
func TestWeightsEnumsMirrorTheWire(t *testing.T) {
	for v := int32(-1); v <= int32(len(pb.NamingPreset_name)); v++ {
		if got, want := weights.Preset(v).String(), pb.NamingPreset(v).String(); got != want {
			t.Errorf("weights.Preset(%d) = %s, want %s", v, got, want)
		}
	}
	for v := int32(-1); v <= int32(len(pb.WeightQuantization_name)); v++ {
		if got, want := weights.Quantization(v).String(), pb.WeightQuantization(v).String(); got != want {
			t.Errorf("weights.Quantization(%d) = %s, want %s", v, got, want)
		}
	}
	for v := int32(-1); v <= int32(len(pb.Activation_name)); v++ {
		if got, want := moe.Activation(v).WireName(), pb.Activation(v).String(); got != want {
			t.Errorf("moe.Activation(%d).WireName() = %s, want %s", v, got, want)
		}
	}
}

// TestRoutingToProto: a checkpoint's routing reaches ExpertSetInfo with
// every field, its correction bias inline.
func TestRoutingToProto(t *testing.T) {
	if routingToProto(nil) != nil {
		t.Error("no routing became one")
	}
	bias := &moe.Tensor{DType: moe.Float32, Shape: []int{2}, Data: moe.Float32Bytes([]float32{1, 2})}
	got := routingToProto(&moe.RoutingInput{TopK: 2, Renormalize: true, Scoring: moe.Sigmoid, CorrectionBias: bias, NumGroups: 2, TopKGroups: 1, ScalingFactor: 2.5})
	if got.GetTopK() != 2 || !got.GetRenormalize() || got.GetScoring() != pb.Scoring_SCORING_SIGMOID || got.GetNumExpertGroups() != 2 ||
		got.GetTopkGroups() != 1 || got.GetRoutedScalingFactor() != 2.5 || got.GetCorrectionBias().GetDtype() != pb.DataType_DATA_TYPE_FLOAT32 ||
		len(got.GetCorrectionBias().GetShape()) != 1 || got.GetCorrectionBias().GetShape()[0] != 2 || len(got.GetCorrectionBias().GetData()) != 8 {
		t.Errorf("routingToProto = %v", got)
	}
}
