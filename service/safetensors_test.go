package service_test

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/internal/safetensorstest"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// stTensor is one tensor to write into a test .safetensors file.
type stTensor struct {
	dtype string
	shape []int64
	data  []byte
}

// writeSafetensors writes tensors in the safetensors format: header length,
// JSON header padded to 8 bytes, data.
func writeSafetensors(t testing.TB, path string, tensors map[string]stTensor, meta map[string]string) {
	t.Helper()
	ts := make(map[string]safetensorstest.Tensor, len(tensors))
	for n, tt := range tensors {
		ts[n] = safetensorstest.Tensor{DType: tt.dtype, Shape: tt.shape, Data: tt.data}
	}
	if err := safetensorstest.Write(path, ts, meta); err != nil {
		t.Fatal(err)
	}
}

func scalarF32(v float32) stTensor { return stTensor{"F32", []int64{}, f32Bytes([]float32{v})} }

func bf16Bytes(v []float32) []byte {
	b := make([]byte, 2*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint16(b[2*i:], scaling.Float32ToBF16(x))
	}
	return b
}

func positive(rng *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = 0.001 + rng.Float32()*0.01
	}
	return v
}

func fp8Bytes(rng *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = scaling.Float32ToE4M3(float32(rng.NormFloat64() * 50))
	}
	return b
}

func fp8T(b []byte, shape ...int64) *pb.Tensor {
	return &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT8_E4M3FN, Shape: shape, Source: &pb.Tensor_Data{Data: b}}
}

// nemotronFile writes layer 1 of a Nemotron-H-style checkpoint (and a
// decoy layer 0) and returns the ExpertWeights it should load as.
func nemotronFile(t *testing.T, rng *rand.Rand, path string, e, k, n int) *pb.ExpertWeights {
	ts := map[string]stTensor{"backbone.layers.1.mixer.gate.weight": {"BF16", []int64{int64(e), int64(k)}, make([]byte, 2*e*k)}}
	var w1, w2 []byte
	s1, s2, a1, a2 := positive(rng, e), positive(rng, e), positive(rng, e), positive(rng, e)
	for x := range e {
		up, down := fp8Bytes(rng, n*k), fp8Bytes(rng, k*n)
		w1, w2 = append(w1, up...), append(w2, down...)
		for _, layer := range []int{0, 1} {
			p := fmt.Sprintf("backbone.layers.%d.mixer.experts.%d.", layer, x)
			u, d := up, down
			if layer == 0 {
				u, d = fp8Bytes(rng, n*k), fp8Bytes(rng, k*n)
			}
			ts[p+"up_proj.weight"] = stTensor{"F8_E4M3", []int64{int64(n), int64(k)}, u}
			ts[p+"down_proj.weight"] = stTensor{"F8_E4M3", []int64{int64(k), int64(n)}, d}
			ts[p+"up_proj.weight_scale"] = scalarF32(s1[x])
			ts[p+"down_proj.weight_scale"] = scalarF32(s2[x])
			ts[p+"up_proj.input_scale"] = scalarF32(a1[x])
			ts[p+"down_proj.input_scale"] = scalarF32(a2[x])
		}
	}
	writeSafetensors(t, path, ts, map[string]string{"num_experts_per_tok": "6"})
	return &pb.ExpertWeights{
		Activation: pb.Activation_ACTIVATION_RELU2,
		W13:        fp8T(w1, int64(e), int64(n), int64(k)),
		W2:         fp8T(w2, int64(e), int64(k), int64(n)),
		W13Scale:   f32Tensor(s1, int64(e)),
		W2Scale:    f32Tensor(s2, int64(e)),
		A13Scale:   f32Tensor(a1, int64(e)),
		A2Scale:    f32Tensor(a2, int64(e)),
	}
}

