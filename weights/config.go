package weights

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/expertd/expertd/moe"
)

// moeConfig is what a config.json says about its MoE layers. Pointers tell
// a key's absence (the model type's default applies) from a value given,
// which is checked.
type moeConfig struct {
	ModelType           string     `json:"model_type"`
	NumExperts          *int       `json:"num_experts"`       // Qwen3-MoE
	NumLocalExperts     *int       `json:"num_local_experts"` // Mixtral
	NRoutedExperts      *int       `json:"n_routed_experts"`  // DeepSeek-V3, Nemotron-H
	TopK                *int       `json:"num_experts_per_tok"`
	NormTopKProb        *bool      `json:"norm_topk_prob"`
	ScoringFunc         *string    `json:"scoring_func"`
	TopKMethod          *string    `json:"topk_method"`
	NGroup              *int       `json:"n_group"`
	TopKGroup           *int       `json:"topk_group"`
	RoutedScalingFactor *float64   `json:"routed_scaling_factor"`
	SwigluLimit         *float64   `json:"swiglu_limit"` // gpt-oss
	SwigluAlpha         *float64   `json:"swiglu_alpha"` // gpt-oss
	HiddenAct           string     `json:"hidden_act"`
	MLPHiddenAct        string     `json:"mlp_hidden_act"` // Nemotron-H
	Quantization        *quantConf `json:"quantization_config"`
	// TextConfig holds the language model's fields in multimodal
	// checkpoints (Qwen3-VL).
	TextConfig *moeConfig `json:"text_config"`
}

type quantConf struct {
	WeightBlockSize []int32 `json:"weight_block_size"`
}

// decodeConfig decodes config.json, naming the key of a value of the
// wrong type.
func decodeConfig(b []byte, c *moeConfig) error {
	err := json.Unmarshal(b, c)
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		if te.Field == "" {
			return fmt.Errorf("a JSON %s, want an object", te.Value)
		}
		return fmt.Errorf("%s: a JSON %s, want %v", te.Field, te.Value, te.Type)
	}
	return err
}

// text returns the language model's config, with the top level's
// quantization_config when the text config has none.
func (c *moeConfig) text() *moeConfig {
	if c.TextConfig == nil {
		return c
	}
	t := *c.TextConfig
	if t.Quantization == nil {
		t.Quantization = c.Quantization
	}
	if t.ModelType == "" {
		t.ModelType = c.ModelType
	}
	return &t
}

// textKeys is how the keys of c.text() are named in messages: with
// "text_config." for a multimodal checkpoint's language model.
func (c *moeConfig) textKeys() string {
	if c.TextConfig != nil {
		return "text_config."
	}
	return ""
}

// experts is the layer's expert count config.json gives, 0 for none; the
// keys that give it must agree.
func (c *moeConfig) experts(kp string) (int, error) {
	n, from := 0, ""
	for _, k := range []struct {
		key string
		v   *int
	}{{"num_experts", c.NumExperts}, {"num_local_experts", c.NumLocalExperts}, {"n_routed_experts", c.NRoutedExperts}} {
		if k.v == nil {
			continue
		}
		if *k.v < 1 || *k.v > moe.MaxExperts {
			return 0, fmt.Errorf("%s%s %d: want in [1, %d]", kp, k.key, *k.v, moe.MaxExperts)
		}
		if n != 0 && *k.v != n {
			return 0, fmt.Errorf("%s%s %d disagrees with %s%s %d", kp, k.key, *k.v, kp, from, n)
		}
		n, from = *k.v, k.key
	}
	return n, nil
}

// blockSize is quantization_config.weight_block_size, nil for none.
func (c *moeConfig) blockSize() ([]int, error) {
	if c.Quantization == nil || c.Quantization.WeightBlockSize == nil {
		return nil, nil
	}
	bs := c.Quantization.WeightBlockSize
	if len(bs) != 2 || bs[0] < 1 || bs[1] < 1 {
		return nil, fmt.Errorf("quantization_config.weight_block_size %v: want [Bn, Bk] with both >= 1", bs)
	}
	return []int{int(bs[0]), int(bs[1])}, nil
}

// routerDefaults is what a model type's router does where config.json is
// silent: the defaults of its transformers config class and the fixed
// behaviour of its router module (transformers 5.23; see each model's
// configuration_*.py and its TopKRouter).
type routerDefaults struct {
	scoring moe.Scoring
	// normTopKProb is norm_topk_prob's default; alwaysRenormalize is a
	// router that renormalizes whatever the key says.
	normTopKProb, alwaysRenormalize bool
	// grouped routers read n_group, topk_group and routed_scaling_factor
	// (defaults below; 0 groups for none); the others ignore the keys.
	grouped             bool
	nGroup, topKGroup   int
	routedScalingFactor float64
	// readsTopKMethod: topk_method must be noaux_tc, which needs the
	// correction bias tensor.
	readsTopKMethod bool
}

