package weights_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/expertd/expertd/internal/safetensorstest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/weights"
)

func bf16Bytes(v []float32) []byte {
	b := make([]byte, 2*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint16(b[2*i:], scaling.Float32ToBF16(x))
	}
	return b
}

// powersOfTwo are n signed powers of two, which BF16 holds exactly and
// which quantize to E4M3 codes exactly at any scale of amax/448.
func powersOfTwo(n, seed int) []float32 {
	vals := []float32{1, -0.5, 0.25, -0.125, 0.5, -1, 0.125, -0.25}
	v := make([]float32, n)
	for i := range v {
		v[i] = vals[(i*5+i/7+seed)%len(vals)]
	}
	return v
}

// TestLoadGptOssLayout reads a gpt-oss layer's stacked tensors straight
// from the loader: each expert's w13 is the transpose of its gate_up_proj
// (rows interleaved gate, up as stored), w2 that of its down_proj, the
// biases the stacked rows, the SwiGLU parameters config.json's (or the
// request's, for a single file), the routing GptOssTopKRouter's. The
// weights are powers of two, so the only error FP8 adds is the scale's
// float32 rounding, and a transposed or shifted element is off by far
// more.
func TestLoadGptOssLayout(t *testing.T) {
	const e, k, n = 3, 8, 4
	gu, down := powersOfTwo(e*k*2*n, 0), powersOfTwo(e*n*k, 3)
	gub, db := powersOfTwo(e*2*n, 1), powersOfTwo(e*k, 2)
	const p = "model.layers.0.mlp.experts."
	ts := map[string]safetensorstest.Tensor{
		p + "gate_up_proj":      {DType: "BF16", Shape: []int64{e, k, 2 * n}, Data: bf16Bytes(gu)},
		p + "gate_up_proj_bias": {DType: "BF16", Shape: []int64{e, 2 * n}, Data: bf16Bytes(gub)},
		p + "down_proj":         {DType: "BF16", Shape: []int64{e, n, k}, Data: bf16Bytes(down)},
		p + "down_proj_bias":    {DType: "F32", Shape: []int64{e, k}, Data: moe.Float32Bytes(db)},
	}
	root := t.TempDir()
	for _, d := range []string{"ck", "file"} {
		if err := os.Mkdir(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := safetensorstest.Write(filepath.Join(root, d, "model.safetensors"), ts, nil); err != nil {
			t.Fatal(err)
		}
	}
	cfg := fmt.Sprintf(`{"model_type":"gpt_oss","num_local_experts":%d,"num_experts_per_tok":2,"hidden_act":"silu","swiglu_limit":0.5,"swiglu_alpha":2.5}`, e)
	if err := os.WriteFile(filepath.Join(root, "ck", "config.json"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name         string
		src          weights.Source
		subset       []int
		limit, alpha float32
		routing      bool
	}{
		{"checkpoint by model_type", weights.Source{Path: "ck", Preset: weights.Auto}, nil, 0.5, 2.5, true},
		{"checkpoint, limit given", weights.Source{Path: "ck", Preset: weights.GptOss, SwigluLimit: 3}, nil, 3, 2.5, true},
		{"checkpoint subset", weights.Source{Path: "ck", Preset: weights.GptOss}, []int{2, 0}, 0.5, 2.5, true},
		{"single file", weights.Source{Path: "file/model.safetensors", Preset: weights.GptOss, SwigluAlpha: 1.5}, nil, moe.DefaultSwigluLimit, 1.5, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			l := &weights.Loader{Dir: weights.Dir(root), Budget: &budget{max: 1 << 20}}
			var subset weights.ExpertSubset
			if tt.subset != nil {
				subset = func(int) ([]int, error) { return tt.subset, nil }
			}
			set, err := l.Load(context.Background(), &tt.src, subset)
			if err != nil {
				t.Fatal(err)
			}
			defer set.Release()
			ids := tt.subset
			if ids == nil {
				ids = []int{0, 1, 2}
			}
			s := set.Set
			if s.Activation != moe.SwigluOAI || s.E != len(ids) || s.K != k || s.N != n || s.SwigluLimit != tt.limit || s.SwigluAlpha != tt.alpha {
				t.Errorf("set %v E %d K %d N %d limit %v alpha %v, want swiglu_oai %d %d %d %v %v",
					s.Activation, s.E, s.K, s.N, s.SwigluLimit, s.SwigluAlpha, len(ids), k, n, tt.limit, tt.alpha)
			}
			if rt := set.Routing; tt.routing && (rt == nil || rt.TopK != 2 || !rt.Renormalize || rt.Scoring != moe.Softmax) || !tt.routing && rt != nil {
				t.Errorf("routing %+v, want top-2 renormalized softmax: %v", rt, tt.routing)
			}
			near := func(what string, got, want float32) {
				if math.Abs(float64(got-want)) > 1e-6*math.Abs(float64(want)) {
					t.Fatalf("%s = %v, want %v", what, got, want)
				}
			}
			for x, id := range ids {
				for r := range 2 * n {
					for c := range k {
						got := scaling.E4M3ToFloat32(s.W13[(x*2*n+r)*k+c]) * s.W13Scale.At(x, r, c)
						near(fmt.Sprintf("expert %d w13[%d][%d]", x, r, c), got, gu[(id*k+c)*2*n+r])
					}
					near(fmt.Sprintf("expert %d w13_bias[%d]", x, r), s.W13Bias[x*2*n+r], gub[id*2*n+r])
				}
				for r := range k {
					for c := range n {
						got := scaling.E4M3ToFloat32(s.W2[(x*k+r)*n+c]) * s.W2Scale.At(x, r, c)
						near(fmt.Sprintf("expert %d w2[%d][%d]", x, r, c), got, down[(id*n+c)*k+r])
					}
					near(fmt.Sprintf("expert %d w2_bias[%d]", x, r), s.W2Bias[x*k+r], db[id*k+r])
				}
			}
		})
	}
}
