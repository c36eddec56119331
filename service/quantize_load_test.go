package service_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// halfLayer is one MoE layer of a BF16 or F16 checkpoint.
type halfLayer struct {
	e, k, n int
	gated   bool
	dtype   string // "BF16" or "F16"
	// expert names expert x's projection p ("gate", "up", "down"),
	// without ".weight".
	expert func(layer, x int, p string) string
}

// weightGen makes a rows x cols matrix.
type weightGen func(rng *rand.Rand, rows, cols int) []float32

// randomWeights is randn/10-sized weights.
func randomMatrix(rng *rand.Rand, rows, cols int) []float32 { return randn(rng, rows*cols, 0.1) }

// outlierMatrix is random weights with what real checkpoints have worse
// than randn: a few input channels 20x larger, rows of magnitudes spread
// over three decades, and sparse spikes of 50x.
func outlierMatrix(rng *rand.Rand, rows, cols int) []float32 {
	v := randn(rng, rows*cols, 0.1)
	for r := range rows {
		rs := float32(math.Pow(10, -1.5*rng.Float64()))
		for c := range cols {
			x := &v[r*cols+c]
			*x *= rs
			if c%29 == 3 {
				*x *= 20
			}
			if rng.Float64() < 2e-3 {
				*x *= 50
			}
		}
	}
	return v
}

// halfBytes encodes v in dtype, and returns the values it holds.
func halfBytes(dtype string, v []float32) ([]byte, []float32) {
	b := make([]byte, 2*len(v))
	exact := make([]float32, len(v))
	for i, x := range v {
		h := scaling.Float32ToBF16(x)
		exact[i] = scaling.BF16ToFloat32(h)
		if dtype == "F16" {
			h = scaling.Float32ToFP16(x)
			exact[i] = scaling.FP16ToFloat32(h)
		}
		binary.LittleEndian.PutUint16(b[2*i:], h)
	}
	return b, exact
}

// write adds the layer's tensors to ts and returns the values they hold:
// w13 [e, rows, k] (gate rows first) and w2 [e, k, n].
func (h halfLayer) write(rng *rand.Rand, gen weightGen, ts map[string]stTensor, layer int) (w13, w2 []float32) {
	projs := []string{"up", "down"}
	if h.gated {
		projs = []string{"gate", "up", "down"}
	}
	for x := range h.e {
		for _, p := range projs {
			rows, cols := h.n, h.k
			if p == "down" {
				rows, cols = h.k, h.n
			}
			b, v := halfBytes(h.dtype, gen(rng, rows, cols))
			ts[h.expert(layer, x, p)+".weight"] = stTensor{h.dtype, []int64{int64(rows), int64(cols)}, b}
			if p == "down" {
				w2 = append(w2, v...)
			} else {
				w13 = append(w13, v...)
			}
		}
	}
	return w13, w2
}

// writeHalfCheckpoint writes a checkpoint of random weights in h's layout
// at layer, without a config.json.
func writeHalfCheckpoint(t testing.TB, rng *rand.Rand, h halfLayer, dir string, layer, shards int) {
	ts := map[string]stTensor{}
	h.write(rng, randomMatrix, ts, layer)
	writeCheckpoint(t, dir, ts, shards, nil)
}

// dynamicFP8 is the row x as the server quantizes dynamic activations,
// per group of group columns (min(group, len(x))), dequantized; group 0
// leaves it unquantized.
func dynamicFP8(x []float32, group int) []float64 {
	out := make([]float64, len(x))
	if group == 0 {
		for i, v := range x {
			out[i] = float64(v)
		}
		return out
	}
	g := min(group, len(x))
	q, s, back := make([]uint8, len(x)), make([]float32, (len(x)+g-1)/g), make([]float32, len(x))
	scaling.QuantizeDynamic(q, s, x, 1, len(x), g)
	scaling.Dequantize(back, q, s, 1, len(x), g)
	for i, v := range back {
		out[i] = float64(v)
	}
	return out
}