// modelType is what the loader knows of a config.json model_type: its
// naming preset, the tensor prefix of a multimodal wrapper's language
// model, and its router.
type modelType struct {
	preset Preset
	prefix string
	router routerDefaults
}

var (
	// DeepseekV3Config: n_group 8, topk_group 4, routed_scaling_factor
	// 2.5, norm_topk_prob True; DeepseekV3TopkRouter scores with a sigmoid
	// plus e_score_correction_bias. Kimi-K2 ships DeepSeek-V3's
	// architecture under its own model_type.
	deepseekV3Router = routerDefaults{scoring: moe.Sigmoid, normTopKProb: true, grouped: true, nGroup: 8, topKGroup: 4,
		routedScalingFactor: 2.5, readsTopKMethod: true}
	// NemotronHConfig: n_group 1, topk_group 1, routed_scaling_factor 1.0,
	// norm_topk_prob True; NemotronHTopkRouter as DeepSeek-V3's.
	nemotronHRouter = routerDefaults{scoring: moe.Sigmoid, normTopKProb: true, grouped: true, nGroup: 1, topKGroup: 1,
		routedScalingFactor: 1}
	// Qwen3MoeConfig and Qwen2MoeConfig: norm_topk_prob False; softmax.
	qwenMoERouter = routerDefaults{scoring: moe.Softmax}
	// Qwen3NextConfig: norm_topk_prob True; softmax. Its shared expert is
	// a dense MLP the caller runs beside the routed experts.
	qwenNextRouter = routerDefaults{scoring: moe.Softmax, normTopKProb: true}
	// Glm4MoeConfig (GLM-4.5 and 4.6): n_group 1, topk_group 1,
	// routed_scaling_factor 1.0, norm_topk_prob True; Glm4MoeTopkRouter
	// as DeepSeek-V3's, with no topk_method key.
	glm4MoERouter = routerDefaults{scoring: moe.Sigmoid, normTopKProb: true, grouped: true, nGroup: 1, topKGroup: 1,
		routedScalingFactor: 1}
	// Qwen3VLMoeTextTopKRouter and MixtralTopKRouter renormalize their
	// top-k softmax weights always; their configs have no norm_topk_prob.
	// GptOssTopKRouter's softmax over the top-k logits is the same.
	renormalizingRouter = routerDefaults{scoring: moe.Softmax, alwaysRenormalize: true}
	// customRouter reads every key as given, with no defaults.
	customRouter = routerDefaults{scoring: moe.Softmax, grouped: true, routedScalingFactor: 1}
)

// modelTypes is every config.json model_type the loader knows.
var modelTypes = map[string]modelType{
	"deepseek_v3":  {DeepSeekV3, "", deepseekV3Router},
	"kimi_k2":      {DeepSeekV3, "", deepseekV3Router},
	"nemotron_h":   {NemotronH, "", nemotronHRouter},
	"qwen3_moe":    {Qwen3MoE, "", qwenMoERouter},
	"qwen2_moe":    {Qwen3MoE, "", qwenMoERouter},
	"qwen3_next":   {Qwen3MoE, "", qwenNextRouter},
	"glm4_moe":     {DeepSeekV3, "", glm4MoERouter},
	"qwen3_vl_moe": {Qwen3MoE, "model.language_model.", renormalizingRouter},
	"mixtral":      {Mixtral, "", renormalizingRouter},
	"gpt_oss":      {GptOss, "", renormalizingRouter},
}

// presetRouter is the router a preset's checkpoint takes when config.json
// names no model_type the loader knows.
var presetRouter = map[Preset]routerDefaults{
	DeepSeekV3: deepseekV3Router,
	NemotronH:  nemotronHRouter,
	Qwen3MoE:   qwenMoERouter,
	Mixtral:    renormalizingRouter,
	GptOss:     renormalizingRouter,
}

// routerOf is the router of the first of modelTypes the loader knows, else
// the preset's, else one that reads every key as given (CUSTOM).
func routerOf(types []string, preset Preset) routerDefaults {
	for _, t := range types {
		if m, ok := modelTypes[t]; ok {
			return m.router
		}
	}
	if r, ok := presetRouter[preset]; ok {
		return r
	}
	return customRouter
}

