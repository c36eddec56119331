// Package clienttest converts kerneltest cases into the SDK's request
// types, so that a test can check a result against kerneltest.Reference.
// The in-process daemon the tests and examples call is
// internal/testdaemon: this package links neither the engine nor the
// service.
package clienttest

import (
	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// Weights is the SDK form of a kerneltest expert set.
func Weights(set *moe.ExpertSet) *client.ExpertWeights {
	scale := func(ws scaling.WeightScale) client.Tensor {
		return client.FromFloat32(ws.Values, ws.Shape()...)
	}
	w := &client.ExpertWeights{
		Activation:  moe.Activation(set.Activation),
		W13:         client.FromFP8(set.W13, set.E, set.Rows1(), set.K),
		W2:          client.FromFP8(set.W2, set.E, set.K, set.N),
		W13Scale:    scale(set.W13Scale),
		W2Scale:     scale(set.W2Scale),
		BlockShape:  set.Block,
		SwigluLimit: set.SwigluLimit, SwigluAlpha: set.SwigluAlpha,
	}
	if set.W13Bias != nil {
		w.W13Bias = client.FromFloat32(set.W13Bias, set.E, set.Rows1())
	}
	if set.W2Bias != nil {
		w.W2Bias = client.FromFloat32(set.W2Bias, set.E, set.K)
	}
	if set.A13Scale != nil {
		w.A13Scale = client.FromFloat32([]float32{*set.A13Scale})
	}
	if set.A2Scale != nil {
		w.A2Scale = client.FromFloat32([]float32{*set.A2Scale})
	}
	return w
}

// Request is the SDK form of a kerneltest request on the loaded set name
// (or, with name "", on inline weights the caller fills in).
func Request(name string, set *moe.ExpertSet, r *moe.Request) *client.FusedMoERequest {
	m := r.M()
	tensor := func(t moe.Tensor) client.Tensor {
		return client.Tensor{DType: moe.DType(t.DType), Shape: t.Shape, Data: t.Data}
	}
	req := &client.FusedMoERequest{
		ExpertSet:   name,
		Hidden:      tensor(r.Hidden),
		OutputDType: moe.DType(r.OutDType),
		Routing: client.Routing{
			TopK: r.Routing.TopK, Renormalize: r.Routing.Renormalize, Scoring: moe.Scoring(r.Routing.Scoring),
			NumGroups: r.Routing.NumGroups, TopKGroups: r.Routing.TopKGroups, ScalingFactor: r.Routing.ScalingFactor,
		},
	}
	switch n := len(r.HiddenScale); {
	case n == 0:
	case n == 1:
		req.HiddenScale = client.FromFloat32(r.HiddenScale)
	case n == m:
		req.HiddenScale = client.FromFloat32(r.HiddenScale, m)
	default:
		req.HiddenScale = client.FromFloat32(r.HiddenScale, m, n/m)
	}
	if r.Routing.CorrectionBias != nil {
		req.Routing.CorrectionBias = client.FromFloat32(r.Routing.CorrectionBias, set.E)
	}
	if r.TopKIDs != nil {
		k := r.Routing.TopK
		req.TopKIDs = client.FromInt32(r.TopKIDs, m, k)
		req.TopKWeights = client.FromFloat32(r.TopKWeights, m, k)
	} else {
		req.RouterLogits = tensor(r.Logits)
	}
	return req
}
