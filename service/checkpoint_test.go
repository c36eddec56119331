package service_test

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/google/go-cmp/cmp"

	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// ckForm is how a synthetic checkpoint scales its weights.
type ckForm int

const (
	ckBlock   ckForm = iota // DeepSeek/Qwen FP8: BF16 weight_scale_inv tile grids
	ckChannel               // compressed-tensors: F32 weight_scale [rows, 1]
	ckScalar                // ModelOpt: F32 weight_scale and input_scale scalars
)

// ckLayer describes one MoE layer written in a real checkpoint's layout.
type ckLayer struct {
	e, k, n int
	// expert names expert x's projection p ("gate", "up", "down"), without
	// ".weight".
	expert func(layer, x int, p string) string
	gated  bool
	form   ckForm
	block  [2]int
}

// write adds layer's tensors to ts and returns the ExpertWeights a chunked
// upload of the same layer sends.
func (c ckLayer) write(rng *rand.Rand, ts map[string]stTensor, layer int) *pb.ExpertWeights {
	e, k, n := c.e, c.k, c.n
	projs := []string{"up", "down"}
	if c.gated {
		projs = []string{"gate", "up", "down"}
	}
	var w13, w2 []byte
	var s13, s2, a13, a2 []float32
	for x := range e {
		var in13 float32
		for _, p := range projs {
			rows, cols := n, k
			if p == "down" {
				rows, cols = k, n
			}
			name := c.expert(layer, x, p)
			w := fp8Bytes(rng, rows*cols)
			ts[name+".weight"] = stTensor{"F8_E4M3", []int64{int64(rows), int64(cols)}, w}
			var sc []float32
			switch c.form {
			case ckBlock:
				rb, cb := (rows+c.block[0]-1)/c.block[0], (cols+c.block[1]-1)/c.block[1]
				sc = bf16Exact(positive(rng, rb*cb))
				ts[name+".weight_scale_inv"] = stTensor{"BF16", []int64{int64(rb), int64(cb)}, bf16Bytes(sc)}
			case ckChannel:
				sc = positive(rng, rows)
				ts[name+".weight_scale"] = stTensor{"F32", []int64{int64(rows), 1}, f32Bytes(sc)}
			case ckScalar:
				sc = positive(rng, 1)
				in := positive(rng, 1)[0]
				ts[name+".weight_scale"] = scalarF32(sc[0])
				ts[name+".input_scale"] = scalarF32(in)
				if p == "down" {
					a2 = append(a2, in)
				} else {
					in13 = max(in13, in)
				}
			}
			if p == "down" {
				w2, s2 = append(w2, w...), append(s2, sc...)
			} else {
				w13, s13 = append(w13, w...), append(s13, sc...)
			}
		}
		if c.form == ckScalar {
			a13 = append(a13, in13)
		}
	}
	r := n
	if c.gated {
		r = 2 * n
	}
	want := &pb.ExpertWeights{
		Activation: pb.Activation_ACTIVATION_RELU2,
		W13:        fp8T(w13, int64(e), int64(r), int64(k)),
		W2:         fp8T(w2, int64(e), int64(k), int64(n)),
	}
	if c.gated {
		want.Activation = pb.Activation_ACTIVATION_SILU_GATED
	}
	switch c.form {
	case ckBlock:
		want.W13Scale = f32Tensor(s13, int64(e), int64((r+c.block[0]-1)/c.block[0]), int64((k+c.block[1]-1)/c.block[1]))
		want.W2Scale = f32Tensor(s2, int64(e), int64((k+c.block[0]-1)/c.block[0]), int64((n+c.block[1]-1)/c.block[1]))
		want.WeightBlockShape = []int32{int32(c.block[0]), int32(c.block[1])}
	case ckChannel:
		want.W13Scale, want.W2Scale = f32Tensor(s13, int64(e), int64(r)), f32Tensor(s2, int64(e), int64(k))
	case ckScalar:
		if c.gated { // gate and up scaled differently: per channel
			var ch []float32
			for x := range e {
				for range n {
					ch = append(ch, s13[2*x])
				}
				for range n {
					ch = append(ch, s13[2*x+1])
				}
			}
			want.W13Scale = f32Tensor(ch, int64(e), int64(r))
		} else {
			want.W13Scale = f32Tensor(s13, int64(e))
		}
		want.W2Scale = f32Tensor(s2, int64(e))
		want.A13Scale, want.A2Scale = f32Tensor(a13, int64(e)), f32Tensor(a2, int64(e))
	}
	return want
}

