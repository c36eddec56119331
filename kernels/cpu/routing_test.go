package cpu

import (
	"math"
	"slices"
	"testing"

	"github.com/expertd/expertd/kernels"
)

// TestRoute checks every routing mode against small hand-computed examples.
func TestRoute(t *testing.T) {
	nan := float32(math.NaN())
	tests := []struct {
		name    string
		logits  []float32
		r       kernels.Routing
		wantIDs []int32
		wantW   []float32
	}{
		{
			name:    "softmax renormalize",
			logits:  []float32{1, 2, 3, 0},
			r:       kernels.Routing{TopK: 2, Renormalize: true, Scoring: kernels.Softmax, ScalingFactor: 1},
			wantIDs: []int32{2, 1},
			wantW:   []float32{0.7310585786, 0.2689414214}, // e^3/(e^3+e^2), e^2/(e^3+e^2)
		},
		{
			name:    "softmax plain",
			logits:  []float32{1, 2, 3, 0},
			r:       kernels.Routing{TopK: 2, Scoring: kernels.Softmax, ScalingFactor: 1},
			wantIDs: []int32{2, 1},
			wantW:   []float32{0.6439142599, 0.2368828181}, // e^3/Σ, e^2/Σ
		},
		{
			name:    "softmax renormalize scaled",
			logits:  []float32{1, 2, 3, 0},
			r:       kernels.Routing{TopK: 2, Renormalize: true, Scoring: kernels.Softmax, ScalingFactor: 2.5},
			wantIDs: []int32{2, 1},
			wantW:   []float32{2.5 * 0.7310585786, 2.5 * 0.2689414214},
		},
		{
			name:    "softmax ties go to the lower id",
			logits:  []float32{1, 1, 1, 1},
			r:       kernels.Routing{TopK: 2, Scoring: kernels.Softmax, ScalingFactor: 1},
			wantIDs: []int32{0, 1},
			wantW:   []float32{0.25, 0.25},
		},
		{
			name:    "softmax top_k = E",
			logits:  []float32{0.5, -1, 2},
			r:       kernels.Routing{TopK: 3, Scoring: kernels.Softmax, ScalingFactor: 1},
			wantIDs: []int32{2, 0, 1},
			wantW:   []float32{0.7855970346, 0.1752903921, 0.0391125733},
		},
		{
			name:    "sigmoid renormalize scaled",
			logits:  []float32{0, 2, -1, 1},
			r:       kernels.Routing{TopK: 2, Renormalize: true, Scoring: kernels.Sigmoid, ScalingFactor: 2.5},
			wantIDs: []int32{1, 3},
			wantW:   []float32{1.3661227579, 1.1338772421}, // 2.5·σ(2)/(σ(2)+σ(1)), 2.5·σ(1)/(…)
		},
		{
			// sel = s + bias = [1.0, 0.881, 1.169, 0.731]: the bias picks 2 and 0,
			// the weights stay the unbiased σ(-1), σ(0).
			name:    "sigmoid bias selects, weights unbiased",
			logits:  []float32{0, 2, -1, 1},
			r:       kernels.Routing{TopK: 2, Scoring: kernels.Sigmoid, CorrectionBias: []float32{0.5, 0, 0.9, 0}, ScalingFactor: 1},
			wantIDs: []int32{2, 0},
			wantW:   []float32{0.2689414214, 0.5},
		},
		{
			name:    "sigmoid bias renormalize",
			logits:  []float32{0, 2, -1, 1},
			r:       kernels.Routing{TopK: 2, Renormalize: true, Scoring: kernels.Sigmoid, CorrectionBias: []float32{0.5, 0, 0.9, 0}, ScalingFactor: 1},
			wantIDs: []int32{2, 0},
			wantW:   []float32{0.3497554091, 0.6502445909},
		},
		{
			// s = 0.5 everywhere; sel = [0.9,0.1 | 0.7,0.7 | 0.6,0.5 | 0,0.85].
			// Group scores (top-2 sums) 1.0, 1.4, 1.1, 0.85 keep groups 1 and 2,
			// so experts 0 and 7, the two best, are not eligible.
			name:   "sigmoid groups by top-2 sum",
			logits: make([]float32, 8),
			r: kernels.Routing{TopK: 3, Renormalize: true, Scoring: kernels.Sigmoid, ScalingFactor: 2.5,
				CorrectionBias: []float32{0.4, -0.4, 0.2, 0.2, 0.1, 0, -0.5, 0.35}, NumGroups: 4, TopKGroups: 2},
			wantIDs: []int32{2, 3, 4},
			wantW:   []float32{2.5 / 3, 2.5 / 3, 2.5 / 3},
		},
		{
			// sel = [0.625, 0.75 | 0.5, 0.875]: both groups sum to 1.375, so
			// group 0 wins the tie and expert 3 is out despite the top score.
			name:   "sigmoid group ties go to the lower group",
			logits: make([]float32, 4),
			r: kernels.Routing{TopK: 1, Scoring: kernels.Sigmoid, ScalingFactor: 1,
				CorrectionBias: []float32{0.125, 0.25, 0, 0.375}, NumGroups: 2, TopKGroups: 1},
			wantIDs: []int32{1},
			wantW:   []float32{0.5},
		},
		{
			// One expert per group: the group score is that expert's score.
			name:   "sigmoid singleton groups",
			logits: []float32{0, 2, -1, 1},
			r: kernels.Routing{TopK: 2, Scoring: kernels.Sigmoid, ScalingFactor: 1,
				NumGroups: 4, TopKGroups: 2},
			wantIDs: []int32{1, 3},
			wantW:   []float32{0.8807970780, 0.7310585786},
		},
		{
			name:    "sigmoid ties go to the lower id",
			logits:  []float32{-1, 3, 3, 3},
			r:       kernels.Routing{TopK: 2, Scoring: kernels.Sigmoid, ScalingFactor: 1},
			wantIDs: []int32{1, 2},
			wantW:   []float32{0.9525741268, 0.9525741268},
		},
		{
			name:    "NaN never wins",
			logits:  []float32{nan, 1, 0},
			r:       kernels.Routing{TopK: 2, Scoring: kernels.Sigmoid, ScalingFactor: 1},
			wantIDs: []int32{1, 2},
			wantW:   []float32{0.7310585786, 0.5},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := len(tt.logits)
			gotIDs := make([]int32, tt.r.TopK)
			gotW := make([]float32, tt.r.TopK)
			Route(gotIDs, gotW, tt.logits, 1, e, tt.r)
			if !slices.Equal(gotIDs, tt.wantIDs) {
				t.Errorf("ids = %v, want %v", gotIDs, tt.wantIDs)
			}
			for j := range gotW {
				if d := math.Abs(float64(gotW[j] - tt.wantW[j])); d > 1e-6*math.Abs(float64(tt.wantW[j])) {
					t.Errorf("weights = %v, want %v", gotW, tt.wantW)
					break
				}
			}
		})
	}
}

// TestRouteRows checks that tokens are routed independently, row by row.
func TestRouteRows(t *testing.T) {
	logits := []float32{1, 2, 3, 0, 3, 2, 1, 0}
	r := kernels.Routing{TopK: 2, Renormalize: true, Scoring: kernels.Softmax, ScalingFactor: 1}
	ids := make([]int32, 4)
	w := make([]float32, 4)
	Route(ids, w, logits, 2, 4, r)
	if want := []int32{2, 1, 0, 1}; !slices.Equal(ids, want) {
		t.Errorf("ids = %v, want %v", ids, want)
	}
	if w[0] != w[2] || w[1] != w[3] {
		t.Errorf("weights = %v, want the same pair twice", w)
	}
}