// routedRef is a MoE layer's output in float64: each token's input,
// quantized with quant (dynamicFP8 with group), goes through its top-k
// experts, expert(e, a, quant) returning expert e's [k] output (which
// quantizes its intermediate with quant), summed with the routing weights.
func routedRef(hidden []float32, ids []int32, wts []float32, k, topk, group int, expert func(e int, a []float64, quant func([]float32) []float64) []float64) []float64 {
	quant := func(x []float32) []float64 { return dynamicFP8(x, group) }
	m := len(hidden) / k
	out := make([]float64, m*k)
	for t := range m {
		a := quant(hidden[t*k : (t+1)*k])
		for j := range topk {
			y := expert(int(ids[t*topk+j]), a, quant)
			for c := range k {
				out[t*k+c] += float64(wts[t*topk+j]) * y[c]
			}
		}
	}
	return out
}

// refMoE is the layer's output in float64 with the weights as the
// checkpoint holds them, unquantized; with group > 0 the experts' input
// and the intermediate are FP8-quantized per token and group of group
// columns (cols: per token), as the server quantizes dynamic activations.
func refMoE(h halfLayer, w13, w2, hidden []float32, ids []int32, wts []float32, topk, group int) []float64 {
	k, n := h.k, h.n
	rows := n
	if h.gated {
		rows = 2 * n
	}
	return routedRef(hidden, ids, wts, k, topk, group, func(e int, a []float64, quant func([]float32) []float64) []float64 {
		hh := make([]float64, rows)
		for r := range rows {
			for c := range k {
				hh[r] += float64(w13[(e*rows+r)*k+c]) * a[c]
			}
		}
		mid := make([]float32, n)
		for i := range n {
			if h.gated {
				g := hh[i]
				mid[i] = float32(g / (1 + math.Exp(-g)) * hh[n+i])
			} else {
				r := math.Max(hh[i], 0)
				mid[i] = float32(r * r)
			}
		}
		q := quant(mid)
		y := make([]float64, k)
		for r := range k {
			for c := range n {
				y[r] += float64(w2[(e*k+r)*n+c]) * q[c]
			}
		}
		return y
	})
}

func relL2(got []float32, want []float64) float64 {
	var num, den float64
	for i, w := range want {
		d := float64(got[i]) - w
		num += d * d
		den += w * w
	}
	return math.Sqrt(num / den)
}

// halfTokens is m random tokens routed to top-k random experts.
func halfTokens(rng *rand.Rand, h halfLayer, m, topk int) (hidden []float32, ids []int32, wts []float32) {
	hidden = randn(rng, m*h.k, 1)
	for range m {
		for j, e := range rng.Perm(h.e)[:topk] {
			ids = append(ids, int32(e))
			wts = append(wts, float32(0.2+rng.Float64())/float32(j+1))
		}
	}
	return hidden, ids, wts
}

// halfRun is the set's output for the tokens.
func halfRun(t *testing.T, c pb.ExpertServiceClient, name string, h halfLayer, hidden []float32, ids []int32, wts []float32) []float32 {
	t.Helper()
	m, topk := len(hidden)/h.k, len(ids)*h.k/len(hidden)
	res, err := c.FusedMoE(testContext(t), &pb.FusedMoERequest{
		Experts:      &pb.FusedMoERequest_ExpertSet{ExpertSet: name},
		HiddenStates: f32Tensor(hidden, int64(m), int64(h.k)),
		TopkIds:      &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_INT32, Shape: []int64{int64(m), int64(topk)}, Source: &pb.Tensor_Data{Data: i32Bytes(ids)}},
		TopkWeights:  f32Tensor(wts, int64(m), int64(topk)),
		OutputDtype:  pb.DataType_DATA_TYPE_FLOAT32,
	})
	if err != nil {
		t.Fatalf("FusedMoE(%s): %v", name, err)
	}
	return bytesF32(res.GetOutput().GetData())
}

