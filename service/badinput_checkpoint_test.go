package service_test

import (
	"context"
	"encoding/json"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"

	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
)

// checkpointBadInput writes corrupt checkpoint directories into a weights
// directory and returns the LoadExperts calls on them, each with the
// answer that names what is wrong: a corrupt index, config.json values
// of the wrong type, out of range or inconsistent, a missing correction
// bias, files over their cap, and one shard of a checkpoint loaded alone.
func checkpointBadInput(t *testing.T, rng *rand.Rand) []badCall {
	root := t.TempDir()
	cfg := service.Config{WeightsDir: root}
	const e = 4
	ts := map[string]stTensor{}
	ckLayer{e: e, k: 16, n: 16, gated: true, form: ckChannel, expert: hfExpert("model.", "mlp", projNames)}.write(rng, ts, 0)
	vl := map[string]stTensor{}
	ckLayer{e: e, k: 16, n: 16, gated: true, form: ckChannel, expert: hfExpert("model.language_model.", "mlp", projNames)}.write(rng, vl, 0)

	with := func(base map[string]any, kv ...any) map[string]any {
		c := maps.Clone(base)
		for i := 0; i < len(kv); i += 2 {
			c[kv[i].(string)] = kv[i+1]
		}
		return c
	}
	qwen := map[string]any{"model_type": "qwen3_moe", "num_experts": e, "num_experts_per_tok": 2}
	dsv3 := map[string]any{"model_type": "deepseek_v3", "n_routed_experts": e, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
		"routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
	bias := map[string]stTensor{"model.layers.0.mlp.gate.e_score_correction_bias": {"F32", []int64{e}, f32Bytes(positive(rng, e))}}
	withBias := maps.Clone(ts)
	maps.Copy(withBias, bias)

	call := func(path string, preset pb.NamingPreset) func(ctx context.Context, c pb.ExpertServiceClient) error {
		return func(ctx context.Context, c pb.ExpertServiceClient) error {
			stream, err := c.LoadExperts(ctx)
			if err != nil {
				return err
			}
			src := &pb.LoadExpertsRequest_SafetensorsSource{Name: "ck", Path: path, Preset: preset}
			if err := stream.Send(&pb.LoadExpertsRequest{Payload: &pb.LoadExpertsRequest_Safetensors{Safetensors: src}}); err != nil {
				return err
			}
			_, err = stream.CloseAndRecv()
			return err
		}
	}
	var cases []badCall
	add := func(name, path string, wantCode codes.Code, wantMsg string) {
		cases = append(cases, badCall{"LoadExperts/checkpoint/" + name, cfg, call(path, pb.NamingPreset_NAMING_PRESET_AUTO), wantCode, wantMsg})
	}
	// badConfig writes a checkpoint of tensors with config and adds the
	// call that must be refused with a message containing want.
	badConfig := func(name string, tensors map[string]stTensor, config any, want string) {
		dir := filepath.Join(root, name)
		writeCheckpoint(t, dir, tensors, 2, nil)
		js, err := json.Marshal(config)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "config.json"), js, 0o644); err != nil {
			t.Fatal(err)
		}
		add(name, name, codes.InvalidArgument, `safetensors.path: "`+name+`/config.json": `+want)
	}

	// An index without a weight_map is not "no experts in this layer"
	// (NotFound, which loaders of every layer skip).
	for name, index := range map[string]string{"null index": "null", "index without weight_map": `{"metadata":{}}`,
		"empty weight_map": `{"weight_map":{}}`, "null weight_map": `{"weight_map":null}`} {
		dir := filepath.Join(root, name)
		writeCheckpoint(t, dir, ts, 2, qwen)
		if err := os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), []byte(index), 0o644); err != nil {
			t.Fatal(err)
		}
		add(name, name, codes.InvalidArgument, `safetensors.path: "`+name+`/model.safetensors.index.json": weight_map is missing or empty`)
	}

	badConfig("noaux_tc without bias", ts, dsv3, "topk_method noaux_tc needs the tensor \"model.layers.0.mlp.gate.e_score_correction_bias\"")
	badConfig("topk_method greedy", withBias, with(dsv3, "topk_method", "greedy"), `topk_method "greedy": want noaux_tc`)
	badConfig("num_experts -1", ts, with(qwen, "num_experts", -1), "num_experts -1: want in [1, 65536]")
	badConfig("num_experts 0", ts, with(qwen, "num_experts", 0), "num_experts 0: want in [1, 65536]")
	badConfig("num_experts string", ts, with(qwen, "num_experts", "4"), "num_experts: a JSON string, want int")
	badConfig("num_experts fraction", ts, with(qwen, "num_experts", 4.5), "num_experts: a JSON number 4.5, want int")
	badConfig("expert counts disagree", ts, with(qwen, "num_local_experts", 8), "num_local_experts 8 disagrees with num_experts 4")
	badConfig("n_routed_experts 0", withBias, with(dsv3, "n_routed_experts", 0), "n_routed_experts 0: want in [1, 65536]")
	badConfig("num_experts_per_tok 0", ts, with(qwen, "num_experts_per_tok", 0), "num_experts_per_tok 0: want in [1, 4]")
	badConfig("num_experts_per_tok over E", ts, with(qwen, "num_experts_per_tok", 5), "num_experts_per_tok 5: want in [1, 4]")
	badConfig("text_config num_experts_per_tok 0", vl, map[string]any{"model_type": "qwen3_vl_moe",
		"text_config": map[string]any{"model_type": "qwen3_vl_moe_text", "num_experts": e, "num_experts_per_tok": 0}},
		"text_config.num_experts_per_tok 0: want in [1, 4]")
	badConfig("text_config not an object", vl, map[string]any{"model_type": "qwen3_vl_moe", "text_config": "x"}, "text_config: a JSON string")
	badConfig("n_group -2", withBias, with(dsv3, "n_group", -2), "n_group -2: want in [1, 65536]")
	badConfig("n_group not dividing E", withBias, with(dsv3, "n_group", 3), "n_group 3 does not divide the 4 experts")
	badConfig("default n_group not dividing E", withBias, with(dsv3, "n_group", nil), "n_group 8 (the model type's default) does not divide the 4 experts")
	badConfig("topk_group over n_group", withBias, with(dsv3, "topk_group", 3), "topk_group 3: want in [1, 2] (n_group)")
	badConfig("topk_group 0", withBias, with(dsv3, "topk_group", 0), "topk_group 0: want in [1, 2] (n_group)")
	badConfig("routed_scaling_factor 0", withBias, with(dsv3, "routed_scaling_factor", 0), "routed_scaling_factor 0: want finite and > 0")
	badConfig("routed_scaling_factor -1", withBias, with(dsv3, "routed_scaling_factor", -1), "routed_scaling_factor -1: want finite and > 0")
	badConfig("routed_scaling_factor under float32", withBias, with(dsv3, "routed_scaling_factor", 1e-50), "routed_scaling_factor 1e-50: want finite and > 0")
	badConfig("scoring_func tanh", ts, with(qwen, "scoring_func", "tanh"), `scoring_func "tanh": want softmax or sigmoid`)
	badConfig("norm_topk_prob string", ts, with(qwen, "norm_topk_prob", "yes"), "norm_topk_prob: a JSON string, want bool")
	badConfig("hidden_act number", ts, with(qwen, "hidden_act", 5), "hidden_act: a JSON number, want string")
	badConfig("weight_block_size [128]", ts, with(qwen, "quantization_config", map[string]any{"weight_block_size": []int{128}}),
		"quantization_config.weight_block_size [128]: want [Bn, Bk] with both >= 1")
	badConfig("weight_block_size [128, 0]", ts, with(qwen, "quantization_config", map[string]any{"weight_block_size": []int{128, 0}}),
		"quantization_config.weight_block_size [128 0]: want [Bn, Bk] with both >= 1")
	badConfig("config array", ts, []int{1}, "a JSON array, want an object")

	// Files over their cap are refused from their size: a sparse 4 GiB
	// config.json or index is never read.
	for _, f := range []string{"config.json", "model.safetensors.index.json"} {
		name := "4 GiB " + f
		dir := filepath.Join(root, name)
		writeCheckpoint(t, dir, ts, 2, qwen)
		if err := os.Truncate(filepath.Join(dir, f), 4<<30); err != nil {
			t.Fatal(err)
		}
		add(name, name, codes.InvalidArgument, `safetensors.path: "`+name+"/"+f+`": "`+f+`" is 4294967296 bytes, over the size cap of 64 MiB`)
	}

	// Tensors larger than they can be are refused from the header, before
	// they are read: a weight scale with more values than its weight has
	// rows (or tiles), an input scale of more than one value, a
	// correction bias of more than 65536.
	huge := func(shape ...int64) stTensor {
		n := int64(4)
		for _, d := range shape {
			n *= d
		}
		return stTensor{"F32", shape, make([]byte, n)}
	}
	bigScale := maps.Clone(ts)
	bigScale["model.layers.0.mlp.experts.0.gate_proj.weight_scale"] = huge(1 << 20)
	writeCheckpoint(t, filepath.Join(root, "big scale"), bigScale, 2, qwen)
	add("big scale", "big scale", codes.InvalidArgument, `tensor "model.layers.0.mlp.experts.0.gate_proj.weight_scale" has 1048576 values, want at most 16`)
	bigInput := map[string]stTensor{}
	ckLayer{e: e, k: 16, n: 16, gated: true, form: ckScalar, expert: hfExpert("model.", "mlp", projNames)}.write(rng, bigInput, 0)
	bigInput["model.layers.0.mlp.experts.1.down_proj.input_scale"] = huge(1 << 16)
	writeCheckpoint(t, filepath.Join(root, "big input scale"), bigInput, 2, qwen)
	add("big input scale", "big input scale", codes.InvalidArgument, `tensor "model.layers.0.mlp.experts.1.down_proj.input_scale" has 65536 values, want at most 1`)
	bigBias := maps.Clone(ts)
	bigBias["model.layers.0.mlp.gate.e_score_correction_bias"] = huge(1 << 17)
	writeCheckpoint(t, filepath.Join(root, "big bias"), bigBias, 2, dsv3)
	add("big bias", "big bias", codes.InvalidArgument, `tensor "model.layers.0.mlp.gate.e_score_correction_bias" has 131072 values, want at most 65536`)

	// One shard of a checkpoint, loaded by itself, holds experts 0 and 1
	// of config.json's 4: refused, not loaded as a set of 2.
	part := map[string]stTensor{}
	for name, x := range ts {
		if !strings.HasPrefix(name, "model.layers.0.mlp.experts.2.") && !strings.HasPrefix(name, "model.layers.0.mlp.experts.3.") {
			part[name] = x
		}
	}
	writeCheckpoint(t, filepath.Join(root, "shard"), ts, 2, qwen)
	writeSafetensors(t, filepath.Join(root, "shard", "experts-0-1.safetensors"), part, nil)
	cases = append(cases, badCall{"LoadExperts/checkpoint/one shard alone", cfg, call("shard/experts-0-1.safetensors", pb.NamingPreset_NAMING_PRESET_QWEN3_MOE),
		codes.InvalidArgument, `safetensors.num_experts: "shard/experts-0-1.safetensors" holds 2 of layer 0's 4 experts ("shard/config.json"), not "model.layers.0.mlp.experts.2.gate_proj.weight"`})
	return cases
}
