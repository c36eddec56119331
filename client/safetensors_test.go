package client_test

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/internal/safetensorstest"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/service"
)

// writeSafetensors writes tensors (name -> dtype, shape, bytes) as a
// .safetensors file: a little-endian header length, the JSON header, the
// data.
func writeSafetensors(t *testing.T, path string, names []string, tensors map[string]client.Tensor) {
	t.Helper()
	hdr := map[string]any{}
	var data []byte
	for _, n := range names {
		tt := tensors[n]
		dtype := map[moe.DType]string{moe.Float8E4M3FN: "F8_E4M3", moe.Float32: "F32"}[tt.DType]
		hdr[n] = map[string]any{"dtype": dtype, "shape": tt.Shape, "data_offsets": []int{len(data), len(data) + len(tt.Data)}}
		data = append(data, tt.Data...)
	}
	js, err := json.Marshal(hdr)
	if err != nil {
		t.Fatal(err)
	}
	out := binary.LittleEndian.AppendUint64(nil, uint64(len(js)))
	if err := os.WriteFile(path, append(append(out, js...), data...), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestLoadSafetensors has the server read a layer from a file with custom
// names, and checks it is byte for byte the layer an upload of the same
// weights gives (equal fingerprints), and that a path leaving the weights
// directory is refused.
func TestLoadSafetensors(t *testing.T) {
	const e, k, n = 3, 32, 16
	rng := newRand(t)
	dir := t.TempDir()
	c := startServer(t, service.Config{WeightsDir: dir})
	ctx := testContext(t)

	w13 := randomCodes(t, e*2*n*k)
	w2 := randomCodes(t, e*k*n)
	s13, s2 := make([]float32, e), make([]float32, e)
	tensors := map[string]client.Tensor{}
	var names []string
	for x := range e {
		s13[x], s2[x] = 0.01+float32(rng.Float64()), 0.01+float32(rng.Float64())
		add := func(name string, tt client.Tensor) {
			names = append(names, name)
			tensors[name] = tt
		}
		add(fmt.Sprintf("l.2.e.%d.w13", x), client.FromFP8(w13[x*2*n*k:(x+1)*2*n*k], 2*n, k))
		add(fmt.Sprintf("l.2.e.%d.w2", x), client.FromFP8(w2[x*k*n:(x+1)*k*n], k, n))
		add(fmt.Sprintf("l.2.e.%d.w13_scale", x), client.FromFloat32([]float32{s13[x]}))
		add(fmt.Sprintf("l.2.e.%d.w2_scale", x), client.FromFloat32([]float32{s2[x]}))
	}
	writeSafetensors(t, filepath.Join(dir, "layer.safetensors"), names, tensors)

	src := client.SafetensorsSource{
		Path: "layer.safetensors", Layer: 2, Preset: client.CustomNames, Activation: moe.SiluGated,
		W13Template: "l.{L}.e.{e}.w13", W2Template: "l.{L}.e.{e}.w2",
		W13ScaleTemplate: "l.{L}.e.{e}.w13_scale", W2ScaleTemplate: "l.{L}.e.{e}.w2_scale",
	}
	got, err := c.LoadSafetensors(ctx, "from-file", src)
	if err != nil {
		t.Fatalf("LoadSafetensors: %v", err)
	}
	want, err := c.LoadExperts(ctx, "uploaded", &client.ExpertWeights{
		Activation: moe.SiluGated,
		W13:        client.FromFP8(w13, e, 2*n, k), W2: client.FromFP8(w2, e, k, n),
		W13Scale: client.FromFloat32(s13, e), W2Scale: client.FromFloat32(s2, e),
	})
	if err != nil {
		t.Fatalf("LoadExperts: %v", err)
	}
	if got.Fingerprint != want.Fingerprint || got.NumExperts != e || got.HiddenSize != k || got.IntermediateSize != n {
		t.Errorf("from file: %+v\nuploaded: %+v\nwant the same fingerprint and E,K,N = %d,%d,%d", got, want, e, k, n)
	}
	if _, err := c.LoadSafetensors(ctx, "from-file", src); status.Code(err) != codes.AlreadyExists {
		t.Errorf("second LoadSafetensors = %v, want AlreadyExists", err)
	}
	if _, err := c.LoadSafetensors(ctx, "from-file", src, client.Overwrite()); err != nil {
		t.Errorf("LoadSafetensors with Overwrite = %v", err)
	}
	src.Path = "../layer.safetensors"
	if _, err := c.LoadSafetensors(ctx, "escape", src); status.Code(err) != codes.InvalidArgument {
		t.Errorf("LoadSafetensors(%q) = %v, want InvalidArgument", src.Path, err)
	}
}

// TestLoadCheckpointDir has the server read a Mixtral layer from a
// checkpoint directory by its config.json (AutoPreset) and checks the
// routing it reports comes back in ExpertSetInfo.Routing and serves.
func TestLoadCheckpointDir(t *testing.T) {
	const e, k, n = 4, 32, 16
	dir := t.TempDir()
	ck := filepath.Join(dir, "mixtral")
	if err := os.Mkdir(ck, 0o755); err != nil {
		t.Fatal(err)
	}
	c := startServer(t, service.Config{WeightsDir: dir})
	ctx := testContext(t)
	tensors := map[string]client.Tensor{}
	var names []string
	for x := range e {
		for _, p := range []string{"w1", "w3", "w2"} {
			rows, cols := n, k
			if p == "w2" {
				rows, cols = k, n
			}
			name := fmt.Sprintf("model.layers.0.block_sparse_moe.experts.%d.%s", x, p)
			names = append(names, name+".weight", name+".weight_scale")
			tensors[name+".weight"] = client.FromFP8(randomCodes(t, rows*cols), rows, cols)
			tensors[name+".weight_scale"] = client.FromFloat32([]float32{0.01})
		}
	}
	writeSafetensors(t, filepath.Join(ck, "model.safetensors"), names, tensors)
	cfg, _ := json.Marshal(map[string]any{"model_type": "mixtral", "num_local_experts": e, "num_experts_per_tok": 2, "hidden_act": "silu"})
	if err := os.WriteFile(filepath.Join(ck, "config.json"), cfg, 0o644); err != nil {
		t.Fatal(err)
	}
	info, err := c.LoadSafetensors(ctx, "mixtral/layer0", client.SafetensorsSource{Path: "mixtral", Preset: client.AutoPreset})
	if err != nil {
		t.Fatalf("LoadSafetensors(checkpoint dir): %v", err)
	}
	want := client.Routing{TopK: 2, Renormalize: true, Scoring: moe.Softmax}
	if info.Routing == nil || !reflect.DeepEqual(*info.Routing, want) || info.NumExperts != e || info.Activation != moe.SiluGated {
		t.Fatalf("info %+v, routing %+v; want E=%d, SiluGated, routing %+v", info, info.Routing, e, want)
	}
	_, err = c.FusedMoE(ctx, &client.FusedMoERequest{ExpertSet: info.Name, Hidden: client.FromFloat32(make([]float32, k), 1, k),
		RouterLogits: client.FromFloat32(make([]float32, e), 1, e), Routing: *info.Routing})
	if err != nil {
		t.Errorf("FusedMoE with the checkpoint's routing: %v", err)
	}
}

// TestPresetEnumsMirrorProto: LoadSafetensors sends NamingPreset and
// WeightQuantization as their integer values, so each SDK constant must
// be the wire's value of the same name, and every wire value but
// UNSPECIFIED must have a constant (a preset the proto grows is one the
// SDK can name).
func TestPresetEnumsMirrorProto(t *testing.T) {
	presets := map[string]client.NamingPreset{
		"NAMING_PRESET_NEMOTRON_H": client.NemotronH, "NAMING_PRESET_QWEN3_MOE": client.Qwen3MoE,
		"NAMING_PRESET_CUSTOM": client.CustomNames, "NAMING_PRESET_DEEPSEEK_V3": client.DeepSeekV3,
		"NAMING_PRESET_MIXTRAL": client.Mixtral, "NAMING_PRESET_AUTO": client.AutoPreset,
		"NAMING_PRESET_GPT_OSS": client.GptOss,
	}
	quants := map[string]client.WeightQuantization{
		"WEIGHT_QUANTIZATION_PER_TENSOR": client.QuantizePerTensor, "WEIGHT_QUANTIZATION_PER_CHANNEL": client.QuantizePerChannel,
		"WEIGHT_QUANTIZATION_BLOCK": client.QuantizeBlock,
	}
	mirrorsWire(t, pb.NamingPreset_value, presets)
	mirrorsWire(t, pb.WeightQuantization_value, quants)
}

// mirrorsWire checks an SDK enum's constants (by wire name) against the
// wire's values: each constant is its name's value, and each wire value
// but the zero default has a constant.
func mirrorsWire[T ~int](t *testing.T, wire map[string]int32, sdk map[string]T) {
	t.Helper()
	for name, v := range wire {
		got, ok := sdk[name]
		switch {
		case v == 0:
			if ok {
				t.Errorf("%s (0) has an SDK constant; the zero value is the default", name)
			}
		case !ok:
			t.Errorf("%s (%d) has no SDK constant", name, v)
		case int32(got) != v:
			t.Errorf("SDK constant for %s is %d, want the wire's %d", name, got, v)
		}
	}
	for name := range sdk {
		if _, ok := wire[name]; !ok {
			t.Errorf("SDK constant %s is not a wire value", name)
		}
	}
}

// TestLoadGptOss has the server read a gpt-oss layer (stacked BF16
// experts with biases) through the SDK's GptOss preset and checks that
// SafetensorsSource's SwiGLU parameters and weight quantization reach it:
// the activation and shape it reports, the scale granularity each
// WeightQuantization gives, and FusedMoE's output, which a clamp limit or
// slope that got lost on the way would leave at gpt-oss's defaults.
func TestLoadGptOss(t *testing.T) {
	const e, k, n, m = 4, 32, 16, 3
	rng := newRand(t)
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "ck"), 0o755); err != nil {
		t.Fatal(err)
	}
	bf16 := func(shape ...int64) safetensorstest.Tensor {
		numel := int64(1)
		for _, d := range shape {
			numel *= d
		}
		b := make([]byte, 2*numel)
		for i := range numel {
			binary.LittleEndian.PutUint16(b[2*i:], scaling.Float32ToBF16(float32(rng.NormFloat64())))
		}
		return safetensorstest.Tensor{DType: "BF16", Shape: shape, Data: b}
	}
	const p = "model.layers.0.mlp.experts."
	err := safetensorstest.Write(filepath.Join(dir, "ck", "model.safetensors"), map[string]safetensorstest.Tensor{
		p + "gate_up_proj": bf16(e, k, 2*n), p + "gate_up_proj_bias": bf16(e, 2*n),
		p + "down_proj": bf16(e, n, k), p + "down_proj_bias": bf16(e, k),
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := fmt.Sprintf(`{"model_type":"gpt_oss","num_local_experts":%d,"num_experts_per_tok":2}`, e)
	if err := os.WriteFile(filepath.Join(dir, "ck", "config.json"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	c := startServer(t, service.Config{WeightsDir: dir})
	ctx := testContext(t)

	// Hidden states of a few units make GEMM1's outputs exceed a limit of
	// 0.25 by far, so the clamp decides the output.
	hidden := make([]float32, m*k)
	for i := range hidden {
		hidden[i] = 4 * float32(rng.NormFloat64())
	}
	logits := make([]float32, m*e)
	for i := range logits {
		logits[i] = float32(rng.NormFloat64())
	}
	run := func(t *testing.T, name string, src client.SafetensorsSource, wantGranularity string) []float32 {
		t.Helper()
		src.Path, src.Preset = "ck", client.GptOss
		info, err := c.LoadSafetensors(ctx, name, src)
		if err != nil {
			t.Fatalf("LoadSafetensors(%+v): %v", src, err)
		}
		if info.Activation != moe.SwigluOAI || info.NumExperts != e || info.HiddenSize != k || info.IntermediateSize != n ||
			info.W13ScaleGranularity != wantGranularity {
			t.Errorf("%+v: info %+v, want swiglu_oai E,K,N = %d,%d,%d with %s w13 scales", src, info, e, k, n, wantGranularity)
		}
		res, err := c.FusedMoE(ctx, &client.FusedMoERequest{ExpertSet: name, Hidden: client.FromFloat32(hidden, m, k),
			RouterLogits: client.FromFloat32(logits, m, e), Routing: client.Routing{TopK: 2, Renormalize: true},
			OutputDType: moe.Float32})
		if err != nil {
			t.Fatalf("FusedMoE on %+v: %v", src, err)
		}
		out, err := res.Output.Float32s()
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	def := run(t, "defaults", client.SafetensorsSource{}, "per-channel")
	for _, tt := range []struct {
		name        string
		src         client.SafetensorsSource
		granularity string
		same        bool // as the defaults' output
	}{
		{"given-defaults", client.SafetensorsSource{SwigluLimit: moe.DefaultSwigluLimit, SwigluAlpha: moe.DefaultSwigluAlpha}, "per-channel", true},
		{"per-channel", client.SafetensorsSource{WeightQuantization: client.QuantizePerChannel}, "per-channel", true},
		{"limit-0.25", client.SafetensorsSource{SwigluLimit: 0.25}, "per-channel", false},
		{"alpha-0.5", client.SafetensorsSource{SwigluAlpha: 0.5}, "per-channel", false},
		{"per-tensor", client.SafetensorsSource{WeightQuantization: client.QuantizePerTensor}, "per-expert", false},
		{"block", client.SafetensorsSource{WeightQuantization: client.QuantizeBlock}, "block", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := run(t, tt.name, tt.src, tt.granularity)
			if same := slices.Equal(got, def); same != tt.same {
				t.Errorf("output equal to the defaults' = %v, want %v\ngot      %v\ndefaults %v", same, tt.same, got[:4], def[:4])
			}
		})
	}
}
