package moe

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// TestRoute checks every routing mode against small hand-computed examples.
func TestRoute(t *testing.T) {
	nan := float32(math.NaN())
	ninf := float32(math.Inf(-1))
	tests := []struct {
		name    string
		logits  []float32
		r       Routing
		wantIDs []int32
		wantW   []float32
	}{
		{
			name:    "softmax renormalize",
			logits:  []float32{1, 2, 3, 0},
			r:       Routing{TopK: 2, Renormalize: true, Scoring: Softmax, ScalingFactor: 1},
			wantIDs: []int32{2, 1},
			wantW:   []float32{0.7310585786, 0.2689414214}, // e^3/(e^3+e^2), e^2/(e^3+e^2)
		},
		{
			name:    "softmax plain",
			logits:  []float32{1, 2, 3, 0},
			r:       Routing{TopK: 2, Scoring: Softmax, ScalingFactor: 1},
			wantIDs: []int32{2, 1},
			wantW:   []float32{0.6439142599, 0.2368828181}, // e^3/Σ, e^2/Σ
		},
		{
			name:    "softmax renormalize scaled",
			logits:  []float32{1, 2, 3, 0},
			r:       Routing{TopK: 2, Renormalize: true, Scoring: Softmax, ScalingFactor: 2.5},
			wantIDs: []int32{2, 1},
			wantW:   []float32{2.5 * 0.7310585786, 2.5 * 0.2689414214},
		},
		{
			name:    "softmax ties go to the lower id",
			logits:  []float32{1, 1, 1, 1},
			r:       Routing{TopK: 2, Scoring: Softmax, ScalingFactor: 1},
			wantIDs: []int32{0, 1},
			wantW:   []float32{0.25, 0.25},
		},
		{
			name:    "softmax top_k = E",
			logits:  []float32{0.5, -1, 2},
			r:       Routing{TopK: 3, Scoring: Softmax, ScalingFactor: 1},
			wantIDs: []int32{2, 0, 1},
			wantW:   []float32{0.7855970346, 0.1752903921, 0.0391125733},
		},
		{
			name:    "sigmoid renormalize scaled",
			logits:  []float32{0, 2, -1, 1},
			r:       Routing{TopK: 2, Renormalize: true, Scoring: Sigmoid, ScalingFactor: 2.5},
			wantIDs: []int32{1, 3},
			wantW:   []float32{1.3661227579, 1.1338772421}, // 2.5·σ(2)/(σ(2)+σ(1)), 2.5·σ(1)/(…)
		},
		{
			// sel = s + bias = [1.0, 0.881, 1.169, 0.731]: the bias picks 2 and 0,
			// the weights stay the unbiased σ(-1), σ(0).
			name:    "sigmoid bias selects, weights unbiased",
			logits:  []float32{0, 2, -1, 1},
			r:       Routing{TopK: 2, Scoring: Sigmoid, CorrectionBias: []float32{0.5, 0, 0.9, 0}, ScalingFactor: 1},
			wantIDs: []int32{2, 0},
			wantW:   []float32{0.2689414214, 0.5},
		},
		{
			name:    "sigmoid bias renormalize",
			logits:  []float32{0, 2, -1, 1},
			r:       Routing{TopK: 2, Renormalize: true, Scoring: Sigmoid, CorrectionBias: []float32{0.5, 0, 0.9, 0}, ScalingFactor: 1},
			wantIDs: []int32{2, 0},
			wantW:   []float32{0.3497554091, 0.6502445909},
		},
		{
			// s = 0.5 everywhere; sel = [0.9,0.1 | 0.7,0.7 | 0.6,0.5 | 0,0.85].
			// Group scores (top-2 sums) 1.0, 1.4, 1.1, 0.85 keep groups 1 and 2,
			// so experts 0 and 7, the two best, are not eligible.
			name:   "sigmoid groups by top-2 sum",
			logits: make([]float32, 8),
			r: Routing{TopK: 3, Renormalize: true, Scoring: Sigmoid, ScalingFactor: 2.5,
				CorrectionBias: []float32{0.4, -0.4, 0.2, 0.2, 0.1, 0, -0.5, 0.35}, NumGroups: 4, TopKGroups: 2},
			wantIDs: []int32{2, 3, 4},
			wantW:   []float32{2.5 / 3, 2.5 / 3, 2.5 / 3},
		},
		{
			// sel = [0.625, 0.75 | 0.5, 0.875]: both groups sum to 1.375, so
			// group 0 wins the tie and expert 3 is out despite the top score.
			name:   "sigmoid group ties go to the lower group",
			logits: make([]float32, 4),
			r: Routing{TopK: 1, Scoring: Sigmoid, ScalingFactor: 1,
				CorrectionBias: []float32{0.125, 0.25, 0, 0.375}, NumGroups: 2, TopKGroups: 1},
			wantIDs: []int32{1},
			wantW:   []float32{0.5},
		},
		{
			// One expert per group: the group score is that expert's score.
			name:   "sigmoid singleton groups",
			logits: []float32{0, 2, -1, 1},
			r: Routing{TopK: 2, Scoring: Sigmoid, ScalingFactor: 1,
				NumGroups: 4, TopKGroups: 2},
			wantIDs: []int32{1, 3},
			wantW:   []float32{0.8807970780, 0.7310585786},
		},
		{
			name:    "sigmoid ties go to the lower id",
			logits:  []float32{-1, 3, 3, 3},
			r:       Routing{TopK: 2, Scoring: Sigmoid, ScalingFactor: 1},
			wantIDs: []int32{1, 2},
			wantW:   []float32{0.9525741268, 0.9525741268},
		},
		{
			name:    "NaN never wins",
			logits:  []float32{nan, 1, 0},
			r:       Routing{TopK: 2, Scoring: Sigmoid, ScalingFactor: 1},
			wantIDs: []int32{1, 2},
			wantW:   []float32{0.7310585786, 0.5},
		},
		// -Inf masks an expert: weight 0 exactly, never NaN, even with fewer
		// unmasked experts than top_k or none (issue 14).
		{"softmax all masked", []float32{ninf, ninf, ninf, ninf}, Routing{TopK: 2, Scoring: Softmax, ScalingFactor: 1}, []int32{0, 1}, []float32{0, 0}},
		{"softmax all masked renormalized", []float32{ninf, ninf, ninf, ninf}, Routing{TopK: 2, Scoring: Softmax, Renormalize: true, ScalingFactor: 1}, []int32{0, 1}, []float32{0, 0}},
		{"softmax one unmasked of top 3", []float32{ninf, 0.5, ninf, ninf}, Routing{TopK: 3, Scoring: Softmax, Renormalize: true, ScalingFactor: 1}, []int32{1, 0, 2}, []float32{1, 0, 0}},
		{"sigmoid all masked renormalized", []float32{ninf, ninf, ninf, ninf}, Routing{TopK: 2, Scoring: Sigmoid, Renormalize: true, ScalingFactor: 1}, []int32{0, 1}, []float32{0, 0}},
		{"sigmoid grouped masked", []float32{ninf, ninf, 0, ninf}, Routing{TopK: 2, Scoring: Sigmoid, Renormalize: true, ScalingFactor: 1, NumGroups: 2, TopKGroups: 1}, []int32{2, 3}, []float32{1, 0}},
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
				// Written so that a NaN weight fails too.
				if d := math.Abs(float64(gotW[j] - tt.wantW[j])); !(d <= 1e-6*math.Abs(float64(tt.wantW[j]))) {
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
	r := Routing{TopK: 2, Renormalize: true, Scoring: Softmax, ScalingFactor: 1}
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

// sortRoute is a sort-based oracle for Route: stable sorts over ascending
// ids give "lower id wins" for experts and groups alike.
func sortRoute(logits []float32, r Routing) ([]int32, []float64) {
	e := len(logits)
	score := make([]float64, e)
	if r.Scoring == Sigmoid {
		for i, x := range logits {
			score[i] = 1 / (1 + math.Exp(-float64(x)))
		}
	} else {
		var sum float64
		mx := float64(slices.Max(logits))
		for i, x := range logits {
			score[i] = math.Exp(float64(x) - mx)
			sum += score[i]
		}
		for i := range score {
			score[i] /= sum
		}
	}
	sel := slices.Clone(score)
	for i := range sel {
		if r.CorrectionBias != nil {
			sel[i] += float64(r.CorrectionBias[i])
		}
	}
	var cand []int
	if r.NumGroups > 1 {
		size := e / r.NumGroups
		gs := make([]float64, r.NumGroups)
		order := make([]int, r.NumGroups)
		for g := range gs {
			order[g] = g
			m := slices.Clone(sel[g*size : (g+1)*size])
			slices.SortFunc(m, func(a, b float64) int { return cmpDesc(a, b) })
			gs[g] = m[0]
			if size > 1 {
				gs[g] += m[1]
			}
		}
		slices.SortStableFunc(order, func(a, b int) int { return cmpDesc(gs[a], gs[b]) })
		for _, g := range order[:r.TopKGroups] {
			for i := g * size; i < (g+1)*size; i++ {
				cand = append(cand, i)
			}
		}
		slices.Sort(cand)
	} else {
		for i := range e {
			cand = append(cand, i)
		}
	}
	slices.SortStableFunc(cand, func(a, b int) int { return cmpDesc(sel[a], sel[b]) })
	ids := make([]int32, r.TopK)
	w := make([]float64, r.TopK)
	var sum float64
	for j := range ids {
		ids[j] = int32(cand[j])
		w[j] = score[cand[j]]
		sum += w[j]
	}
	for j := range w {
		if r.Renormalize {
			w[j] /= sum
		}
		w[j] *= float64(r.ScalingFactor)
	}
	return ids, w
}

func cmpDesc(a, b float64) int {
	switch {
	case a > b:
		return -1
	case a < b:
		return 1
	}
	return 0
}

// TestRouteTies routes random tokens whose logits and biases come from a
// handful of values, so ties between experts and between groups are the
// rule, against the sort-based oracle, in every mode.
func TestRouteTies(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 9))
	levels := []float32{-1, 0, 0.5, 1}
	biasLevels := []float32{0, 0.25, 0.5}
	modes := []Routing{
		{TopK: 3, Scoring: Softmax, Renormalize: true, ScalingFactor: 1},
		{TopK: 3, Scoring: Sigmoid, ScalingFactor: 2.5},
		{TopK: 4, Scoring: Sigmoid, Renormalize: true, ScalingFactor: 2.5, NumGroups: 4, TopKGroups: 2},
		{TopK: 2, Scoring: Softmax, ScalingFactor: 1, NumGroups: 8, TopKGroups: 3},
		{TopK: 16, Scoring: Sigmoid, Renormalize: true, ScalingFactor: 1},
	}
	const e = 16
	for mi, r := range modes {
		for trial := range 200 {
			logits := make([]float32, e)
			for i := range logits {
				logits[i] = levels[rng.IntN(len(levels))]
			}
			r := r
			if trial%2 == 1 {
				r.CorrectionBias = make([]float32, e)
				for i := range r.CorrectionBias {
					r.CorrectionBias[i] = biasLevels[rng.IntN(len(biasLevels))]
				}
			}
			ids := make([]int32, r.TopK)
			w := make([]float32, r.TopK)
			Route(ids, w, logits, 1, e, r)
			wantIDs, wantW := sortRoute(logits, r)
			if !slices.Equal(ids, wantIDs) {
				t.Fatalf("mode %d, logits %v, bias %v: ids %v, want %v", mi, logits, r.CorrectionBias, ids, wantIDs)
			}
			for j := range w {
				if math.Abs(float64(w[j])-wantW[j]) > 1e-6*math.Abs(wantW[j]) {
					t.Fatalf("mode %d: weights %v, want %v", mi, w, wantW)
				}
			}
		}
	}
}

// FuzzRoute checks Route against the oracle on arbitrary logits (NaN
// excluded: the oracle's sorts do not order it).
func FuzzRoute(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, uint8(0))
	f.Add([]byte{7, 7, 7, 7, 7, 7, 7, 7, 1, 1, 1, 1, 1, 1, 1, 1}, uint8(2))
	f.Fuzz(func(t *testing.T, data []byte, mode uint8) {
		const e = 8
		if len(data) < e {
			return
		}
		logits := make([]float32, e)
		masked := false
		for i := range logits {
			logits[i] = float32(int8(data[i])) / 16
			if data[i] == 0x80 { // a masked expert
				logits[i], masked = float32(math.Inf(-1)), true
			}
		}
		r := []Routing{
			{TopK: 2, Scoring: Softmax, Renormalize: true, ScalingFactor: 1},
			{TopK: 3, Scoring: Sigmoid, ScalingFactor: 2.5},
			{TopK: 3, Scoring: Sigmoid, Renormalize: true, ScalingFactor: 1, NumGroups: 4, TopKGroups: 2},
		}[int(mode)%3]
		ids := make([]int32, r.TopK)
		w := make([]float32, r.TopK)
		Route(ids, w, logits, 1, e, r)
		for j, x := range w {
			if x != x || math.IsInf(float64(x), 0) || (logits[ids[j]] == float32(math.Inf(-1)) && x != 0) {
				t.Fatalf("logits %v mode %d: weight %d of expert %d is %v", logits, mode%3, j, ids[j], x)
			}
		}
		if masked {
			return // sortRoute's float64 softmax does not model masks
		}
		if wantIDs, _ := sortRoute(logits, r); !slices.Equal(ids, wantIDs) {
			t.Errorf("logits %v mode %d: ids %v, want %v", logits, mode%3, ids, wantIDs)
		}
	})
}