var halfGranularities = []struct {
	q    pb.WeightQuantization
	name string // ExpertSetInfo's w13_scale_granularity
	g    scaling.Granularity
}{
	{pb.WeightQuantization_WEIGHT_QUANTIZATION_PER_TENSOR, "per-expert", scaling.PerTensor},
	{pb.WeightQuantization_WEIGHT_QUANTIZATION_PER_CHANNEL, "per-channel", scaling.PerChannel},
	{pb.WeightQuantization_WEIGHT_QUANTIZATION_BLOCK, "block", scaling.Block},
	{pb.WeightQuantization_WEIGHT_QUANTIZATION_UNSPECIFIED, "per-channel", scaling.PerChannel},
}

// fp8Model is the [e, rows, cols] weights w as the loader quantizes them
// at granularity g, dequantized: one scale group set per expert's matrix.
func fp8Model(w []float32, e, rows, cols int, g scaling.Granularity, block [2]int) []float32 {
	out := make([]float32, len(w))
	for x := range e {
		src := w[x*rows*cols : (x+1)*rows*cols]
		q, ws := scaling.QuantizeWeights(src, 1, rows, cols, g, block)
		for i := range src {
			out[x*rows*cols+i] = scaling.E4M3Table[q[i]] * ws.At(0, i/cols, i%cols)
		}
	}
	return out
}

// TestLoadHalfCheckpoint loads sharded BF16 and F16 checkpoints of each
// preset's layout at each granularity and checks the set against two
// float64 models with the server's activation quantization: with the
// weights quantized at that granularity, within the FP8 bar (so the set
// holds exactly those codes and scales, in the right places); and with
// the checkpoint's own weights, within what E4M3 rounding costs.
func TestLoadHalfCheckpoint(t *testing.T) {
	rng := newRand(t)
	root := t.TempDir()
	const e, k, n, m, topk = 4, 160, 96, 16, 2
	presets := []struct {
		name   string
		layer  halfLayer
		config map[string]any
	}{
		{"deepseek-v3", halfLayer{e: e, k: k, n: n, gated: true, expert: hfExpert("model.", "mlp", projNames)},
			map[string]any{"model_type": "deepseek_v3", "n_routed_experts": e, "num_experts_per_tok": topk, "n_group": 1, "topk_group": 1, "hidden_act": "silu"}},
		{"qwen3-moe", halfLayer{e: e, k: k, n: n, gated: true, expert: hfExpert("model.", "mlp", projNames)},
			map[string]any{"model_type": "qwen3_moe", "num_experts": e, "num_experts_per_tok": topk, "hidden_act": "silu"}},
		{"mixtral", halfLayer{e: e, k: k, n: n, gated: true, expert: hfExpert("model.", "block_sparse_moe", mixtralNames)},
			map[string]any{"model_type": "mixtral", "num_local_experts": e, "num_experts_per_tok": topk, "hidden_act": "silu"}},
		{"nemotron-h", halfLayer{e: e, k: k, n: n, expert: hfExpert("backbone.", "mixer", projNames)},
			map[string]any{"model_type": "nemotron_h", "n_routed_experts": e, "num_experts_per_tok": topk, "mlp_hidden_act": "relu2"}},
	}
	c, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: root}, cpu.New(kernels.Config{Threads: 2}))
	for _, dtype := range []string{"BF16", "F16"} {
		for _, p := range presets {
			h := p.layer
			h.dtype = dtype
			ts := map[string]stTensor{}
			h.write(rng, randomMatrix, ts, 0) // a decoy layer
			w13, w2 := h.write(rng, randomMatrix, ts, 1)
			dir := p.name + "-" + dtype
			writeCheckpoint(t, filepath.Join(root, dir), ts, 3, p.config)
			for _, g := range halfGranularities {
				name := fmt.Sprintf("%s/%v", dir, g.q)
				t.Run(name, func(t *testing.T) {
					info, err := loadSafetensors(t, c, &pb.LoadExpertsRequest_SafetensorsSource{Name: name, Path: dir, Layer: 1,
						Preset: pb.NamingPreset_NAMING_PRESET_AUTO, WeightQuantization: g.q, WeightBlockShape: []int32{64, 32}})
					if err != nil {
						t.Fatalf("LoadExperts: %v", err)
					}
					if info.GetW13ScaleGranularity() != g.name || info.GetW2ScaleGranularity() != g.name {
						t.Errorf("granularities %s, %s; want %s", info.GetW13ScaleGranularity(), info.GetW2ScaleGranularity(), g.name)
					}
					block := g.g == scaling.Block
					if block != (len(info.GetWeightBlockShape()) == 2) {
						t.Errorf("weight_block_shape %v with %v", info.GetWeightBlockShape(), g.q)
					}
					if info.GetNumExperts() != e || info.GetHiddenSize() != k || info.GetIntermediateSize() != n || info.GetRouting().GetTopK() != topk {
						t.Errorf("info %v", info)
					}
					hidden, ids, wts := halfTokens(rng, h, m, topk)
					got := halfRun(t, c, name, h, hidden, ids, wts)
					group := k
					if block {
						group = 32
					}
					rows := 2 * n
					if !h.gated {
						rows = n
					}
					bs := [2]int{64, 32}
					q13, q2 := fp8Model(w13, e, rows, k, g.g, bs), fp8Model(w2, e, k, n, g.g, bs)
					if rel := relL2(got, refMoE(h, q13, q2, hidden, ids, wts, topk, group)); !(rel <= cpuBar) {
						t.Errorf("rel L2 against the float64 model of the FP8 weights %.3e, want <= %.0e", rel, cpuBar)
					}
					if rel := relL2(got, refMoE(h, w13, w2, hidden, ids, wts, topk, group)); !(rel <= halfBar) {
						t.Errorf("rel L2 against the float64 model of the %s weights %.3e, want <= %.0e", dtype, rel, halfBar)
					}
				})
			}
		}
	}
}