// qwenFile writes a Qwen3-MoE-style layer 0. With block set, the scales
// are BF16 "weight_scale_inv" tile grids; otherwise gate and up get
// different scalar scales, which must load as per-channel.
func qwenFile(t *testing.T, rng *rand.Rand, path string, e, k, n int, block []int) *pb.ExpertWeights {
	ts := map[string]stTensor{}
	var w13, w2 []byte
	var s13, s2 []float32
	for x := range e {
		p := fmt.Sprintf("model.layers.0.mlp.experts.%d.", x)
		gate, up, down := fp8Bytes(rng, n*k), fp8Bytes(rng, n*k), fp8Bytes(rng, k*n)
		w13 = append(append(w13, gate...), up...)
		w2 = append(w2, down...)
		ts[p+"gate_proj.weight"] = stTensor{"F8_E4M3", []int64{int64(n), int64(k)}, gate}
		ts[p+"up_proj.weight"] = stTensor{"F8_E4M3", []int64{int64(n), int64(k)}, up}
		ts[p+"down_proj.weight"] = stTensor{"F8_E4M3", []int64{int64(k), int64(n)}, down}
		if block == nil {
			g, u, d := positive(rng, 1)[0], positive(rng, 1)[0], positive(rng, 1)[0]
			ts[p+"gate_proj.weight_scale"] = scalarF32(g)
			ts[p+"up_proj.weight_scale"] = scalarF32(u)
			ts[p+"down_proj.weight_scale"] = scalarF32(d)
			for range n {
				s13 = append(s13, g)
			}
			for range n {
				s13 = append(s13, u)
			}
			s2 = append(s2, d)
			continue
		}
		rb, kb, nb, k2 := n/block[0], k/block[1], (n+block[1]-1)/block[1], (k+block[0]-1)/block[0]
		// BF16-exact values, so the loaded FP32 scales are these exactly.
		bf := func(c int) []float32 {
			v := positive(rng, c)
			for i := range v {
				v[i] = scaling.BF16ToFloat32(scaling.Float32ToBF16(v[i]))
			}
			return v
		}
		g, u, d := bf(rb*kb), bf(rb*kb), bf(k2*nb)
		ts[p+"gate_proj.weight_scale_inv"] = stTensor{"BF16", []int64{int64(rb), int64(kb)}, bf16Bytes(g)}
		ts[p+"up_proj.weight_scale_inv"] = stTensor{"BF16", []int64{int64(rb), int64(kb)}, bf16Bytes(u)}
		ts[p+"down_proj.weight_scale_inv"] = stTensor{"BF16", []int64{int64(k2), int64(nb)}, bf16Bytes(d)}
		s13 = append(append(s13, g...), u...)
		s2 = append(s2, d...)
	}
	writeSafetensors(t, path, ts, nil)
	w := &pb.ExpertWeights{
		Activation: pb.Activation_ACTIVATION_SILU_GATED,
		W13:        fp8T(w13, int64(e), int64(2*n), int64(k)),
		W2:         fp8T(w2, int64(e), int64(k), int64(n)),
		W13Scale:   f32Tensor(s13, int64(e), int64(2*n)),
		W2Scale:    f32Tensor(s2, int64(e)),
	}
	if block != nil {
		w.W13Scale.Shape = []int64{int64(e), int64(2 * n / block[0]), int64(k / block[1])}
		w.W2Scale.Shape = []int64{int64(e), int64((k + block[0] - 1) / block[0]), int64((n + block[1] - 1) / block[1])}
		w.WeightBlockShape = []int32{int32(block[0]), int32(block[1])}
	}
	return w
}