func bf16Exact(v []float32) []float32 {
	return bf16Floats(bf16Bytes(v))
}

func bf16Floats(b []byte) []float32 {
	v := make([]float32, len(b)/2)
	for i := range v {
		v[i] = math.Float32frombits((uint32(b[2*i]) | uint32(b[2*i+1])<<8) << 16)
	}
	return v
}

// writeCheckpoint writes ts as a Hugging Face checkpoint directory: with
// shards > 1, tensors spread round-robin (in name order) over
// model-0000i-of-0000n.safetensors with model.safetensors.index.json;
// with 1, a single model.safetensors. config is written as config.json
// when not nil.
func writeCheckpoint(t testing.TB, dir string, ts map[string]stTensor, shards int, config map[string]any) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if config != nil {
		js, _ := json.Marshal(config)
		if err := os.WriteFile(filepath.Join(dir, "config.json"), js, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if shards == 1 {
		writeSafetensors(t, filepath.Join(dir, "model.safetensors"), ts, nil)
		return
	}
	names := make([]string, 0, len(ts))
	for n := range ts {
		names = append(names, n)
	}
	slices.Sort(names)
	parts := make([]map[string]stTensor, shards)
	weightMap := map[string]string{}
	for i, n := range names {
		s := i % shards
		if parts[s] == nil {
			parts[s] = map[string]stTensor{}
		}
		parts[s][n] = ts[n]
		weightMap[n] = fmt.Sprintf("model-%05d-of-%05d.safetensors", s+1, shards)
	}
	for s, p := range parts {
		writeSafetensors(t, filepath.Join(dir, fmt.Sprintf("model-%05d-of-%05d.safetensors", s+1, shards)), p, nil)
	}
	js, _ := json.Marshal(map[string]any{"metadata": map[string]any{"total_size": 0}, "weight_map": weightMap})
	if err := os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), js, 0o644); err != nil {
		t.Fatal(err)
	}
}

func hfExpert(prefix, mlp string, names map[string]string) func(layer, x int, p string) string {
	return func(layer, x int, p string) string {
		return fmt.Sprintf("%slayers.%d.%s.experts.%d.%s", prefix, layer, mlp, x, names[p])
	}
}

