package service

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"path"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// A checkpoint directory is what Hugging Face writes: config.json, and
// either one model.safetensors or shards listed by
// model.safetensors.index.json ({"weight_map": {tensor: shard file}}). A
// layer's experts are read from the shards that hold them, each tensor by
// itself; the other shards are never opened.

const (
	checkpointIndex  = "model.safetensors.index.json"
	checkpointSingle = "model.safetensors"
	checkpointConfig = "config.json"
	// maxJSONFile bounds config.json and the index: real ones are a few
	// hundred KB (DeepSeek-V3's index lists ~92k tensors in ~9 MB).
	maxJSONFile = 64 << 20
	// maxShards bounds how many shards one layer may span.
	maxShards = 4096
)

// weightsIsDir reports whether rel names a directory in the weights
// directory (with weightsDir.open's confinement).
func (s *Server) weightsIsDir(rel string) (bool, error) {
	f, err := s.weights.openPath(rel, true)
	if err != nil {
		return false, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return false, fmt.Errorf("stat weights path: %w", err)
	}
	return st.IsDir(), nil
}

// readWeightsJSON decodes a JSON file of the checkpoint directory; a
// missing file is (false, nil).
func (s *Server) readWeightsJSON(rel string, v any) (bool, error) {
	f, err := s.weights.open(rel)
	var re *requestError
	if errors.As(err, &re) && re.code == codes.NotFound {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxJSONFile+1))
	if err != nil {
		return false, invalidf("safetensors.path", "%s: %v", Quote(rel), err)
	}
	if len(b) > maxJSONFile {
		return false, invalidf("safetensors.path", "%s is larger than %d bytes", Quote(rel), maxJSONFile)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return false, invalidf("safetensors.path", "%s: %v", Quote(rel), err)
	}
	return true, nil
}

