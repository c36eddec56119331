package weights

import (
	"testing"

	"github.com/expertd/expertd/moe"
)

// FuzzDecodeConfig feeds arbitrary config.json bytes through what the
// loader does with them: it must never panic, and a routing it accepts
// for the experts config.json counts is one the service's routing check
// takes.
func FuzzDecodeConfig(f *testing.F) {
	for _, s := range []string{
		`{"model_type":"deepseek_v3","n_routed_experts":8,"num_experts_per_tok":2,"topk_method":"noaux_tc"}`,
		`{"model_type":"deepseek_v3","n_routed_experts":16,"num_experts_per_tok":4,"n_group":4,"topk_group":2,"routed_scaling_factor":2.5}`,
		`{"model_type":"qwen3_vl_moe","text_config":{"num_experts":8,"num_experts_per_tok":2,"norm_topk_prob":false}}`,
		`{"model_type":"qwen3_moe","num_experts":4,"num_experts_per_tok":0,"quantization_config":{"weight_block_size":[128]}}`,
		`{"model_type":"nemotron_h","n_routed_experts":8,"num_experts_per_tok":2,"n_group":-2,"routed_scaling_factor":1e-50}`,
		`{"model_type":"mixtral","num_local_experts":8,"num_experts":4,"num_experts_per_tok":9,"scoring_func":"sigmoid"}`,
		`null`, `[]`, `{"text_config":"x"}`,
	} {
		f.Add([]byte(s), uint8(0), false)
	}
	f.Fuzz(func(t *testing.T, b []byte, preset uint8, hasBias bool) {
		var c moeConfig
		if decodeConfig(b, &c) != nil {
			return
		}
		tc := c.text()
		kp := c.textKeys()
		e, err := tc.experts(kp)
		if err != nil {
			return
		}
		if e < 0 || e > moe.MaxExperts {
			t.Fatalf("experts accepted %d", e)
		}
		if bs, err := tc.blockSize(); err == nil && bs != nil && (len(bs) != 2 || bs[0] < 1 || bs[1] < 1) {
			t.Fatalf("weight_block_size %v accepted", bs)
		}
		_ = tc.activation(kp, moe.SiluGated)
		d := routerOf([]string{c.ModelType, tc.ModelType}, Preset(preset%6))
		rt, err := tc.routing(d, kp, e, "bias", hasBias)
		if err != nil || rt == nil || e == 0 {
			return
		}
		if hasBias {
			rt.CorrectionBias = &moe.Tensor{DType: moe.Float32, Shape: []int{e}, Data: make([]byte, 4*e)}
		}
		if _, err := moe.ValidateRouting(rt, e); err != nil {
			t.Errorf("config.json routing %v for E = %d accepted, the routing check refuses it: %v", rt, e, err)
		}
	})
}

// FuzzDecodeIndex: the index decoder never panics and never accepts an
// index without shards.
func FuzzDecodeIndex(f *testing.F) {
	for _, s := range []string{`{"weight_map":{"a":"model-00001-of-00002.safetensors"}}`, `null`, `{"metadata":{}}`, `{"weight_map":{}}`, `{"weight_map":null}`, `[]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		wm, err := decodeIndex(b)
		if err == nil && len(wm) == 0 {
			t.Errorf("index %q accepted with an empty weight_map", b)
		}
	})
}