var (
	projNames    = map[string]string{"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
	mixtralNames = map[string]string{"gate": "w1", "up": "w3", "down": "w2"}
)

// TestLoadCheckpoint loads a sharded checkpoint directory of each real
// layout and checks the set is the one a chunked upload of the same
// weights gives (equal fingerprints), and the routing is config.json's.
func TestLoadCheckpoint(t *testing.T) {
	rng := newRand(t)
	root := t.TempDir()
	const e, k, n = 4, 32, 16
	bias := positive(rng, e)
	biasBF := bf16Exact(bias)
	tests := []struct {
		name    string
		dir     string
		layer   ckLayer
		shards  int
		config  map[string]any
		src     *pb.LoadExpertsRequest_SafetensorsSource
		extra   map[string]stTensor
		routing *pb.Routing
	}{
		{
			name:  "deepseek-v3",
			layer: ckLayer{e: e, k: k, n: n, gated: true, form: ckBlock, block: [2]int{8, 16}, expert: hfExpert("model.", "mlp", projNames)},
			config: map[string]any{"model_type": "deepseek_v3", "n_routed_experts": e, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
				"routed_scaling_factor": 2.5, "norm_topk_prob": true, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu",
				"quantization_config": map[string]any{"quant_method": "fp8", "weight_block_size": []int{8, 16}}},
			shards: 3,
			src:    &pb.LoadExpertsRequest_SafetensorsSource{Preset: pb.NamingPreset_NAMING_PRESET_AUTO},
			extra:  map[string]stTensor{"model.layers.1.mlp.gate.e_score_correction_bias": {"BF16", []int64{e}, bf16Bytes(bias)}},
			routing: &pb.Routing{TopK: 2, Renormalize: true, Scoring: pb.Scoring_SCORING_SIGMOID, NumExpertGroups: 2, TopkGroups: 1,
				RoutedScalingFactor: 2.5, CorrectionBias: f32Tensor(biasBF, e)},
		},
		{
			name:  "qwen3-vl",
			layer: ckLayer{e: e, k: k, n: n, gated: true, form: ckBlock, block: [2]int{16, 16}, expert: hfExpert("model.language_model.", "mlp", projNames)},
			config: map[string]any{"model_type": "qwen3_vl_moe",
				"text_config":         map[string]any{"model_type": "qwen3_vl_moe_text", "num_experts": e, "num_experts_per_tok": 2, "norm_topk_prob": true, "hidden_act": "silu"},
				"quantization_config": map[string]any{"weight_block_size": []int{16, 16}}},
			shards:  2,
			src:     &pb.LoadExpertsRequest_SafetensorsSource{Preset: pb.NamingPreset_NAMING_PRESET_AUTO},
			routing: &pb.Routing{TopK: 2, Renormalize: true, Scoring: pb.Scoring_SCORING_SOFTMAX},
		},
		{
			name:    "qwen3-moe-prefix",
			layer:   ckLayer{e: e, k: k, n: n, gated: true, form: ckChannel, expert: hfExpert("model.language_model.", "mlp", projNames)},
			config:  map[string]any{"model_type": "qwen3_moe", "num_experts": e, "num_experts_per_tok": 3},
			shards:  4,
			src:     &pb.LoadExpertsRequest_SafetensorsSource{Preset: pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, TensorPrefix: "model.language_model."},
			routing: &pb.Routing{TopK: 3, Scoring: pb.Scoring_SCORING_SOFTMAX},
		},
		{
			name:    "mixtral-compressed-tensors",
			layer:   ckLayer{e: e, k: k, n: n, gated: true, form: ckChannel, expert: hfExpert("model.", "block_sparse_moe", mixtralNames)},
			config:  map[string]any{"model_type": "mixtral", "num_local_experts": e, "num_experts_per_tok": 2, "hidden_act": "silu"},
			shards:  1,
			src:     &pb.LoadExpertsRequest_SafetensorsSource{Preset: pb.NamingPreset_NAMING_PRESET_MIXTRAL},
			routing: &pb.Routing{TopK: 2, Renormalize: true, Scoring: pb.Scoring_SCORING_SOFTMAX},
		},
		{
			name:  "mixtral-modelopt",
			layer: ckLayer{e: e, k: k, n: n, gated: true, form: ckScalar, expert: hfExpert("model.", "block_sparse_moe", mixtralNames)},
			// No config.json: the set loads, with no routing.
			shards: 2,
			src:    &pb.LoadExpertsRequest_SafetensorsSource{Preset: pb.NamingPreset_NAMING_PRESET_MIXTRAL},
		},
		{
			name:  "nemotron-h",
			layer: ckLayer{e: e, k: k, n: n, form: ckScalar, expert: hfExpert("backbone.", "mixer", projNames)},
			config: map[string]any{"model_type": "nemotron_h", "n_routed_experts": e, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
				"routed_scaling_factor": 2.5, "norm_topk_prob": true, "mlp_hidden_act": "relu2"},
			shards: 3,
			src:    &pb.LoadExpertsRequest_SafetensorsSource{Preset: pb.NamingPreset_NAMING_PRESET_AUTO},
			extra:  map[string]stTensor{"backbone.layers.1.mixer.gate.e_score_correction_bias": {"F32", []int64{e}, f32Bytes(bias)}},
			routing: &pb.Routing{TopK: 2, Renormalize: true, Scoring: pb.Scoring_SCORING_SIGMOID, NumExpertGroups: 1, TopkGroups: 1,
				RoutedScalingFactor: 2.5, CorrectionBias: f32Tensor(bias, e)},
		},
		{
			name:   "custom-templates",
			layer:  ckLayer{e: e, k: k, n: n, gated: true, form: ckScalar, expert: hfExpert("lm.", "moe", map[string]string{"gate": "wg", "up": "wu", "down": "wd"})},
			shards: 2,
			src: &pb.LoadExpertsRequest_SafetensorsSource{Preset: pb.NamingPreset_NAMING_PRESET_CUSTOM, Activation: pb.Activation_ACTIVATION_SILU_GATED,
				GateTemplate: "lm.layers.{L}.moe.experts.{e}.wg.weight", UpTemplate: "lm.layers.{L}.moe.experts.{e}.wu.weight",
				W2Template:        "lm.layers.{L}.moe.experts.{e}.wd.weight",
				GateScaleTemplate: "lm.layers.{L}.moe.experts.{e}.wg.weight_scale", UpScaleTemplate: "lm.layers.{L}.moe.experts.{e}.wu.weight_scale",
				W2ScaleTemplate:       "lm.layers.{L}.moe.experts.{e}.wd.weight_scale",
				W13InputScaleTemplate: "lm.layers.{L}.moe.experts.{e}.wg.input_scale", W2InputScaleTemplate: "lm.layers.{L}.moe.experts.{e}.wd.input_scale"},
		},
	}
	wants := make([]*pb.ExpertWeights, len(tests))
	for i, tt := range tests {
		ts := map[string]stTensor{}
		// Layer 0 is a decoy, and layer 1 the one loaded.
		tt.layer.write(rng, ts, 0)
		wants[i] = tt.layer.write(rng, ts, 1)
		for name, x := range tt.extra {
			ts[name] = x
		}
		if tt.name == "custom-templates" {
			// One template names GEMM1's input scale; give gate's the value
			// an upload takes (the max of gate's and up's).
			a := wants[i].GetA13Scale().GetData()
			for x := range tt.layer.e {
				ts[tt.layer.expert(1, x, "gate")+".input_scale"] = stTensor{"F32", []int64{}, a[4*x : 4*x+4]}
			}
		}
		writeCheckpoint(t, filepath.Join(root, tt.name), ts, tt.shards, tt.config)
	}

	c, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: root}, &fakeBackend{})
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.src.Name, tt.src.Path, tt.src.Layer = tt.name, tt.name, 1
			got, err := loadSafetensors(t, c, tt.src)
			if err != nil {
				t.Fatalf("LoadExperts(checkpoint): %v", err)
			}
			if want := fingerprintOf(wants[i]); got.GetFingerprint() != want {
				t.Errorf("fingerprint %s, want %s (the chunked upload's)", got.GetFingerprint(), want)
			}
			if got.GetNumExperts() != e || got.GetHiddenSize() != k || got.GetIntermediateSize() != n || got.GetActivation() != wants[i].GetActivation() {
				t.Errorf("E, K, N, act = %d, %d, %d, %v; want %d, %d, %d, %v", got.GetNumExperts(), got.GetHiddenSize(), got.GetIntermediateSize(), got.GetActivation(), e, k, n, wants[i].GetActivation())
			}
			if !slices.Equal(got.GetWeightBlockShape(), wants[i].GetWeightBlockShape()) {
				t.Errorf("weight_block_shape %v, want %v", got.GetWeightBlockShape(), wants[i].GetWeightBlockShape())
			}
			if diff := cmp.Diff(tt.routing, got.GetRouting(), protocmp.Transform()); diff != "" {
				t.Errorf("routing (-want +got):\n%s", diff)
			}
			if tt.routing != nil && got.GetTopKHint() != tt.routing.GetTopK() {
				t.Errorf("top_k_hint %d, want %d", got.GetTopKHint(), tt.routing.GetTopK())
			}
		})
	}
	// A set loaded this way serves with the routing it reports.
	info := &pb.ExpertSetInfo{}
	list, err := c.ListExperts(testContext(t), &pb.ListExpertsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range list.GetExpertSets() {
		if s.GetName() == "deepseek-v3" {
			info = s
		}
	}
	_, err = c.FusedMoE(testContext(t), &pb.FusedMoERequest{Experts: &pb.FusedMoERequest_ExpertSet{ExpertSet: "deepseek-v3"},
		HiddenStates: f32Tensor(randn(rng, 2*k, 1), 2, k), RouterLogits: f32Tensor(randn(rng, 2*e, 1), 2, e), Routing: info.GetRouting()})
	if err != nil {
		t.Fatalf("FusedMoE with the checkpoint's routing: %v", err)
	}
}