// moeConfig is what a config.json says about its MoE layers. Pointers tell
// a field's absence from its zero value where the defaults differ.
type moeConfig struct {
	ModelType           string     `json:"model_type"`
	NumExperts          int        `json:"num_experts"`       // Qwen3-MoE
	NumLocalExperts     int        `json:"num_local_experts"` // Mixtral
	NRoutedExperts      int        `json:"n_routed_experts"`  // DeepSeek-V3, Nemotron-H
	TopK                int        `json:"num_experts_per_tok"`
	NormTopKProb        *bool      `json:"norm_topk_prob"`
	ScoringFunc         string     `json:"scoring_func"`
	NGroup              int        `json:"n_group"`
	TopKGroup           int        `json:"topk_group"`
	RoutedScalingFactor float64    `json:"routed_scaling_factor"`
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

func (c *moeConfig) experts() int {
	return max(c.NumExperts, c.NumLocalExperts, c.NRoutedExperts)
}

// presetOfModelType maps config.json model_type to a naming preset and,
// for multimodal wrappers, the tensor prefix of the language model.
var presetOfModelType = map[string]struct {
	preset pb.NamingPreset
	prefix string
}{
	"nemotron_h":   {pb.NamingPreset_NAMING_PRESET_NEMOTRON_H, ""},
	"qwen3_moe":    {pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, ""},
	"qwen3_vl_moe": {pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, "model.language_model."},
	"qwen2_moe":    {pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, ""},
	"deepseek_v3":  {pb.NamingPreset_NAMING_PRESET_DEEPSEEK_V3, ""},
	"kimi_k2":      {pb.NamingPreset_NAMING_PRESET_DEEPSEEK_V3, ""},
	"mixtral":      {pb.NamingPreset_NAMING_PRESET_MIXTRAL, ""},
}

// defaultPrefix is what precedes "layers.{L}" in a preset's names.
func defaultPrefix(p pb.NamingPreset) string {
	if p == pb.NamingPreset_NAMING_PRESET_NEMOTRON_H {
		return "backbone."
	}
	return "model."
}

// stdProjection names a projection's weight and its scales as ModelOpt,
// compressed-tensors and the DeepSeek/Qwen block checkpoints write them.
func stdProjection(prefix string) projection {
	return projection{
		weight: prefix + ".weight",
		// ModelOpt and compressed-tensors write weight_scale; DeepSeek and
		// Qwen block checkpoints write weight_scale_inv, which despite its
		// name multiplies, as a dequantization scale does.
		scales: []string{prefix + ".weight_scale", prefix + ".weight_scale_inv"},
		input:  prefix + ".input_scale",
	}
}

// checkpointLayout returns the layout of the presets and template forms
// presetLayout does not know; ok is false for the ones it does.
func checkpointLayout(src *pb.LoadExpertsRequest_SafetensorsSource, e int) (l stLayout, ok bool, err error) {
	layer := int(src.GetLayer())
	prefix := src.GetTensorPrefix()
	if prefix == "" {
		prefix = defaultPrefix(src.GetPreset())
	}
	gated := func(base, gate, up, down string) stLayout {
		p := expand(prefix+base, layer, e)
		return stLayout{act: pb.Activation_ACTIVATION_SILU_GATED,
			w13: []projection{stdProjection(p + gate), stdProjection(p + up)}, w2: stdProjection(p + down)}
	}
	switch src.GetPreset() {
	case pb.NamingPreset_NAMING_PRESET_DEEPSEEK_V3:
		return gated("layers.{L}.mlp.experts.{e}.", "gate_proj", "up_proj", "down_proj"), true, nil
	case pb.NamingPreset_NAMING_PRESET_MIXTRAL:
		return gated("layers.{L}.block_sparse_moe.experts.{e}.", "w1", "w3", "w2"), true, nil
	case pb.NamingPreset_NAMING_PRESET_QWEN3_MOE:
		if src.GetTensorPrefix() == "" {
			return l, false, nil
		}
		return gated("layers.{L}.mlp.experts.{e}.", "gate_proj", "up_proj", "down_proj"), true, nil
	case pb.NamingPreset_NAMING_PRESET_NEMOTRON_H:
		if src.GetTensorPrefix() == "" {
			return l, false, nil
		}
		p := expand(prefix+"layers.{L}.mixer.experts.{e}.", layer, e)
		return stLayout{act: pb.Activation_ACTIVATION_RELU2, w13: []projection{stdProjection(p + "up_proj")}, w2: stdProjection(p + "down_proj")}, true, nil
	case pb.NamingPreset_NAMING_PRESET_AUTO:
		return l, true, invalidf("safetensors.preset", "NAMING_PRESET_AUTO needs path to name a checkpoint directory with a config.json")
	case pb.NamingPreset_NAMING_PRESET_CUSTOM:
		return customLayout(src, e)
	}
	return l, false, nil
}

// customLayout is the template form with one template per projection
// (gate_template, up_template) or with static input scales; plain w13/w2
// templates stay presetLayout's.
func customLayout(src *pb.LoadExpertsRequest_SafetensorsSource, e int) (stLayout, bool, error) {
	split := src.GetGateTemplate() != "" || src.GetUpTemplate() != ""
	if !split && src.GetW13InputScaleTemplate() == "" && src.GetW2InputScaleTemplate() == "" {
		return stLayout{}, false, nil
	}
	if src.GetActivation() == pb.Activation_ACTIVATION_UNSPECIFIED {
		return stLayout{}, true, invalidf("safetensors.activation", "is required with NAMING_PRESET_CUSTOM")
	}
	layer := int(src.GetLayer())
	proj := func(w, sc, in string) projection {
		p := projection{weight: expand(w, layer, e), unitScale: sc == ""}
		if sc != "" {
			p.scales = []string{expand(sc, layer, e)}
		}
		if in != "" {
			p.input = expand(in, layer, e)
		}
		return p
	}
	in13 := src.GetW13InputScaleTemplate()
	l := stLayout{act: src.GetActivation(), w2: proj(src.GetW2Template(), src.GetW2ScaleTemplate(), src.GetW2InputScaleTemplate())}
	switch {
	case split && (src.GetGateTemplate() == "" || src.GetUpTemplate() == "" || src.GetW13Template() != ""):
		return l, true, invalidf("safetensors.gate_template", "gate_template and up_template go together, instead of w13_template")
	case split && src.GetActivation() != pb.Activation_ACTIVATION_SILU_GATED:
		return l, true, invalidf("safetensors.gate_template", "separate gate and up projections need ACTIVATION_SILU_GATED")
	case split:
		l.w13 = []projection{proj(src.GetGateTemplate(), src.GetGateScaleTemplate(), in13), proj(src.GetUpTemplate(), src.GetUpScaleTemplate(), in13)}
	case src.GetW13Template() == "":
		return l, true, invalidf("safetensors.w13_template", "w13_template (or gate_template and up_template) is required with NAMING_PRESET_CUSTOM")
	default:
		l.w13 = []projection{proj(src.GetW13Template(), src.GetW13ScaleTemplate(), in13)}
	}
	if src.GetW2Template() == "" {
		return l, true, invalidf("safetensors.w2_template", "is required with NAMING_PRESET_CUSTOM")
	}
	return l, true, nil
}

// biasName is the routing correction bias of a preset's layer, "" for
// presets without one.
func biasName(src *pb.LoadExpertsRequest_SafetensorsSource, prefix string) string {
	switch src.GetPreset() {
	case pb.NamingPreset_NAMING_PRESET_DEEPSEEK_V3:
		return expand(prefix+"layers.{L}.mlp.gate.e_score_correction_bias", int(src.GetLayer()), 0)
	case pb.NamingPreset_NAMING_PRESET_NEMOTRON_H:
		return expand(prefix+"layers.{L}.mixer.gate.e_score_correction_bias", int(src.GetLayer()), 0)
	}
	return ""
}

// multiReaderAt reads the shards as one address space: shard i occupies
// [starts[i], starts[i]+sizes[i]).
type multiReaderAt struct {
	parts  []io.ReaderAt
	starts []int64
	sizes  []int64
}

func (m *multiReaderAt) ReadAt(p []byte, off int64) (int, error) {
	n := 0
	for len(p) > 0 {
		i, _ := slices.BinarySearch(m.starts, off+1)
		i--
		if i < 0 || off >= m.starts[i]+m.sizes[i] {
			return n, io.EOF
		}
		local := off - m.starts[i]
		k := min(int64(len(p)), m.sizes[i]-local)
		got, err := m.parts[i].ReadAt(p[:k], local)
		n += got
		if err != nil && !(errors.Is(err, io.EOF) && int64(got) == k) {
			return n, err
		}
		p, off = p[k:], off+k
	}
	return n, nil
}

// openCheckpoint opens the shards of dir that hold the tensors wanted
// selects and returns them as one stFile (base 0, offsets rebased into the
// shards' joint address space), and a closer for the shard files.
func (s *Server) openCheckpoint(dir string, wanted func(name string) bool) (*stFile, func(), error) {
	var index struct {
		WeightMap map[string]string `json:"weight_map"`
	}
	found, err := s.readWeightsJSON(path.Join(dir, checkpointIndex), &index)
	if err != nil {
		return nil, nil, err
	}
	var shards []string
	owner := map[string]string{}
	if found {
		for name, shard := range index.WeightMap {
			if wanted(name) {
				owner[name] = shard
				if !slices.Contains(shards, shard) {
					shards = append(shards, shard)
				}
			}
		}
		if len(shards) > maxShards {
			return nil, nil, invalidf("safetensors.path", "%s: the layer spans %d shards, more than %d", Quote(dir), len(shards), maxShards)
		}
		slices.Sort(shards)
	} else {
		shards = []string{checkpointSingle}
	}
	var files []*os.File
	closeAll := func() {
		for _, f := range files {
			f.Close()
		}
	}
	merged := &stFile{tensors: map[string]stTensor{}}
	mr := &multiReaderAt{}
	var at int64
	for _, shard := range shards {
		if strings.Contains(shard, "/") || shard == ".." {
			closeAll()
			return nil, nil, invalidf("safetensors.path", "%s: shard %s: want a file name in the checkpoint directory", Quote(dir), Quote(shard))
		}
		rel := path.Join(dir, shard)
		fh, err := s.weights.open(rel)
		if err != nil {
			closeAll()
			return nil, nil, err
		}
		files = append(files, fh)
		st, err := fh.Stat()
		if err != nil {
			closeAll()
			return nil, nil, fmt.Errorf("stat shard: %w", err)
		}
		if !st.Mode().IsRegular() {
			closeAll()
			return nil, nil, invalidf("safetensors.path", "%s: not a regular file", Quote(rel))
		}
		f, err := parseSafetensors(fh, st.Size())
		if err != nil {
			closeAll()
			return nil, nil, invalidf("safetensors.path", "%s: %v", Quote(rel), err)
		}
		for name, t := range f.tensors {
			if !wanted(name) || (found && owner[name] != shard) {
				continue
			}
			t.DataOffsets = [2]int64{at + f.base + t.DataOffsets[0], at + f.base + t.DataOffsets[1]}
			merged.tensors[name] = t
		}
		mr.parts, mr.starts, mr.sizes = append(mr.parts, fh), append(mr.starts, at), append(mr.sizes, st.Size())
		at += st.Size()
	}
	for name, shard := range owner {
		if _, ok := merged.tensors[name]; !ok {
			closeAll()
			return nil, nil, invalidf("safetensors.path", "%s: the index puts %s in %s, which does not hold it", Quote(dir), Quote(name), Quote(shard))
		}
	}
	merged.r = mr
	return merged, closeAll, nil
}

// loadCheckpoint loads one layer's experts from a checkpoint directory.
func (s *Server) loadCheckpoint(ctx context.Context, src *pb.LoadExpertsRequest_SafetensorsSource, subset ExpertSubset) (*pb.ExpertSetInfo, error) {
	dir := src.GetPath()
	var cfg moeConfig
	haveCfg, err := s.readWeightsJSON(path.Join(dir, checkpointConfig), &cfg)
	if err != nil {
		return nil, err
	}
	tc := cfg.text()
	src = proto.CloneOf(src)
	if src.GetPreset() == pb.NamingPreset_NAMING_PRESET_AUTO {
		// A multimodal wrapper's own model_type names the layout
		// (qwen3_vl_moe), not its text_config's.
		p, ok := presetOfModelType[cfg.ModelType]
		if !ok {
			p, ok = presetOfModelType[tc.ModelType]
		}
		if !haveCfg || !ok {
			return nil, invalidf("safetensors.preset", "NAMING_PRESET_AUTO: %s/config.json model_type %s is not one of nemotron_h, qwen3_moe, qwen3_vl_moe, deepseek_v3, kimi_k2, mixtral",
				Quote(dir), Quote(cfg.ModelType))
		}
		src.Preset = p.preset
		if src.GetTensorPrefix() == "" {
			src.TensorPrefix = p.prefix
		}
	}
	if src.GetNumExperts() == 0 && tc.experts() > 0 {
		src.NumExperts = int32(min(tc.experts(), maxExperts+1))
	}
	if len(src.GetWeightBlockShape()) == 0 && tc.Quantization != nil && len(tc.Quantization.WeightBlockSize) == 2 {
		src.WeightBlockShape = tc.Quantization.WeightBlockSize
	}
	lay0, err := presetLayout(src, 0)
	if err != nil {
		return nil, err
	}
	if err := checkActivation(tc, lay0.act); err != nil {
		return nil, err
	}
	prefix := src.GetTensorPrefix()
	if prefix == "" {
		prefix = defaultPrefix(src.GetPreset())
	}
	// Every name of the layer's experts starts where experts 0 and 1 part.
	lay1, _ := presetLayout(src, 1)
	common := lay0.w13[0].weight[:commonPrefix(lay0.w13[0].weight, lay1.w13[0].weight)]
	bias := biasName(src, prefix)
	f, closeAll, err := s.openCheckpoint(dir, func(name string) bool { return strings.HasPrefix(name, common) || name == bias })
	if err != nil {
		return nil, err
	}
	defer closeAll()
	if len(f.tensors) == 0 {
		// NotFound, not InvalidArgument: a dense layer of a MoE model has
		// no experts, which a caller loading every layer skips.
		return nil, codedf(codes.NotFound, "safetensors.layer", "%s: no tensor of layer %d starts with %s", Quote(dir), src.GetLayer(), Quote(common))
	}
	rt, err := configRouting(f, tc, src, bias)
	if err != nil {
		return nil, err
	}
	// A layer of a large checkpoint takes seconds to read; the log shows
	// each one start and end (with "expert set loaded").
	began := time.Now()
	s.log.InfoContext(ctx, "reading expert set from checkpoint", slog.String("name", src.GetName()), slog.String("path", Clip(dir)),
		slog.Int("layer", int(src.GetLayer())), slog.Int("shards", len(f.r.(*multiReaderAt).parts)), slog.Int("tensors", len(f.tensors)))
	info, err := s.loadAssembled(ctx, f, src, subset, rt, int(tc.TopK))
	if err == nil {
		s.log.InfoContext(ctx, "checkpoint layer read", slog.String("name", src.GetName()), slog.Duration("took", time.Since(began)))
	}
	return info, err
}

func commonPrefix(a, b string) int {
	i := 0
	for i < len(a) && i < len(b) && a[i] == b[i] {
		i++
	}
	return i
}

// checkActivation refuses a config whose activation is not the preset's.
func checkActivation(c *moeConfig, act pb.Activation) error {
	got := c.HiddenAct
	if c.MLPHiddenAct != "" {
		got = c.MLPHiddenAct
	}
	if got == "" {
		return nil
	}
	want := map[pb.Activation][]string{
		pb.Activation_ACTIVATION_SILU_GATED: {"silu", "swish"},
		pb.Activation_ACTIVATION_RELU2:      {"relu2"},
	}[act]
	if !slices.Contains(want, got) {
		return invalidf("safetensors.path", "config.json activation %s does not match the preset's %v (want %v)", Quote(got), act, want)
	}
	return nil
}

// configRouting is the routing config.json gives the layer, nil without a
// config that names top_k.
func configRouting(f *stFile, c *moeConfig, src *pb.LoadExpertsRequest_SafetensorsSource, bias string) (*pb.Routing, error) {
	if c.TopK == 0 {
		return nil, nil
	}
	r := &pb.Routing{TopK: int32(c.TopK), Scoring: pb.Scoring_SCORING_SOFTMAX}
	switch src.GetPreset() {
	case pb.NamingPreset_NAMING_PRESET_MIXTRAL:
		// Mixtral's block renormalizes its top-k softmax weights always.
		r.Renormalize = true
	case pb.NamingPreset_NAMING_PRESET_DEEPSEEK_V3, pb.NamingPreset_NAMING_PRESET_NEMOTRON_H:
		r.Scoring = pb.Scoring_SCORING_SIGMOID
		// Both models' configs default norm_topk_prob to true.
		r.Renormalize = c.NormTopKProb == nil || *c.NormTopKProb
	default:
		r.Renormalize = c.NormTopKProb != nil && *c.NormTopKProb
	}
	switch c.ScoringFunc {
	case "sigmoid":
		r.Scoring = pb.Scoring_SCORING_SIGMOID
	case "softmax":
		r.Scoring = pb.Scoring_SCORING_SOFTMAX
	case "":
	default:
		return nil, invalidf("safetensors.path", "config.json scoring_func %s: want softmax or sigmoid", Quote(c.ScoringFunc))
	}
	if c.NGroup > 0 {
		r.NumExpertGroups, r.TopkGroups = int32(c.NGroup), int32(c.TopKGroup)
	}
	if sf := c.RoutedScalingFactor; sf != 0 {
		if math.IsNaN(sf) || math.IsInf(sf, 0) || sf < 0 {
			return nil, invalidf("safetensors.path", "config.json routed_scaling_factor %v: want finite and > 0", sf)
		}
		r.RoutedScalingFactor = float32(sf)
	}
	if _, ok := f.tensors[bias]; ok && bias != "" {
		_, v, err := f.floats(bias)
		if err != nil {
			return nil, invalidf("safetensors", "%s: %v", Quote(src.GetPath()), err)
		}
		r.CorrectionBias = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT32, Shape: []int64{int64(len(v))}, Source: &pb.Tensor_Data{Data: float32Bytes(v)}}
	}
	return r, nil
}

