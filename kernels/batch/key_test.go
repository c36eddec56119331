package batch

import (
	"reflect"
	"slices"
	"testing"

	"github.com/expertd/expertd/moe"
)

// TestBatchKeyCoversRequest fails when moe.Request or moe.Routing
// gains a field: the batcher must then decide whether calls that differ in
// it may merge (keyOf) and how to merge it (mergeRequests), or a merged
// call would silently compute with the first caller's value for everyone.
// (Calls with device tensors or OutDev never reach it: accepts refuses
// them, and a merge copies host and pinned tensors into host memory.
// NoRouting does not split batches: a batch returns routing when any
// member wants it.)
func TestBatchKeyCoversRequest(t *testing.T) {
	tests := []struct {
		typ  reflect.Type
		want []string
	}{
		{reflect.TypeFor[moe.Request](), []string{"Hidden", "HiddenScale", "Logits", "Routing", "TopKIDs", "TopKWeights", "OutDType", "Out", "OutDev", "NoRouting"}},
		{reflect.TypeFor[moe.Routing](), []string{"TopK", "Renormalize", "Scoring", "CorrectionBias", "NumGroups", "TopKGroups", "ScalingFactor"}},
		{reflect.TypeFor[moe.Tensor](), []string{"DType", "Shape", "Data", "Memory", "Dev", "DevBytes"}},
	}
	for _, tt := range tests {
		var got []string
		for f := range tt.typ.Fields() {
			got = append(got, f.Name)
		}
		if !slices.Equal(got, tt.want) {
			t.Errorf("%v has fields %v; the batcher knows %v: update keyOf, mergeRequests and this list", tt.typ, got, tt.want)
		}
	}
}