const (
	// cpuBar is the CPU backend's bar against a float64 reference of the
	// same FP8 weights, tighter than MOE_SPEC.md's 2e-2: only float32
	// summation order separates them, which now and then moves an
	// intermediate element across an E4M3 rounding boundary, a step far
	// smaller than a misplaced scale or code costs.
	cpuBar = 5e-3
	// halfBar bounds a quantized BF16 layer's error against the float64
	// model of its BF16 weights: E4M3's 3 mantissa bits round randn
	// weights with about 2.6% relative RMS error, which both GEMMs, the
	// gate-up product and the intermediate's requantization carry into
	// the output; MOE_SPEC.md's 2e-2 holds against the FP8 weights.
	halfBar = 8e-2
)

// TestWeightQuantizationAccuracy measures each granularity's error against
// the float64 model of a BF16 layer, on random and on outlier-heavy
// weights, and checks the default is the most accurate: the weights'
// relative Frobenius error (which is the expected relative error of a
// GEMM's output for isotropic inputs), and the layer's output through the
// server, with the server's activation quantization in the reference.
//
// The seed is fixed: the test measures, and a choice must not hang on a
// draw. On random weights the three tie at the output, their order set by
// the draw, so the default need only be within 5% of the best there; on
// outlier-heavy weights it must be the best.
func TestWeightQuantizationAccuracy(t *testing.T) {
	rng := rand.New(rand.NewPCG(32, 1))
	root := t.TempDir()
	const e, k, n, m, topk = 4, 384, 256, 64, 2
	h := halfLayer{e: e, k: k, n: n, gated: true, dtype: "BF16", expert: hfExpert("model.", "mlp", projNames)}
	c, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: root}, cpu.New(kernels.Config{Threads: 2}))
	for _, kind := range []struct {
		name string
		gen  weightGen
	}{{"random", randomMatrix}, {"outliers", outlierMatrix}} {
		ts := map[string]stTensor{}
		w13, w2 := h.write(rng, kind.gen, ts, 0)
		writeCheckpoint(t, filepath.Join(root, kind.name), ts, 1, map[string]any{"model_type": "qwen3_moe", "num_experts": e})
		// The same tokens for every granularity, which makes the comparison
		// of output errors paired.
		hidden, ids, wts := halfTokens(rng, h, m, topk)
		weightErr := map[scaling.Granularity]float64{}
		outErr := map[scaling.Granularity]float64{}
		for _, g := range halfGranularities[:3] {
			q13, q2 := fp8Model(w13, e, 2*n, k, g.g, [2]int{128, 128}), fp8Model(w2, e, k, n, g.g, [2]int{128, 128})
			var num, den float64
			q := slices.Concat(q13, q2)
			for i, w := range slices.Concat(w13, w2) {
				d := float64(q[i]) - float64(w)
				num, den = num+d*d, den+float64(w)*float64(w)
			}
			weightErr[g.g] = math.Sqrt(num / den)
			name := kind.name + "/" + g.name
			if _, err := loadSafetensors(t, c, &pb.LoadExpertsRequest_SafetensorsSource{Name: name, Path: kind.name,
				Preset: pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, WeightQuantization: g.q}); err != nil {
				t.Fatalf("LoadExperts(%s): %v", name, err)
			}
			group := k
			if g.g == scaling.Block {
				group = 128
			}
			got := halfRun(t, c, name, h, hidden, ids, wts)
			outErr[g.g] = relL2(got, refMoE(h, w13, w2, hidden, ids, wts, topk, group))
			t.Logf("%-8s %-11s weights %.3e  output %.3e", kind.name, g.name, weightErr[g.g], outErr[g.g])
		}
		// The output's error also carries the activations' quantization,
		// which block mode does per group of 128 and the others per token,
		// and sampling noise of a few percent of itself.
		def := scaling.PerChannel
		for g, w := range weightErr {
			if weightErr[def] > w {
				t.Errorf("%s weights: the default %v's error %.3e is larger than %v's %.3e", kind.name, def, weightErr[def], g, w)
			}
			if slack := map[string]float64{"random": 1.05, "outliers": 1}[kind.name]; outErr[def] > slack*outErr[g] {
				t.Errorf("%s weights: the default %v's output error %.3e is larger than %v's %.3e", kind.name, def, outErr[def], g, outErr[g])
			}
		}
	}
}