// loadAssembled reads the set src names from f and makes it resident,
// with the checkpoint's routing (nil for none) in its info.
func (s *Server) loadAssembled(ctx context.Context, f *stFile, src *pb.LoadExpertsRequest_SafetensorsSource, subset ExpertSubset, rt *pb.Routing, hint int) (*pb.ExpertSetInfo, error) {
	block := [2]int{128, 128}
	if bs := src.GetWeightBlockShape(); len(bs) != 0 {
		if len(bs) != 2 || bs[0] < 1 || bs[1] < 1 {
			return nil, invalidf("safetensors.weight_block_shape", "%v: want [Bn, Bk] with both >= 1", bs)
		}
		block = [2]int{int(bs[0]), int(bs[1])}
	}
	hq, _ := s.backend.(HalfQuantizer)
	a, err := assemble(ctx, f, src, subset, block, s.reg, hq)
	if err != nil {
		return nil, err
	}
	defer a.release()
	if rt != nil {
		if _, err := checkRouting(rt, a.set.E); err != nil {
			return nil, invalidf("safetensors.path", "%s/config.json gives a routing the set cannot take: %v", Quote(src.GetPath()), err)
		}
	}
	info, err := s.commitRouted(ctx, src.GetName(), a.set, a.bytes, fingerprint(a.bufs), hint, rt, src.GetOverwrite())
	if err != nil {
		return nil, err
	}
	a.committed = true
	return info, nil
}