// TestLoadCheckpointReadsOnlyTheLayersShards puts another layer in a shard
// that is not a safetensors file at all: loading layer 1 never opens it.
func TestLoadCheckpointReadsOnlyTheLayersShards(t *testing.T) {
	rng := newRand(t)
	root := t.TempDir()
	dir := filepath.Join(root, "ck")
	l := ckLayer{e: 2, k: 16, n: 16, gated: true, form: ckChannel, expert: hfExpert("model.", "mlp", projNames)}
	ts := map[string]stTensor{}
	want := l.write(rng, ts, 1)
	writeCheckpoint(t, dir, ts, 2, map[string]any{"model_type": "qwen3_moe", "num_experts": 2, "num_experts_per_tok": 1})
	var index map[string]map[string]string
	b, _ := os.ReadFile(filepath.Join(dir, "model.safetensors.index.json"))
	json.Unmarshal(b, &index)
	index["weight_map"]["model.layers.0.mlp.experts.0.gate_proj.weight"] = "model-00099-of-00099.safetensors"
	b, _ = json.Marshal(index)
	os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), b, 0o644)
	os.WriteFile(filepath.Join(dir, "model-00099-of-00099.safetensors"), []byte("not safetensors"), 0o644)

	c, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: root}, &fakeBackend{})
	got, err := loadSafetensors(t, c, &pb.LoadExpertsRequest_SafetensorsSource{Name: "l1", Path: "ck", Layer: 1, Preset: pb.NamingPreset_NAMING_PRESET_AUTO})
	if err != nil {
		t.Fatalf("loading layer 1: %v", err)
	}
	if got.GetFingerprint() != fingerprintOf(want) {
		t.Errorf("fingerprint %s, want %s", got.GetFingerprint(), fingerprintOf(want))
	}
	// Layer 0's shard is read, and refused, when asked for.
	_, err = loadSafetensors(t, c, &pb.LoadExpertsRequest_SafetensorsSource{Name: "l0", Path: "ck", Layer: 0, Preset: pb.NamingPreset_NAMING_PRESET_AUTO})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "model-00099-of-00099.safetensors") {
		t.Errorf("loading layer 0 from a broken shard: %v, want InvalidArgument naming the shard", err)
	}
}

