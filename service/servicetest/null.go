package servicetest

import (
	"context"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
)

// NullBackend is a backend (the CPU backend, say, for loading and
// capabilities) whose FusedMoE computes nothing: it answers zeros of the
// right size, in the request's output memory when it names some, and a
// kernel time of 1 ns, so a benchmark on it times the call path alone.
type NullBackend struct{ kernels.Backend }

// FusedMoE implements kernels.Backend.
func (NullBackend) FusedMoE(_ context.Context, l kernels.Loaded, req *moe.Request) (*moe.Result, error) {
	n := req.M() * l.Set().K * req.OutDType.Size()
	out := req.Out
	if out == nil {
		out = make([]byte, n)
	}
	return &moe.Result{Output: out[:n], TopKIDs: make([]int32, req.M()*req.Routing.TopK),
		TopKWeights: make([]float32, req.M()*req.Routing.TopK), KernelNanos: 1}, nil
}
