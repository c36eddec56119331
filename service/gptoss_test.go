package service_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/google/go-cmp/cmp"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// gptossLayer is one MoE layer of a gpt-oss BF16 or F16 release, stored
// as transformers' GptOssExperts holds it.
type gptossLayer struct {
	e, k, n int
	dtype   string
}

// gptossWeights are a layer's values as the checkpoint holds them:
// gu [e, k, 2n] (gate and up interleaved in the last dimension), gub
// [e, 2n], down [e, n, k], db [e, k].
type gptossWeights struct{ gu, gub, down, db []float32 }

// write adds the layer's stacked tensors (and its router's) to ts.
func (g gptossLayer) write(rng *rand.Rand, ts map[string]stTensor, layer int) gptossWeights {
	e, k, n := int64(g.e), int64(g.k), int64(g.n)
	p := fmt.Sprintf("model.layers.%d.mlp.", layer)
	var w gptossWeights
	put := func(name, dtype string, v []float32, shape ...int64) []float32 {
		b, exact := halfBytes(dtype, v)
		if dtype == "F32" {
			b, exact = f32Bytes(v), v
		}
		ts[p+name] = stTensor{dtype, shape, b}
		return exact
	}
	w.gu = put("experts.gate_up_proj", g.dtype, randn(rng, g.e*g.k*2*g.n, 0.1), e, k, 2*n)
	w.gub = put("experts.gate_up_proj_bias", "BF16", randn(rng, g.e*2*g.n, 0.3), e, 2*n)
	w.down = put("experts.down_proj", g.dtype, randn(rng, g.e*g.n*g.k, 0.1), e, n, k)
	w.db = put("experts.down_proj_bias", "F32", randn(rng, g.e*g.k, 0.3), e, k)
	put("router.weight", "BF16", randn(rng, g.e*g.k, 0.1), e, k)
	put("router.bias", "BF16", randn(rng, g.e, 0.1), e)
	return w
}

// transposeExperts is the [e, rows, cols] values v as [e, cols, rows].
func transposeExperts(v []float32, e, rows, cols int) []float32 {
	out := make([]float32, len(v))
	for x := range e {
		for r := range rows {
			for c := range cols {
				out[(x*cols+c)*rows+r] = v[(x*rows+r)*cols+c]
			}
		}
	}
	return out
}

// fp8 is w with its stacked matrices quantized as the loader quantizes
// them at granularity q, dequantized: each expert's transposes (w13
// [2n, k], w2 [k, n]) scaled by themselves.
func (g gptossLayer) fp8(w gptossWeights, q scaling.Granularity) gptossWeights {
	e, k, n := g.e, g.k, g.n
	bs := [2]int{128, 128}
	w.gu = transposeExperts(fp8Model(transposeExperts(w.gu, e, k, 2*n), e, 2*n, k, q, bs), e, 2*n, k)
	w.down = transposeExperts(fp8Model(transposeExperts(w.down, e, n, k), e, k, n, q, bs), e, k, n)
	return w
}

// gptossRef is GptOssExperts' forward in float64 on the stacked layout,
// with the server's dynamic FP8 quantization of the experts' input and of
// the intermediate, per token: gate_up = x @ gu[e] + gub[e]; gate and up
// are its even and odd columns; gate clamped above at limit, up to
// [-limit, limit]; (up + 1) * gate * sigmoid(alpha * gate) @ down[e] +
// db[e], times the routing weight.
func (g gptossLayer) ref(w gptossWeights, hidden []float32, ids []int32, wts []float32, topk int, limit, alpha float64) []float64 {
	k, n := g.k, g.n
	// One group of both k and n columns: per token.
	return routedRef(hidden, ids, wts, k, topk, k+n, func(e int, a []float64, quant func([]float32) []float64) []float64 {
		gu := make([]float64, 2*n)
		for c := range 2 * n {
			gu[c] = float64(w.gub[e*2*n+c])
			for r := range k {
				gu[c] += a[r] * float64(w.gu[(e*k+r)*2*n+c])
			}
		}
		mid := make([]float32, n)
		for i := range n {
			gate := math.Min(gu[2*i], limit)
			up := math.Max(-limit, math.Min(gu[2*i+1], limit))
			mid[i] = float32((up + 1) * gate / (1 + math.Exp(-alpha*gate)))
		}
		q := quant(mid)
		y := make([]float64, k)
		for c := range k {
			y[c] = float64(w.db[e*k+c])
			for r := range n {
				y[c] += q[r] * float64(w.down[(e*n+r)*k+c])
			}
		}
		return y
	})
}

