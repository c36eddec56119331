package kernels

import (
	"testing"

	"github.com/expertd/expertd/moe"
)

func TestRoutingSized(t *testing.T) {
	req := func(noRouting bool) *moe.Request {
		return &moe.Request{Hidden: moe.Tensor{Shape: []int{3, 8}}, Routing: moe.Routing{TopK: 2}, NoRouting: noRouting}
	}
	full := &moe.Result{TopKIDs: make([]int32, 6), TopKWeights: make([]float32, 6)}
	tests := []struct {
		name string
		req  *moe.Request
		res  *moe.Result
		want bool
	}{
		{"wanted and there", req(false), full, true},
		{"wanted and missing", req(false), &moe.Result{}, false},
		{"wanted, ids short", req(false), &moe.Result{TopKIDs: make([]int32, 5), TopKWeights: make([]float32, 6)}, false},
		{"not wanted and missing", req(true), &moe.Result{}, true},
		{"not wanted and there", req(true), full, true},
		{"not wanted, only weights", req(true), &moe.Result{TopKWeights: make([]float32, 6)}, false},
		{"not wanted, wrong size", req(true), &moe.Result{TopKIDs: make([]int32, 4), TopKWeights: make([]float32, 4)}, false},
	}
	for _, tt := range tests {
		if got := RoutingSized(tt.req, tt.res); got != tt.want {
			t.Errorf("%s: RoutingSized = %v, want %v", tt.name, got, tt.want)
		}
	}
}