func loadSafetensors(t testing.TB, c pb.ExpertServiceClient, src *pb.LoadExpertsRequest_SafetensorsSource) (*pb.ExpertSetInfo, error) {
	t.Helper()
	stream, err := c.LoadExperts(testContext(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&pb.LoadExpertsRequest{Payload: &pb.LoadExpertsRequest_Safetensors{Safetensors: src}}); err != nil {
		t.Fatal(err)
	}
	return stream.CloseAndRecv()
}

// TestLoadSafetensors loads each preset and checks the set is the one the
// same weights give through a chunked upload: equal fingerprints mean
// equal bytes in the same layout.
func TestLoadSafetensors(t *testing.T) {
	rng := newRand(t)
	dir := t.TempDir()
	const e, k, n = 3, 32, 16
	tests := []struct {
		name     string
		src      *pb.LoadExpertsRequest_SafetensorsSource
		want     *pb.ExpertWeights
		wantHint int32
	}{
		{"nemotron", &pb.LoadExpertsRequest_SafetensorsSource{Path: "nemotron.safetensors", Layer: 1, Preset: pb.NamingPreset_NAMING_PRESET_NEMOTRON_H},
			nemotronFile(t, rng, filepath.Join(dir, "nemotron.safetensors"), e, k, n), 6},
		{"qwen-per-channel", &pb.LoadExpertsRequest_SafetensorsSource{Path: "sub/qwen.safetensors", Preset: pb.NamingPreset_NAMING_PRESET_QWEN3_MOE},
			func() *pb.ExpertWeights {
				os.Mkdir(filepath.Join(dir, "sub"), 0o755)
				return qwenFile(t, rng, filepath.Join(dir, "sub", "qwen.safetensors"), e, k, n, nil)
			}(), 0},
		{"qwen-block", &pb.LoadExpertsRequest_SafetensorsSource{Path: "qwenblock.safetensors", Preset: pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, WeightBlockShape: []int32{8, 16}, NumExperts: e},
			qwenFile(t, rng, filepath.Join(dir, "qwenblock.safetensors"), e, k, n, []int{8, 16}), 0},
		{"custom", &pb.LoadExpertsRequest_SafetensorsSource{Path: "nemotron.safetensors", Layer: 1, Preset: pb.NamingPreset_NAMING_PRESET_CUSTOM,
			Activation:  pb.Activation_ACTIVATION_RELU2,
			W13Template: "backbone.layers.{L}.mixer.experts.{e}.up_proj.weight", W2Template: "backbone.layers.{L}.mixer.experts.{e}.down_proj.weight",
			W13ScaleTemplate: "backbone.layers.{L}.mixer.experts.{e}.up_proj.weight_scale"},
			nil, 6},
	}
	// The custom mapping reads the Nemotron file without input scales and
	// with a unit w2 scale.
	nem := tests[0].want
	tests[3].want = &pb.ExpertWeights{W13: nem.W13, W2: nem.W2, W13Scale: nem.W13Scale, W2Scale: f32Tensor([]float32{1, 1, 1}, e)}

	b := &fakeBackend{}
	c, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: dir}, b)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.src.Name = tt.name
			got, err := loadSafetensors(t, c, tt.src)
			if err != nil {
				t.Fatalf("LoadExperts(safetensors): %v", err)
			}
			if got.GetFingerprint() != fingerprintOf(tt.want) {
				t.Errorf("fingerprint %s, want %s (the chunked upload's)", got.GetFingerprint(), fingerprintOf(tt.want))
			}
			if got.GetNumExperts() != e || got.GetHiddenSize() != k || got.GetIntermediateSize() != n || got.GetTopKHint() != tt.wantHint {
				t.Errorf("E, K, N, top_k_hint = %d, %d, %d, %d; want %d, %d, %d, %d", got.GetNumExperts(), got.GetHiddenSize(), got.GetIntermediateSize(), got.GetTopKHint(), e, k, n, tt.wantHint)
			}
			if !slices.Equal(got.GetWeightBlockShape(), tt.want.GetWeightBlockShape()) {
				t.Errorf("weight_block_shape %v, want %v", got.GetWeightBlockShape(), tt.want.GetWeightBlockShape())
			}
			if got.GetStaticA13Scale() != (tt.want.A13Scale != nil) {
				t.Errorf("static_a13_scale = %v, want %v", got.GetStaticA13Scale(), tt.want.A13Scale != nil)
			}
		})
	}
	// The Nemotron set's static scales are the max over experts.
	list, _ := c.ListExperts(testContext(t), &pb.ListExpertsRequest{})
	if len(list.GetExpertSets()) != len(tests) {
		t.Errorf("ListExperts has %d sets, want %d", len(list.GetExpertSets()), len(tests))
	}
	stream, _ := c.FusedMoEStream(testContext(t))
	req := &pb.FusedMoERequest{Experts: &pb.FusedMoERequest_ExpertSet{ExpertSet: "nemotron"},
		HiddenStates: f32Tensor(randn(rng, k, 1), 1, k), RouterLogits: f32Tensor(randn(rng, e, 1), 1, e), Routing: &pb.Routing{TopK: 1}}
	stream.Send(req)
	if _, err := stream.Recv(); err != nil {
		t.Fatalf("FusedMoE on the loaded set: %v", err)
	}
}