// TestLoadGptOss loads BF16 and F16 gpt-oss layers (sharded checkpoint
// directories, by model_type and by preset, an expert subset, and a
// single file, whose SwiGLU parameters the request gives) and
// checks each against GptOssExperts' forward in float64: with the weights
// quantized as the loader should, within the CPU backend's bar, and with
// the checkpoint's own weights, within what E4M3 rounding costs.
// config.json's swiglu_limit and swiglu_alpha are far from gpt-oss's
// defaults, so a load that ignored them, or the biases, or transposed
// wrongly, misses both bars.
func TestLoadGptOss(t *testing.T) {
	rng := newRand(t)
	root := t.TempDir()
	const e, k, n, m, topk = 6, 96, 48, 12, 2
	const limit, alpha = 0.4, 3.0
	c, srv, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: root}, cpu.New(kernels.Config{Threads: 2}))
	config := map[string]any{"model_type": "gpt_oss", "num_local_experts": e, "num_experts_per_tok": topk, "hidden_act": "silu",
		"swiglu_limit": limit, "swiglu_alpha": alpha, "hidden_size": k, "intermediate_size": n}
	for _, tt := range []struct {
		dtype  string
		preset pb.NamingPreset
		q      pb.WeightQuantization
		g      scaling.Granularity
		subset []int
		file   bool
	}{
		{"BF16", pb.NamingPreset_NAMING_PRESET_AUTO, pb.WeightQuantization_WEIGHT_QUANTIZATION_UNSPECIFIED, scaling.PerChannel, nil, false},
		{"F16", pb.NamingPreset_NAMING_PRESET_GPT_OSS, pb.WeightQuantization_WEIGHT_QUANTIZATION_PER_TENSOR, scaling.PerTensor, nil, false},
		{"BF16", pb.NamingPreset_NAMING_PRESET_GPT_OSS, pb.WeightQuantization_WEIGHT_QUANTIZATION_PER_CHANNEL, scaling.PerChannel, []int{4, 1, 3}, false},
		{"BF16", pb.NamingPreset_NAMING_PRESET_GPT_OSS, pb.WeightQuantization_WEIGHT_QUANTIZATION_BLOCK, scaling.Block, nil, true},
	} {
		name := fmt.Sprintf("%s-%v-%v-%d-%v", tt.dtype, tt.preset, tt.q, len(tt.subset), tt.file)
		t.Run(name, func(t *testing.T) {
			g := gptossLayer{e: e, k: k, n: n, dtype: tt.dtype}
			ts := map[string]stTensor{}
			g.write(rng, ts, 0) // a decoy layer
			w := g.write(rng, ts, 1)
			src := &pb.LoadExpertsRequest_SafetensorsSource{Name: name, Path: name, Layer: 1, Preset: tt.preset, WeightQuantization: tt.q}
			if tt.file {
				writeCheckpoint(t, filepath.Join(root, name), ts, 1, nil)
				src.Path += "/model.safetensors"
				src.SwigluLimit, src.SwigluAlpha = limit, alpha
			} else {
				writeCheckpoint(t, filepath.Join(root, name), ts, 3, config)
			}
			var info *pb.ExpertSetInfo
			var err error
			if tt.subset == nil {
				info, err = loadSafetensors(t, c, src)
			} else {
				info, err = srv.LoadSafetensors(testContext(t), src, func(int) ([]int, error) { return tt.subset, nil })
			}
			if err != nil {
				t.Fatalf("LoadExperts: %v", err)
			}
			setE := e
			if tt.subset != nil {
				setE = len(tt.subset)
			}
			if info.GetActivation() != pb.Activation_ACTIVATION_SWIGLU_OAI || info.GetNumExperts() != int32(setE) ||
				info.GetHiddenSize() != k || info.GetIntermediateSize() != n {
				t.Errorf("info %v", info)
			}
			wantRt := &pb.Routing{TopK: topk, Renormalize: true, Scoring: pb.Scoring_SCORING_SOFTMAX}
			if tt.file {
				wantRt = nil // only a checkpoint directory's config.json gives one
			}
			if diff := cmp.Diff(wantRt, info.GetRouting(), protocmp.Transform()); diff != "" {
				t.Errorf("routing (-want +got):\n%s", diff)
			}
			hidden, ids, wts := halfTokens(rng, halfLayer{e: setE, k: k}, m, topk)
			got := halfRun(t, c, name, halfLayer{k: k}, hidden, ids, wts)
			// The reference runs the layer's experts: the set's expert i is
			// the layer's subset[i].
			gids := ids
			if tt.subset != nil {
				gids = make([]int32, len(ids))
				for i, x := range ids {
					gids[i] = int32(tt.subset[x])
				}
			}
			want := g.ref(g.fp8(w, tt.g), hidden, gids, wts, topk, limit, alpha)
			if rel := relL2(got, want); !(rel <= cpuBar) {
				t.Errorf("rel L2 against the float64 model of the FP8 weights %.3e, want <= %.0e", rel, cpuBar)
			}
			if rel := relL2(got, g.ref(w, hidden, gids, wts, topk, limit, alpha)); !(rel <= halfBar) {
				t.Errorf("rel L2 against the float64 model of the %s weights %.3e, want <= %.0e", tt.dtype, rel, halfBar)
			}
			// The parameters must matter here, or the test could not tell.
			if rel := relL2(got, g.ref(g.fp8(w, tt.g), hidden, gids, wts, topk, 7, 1.702)); !(rel > 10*cpuBar) {
				t.Errorf("rel L2 against gpt-oss's default limit and alpha %.3e: the case does not exercise them", rel)
			}
		})
	}
}

