package cpu

import (
	"encoding/json"
	"math"
	"os"
	"slices"
	"testing"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// goldenCase is one case of testdata/golden/moe_golden.json, written by
// gen_moe_golden.py (numpy + ml_dtypes, no code shared with Go).
type goldenCase struct {
	Name           string
	Activation     string
	E, K, N, M     int
	TopK           int `json:"top_k"`
	Scoring        string
	Renormalize    bool
	Bias           []float32
	NumGroups      int     `json:"num_groups"`
	TopKGroups     int     `json:"topk_groups"`
	ScalingFactor  float32 `json:"scaling_factor"`
	Block          []int
	HiddenDType    string `json:"hidden_dtype"`
	OutDType       string `json:"out_dtype"`
	Hidden, Logits []float32
	W13, W2        []uint8
	W13Scale       []float32 `json:"w13_scale"`
	W13ScaleShape  []int     `json:"w13_scale_shape"`
	W2Scale        []float32 `json:"w2_scale"`
	W2ScaleShape   []int     `json:"w2_scale_shape"`
	WantOut        []float64 `json:"want_out"`
	WantIDs        []int32   `json:"want_ids"`
	WantWeights    []float32 `json:"want_weights"`
}

func dtypeNamed(t *testing.T, s string) moe.DType {
	switch s {
	case "float32":
		return moe.Float32
	case "bfloat16":
		return moe.BFloat16
	}
	t.Fatalf("unknown dtype %q", s)
	return 0
}

func (g *goldenCase) build(t *testing.T) (*moe.ExpertSet, *moe.Request) {
	set := &moe.ExpertSet{Activation: moe.Relu2, E: g.E, K: g.K, N: g.N, W13: g.W13, W2: g.W2}
	if g.Activation == "silu_gated" {
		set.Activation = moe.SiluGated
	}
	if len(g.Block) == 2 {
		set.Block = [2]int{g.Block[0], g.Block[1]}
	}
	var err error
	set.W13Scale, err = scaling.NewWeightScale(g.W13ScaleShape, g.W13Scale, g.E, set.Rows1(), g.K, set.Block)
	if err != nil {
		t.Fatalf("w13 scale: %v", err)
	}
	set.W2Scale, err = scaling.NewWeightScale(g.W2ScaleShape, g.W2Scale, g.E, g.K, g.N, set.Block)
	if err != nil {
		t.Fatalf("w2 scale: %v", err)
	}
	req := &moe.Request{
		Hidden: tensorOf(dtypeNamed(t, g.HiddenDType), g.Hidden, g.M, g.K),
		Logits: tensorOf(moe.Float32, g.Logits, g.M, g.E),
		Routing: moe.Routing{TopK: g.TopK, Renormalize: g.Renormalize, Scoring: moe.Softmax,
			CorrectionBias: g.Bias, NumGroups: g.NumGroups, TopKGroups: g.TopKGroups, ScalingFactor: g.ScalingFactor},
		OutDType: dtypeNamed(t, g.OutDType),
	}
	if g.Scoring == "sigmoid" {
		req.Routing.Scoring = moe.Sigmoid
	}
	return set, req
}

// tensorOf encodes float32 values (exactly representable in dt) as a tensor.
func tensorOf(dt moe.DType, v []float32, rows, cols int) moe.Tensor {
	t := moe.Tensor{DType: dt, Shape: []int{rows, cols}, Data: make([]byte, len(v)*dt.Size())}
	for i, x := range v {
		if dt == moe.BFloat16 {
			h := scaling.Float32ToBF16(x)
			t.Data[2*i], t.Data[2*i+1] = byte(h), byte(h>>8)
		} else {
			b := math.Float32bits(x)
			t.Data[4*i], t.Data[4*i+1], t.Data[4*i+2], t.Data[4*i+3] = byte(b), byte(b>>8), byte(b>>16), byte(b>>24)
		}
	}
	return t
}

// TestGolden checks the backend and kerneltest.Reference against the numpy
// implementation's outputs: two independent implementations of the spec
// must agree on routing exactly and on outputs within the FP8 bar.
func TestGolden(t *testing.T) {
	data, err := os.ReadFile("../../testdata/golden/moe_golden.json")
	if err != nil {
		t.Fatal(err)
	}
	var file struct{ Cases []goldenCase }
	if err := json.Unmarshal(data, &file); err != nil {
		t.Fatal(err)
	}
	if len(file.Cases) != 2 {
		t.Fatalf("golden file has %d cases, want 2", len(file.Cases))
	}
	b := New(kernels.Config{})
	for _, g := range file.Cases {
		t.Run(g.Name, func(t *testing.T) {
			set, req := g.build(t)
			res, err := kerneltest.RunCase(t.Context(), b, set, req)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(res.TopKIDs, g.WantIDs) {
				t.Errorf("backend ids = %v, want %v", res.TopKIDs, g.WantIDs)
			}
			got := kerneltest.DecodeOutput(req.OutDType, res.Output)
			if e := kerneltest.RelL2(got, g.WantOut); !(e <= kerneltest.FP8Tol) {
				t.Errorf("backend rel-L2 %.3g, want <= %g", e, kerneltest.FP8Tol)
			} else {
				t.Logf("backend rel-L2 vs numpy %.3g", e)
			}
			if e := kerneltest.RelL2(res.TopKWeights, f64(g.WantWeights)); !(e <= 1e-6) {
				t.Errorf("backend weights rel-L2 %.3g, want <= 1e-6", e)
			}

			ref, ids, _ := kerneltest.Reference(set, req)
			if !slices.Equal(ids, g.WantIDs) {
				t.Errorf("reference ids = %v, want %v", ids, g.WantIDs)
			}
			if e := kerneltest.RelL2(f32(ref), g.WantOut); !(e <= kerneltest.FP8Tol) {
				t.Errorf("reference rel-L2 %.3g, want <= %g", e, kerneltest.FP8Tol)
			} else {
				t.Logf("reference rel-L2 vs numpy %.3g", e)
			}
		})
	}
}

func f64(v []float32) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = float64(x)
	}
	return out
}

func f32(v []float64) []float32 {
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = float32(x)
	}
	return out
}