// TestLoadCheckpointErrors: every bad checkpoint is refused with a status
// naming the field, and leaves nothing loaded.
func TestLoadCheckpointErrors(t *testing.T) {
	rng := newRand(t)
	root := t.TempDir()
	outside := t.TempDir()
	l := ckLayer{e: 2, k: 16, n: 16, gated: true, form: ckChannel, expert: hfExpert("model.", "mlp", projNames)}
	good := map[string]stTensor{}
	l.write(rng, good, 0)
	qwen := map[string]any{"model_type": "qwen3_moe", "num_experts": 2, "num_experts_per_tok": 1}
	writeCheckpoint(t, filepath.Join(root, "good"), good, 2, qwen)
	writeCheckpoint(t, filepath.Join(root, "badact"), good, 1, map[string]any{"model_type": "qwen3_moe", "hidden_act": "gelu"})
	writeCheckpoint(t, filepath.Join(root, "unknown"), good, 1, map[string]any{"model_type": "llama"})
	writeCheckpoint(t, filepath.Join(root, "badtopk"), good, 1, map[string]any{"model_type": "qwen3_moe", "num_experts_per_tok": 9})
	writeCheckpoint(t, filepath.Join(root, "badscore"), good, 1, map[string]any{"model_type": "qwen3_moe", "num_experts_per_tok": 1, "scoring_func": "tanh"})
	index := func(dir string, wm map[string]string) {
		os.MkdirAll(filepath.Join(root, dir), 0o755)
		b, _ := json.Marshal(map[string]any{"weight_map": wm})
		os.WriteFile(filepath.Join(root, dir, "model.safetensors.index.json"), b, 0o644)
	}
	name := "model.layers.0.mlp.experts.0.gate_proj.weight"
	index("escape", map[string]string{name: "../good/model-00001-of-00002.safetensors"})
	index("missing", map[string]string{name: "model-00001-of-00001.safetensors"})
	index("longshard", map[string]string{name: strings.Repeat("x/", 5000)})
	writeCheckpoint(t, filepath.Join(outside, "ck"), good, 1, nil)
	os.MkdirAll(filepath.Join(root, "symlinked"), 0o755)
	os.Symlink(filepath.Join(outside, "ck", "model.safetensors"), filepath.Join(root, "symlinked", "model.safetensors"))
	index("wrongshard", map[string]string{name: "model-00002-of-00002.safetensors"})
	for _, f := range []string{"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} {
		b, _ := os.ReadFile(filepath.Join(root, "good", f))
		os.WriteFile(filepath.Join(root, "wrongshard", f), b, 0o644)
	}
	// wrongshard's index points the gate weight at the shard not holding it.
	os.MkdirAll(filepath.Join(root, "badjson"), 0o755)
	os.WriteFile(filepath.Join(root, "badjson", "config.json"), []byte("{"), 0o644)

	tests := []struct {
		name, path string
		preset     pb.NamingPreset
		layer      int32
		code       codes.Code
		want       string
	}{
		{"activation", "badact", pb.NamingPreset_NAMING_PRESET_AUTO, 0, codes.InvalidArgument, `activation "gelu"`},
		{"model type", "unknown", pb.NamingPreset_NAMING_PRESET_AUTO, 0, codes.InvalidArgument, `model_type "llama"`},
		{"top_k beyond E", "badtopk", pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, 0, codes.InvalidArgument, "routing.top_k"},
		{"scoring", "badscore", pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, 0, codes.InvalidArgument, `scoring_func "tanh"`},
		{"shard outside", "escape", pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, 0, codes.InvalidArgument, "want a file name in the checkpoint directory"},
		{"long shard name", "longshard", pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, 0, codes.InvalidArgument, "want a file name in the checkpoint directory"},
		{"missing shard", "missing", pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, 0, codes.NotFound, "no such file"},
		{"symlinked shard", "symlinked", pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, 0, codes.InvalidArgument, "outside the weights directory"},
		{"wrong shard", "wrongshard", pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, 0, codes.InvalidArgument, "does not hold it"},
		{"no such layer", "good", pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, 7, codes.NotFound, "no tensor of layer 7"},
		{"bad config", "badjson", pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, 0, codes.InvalidArgument, "config.json"},
		{"auto on a file", "good/model-00001-of-00002.safetensors", pb.NamingPreset_NAMING_PRESET_AUTO, 0, codes.InvalidArgument, "NAMING_PRESET_AUTO needs"},
	}
	c, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: root}, &fakeBackend{})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := loadSafetensors(t, c, &pb.LoadExpertsRequest_SafetensorsSource{Name: "x", Path: tt.path, Layer: tt.layer, Preset: tt.preset})
			if status.Code(err) != tt.code || !strings.Contains(status.Convert(err).Message(), tt.want) {
				t.Errorf("got %v, want %v containing %q", err, tt.code, tt.want)
			}
			// Names from files are bounded before they reach a message.
			if n := len(status.Convert(err).Message()); n > 1024 {
				t.Errorf("message of %d bytes, want at most 1024", n)
			}
		})
	}
	list, _ := c.ListExperts(testContext(t), &pb.ListExpertsRequest{})
	if len(list.GetExpertSets()) != 0 {
		t.Errorf("%d sets loaded after failed loads, want none", len(list.GetExpertSets()))
	}
	if _, err := loadSafetensors(t, c, &pb.LoadExpertsRequest_SafetensorsSource{Name: "ok", Path: "good", Preset: pb.NamingPreset_NAMING_PRESET_AUTO}); err != nil {
		t.Errorf("the good checkpoint after the bad ones: %v", err)
	}
}