// TestLoadGptOssErrors: what a gpt-oss checkpoint can get wrong is
// refused with InvalidArgument naming the tensor or config.json key.
func TestLoadGptOssErrors(t *testing.T) {
	rng := newRand(t)
	root := t.TempDir()
	g := gptossLayer{e: 2, k: 16, n: 16, dtype: "BF16"}
	good := map[string]stTensor{}
	g.write(rng, good, 0)
	cfg := func(kv ...any) map[string]any {
		c := map[string]any{"model_type": "gpt_oss", "num_local_experts": 2, "num_experts_per_tok": 1}
		for i := 0; i < len(kv); i += 2 {
			c[kv[i].(string)] = kv[i+1]
		}
		return c
	}
	variant := func(dir string, config map[string]any, edit func(ts map[string]stTensor)) {
		ts := map[string]stTensor{}
		for name, t := range good {
			ts[name] = t
		}
		if edit != nil {
			edit(ts)
		}
		writeCheckpoint(t, filepath.Join(root, dir), ts, 2, config)
	}
	const p = "model.layers.0.mlp.experts."
	variant("good", cfg(), nil)
	variant("limit", cfg("swiglu_limit", -1), nil)
	variant("alpha", cfg("swiglu_alpha", "x"), nil)
	variant("act", cfg("hidden_act", "gelu"), nil)
	variant("experts", cfg("num_local_experts", 3), nil)
	variant("mxfp4", cfg(), func(ts map[string]stTensor) {
		ts[p+"gate_up_proj_blocks"] = stTensor{"U8", []int64{2, 32, 1, 16}, make([]byte, 1024)}
		delete(ts, p+"gate_up_proj")
	})
	variant("fp8", cfg(), func(ts map[string]stTensor) {
		ts[p+"gate_up_proj"] = stTensor{"F8_E4M3", []int64{2, 16, 32}, make([]byte, 1024)}
	})
	variant("downshape", cfg(), func(ts map[string]stTensor) {
		ts[p+"down_proj"] = stTensor{"BF16", []int64{2, 8, 16}, make([]byte, 512)}
	})
	variant("nobias", cfg(), func(ts map[string]stTensor) { delete(ts, p+"down_proj_bias") })
	variant("oddshape", cfg(), func(ts map[string]stTensor) {
		ts[p+"gate_up_proj"] = stTensor{"BF16", []int64{2, 16, 31}, make([]byte, 2*2*16*31)}
	})
	variant("nogateup", cfg(), func(ts map[string]stTensor) { delete(ts, p+"gate_up_proj") })
	writeHalfCheckpoint(t, rng, halfLayer{e: 2, k: 16, n: 16, gated: true, dtype: "BF16", expert: hfExpert("model.", "mlp", projNames)},
		filepath.Join(root, "qwen"), 0, 1)
	tests := []struct {
		name, path string
		preset     pb.NamingPreset
		limit      float32
		code       codes.Code
		want       string
	}{
		{"limit", "limit", pb.NamingPreset_NAMING_PRESET_AUTO, 0, codes.InvalidArgument, "swiglu_limit -1: want finite and > 0"},
		{"alpha type", "alpha", pb.NamingPreset_NAMING_PRESET_AUTO, 0, codes.InvalidArgument, "swiglu_alpha: a JSON string"},
		{"activation", "act", pb.NamingPreset_NAMING_PRESET_AUTO, 0, codes.InvalidArgument, `hidden_act: activation "gelu"`},
		{"fewer experts than config", "experts", pb.NamingPreset_NAMING_PRESET_AUTO, 0, codes.InvalidArgument, "holds 2 of layer 0's 3 experts"},
		{"mxfp4", "mxfp4", pb.NamingPreset_NAMING_PRESET_GPT_OSS, 0, codes.InvalidArgument, `"model.layers.0.mlp.experts.gate_up_proj_blocks" is MXFP4`},
		{"fp8", "fp8", pb.NamingPreset_NAMING_PRESET_GPT_OSS, 0, codes.InvalidArgument, "load from BF16 or F16"},
		{"down shape", "downshape", pb.NamingPreset_NAMING_PRESET_AUTO, 0, codes.InvalidArgument, `"model.layers.0.mlp.experts.down_proj" has shape [2 8 16], want [2 16 16]`},
		{"no bias", "nobias", pb.NamingPreset_NAMING_PRESET_AUTO, 0, codes.InvalidArgument, `no tensor named "model.layers.0.mlp.experts.down_proj_bias"`},
		{"odd 2N", "oddshape", pb.NamingPreset_NAMING_PRESET_AUTO, 0, codes.InvalidArgument, "want [E, K, 2N]"},
		{"no gate_up_proj", "nogateup", pb.NamingPreset_NAMING_PRESET_AUTO, 0, codes.InvalidArgument, `no tensor named "model.layers.0.mlp.experts.gate_up_proj"`},
		{"dense layer", "good", pb.NamingPreset_NAMING_PRESET_AUTO, 0, codes.NotFound, "no tensor of layer 5"},
		{"negative limit", "good", pb.NamingPreset_NAMING_PRESET_GPT_OSS, -2, codes.InvalidArgument, "safetensors.swiglu_limit"},
		{"limit without SWIGLU_OAI", "qwen", pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, 3, codes.InvalidArgument, "safetensors.swiglu_limit: 3: only valid with ACTIVATION_SWIGLU_OAI"},
	}
	c, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: root}, &fakeBackend{})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			layer := int32(0)
			if tt.name == "dense layer" {
				layer = 5
			}
			_, err := loadSafetensors(t, c, &pb.LoadExpertsRequest_SafetensorsSource{Name: "x", Path: tt.path, Layer: layer, Preset: tt.preset, SwigluLimit: tt.limit})
			if status.Code(err) != tt.code || !strings.Contains(status.Convert(err).Message(), tt.want) {
				t.Errorf("got %v, want %v containing %q", err, tt.code, tt.want)
			}
		})
	}
	if _, err := loadSafetensors(t, c, &pb.LoadExpertsRequest_SafetensorsSource{Name: "ok", Path: "good", Preset: pb.NamingPreset_NAMING_PRESET_AUTO}); err != nil {
		t.Errorf("the good checkpoint after the bad ones: %v", err)
	}
}