// TestLoadHalfCheckpointErrors checks that what cannot be quantized is
// refused with the field or tensor named, and leaves the server as it
// was: the reservation of a refused load is returned, so a set of exactly
// the server's limit loads after it.
func TestLoadHalfCheckpointErrors(t *testing.T) {
	rng := newRand(t)
	root := t.TempDir()
	const e, k, n = 2, 16, 16
	h := halfLayer{e: e, k: k, n: n, gated: true, dtype: "BF16", expert: hfExpert("model.", "mlp", projNames)}
	good := map[string]stTensor{}
	h.write(rng, randomMatrix, good, 0)
	writeCheckpoint(t, filepath.Join(root, "good"), good, 2, nil)
	poisoned := func(dir string, v float32) {
		ts := map[string]stTensor{}
		h.write(rng, randomMatrix, ts, 0)
		name := h.expert(0, 1, "up") + ".weight"
		x := ts[name]
		x.data = slices.Clone(x.data)
		binary.LittleEndian.PutUint16(x.data[2*37:], scaling.Float32ToBF16(v))
		ts[name] = x
		writeCheckpoint(t, filepath.Join(root, dir), ts, 1, nil)
	}
	poisoned("nan", float32(math.NaN()))
	poisoned("inf", float32(math.Inf(-1)))
	mixed := map[string]stTensor{}
	h.write(rng, randomMatrix, mixed, 0)
	mixed[h.expert(0, 1, "down")+".weight"] = stTensor{"F8_E4M3", []int64{k, n}, fp8Bytes(rng, k*n)}
	writeCheckpoint(t, filepath.Join(root, "mixed"), mixed, 1, nil)
	fp8 := map[string]stTensor{}
	ckLayer{e: e, k: k, n: n, gated: true, form: ckChannel, expert: h.expert}.write(rng, fp8, 0)
	writeCheckpoint(t, filepath.Join(root, "fp8"), fp8, 1, nil)

	// The set's bytes: FP8 weights and per-channel float32 scales.
	setBytes := int64(e*(2*n*k+k*n) + 4*e*(2*n+k))
	c, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: root, MaxLoadedBytes: setBytes}, &fakeBackend{})
	tests := []struct {
		name, path string
		q          pb.WeightQuantization
		want       string
	}{
		{"unknown granularity", "good", pb.WeightQuantization(9), "safetensors.weight_quantization"},
		{"unknown granularity, FP8 weights", "fp8", pb.WeightQuantization(-1), "safetensors.weight_quantization"},
		{"NaN weight", "nan", 0, `a weight of ["model.layers.0.mlp.experts.1.gate_proj.weight" "model.layers.0.mlp.experts.1.up_proj.weight"] is NaN or infinite`},
		{"infinite weight", "inf", pb.WeightQuantization_WEIGHT_QUANTIZATION_BLOCK, "is NaN or infinite"},
		{"mixed dtypes", "mixed", 0, `"model.layers.0.mlp.experts.1.down_proj.weight" has dtype "F8_E4M3", want BF16`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := loadSafetensors(t, c, &pb.LoadExpertsRequest_SafetensorsSource{Name: "x", Path: tt.path,
				Preset: pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, WeightQuantization: tt.q})
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), tt.want) {
				t.Errorf("got %v, want InvalidArgument containing %q", err, tt.want)
			}
		})
	}
	info, err := loadSafetensors(t, c, &pb.LoadExpertsRequest_SafetensorsSource{Name: "x", Path: "good", Preset: pb.NamingPreset_NAMING_PRESET_QWEN3_MOE})
	if err != nil || info.GetBytes() != setBytes {
		t.Fatalf("after the refusals, a load of exactly the limit: %v, %v bytes; want %d", err, info.GetBytes(), setBytes)
	}
}

