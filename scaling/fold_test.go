package scaling

import (
	"math"
	"slices"
	"strings"
	"testing"
)

func TestFold(t *testing.T) {
	const e = 4
	rng := newRNG()
	w13v, w2v := positive(rng, e), positive(rng, e)
	a13, a2 := 0.001+rng.Float32(), 0.001+rng.Float32()
	perExpert := func(v []float32) WeightScale {
		ws, err := NewWeightScale([]int{e}, v, e, 8, 8, [2]int{})
		if err != nil {
			t.Fatal(err)
		}
		return ws
	}
	perTensor := func(v float32) WeightScale {
		ws, err := NewWeightScale(nil, []float32{v}, e, 8, 8, [2]int{})
		if err != nil {
			t.Fatal(err)
		}
		return ws
	}
	repeat := func(v float32) []float32 { return slices.Repeat([]float32{v}, e) }
	mul := func(v []float32, s float32) []float32 {
		out := make([]float32, len(v))
		for i := range v {
			out[i] = v[i] * s
		}
		return out
	}
	tests := []struct {
		name    string
		w13, w2 WeightScale
		g1, g2  []float32
		a13, a2 float32
		wantGS  float32
		wantErr string
	}{
		{"per-expert", perExpert(w13v), perExpert(w2v), mul(w13v, a13), mul(w2v, a2), a13, a2, 1 / a2, ""},
		{"per-tensor", perTensor(w13v[0]), perTensor(w2v[0]), repeat(w13v[0] * a13), repeat(w2v[0] * a2), a13, a2, 1 / a2, ""},
		{"mixed", perTensor(w13v[1]), perExpert(w2v), repeat(w13v[1] * a13), mul(w2v, a2), a13, a2, 1 / a2, ""},
		{"per-tensor literal, E from the other", WeightScale{Granularity: PerTensor, Values: []float32{w13v[2]}}, perExpert(w2v),
			repeat(w13v[2] * a13), mul(w2v, a2), a13, a2, 1 / a2, ""},
		{"tiny a2 is clamped", perExpert(w13v), perExpert(w2v), mul(w13v, a13), mul(w2v, MinScale), a13, 1e-20, 1 / float32(MinScale), ""},
		{"per-channel", WeightScale{Granularity: PerChannel, Values: positive(rng, e*8), E: e, Rows: 8, Cols: 8}, perExpert(w2v),
			nil, nil, a13, a2, 0, "w13_scale: a per-channel scale does not fold to per-expert alphas"},
		{"block", perExpert(w13v), WeightScale{Granularity: Block, Values: positive(rng, e), Block: [2]int{8, 8}, E: e, Rows: 8, Cols: 8},
			nil, nil, a13, a2, 0, "w2_scale: a block scale does not fold"},
		{"expert counts differ", perExpert(w13v), WeightScale{Granularity: PerExpert, Values: w2v[:3], E: e}, nil, nil, a13, a2, 0, "per-expert scale has 3 values for 4 experts"},
		{"E unknown", WeightScale{Granularity: PerTensor, Values: []float32{1}}, WeightScale{Granularity: PerTensor, Values: []float32{1}},
			nil, nil, a13, a2, 0, "number of experts unknown"},
		{"E disagrees", perExpert(w13v), WeightScale{Granularity: PerExpert, Values: w2v[:3]}, nil, nil, a13, a2, 0,
			"w13_scale is for 4 experts, w2_scale for 3"},
		{"a13 NaN", perExpert(w13v), perExpert(w2v), nil, nil, float32(math.NaN()), a2, 0, "a13_scale is NaN: scales must be finite and > 0"},
		{"a2 zero", perExpert(w13v), perExpert(w2v), nil, nil, a13, 0, 0, "a2_scale is 0"},
		{"a2 Inf", perExpert(w13v), perExpert(w2v), nil, nil, a13, float32(math.Inf(1)), 0, "a2_scale is +Inf"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Fold(tt.w13, tt.w2, tt.a13, tt.a2)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got.G1Alphas, tt.g1) || !slices.Equal(got.G2Alphas, tt.g2) || got.A2GScale != tt.wantGS {
				t.Errorf("Fold = %+v, want G1Alphas %v, A2GScale %v, G2Alphas %v", got, tt.g1, tt.wantGS, tt.g2)
			}
		})
	}
}

// TestFoldedMatchesUnfolded checks the point of folding: a GEMM computed
// with folded alphas equals one that dequantizes operands first.
func TestFoldedMatchesUnfolded(t *testing.T) {
	const e, k = 3, 64
	rng := newRNG()
	x := randn(rng, k, 0.1)
	w, ws := QuantizeWeights(randn(rng, e*k, 1), e, 1, k, PerExpert, [2]int{})
	a13 := PerTensorScale(x)
	xq := make([]uint8, k)
	QuantizeStatic(xq, x, a13)
	f, err := Fold(ws, ws, a13, 1)
	if err != nil {
		t.Fatal(err)
	}
	for ex := range e {
		var acc, deq float64
		for c := range k {
			acc += float64(E4M3Table[xq[c]]) * float64(E4M3Table[w[ex*k+c]])
			deq += float64(E4M3Table[xq[c]]*a13) * float64(E4M3Table[w[ex*k+c]]*ws.Expert(ex))
		}
		got := acc * float64(f.G1Alphas[ex])
		if math.Abs(got-deq) > 1e-5*math.Abs(deq)+1e-9 {
			t.Errorf("expert %d: folded %v, unfolded %v", ex, got, deq)
		}
	}
}

func TestReduceExpertScaleAndClamp(t *testing.T) {
	nan := float32(math.NaN())
	tests := []struct {
		name string
		v    []float32
		want float32
	}{
		{"max", []float32{0.5, 2, 1}, 2},
		{"one", []float32{0.25}, 0.25},
		{"tiny clamps", []float32{1e-20, 1e-30}, MinScale},
		{"NaN first", []float32{nan, 1}, nan},
		{"NaN later", []float32{1, nan, 3}, nan},
		{"empty", nil, nan},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := ReduceExpertScale(tt.v)
			if got != tt.want && !(got != got && tt.want != tt.want) {
				t.Errorf("ReduceExpertScale(%v) = %v, want %v", tt.v, got, tt.want)
			}
		})
	}
	for _, c := range []struct{ in, want float32 }{{0, MinScale}, {-1, MinScale}, {1e-11, MinScale}, {2e-10, 2e-10}, {3, 3}} {
		if got := ClampScale(c.in); got != c.want {
			t.Errorf("ClampScale(%v) = %v, want %v", c.in, got, c.want)
		}
	}
	if got := ClampScale(nan); got == got {
		t.Errorf("ClampScale(NaN) = %v, want NaN", got)
	}
}