func TestLoadSafetensorsErrors(t *testing.T) {
	rng := newRand(t)
	root := t.TempDir()
	dir := filepath.Join(root, "weights")
	os.Mkdir(dir, 0o755)
	nemotronFile(t, rng, filepath.Join(dir, "ok.safetensors"), 2, 16, 8)
	nemotronFile(t, rng, filepath.Join(root, "outside.safetensors"), 2, 16, 8)
	if err := os.Symlink(filepath.Join(root, "outside.safetensors"), filepath.Join(dir, "escape.safetensors")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("ok.safetensors", filepath.Join(dir, "alias.safetensors")); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "garbage.safetensors"), []byte("\xff\xff\xff\xff\xff\xff\xff\xffnot json"), 0o644)
	os.WriteFile(filepath.Join(dir, "notjson.safetensors"), append(binary.LittleEndian.AppendUint64(nil, 4), "{{{{"...), 0o644)
	// Data offsets past the end of the file.
	writeSafetensors(t, filepath.Join(dir, "short.safetensors"), map[string]stTensor{}, nil)
	js := `{"backbone.layers.0.mixer.experts.0.up_proj.weight":{"dtype":"F8_E4M3","shape":[8,16],"data_offsets":[0,128]}}`
	os.WriteFile(filepath.Join(dir, "short.safetensors"), append(binary.LittleEndian.AppendUint64(nil, uint64(len(js))), js...), 0o644)

	// A header over the 16 MiB limit: valid JSON, one huge metadata value.
	huge := []byte(`{"__metadata__":{"pad":"` + strings.Repeat("x", 26<<20) + `"}}`)
	os.WriteFile(filepath.Join(dir, "hugeheader.safetensors"), append(binary.LittleEndian.AppendUint64(nil, uint64(len(huge))), huge...), 0o644)
	os.Mkdir(filepath.Join(dir, "adir.safetensors"), 0o755)

	nem := func(path string) *pb.LoadExpertsRequest_SafetensorsSource {
		return &pb.LoadExpertsRequest_SafetensorsSource{Name: "x", Path: path, Preset: pb.NamingPreset_NAMING_PRESET_NEMOTRON_H}
	}
	long := strings.Repeat("a", 1<<20)
	tests := []struct {
		name     string
		dir      string
		src      *pb.LoadExpertsRequest_SafetensorsSource
		wantCode codes.Code
		wantMsg  string
	}{
		{"symlink inside is fine", dir, nem("alias.safetensors"), codes.OK, ""},
		{"no weights dir", "", nem("ok.safetensors"), codes.FailedPrecondition, "no weights directory"},
		{"dotdot", dir, nem("../outside.safetensors"), codes.InvalidArgument, `may not contain ".."`},
		{"inner dotdot", dir, nem("a/../../outside.safetensors"), codes.InvalidArgument, `may not contain ".."`},
		{"absolute", dir, nem(filepath.Join(dir, "ok.safetensors")), codes.InvalidArgument, "want a path relative"},
		{"empty path", dir, nem(""), codes.InvalidArgument, "safetensors.path"},
		{"symlink escape", dir, nem("escape.safetensors"), codes.InvalidArgument, "resolves outside the weights directory"},
		{"missing", dir, nem("nope.safetensors"), codes.NotFound, "no such file"},
		{"garbage", dir, nem("garbage.safetensors"), codes.InvalidArgument, "header length"},
		{"not json", dir, nem("notjson.safetensors"), codes.InvalidArgument, "not a JSON object"},
		{"offsets past end", dir, nem("short.safetensors"), codes.InvalidArgument, "outside the 0 data bytes"},
		{"wrong layer", dir, func() *pb.LoadExpertsRequest_SafetensorsSource { s := nem("ok.safetensors"); s.Layer = 3; return s }(), codes.InvalidArgument, "for layer 3"},
		{"no preset", dir, func() *pb.LoadExpertsRequest_SafetensorsSource {
			s := nem("ok.safetensors")
			s.Preset = pb.NamingPreset_NAMING_PRESET_UNSPECIFIED
			return s
		}(), codes.InvalidArgument, "safetensors.preset"},
		{"custom without activation", dir, func() *pb.LoadExpertsRequest_SafetensorsSource {
			s := nem("ok.safetensors")
			s.Preset = pb.NamingPreset_NAMING_PRESET_CUSTOM
			return s
		}(), codes.InvalidArgument, "safetensors.activation"},
		{"wrong preset for file", dir, func() *pb.LoadExpertsRequest_SafetensorsSource {
			s := nem("ok.safetensors")
			s.Preset = pb.NamingPreset_NAMING_PRESET_QWEN3_MOE
			return s
		}(), codes.InvalidArgument, "no tensor named"},
		{"too many experts", dir, func() *pb.LoadExpertsRequest_SafetensorsSource {
			s := nem("ok.safetensors")
			s.NumExperts = 3
			return s
		}(), codes.InvalidArgument, "experts.2.up_proj.weight"},
		{"bad name", dir, func() *pb.LoadExpertsRequest_SafetensorsSource { s := nem("ok.safetensors"); s.Name = ""; return s }(), codes.InvalidArgument, "safetensors.name"},
		// Issue 14: bounded strings, relative paths only, regular files only,
		// a bounded header.
		{"file used as a directory", dir, nem("ok.safetensors/x"), codes.InvalidArgument, `safetensors.path: "ok.safetensors/x": not a directory`},
		// A directory is a checkpoint directory: one without an index or a
		// model.safetensors names the file it looked for.
		{"directory without a checkpoint", dir, nem("adir.safetensors"), codes.NotFound, `safetensors.path: "adir.safetensors/model.safetensors": no such file`},
		{"header over 16 MiB", dir, nem("hugeheader.safetensors"), codes.InvalidArgument, "the 16 MiB header limit"},
		{"1 MiB path", dir, nem(long), codes.InvalidArgument, "safetensors.path: \"" + long[:128] + "\"... (1048576 bytes): 1048576 bytes, want at most 4096"},
		{"1 MiB template", dir, func() *pb.LoadExpertsRequest_SafetensorsSource {
			s := nem("ok.safetensors")
			s.Preset, s.Activation, s.W13Template, s.W2Template = pb.NamingPreset_NAMING_PRESET_CUSTOM, pb.Activation_ACTIVATION_RELU2, long, "x"
			return s
		}(), codes.InvalidArgument, "safetensors.w13_template: "},
		{"1 MiB name", dir, func() *pb.LoadExpertsRequest_SafetensorsSource { s := nem("ok.safetensors"); s.Name = long; return s }(), codes.InvalidArgument, "safetensors.name"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: tt.dir}, &fakeBackend{})
			_, err := loadSafetensors(t, c, tt.src)
			msg := status.Convert(err).Message()
			if got := status.Code(err); got != tt.wantCode || !strings.Contains(msg, tt.wantMsg) {
				t.Errorf("got %v %s, want %v containing %s", got, service.Quote(msg), tt.wantCode, service.Quote(tt.wantMsg))
			}
			if strings.Contains(msg, root) && !strings.Contains(tt.src.GetPath(), root) {
				t.Errorf("message %s names the weights directory's absolute path %s", service.Quote(msg), root)
			}
			if len(msg) > 1024 {
				t.Errorf("message is %d bytes, want a bounded one", len(msg))
			}
		})
	}
}