// quantizingBackend is a backend with the HalfQuantizer hook, counting
// its calls; it quantizes as the host path does, or fails with fail.
type quantizingBackend struct {
	kernels.Backend
	calls atomic.Int64
	fail  error
}

func (b *quantizingBackend) QuantizeHalf(_ context.Context, dst, src []byte, dt moe.DType, rows, cols int, g scaling.Granularity, block [2]int, scales []float32) error {
	if b.calls.Add(1) > 1 && b.fail != nil {
		return b.fail
	}
	v := make([]float32, rows*cols)
	for i := range v {
		h := binary.LittleEndian.Uint16(src[2*i:])
		if v[i] = scaling.BF16ToFloat32(h); dt == moe.Float16 {
			v[i] = scaling.FP16ToFloat32(h)
		}
	}
	copy(scales, scaling.QuantizeWeightsInto(dst, v, 1, rows, cols, g, block).Values)
	return nil
}

// TestLoadHalfCheckpointBackendQuantizer checks that a backend with the
// HalfQuantizer hook quantizes each expert's two matrices, into the set
// the host path builds.
func TestLoadHalfCheckpointBackendQuantizer(t *testing.T) {
	rng := newRand(t)
	root := t.TempDir()
	const e = 3
	h := halfLayer{e: e, k: 32, n: 16, dtype: "F16", expert: hfExpert("backbone.", "mixer", projNames)}
	writeHalfCheckpoint(t, rng, h, filepath.Join(root, "ck"), 2, 2)
	src := &pb.LoadExpertsRequest_SafetensorsSource{Name: "x", Path: "ck", Layer: 2, Preset: pb.NamingPreset_NAMING_PRESET_NEMOTRON_H,
		WeightQuantization: pb.WeightQuantization_WEIGHT_QUANTIZATION_BLOCK, WeightBlockShape: []int32{8, 8}}
	hostC, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: root}, &fakeBackend{})
	host, err := loadSafetensors(t, hostC, src)
	if err != nil {
		t.Fatal(err)
	}
	b := &quantizingBackend{Backend: &fakeBackend{}}
	c, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: root}, b)
	got, err := loadSafetensors(t, c, src)
	if err != nil {
		t.Fatal(err)
	}
	if n := b.calls.Load(); n != 2*e {
		t.Errorf("QuantizeHalf called %d times, want %d (two matrices per expert)", n, 2*e)
	}
	if got.GetFingerprint() != host.GetFingerprint() {
		t.Errorf("fingerprint %s, want the host path's %s", got.GetFingerprint(), host.GetFingerprint())
	}

	// The backend's fault is the server's, and the load leaves nothing.
	failing := &quantizingBackend{Backend: &fakeBackend{}, fail: errors.New("device lost")}
	fc, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: root}, failing)
	if _, err := loadSafetensors(t, fc, src); status.Code(err) != codes.Internal {
		t.Errorf("load with a failing quantizer: %v, want Internal", err)
	}
	if list, err := fc.ListExperts(testContext(t), &pb.ListExpertsRequest{}); err != nil || len(list.GetExpertSets()) != 0 {
		t.Errorf("after the failed load: %v, %v; want no sets", list, err)
	}
}

