package service

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"

	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/weights"
)

// This file is the edge of package weights: a LoadExperts safetensors
// source in, its errors out as statuses, and the set it reads committed
// like any other.

// LoadSafetensors loads src as a LoadExperts stream of that one message
// does (same checks, limits and errors), for callers inside the process
// such as the daemon's startup manifest. A non-nil subset loads only the
// experts it picks; nil loads every expert of the layer.
func (s *Server) LoadSafetensors(ctx context.Context, src *pb.LoadExpertsRequest_SafetensorsSource, subset weights.ExpertSubset) (*pb.ExpertSetInfo, error) {
	done, err := s.begin()
	if err != nil {
		return nil, err
	}
	defer done()
	if src == nil {
		return nil, invalidf("safetensors", "required")
	}
	info, err := s.loadSafetensors(ctx, src, subset)
	if err != nil {
		return nil, fmt.Errorf("expert set %q: %w", src.GetName(), err)
	}
	return info, nil
}

// loadSafetensors loads one layer's experts from a file or a checkpoint
// directory in the weights directory and makes them resident.
func (s *Server) loadSafetensors(ctx context.Context, src *pb.LoadExpertsRequest_SafetensorsSource, subset weights.ExpertSubset) (*pb.ExpertSetInfo, error) {
	if err := checkName("safetensors.name", src.GetName()); err != nil {
		return nil, err
	}
	if err := s.reg.checkFree("safetensors.name", src.GetName(), src.GetOverwrite()); err != nil {
		return nil, err
	}
	hq, _ := s.backend.(weights.HalfQuantizer)
	l := weights.Loader{Dir: s.weights, Budget: budget{s.reg}, Quantizer: hq, Log: s.log}
	set, err := l.Load(ctx, sourceFromProto(src), subset)
	if err != nil {
		return nil, fromWeights(err)
	}
	defer set.Release()
	info, err := s.commitRouted(ctx, src.GetName(), set.Set, set.Bytes, set.Fingerprint, set.TopKHint, routingToProto(set.Routing), src.GetOverwrite())
	if err != nil {
		return nil, err
	}
	set.Keep()
	return info, nil
}

// sourceFromProto is src in the loader's terms; the enums' values mirror.
func sourceFromProto(src *pb.LoadExpertsRequest_SafetensorsSource) *weights.Source {
	w := &weights.Source{
		Name:                  src.GetName(),
		Path:                  src.GetPath(),
		Layer:                 int(src.GetLayer()),
		Preset:                weights.Preset(src.GetPreset()),
		TensorPrefix:          src.GetTensorPrefix(),
		NumExperts:            int(src.GetNumExperts()),
		WeightQuantization:    weights.Quantization(src.GetWeightQuantization()),
		Activation:            moe.Activation(src.GetActivation()),
		SwigluLimit:           src.GetSwigluLimit(),
		SwigluAlpha:           src.GetSwigluAlpha(),
		W13Template:           src.GetW13Template(),
		W2Template:            src.GetW2Template(),
		W13ScaleTemplate:      src.GetW13ScaleTemplate(),
		W2ScaleTemplate:       src.GetW2ScaleTemplate(),
		GateTemplate:          src.GetGateTemplate(),
		UpTemplate:            src.GetUpTemplate(),
		GateScaleTemplate:     src.GetGateScaleTemplate(),
		UpScaleTemplate:       src.GetUpScaleTemplate(),
		W13InputScaleTemplate: src.GetW13InputScaleTemplate(),
		W2InputScaleTemplate:  src.GetW2InputScaleTemplate(),
	}
	for _, b := range src.GetWeightBlockShape() {
		w.WeightBlockShape = append(w.WeightBlockShape, int(b))
	}
	return w
}

// routingToProto is a checkpoint's routing as ExpertSetInfo reports it,
// nil for none.
func routingToProto(rt *moe.RoutingInput) *pb.Routing {
	if rt == nil {
		return nil
	}
	r := &pb.Routing{
		TopK:                int32(rt.TopK),
		Renormalize:         rt.Renormalize,
		Scoring:             pb.Scoring(rt.Scoring),
		NumExpertGroups:     int32(rt.NumGroups),
		TopkGroups:          int32(rt.TopKGroups),
		RoutedScalingFactor: rt.ScalingFactor,
	}
	if b := rt.CorrectionBias; b != nil {
		shape := make([]int64, len(b.Shape))
		for i, d := range b.Shape {
			shape[i] = int64(d)
		}
		r.CorrectionBias = &pb.Tensor{Dtype: wireDType(b.DType), Shape: shape, Source: &pb.Tensor_Data{Data: b.Data}}
	}
	return r
}

// fromWeights maps the loader's errors to the service's, with their
// fields and messages unchanged.
func fromWeights(err error) error {
	var we *weights.Error
	if errors.As(err, &we) {
		code := codes.InvalidArgument
		switch we.Kind {
		case weights.NotFound:
			code = codes.NotFound
		case weights.NoDir:
			code = codes.FailedPrecondition
		}
		return codedf(code, we.Field, "%s", we.Msg)
	}
	return fromModel(err)
}

// budget is the registry's byte cap as the loader reserves against it.
type budget struct{ reg *registry }

func (b budget) Reserve(field string, n int64) error { return b.reg.reserve(field, n) }
func (b budget) Release(n int64)                     { b.reg.release(n) }