// TestLoadCheckpointDefaults: where config.json is silent, the routing is
// what the model type's own transformers config class and router give
// (DeepseekV3Config: n_group 8, topk_group 4, routed_scaling_factor 2.5;
// Qwen3-VL-MoE's router renormalizes always; Qwen3NextConfig's
// norm_topk_prob is True; Glm4MoeConfig routes like DeepSeek-V3 with one
// group and no scaling), not Qwen3's defaults.
func TestLoadCheckpointDefaults(t *testing.T) {
	rng := newRand(t)
	root := t.TempDir()
	const e, k, n = 8, 16, 16
	bias := bf16Exact(positive(rng, e))
	biasT := map[string]stTensor{"model.layers.0.mlp.gate.e_score_correction_bias": {"BF16", []int64{e}, bf16Bytes(bias)}}
	dsv3 := &pb.Routing{TopK: 2, Renormalize: true, Scoring: pb.Scoring_SCORING_SIGMOID, NumExpertGroups: 8, TopkGroups: 4,
		RoutedScalingFactor: 2.5, CorrectionBias: f32Tensor(bias, e)}
	tests := []struct {
		name   string
		prefix string
		config map[string]any
		extra  map[string]stTensor
		want   *pb.Routing
	}{
		{"deepseek-v3", "model.", map[string]any{"model_type": "deepseek_v3", "n_routed_experts": e, "num_experts_per_tok": 2}, biasT, dsv3},
		{"kimi-k2", "model.", map[string]any{"model_type": "kimi_k2", "n_routed_experts": e, "num_experts_per_tok": 2, "topk_method": "noaux_tc"}, biasT, dsv3},
		{"nemotron-h", "backbone.", map[string]any{"model_type": "nemotron_h", "n_routed_experts": e, "num_experts_per_tok": 2},
			map[string]stTensor{"backbone.layers.0.mixer.gate.e_score_correction_bias": {"BF16", []int64{e}, bf16Bytes(bias)}},
			&pb.Routing{TopK: 2, Renormalize: true, Scoring: pb.Scoring_SCORING_SIGMOID, NumExpertGroups: 1, TopkGroups: 1, RoutedScalingFactor: 1,
				CorrectionBias: f32Tensor(bias, e)}},
		{"qwen3-vl", "model.language_model.", map[string]any{"model_type": "qwen3_vl_moe",
			"text_config": map[string]any{"num_experts": e, "num_experts_per_tok": 2}}, nil,
			&pb.Routing{TopK: 2, Renormalize: true, Scoring: pb.Scoring_SCORING_SOFTMAX}},
		// Its router renormalizes whatever the key says.
		{"qwen3-vl-norm-false", "model.language_model.", map[string]any{"model_type": "qwen3_vl_moe",
			"text_config": map[string]any{"num_experts": e, "num_experts_per_tok": 2, "norm_topk_prob": false}}, nil,
			&pb.Routing{TopK: 2, Renormalize: true, Scoring: pb.Scoring_SCORING_SOFTMAX}},
		{"qwen3-moe", "model.", map[string]any{"model_type": "qwen3_moe", "num_experts": e, "num_experts_per_tok": 2}, nil,
			&pb.Routing{TopK: 2, Scoring: pb.Scoring_SCORING_SOFTMAX}},
		{"mixtral", "model.", map[string]any{"model_type": "mixtral", "num_local_experts": e, "num_experts_per_tok": 2}, nil,
			&pb.Routing{TopK: 2, Renormalize: true, Scoring: pb.Scoring_SCORING_SOFTMAX}},
		{"qwen3-next", "model.", map[string]any{"model_type": "qwen3_next", "num_experts": e, "num_experts_per_tok": 2}, nil,
			&pb.Routing{TopK: 2, Renormalize: true, Scoring: pb.Scoring_SCORING_SOFTMAX}},
		{"glm4-moe", "model.", map[string]any{"model_type": "glm4_moe", "n_routed_experts": e, "num_experts_per_tok": 2}, biasT,
			&pb.Routing{TopK: 2, Renormalize: true, Scoring: pb.Scoring_SCORING_SIGMOID, NumExpertGroups: 1, TopkGroups: 1,
				RoutedScalingFactor: 1, CorrectionBias: f32Tensor(bias, e)}},
	}
	for _, tt := range tests {
		ts := map[string]stTensor{}
		mlp, names := "mlp", projNames
		switch tt.prefix {
		case "backbone.":
			mlp = "mixer"
		}
		gated := tt.prefix != "backbone."
		if tt.name == "mixtral" {
			mlp, names = "block_sparse_moe", mixtralNames
		}
		ckLayer{e: e, k: k, n: n, gated: gated, form: ckChannel, expert: hfExpert(tt.prefix, mlp, names)}.write(rng, ts, 0)
		maps.Copy(ts, tt.extra)
		writeCheckpoint(t, filepath.Join(root, tt.name), ts, 2, tt.config)
	}
	c, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: root}, &fakeBackend{})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := loadSafetensors(t, c, &pb.LoadExpertsRequest_SafetensorsSource{Name: tt.name, Path: tt.name, Preset: pb.NamingPreset_NAMING_PRESET_AUTO})
			if err != nil {
				t.Fatalf("LoadExperts: %v", err)
			}
			if diff := cmp.Diff(tt.want, got.GetRouting(), protocmp.Transform()); diff != "" {
				t.Errorf("routing (-want +got):\n%s", diff)
			}
		})
	}
}