// TestLoadHalfCheckpointMemory checks that a load streams: what it
// allocates stays under the layer's BF16 bytes plus the FP8 set it builds,
// where reading the layer whole, or widening it to float32, would not.
func TestLoadHalfCheckpointMemory(t *testing.T) {
	rng := newRand(t)
	root := t.TempDir()
	const e, k, n = 64, 256, 128
	h := halfLayer{e: e, k: k, n: n, gated: true, dtype: "BF16", expert: hfExpert("model.", "mlp", projNames)}
	writeHalfCheckpoint(t, rng, h, filepath.Join(root, "ck"), 0, 4)
	c, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: root}, &fakeBackend{})
	layerBF16 := uint64(2 * e * 3 * n * k)
	// The connection's buffers are not the load's.
	if _, err := c.ListExperts(testContext(t), &pb.ListExpertsRequest{}); err != nil {
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	info, err := loadSafetensors(t, c, &pb.LoadExpertsRequest_SafetensorsSource{Name: "x", Path: "ck", Preset: pb.NamingPreset_NAMING_PRESET_QWEN3_MOE})
	runtime.ReadMemStats(&after)
	if err != nil {
		t.Fatal(err)
	}
	alloc := after.TotalAlloc - before.TotalAlloc
	t.Logf("allocated %d bytes for a layer of %d BF16 bytes and a set of %d", alloc, layerBF16, info.GetBytes())
	// The design's bound, 3/4 of the layer's BF16 bytes of staging besides
	// the set, plus room for the headers and the RPC.
	if bound := uint64(info.GetBytes()) + layerBF16*3/4 + 1<<20; alloc > bound {
		t.Errorf("the load allocated %d bytes, want <= %d", alloc, bound)
	}
}

// BenchmarkLoadHalfCheckpoint loads a 32-expert BF16 layer of Qwen3-30B-A3B's
// expert shape (K = 2048, N = 768) at each granularity; weights/s is the
// host path's quantization rate, reading included.
func BenchmarkLoadHalfCheckpoint(b *testing.B) {
	rng := rand.New(rand.NewPCG(1, 1))
	root := b.TempDir()
	const e, k, n = 32, 2048, 768
	h := halfLayer{e: e, k: k, n: n, gated: true, dtype: "BF16", expert: hfExpert("model.", "mlp", projNames)}
	writeHalfCheckpoint(b, rng, h, filepath.Join(root, "ck"), 0, 4)
	c, _, _ := servicetest.StartServerConfig(b, service.Config{WeightsDir: root}, &fakeBackend{})
	for _, g := range halfGranularities[:3] {
		b.Run(g.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := loadSafetensors(b, c, &pb.LoadExpertsRequest_SafetensorsSource{Name: "x", Path: "ck",
					Preset: pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, WeightQuantization: g.q, Overwrite: true}); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N)*3*e*k*n/b.Elapsed().Seconds(), "weights/s")
		})
	}
}