// routing is the routing config.json gives (nil without top_k), checked
// against the expert count e (0 for not known yet). hasBias reports whether
// the checkpoint holds the correction bias tensor named bias. Errors name
// the config key (kp prefixed).
func (c *moeConfig) routing(d routerDefaults, kp string, e int, bias string, hasBias bool) (*moe.RoutingInput, error) {
	if c.TopK == nil {
		return nil, nil
	}
	topK, most := *c.TopK, moe.MaxExperts
	if e > 0 {
		most = e
	}
	if topK < 1 || topK > most {
		return nil, fmt.Errorf("%snum_experts_per_tok %d: want in [1, %d]", kp, topK, most)
	}
	r := &moe.RoutingInput{TopK: topK, Scoring: d.scoring, Renormalize: d.normTopKProb || d.alwaysRenormalize}
	if c.NormTopKProb != nil && !d.alwaysRenormalize {
		r.Renormalize = *c.NormTopKProb
	}
	if c.ScoringFunc != nil {
		switch *c.ScoringFunc {
		case "sigmoid":
			r.Scoring = moe.Sigmoid
		case "softmax":
			r.Scoring = moe.Softmax
		default:
			return nil, fmt.Errorf("%sscoring_func %s: want softmax or sigmoid", kp, quote(*c.ScoringFunc))
		}
	}
	if d.grouped {
		const byDefault = " (the model type's default)"
		g, tg, gFrom, tgFrom := d.nGroup, d.topKGroup, byDefault, byDefault
		if c.NGroup != nil {
			if g, gFrom = *c.NGroup, ""; g < 1 || g > moe.MaxExperts {
				return nil, fmt.Errorf("%sn_group %d: want in [1, %d]", kp, g, moe.MaxExperts)
			}
		}
		if g > 0 && e > 0 && e%g != 0 {
			return nil, fmt.Errorf("%sn_group %d%s does not divide the %d experts", kp, g, gFrom, e)
		}
		if c.TopKGroup != nil {
			tg, tgFrom = *c.TopKGroup, ""
		}
		if g > 0 && (tg < 1 || tg > g) {
			return nil, fmt.Errorf("%stopk_group %d%s: want in [1, %d] (n_group)", kp, tg, tgFrom, g)
		}
		if g > 0 && e > 0 && tg*(e/g) < topK {
			return nil, fmt.Errorf("%stopk_group %d%s: %d groups of %d experts cannot supply num_experts_per_tok %d", kp, tg, tgFrom, tg, e/g, topK)
		}
		if g > 0 {
			r.NumGroups, r.TopKGroups = g, tg
		}
		sf := d.routedScalingFactor
		if c.RoutedScalingFactor != nil {
			sf = *c.RoutedScalingFactor
			if math.IsNaN(sf) || math.IsInf(sf, 0) || sf <= 0 || sf > math.MaxFloat32 || float32(sf) == 0 {
				return nil, fmt.Errorf("%srouted_scaling_factor %v: want finite and > 0", kp, sf)
			}
		}
		r.ScalingFactor = float32(sf)
	}
	if d.readsTopKMethod && c.TopKMethod != nil {
		if m := *c.TopKMethod; m != "noaux_tc" {
			return nil, fmt.Errorf("%stopk_method %s: want noaux_tc (the only method this model type routes with)", kp, quote(m))
		}
		if !hasBias {
			return nil, fmt.Errorf("%stopk_method noaux_tc needs the tensor %s, which the checkpoint does not hold", kp, quote(bias))
		}
	}
	if hasBias && r.Scoring != moe.Sigmoid {
		return nil, fmt.Errorf("the checkpoint holds the correction bias %s, which only sigmoid scoring takes (%sscoring_func is softmax)", quote(bias), kp)
	}
	return r, nil
}

// activation refuses a config whose activation is not the preset's.
func (c *moeConfig) activation(kp string, act moe.Activation) error {
	got, key := c.HiddenAct, "hidden_act"
	if c.MLPHiddenAct != "" {
		got, key = c.MLPHiddenAct, "mlp_hidden_act"
	}
	if got == "" {
		return nil
	}
	want := map[moe.Activation][]string{
		moe.SiluGated: {"silu", "swish"},
		moe.Relu2:     {"relu2"},
		// GptOssConfig's hidden_act is "silu"; its experts clamp it.
		moe.SwigluOAI: {"silu", "swish"},
	}[act]
	if !slices.Contains(want, got) {
		return fmt.Errorf("%s%s: activation %s does not match the preset's %v (want %v)", kp, key, quote(got), act.WireName(), want)
	}
	return nil
}