// TestLoadCheckpointF16Scales: FP8 releases that store their block scales
// as F16 load as the same set as with BF16 scales of the same values.
func TestLoadCheckpointF16Scales(t *testing.T) {
	rng := newRand(t)
	root := t.TempDir()
	l := ckLayer{e: 2, k: 32, n: 16, gated: true, form: ckBlock, block: [2]int{8, 16}, expert: hfExpert("model.", "mlp", projNames)}
	ts := map[string]stTensor{}
	want := l.write(rng, ts, 0)
	for name, x := range ts {
		if strings.HasSuffix(name, ".weight_scale_inv") {
			// BF16 values of this range are exact in F16.
			v := bf16Floats(x.data)
			h := make([]byte, 2*len(v))
			for i, f := range v {
				binary.LittleEndian.PutUint16(h[2*i:], scaling.Float32ToFP16(f))
			}
			ts[name] = stTensor{"F16", x.shape, h}
		}
	}
	writeCheckpoint(t, filepath.Join(root, "ck"), ts, 2, map[string]any{"model_type": "qwen3_moe", "num_experts": 2,
		"quantization_config": map[string]any{"weight_block_size": []int{8, 16}}})
	c, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: root}, &fakeBackend{})
	got, err := loadSafetensors(t, c, &pb.LoadExpertsRequest_SafetensorsSource{Name: "ck", Path: "ck", Preset: pb.NamingPreset_NAMING_PRESET_AUTO})
	if err != nil {
		t.Fatalf("LoadExperts with F16 scales: %v", err)
	}
	if got.GetFingerprint() != fingerprintOf(want) {
		t.Errorf("fingerprint %s, want %s (the chunked upload's)", got.GetFingerprint(), fingerprintOf(want))
	}
}

// TestLoadShardPart: one shard of a checkpoint holding experts 0 and 1 of
// config.json's 4 loads as a set of 2 when the caller asks for 2 with
// num_experts (refused without: see checkpointBadInput).
func TestLoadShardPart(t *testing.T) {
	rng := newRand(t)
	root := t.TempDir()
	dir := filepath.Join(root, "ck")
	ts := map[string]stTensor{}
	want := ckLayer{e: 2, k: 16, n: 16, gated: true, form: ckChannel, expert: hfExpert("model.", "mlp", projNames)}.write(rng, ts, 0)
	writeCheckpoint(t, dir, ts, 1, map[string]any{"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2})
	writeSafetensors(t, filepath.Join(dir, "part.safetensors"), ts, nil)
	c, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: root}, &fakeBackend{})
	got, err := loadSafetensors(t, c, &pb.LoadExpertsRequest_SafetensorsSource{Name: "part", Path: "ck/part.safetensors",
		Preset: pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, NumExperts: 2})
	if err != nil {
		t.Fatalf("LoadExperts of experts 0-1 with num_experts 2: %v", err)
	}
	if got.GetNumExperts() != 2 || got.GetFingerprint() != fingerprintOf(want) {
		t.Errorf("E %d, fingerprint %s; want 2, %s", got.GetNumExperts(), got.GetFingerprint(), fingerprintOf(want))
	}
}
