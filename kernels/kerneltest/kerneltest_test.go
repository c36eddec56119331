package kerneltest

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

func TestRelL2(t *testing.T) {
	inf := math.Inf(1)
	tests := []struct {
		name string
		got  []float32
		want []float64
		rel  float64
	}{
		{"equal", []float32{1, -2, 3}, []float64{1, -2, 3}, 0},
		{"known", []float32{1, 2}, []float64{1, 1}, math.Sqrt(0.5)},
		{"NaN", []float32{1, float32(math.NaN())}, []float64{1, 1}, inf},
		{"Inf", []float32{float32(inf), 1}, []float64{1, 1}, inf},
		{"length", []float32{1}, []float64{1, 1}, inf},
		{"zero want, zero got", []float32{0, 0}, []float64{0, 0}, 0},
		{"zero want, nonzero got", []float32{0, 1}, []float64{0, 0}, inf},
	}
	for _, tt := range tests {
		if got := RelL2(tt.got, tt.want); math.Abs(got-tt.rel) > 1e-12 && got != tt.rel {
			t.Errorf("%s: RelL2 = %v, want %v", tt.name, got, tt.rel)
		}
	}
}

func TestPoison(t *testing.T) {
	for _, size := range []int{1, 2, 4} {
		b := make([]byte, 5*size)
		Poison(b)
		if got := Unwritten(b, size); got != 5 {
			t.Errorf("size %d: Unwritten after Poison = %d, want 5", size, got)
		}
		b[2*size] = 0 // one byte of element 2 written
		if got := Unwritten(b, size); got != 4 {
			t.Errorf("size %d: Unwritten after one write = %d, want 4", size, got)
		}
	}
	for _, dt := range []moe.DType{moe.Float32, moe.BFloat16} {
		b := make([]byte, 2*dt.Size())
		Poison(b)
		for i, v := range DecodeOutput(dt, b) {
			if !math.IsNaN(float64(v)) {
				t.Errorf("%v element %d of poison decodes to %v, want NaN", dt, i, v)
			}
		}
	}
}

func TestDecodeOutput(t *testing.T) {
	v := []float32{1.5, -2.25, 0, 3e-3, 1e30}
	for _, dt := range []moe.DType{moe.Float32, moe.BFloat16} {
		got := DecodeOutput(dt, floatTensor(dt, v, 1, len(v)).Data)
		for i := range v {
			want := v[i]
			if dt == moe.BFloat16 {
				want = scaling.BF16ToFloat32(scaling.Float32ToBF16(v[i]))
			}
			if got[i] != want {
				t.Errorf("%v: element %d = %v, want %v", dt, i, got[i], want)
			}
		}
	}
}

// TestNewCaseOptions checks that each option produces the case it names.
func TestNewCaseOptions(t *testing.T) {
	s := DeepSeekV3.Scaled(136, 24)
	rng := rand.New(rand.NewPCG(1, 1))
	const m = 6
	tests := []struct {
		name  string
		opts  []Option
		check func(*moe.ExpertSet, *moe.Request) error
	}{
		{"default block", nil, func(set *moe.ExpertSet, req *moe.Request) error {
			if set.W13Scale.Granularity != scaling.Block || set.Block != [2]int{128, 128} {
				return fmt.Errorf("granularity %v block %v, want block [128 128]", set.W13Scale.Granularity, set.Block)
			}
			if req.Hidden.DType != moe.BFloat16 || req.OutDType != moe.BFloat16 || set.A13Scale != nil {
				return fmt.Errorf("hidden %v out %v static %v, want bf16, bf16, dynamic", req.Hidden.DType, req.OutDType, set.A13Scale)
			}
			return nil
		}},
		{"per-channel", []Option{WithGranularity(scaling.PerChannel)}, func(set *moe.ExpertSet, _ *moe.Request) error {
			if set.W2Scale.Granularity != scaling.PerChannel || set.Block != [2]int{} {
				return fmt.Errorf("granularity %v block %v, want per-channel, no block", set.W2Scale.Granularity, set.Block)
			}
			return nil
		}},
		{"static", []Option{WithStaticScales()}, func(set *moe.ExpertSet, _ *moe.Request) error {
			if set.A13Scale == nil || set.A2Scale == nil || !(*set.A13Scale > 0 && *set.A2Scale > 0) {
				return fmt.Errorf("static scales %v, %v, want both > 0", set.A13Scale, set.A2Scale)
			}
			return nil
		}},
		{"fp8 per group", []Option{WithHidden(moe.Float8E4M3FN), WithHiddenScale(scaling.Block)}, func(_ *moe.ExpertSet, req *moe.Request) error {
			if req.Hidden.DType != moe.Float8E4M3FN || len(req.HiddenScale) != m*2 {
				return fmt.Errorf("hidden %v with %d scales, want fp8 with %d", req.Hidden.DType, len(req.HiddenScale), m*2)
			}
			return nil
		}},
		{"fp8 per token", []Option{WithHidden(moe.Float8E4M3FN)}, func(_ *moe.ExpertSet, req *moe.Request) error {
			if len(req.HiddenScale) != m {
				return fmt.Errorf("%d scales, want %d", len(req.HiddenScale), m)
			}
			return nil
		}},
		{"precomputed all-to-one", []Option{WithPrecomputedRouting(), WithAllTokensTo(9)}, func(_ *moe.ExpertSet, req *moe.Request) error {
			for tk := range m {
				ids := slices.Clone(req.TopKIDs[tk*s.TopK : (tk+1)*s.TopK])
				if ids[0] != 9 {
					return fmt.Errorf("token %d ids %v, want 9 first", tk, ids)
				}
				slices.Sort(ids)
				if len(slices.Compact(ids)) != s.TopK {
					return fmt.Errorf("token %d ids %v not distinct", tk, ids)
				}
			}
			return nil
		}},
		{"routed all-to-one", []Option{WithAllTokensTo(200), WithLogits(moe.BFloat16)}, func(set *moe.ExpertSet, req *moe.Request) error {
			ids := ReferenceRouting(set, req).IDs
			for tk := range m {
				if ids[tk*s.TopK] != 200 {
					return fmt.Errorf("token %d routed to %v, want 200 first", tk, ids[tk*s.TopK:(tk+1)*s.TopK])
				}
			}
			if req.Logits.DType != moe.BFloat16 {
				return fmt.Errorf("logits %v, want bf16", req.Logits.DType)
			}
			return nil
		}},
	}
	for _, tt := range tests {
		set, req := NewCase(rng, s, m, tt.opts...)
		if err := tt.check(set, req); err != nil {
			t.Errorf("%s: %v", tt.name, err)
		}
	}
}

// refBackend is a backend made of Reference, with an optional defect
// applied to its output, to show CheckBackend passes the right answer and
// catches wrong ones.
type refBackend struct {
	defect func(out []float64, ids []int32)
}

type refLoaded struct{ set *moe.ExpertSet }

func (l refLoaded) Set() *moe.ExpertSet { return l.set }
func (l refLoaded) Close() error        { return nil }

func (b refBackend) Name() string                       { return "ref" }
func (b refBackend) Capabilities() kernels.Capabilities { return kernels.Capabilities{} }
func (b refBackend) Close() error                       { return nil }
func (b refBackend) Load(_ context.Context, set *moe.ExpertSet) (kernels.Loaded, error) {
	return refLoaded{set}, nil
}

func (b refBackend) FusedMoE(_ context.Context, l kernels.Loaded, req *moe.Request) (*moe.Result, error) {
	out, ids, w := Reference(l.Set(), req)
	if b.defect != nil {
		b.defect(out, ids)
	}
	res := &moe.Result{TopKIDs: ids, TopKWeights: w, Output: make([]byte, len(out)*req.OutDType.Size())}
	for i, v := range out {
		if req.OutDType == moe.Float32 {
			binary.LittleEndian.PutUint32(res.Output[4*i:], math.Float32bits(float32(v)))
		} else {
			binary.LittleEndian.PutUint16(res.Output[2*i:], scaling.Float32ToBF16(float32(v)))
		}
	}
	return res, nil
}

// recorder is a testing.TB that records failures instead of failing.
type recorder struct {
	testing.TB
	failed []string
}

func (r *recorder) Helper()                   {}
func (r *recorder) Logf(string, ...any)       {}
func (r *recorder) Errorf(f string, a ...any) { r.failed = append(r.failed, fmt.Sprintf(f, a...)) }

func TestCheckBackendCatches(t *testing.T) {
	var cases []Case
	for _, c := range Cases() {
		if c.Name == "Nemotron/M=1" || c.Name == "top_k=E/softmax" {
			cases = append(cases, c)
		}
	}
	if len(cases) != 2 {
		t.Fatalf("found %d of the 2 cases", len(cases))
	}
	tests := []struct {
		name   string
		defect func(out []float64, ids []int32)
		fail   bool
	}{
		{"correct", nil, false},
		{"one NaN", func(out []float64, _ []int32) { out[len(out)/2] = math.NaN() }, true},
		{"sign flip of one row", func(out []float64, _ []int32) {
			for i := range out[:len(out)/5] {
				out[i] = -out[i]
			}
		}, true},
		{"5% too large", func(out []float64, _ []int32) {
			for i := range out {
				out[i] *= 1.05
			}
		}, true},
		{"ids swapped", func(_ []float64, ids []int32) { ids[0], ids[1] = ids[1], ids[0] }, true},
	}
	for _, tt := range tests {
		r := &recorder{}
		CheckBackend(r, refBackend{tt.defect}, cases...)
		if got := len(r.failed) > 0; got != tt.fail {
			t.Errorf("%s: CheckBackend failed = %v (%q), want %v", tt.name, got, r.failed, tt.fail)
		}
	}
}

// TestReferenceMaskedRow: the reference routes a row of -Inf logits to
// weight 0, as moe.Route does, never NaN, with or without
// renormalization.
func TestReferenceMaskedRow(t *testing.T) {
	set := &moe.ExpertSet{E: 4}
	logits := make([]byte, 4*4)
	for i := range 4 {
		binary.LittleEndian.PutUint32(logits[4*i:], math.Float32bits(float32(math.Inf(-1))))
	}
	for _, renorm := range []bool{false, true} {
		req := &moe.Request{
			Hidden:  moe.Tensor{DType: moe.Float32, Shape: []int{1, 1}},
			Logits:  moe.Tensor{DType: moe.Float32, Shape: []int{1, 4}, Data: logits},
			Routing: moe.Routing{TopK: 2, Scoring: moe.Softmax, Renormalize: renorm, ScalingFactor: 1},
		}
		rt := ReferenceRouting(set, req)
		ids, w := rt.IDs, rt.Weights
		if !slices.Equal(ids, []int32{0, 1}) || !slices.Equal(w, []float64{0, 0}) {
			t.Errorf("renormalize %v: ids %v weights %v, want [0 1] [0 0]", renorm, ids, w)
		}
	}
}

// TestKnifeEdge: only a value within KnifeEdge of a midpoint between two
// E4M3 neighbours gets a step, and saturating values get none.
func TestKnifeEdge(t *testing.T) {
	for _, c := range []struct{ v, want float64 }{
		{432, 32}, {432 * (1 + 0.5*KnifeEdge), 32}, {432 * (1 + 2*KnifeEdge), 0}, {431, 0},
		{17, 2}, {1.0625, 0.125}, {448, 0}, {600, 0}, {0, 0}, {math.Ldexp(3, -10), math.Ldexp(1, -9)},
	} {
		if got := knifeEdgeStep(c.v); got != c.want {
			t.Errorf("knifeEdgeStep(%g) = %g, want %g", c.v, got, c.want)
		}
	}
}

// TestReferenceTol: ReferenceTol's output is Reference's, and its bound is
// FP8Tol exactly unless some intermediate element is at a knife edge, which
// a static A2 scale can put there on purpose.
func TestReferenceTol(t *testing.T) {
	set, req := NewCase(rand.New(rand.NewPCG(3, 4)), Nemotron.Scaled(64, 32), 2, WithStaticScales())
	out, _, _, tol := ReferenceTol(set, req)
	want, _, _ := Reference(set, req)
	if !slices.Equal(out, want) {
		t.Fatal("ReferenceTol's output differs from Reference's")
	}
	if tol < FP8Tol {
		t.Errorf("tol %g < FP8Tol", tol)
	}
	// Put the largest intermediate element of the first routed pair at
	// the 416/448 midpoint.
	ids := ReferenceRouting(set, req).IDs
	a := referenceHidden(set, req)
	x := referenceIntermediate(set, a[:set.K], dequantExpert(set.W13, set.W13Scale, int(ids[0]), set.Rows1(), set.K), int(ids[0]))
	s := float32(slices.Max(x) / 432)
	set.A2Scale = &s
	if _, _, _, tol := ReferenceTol(set, req); !(tol > FP8Tol) {
		t.Errorf("tol %g with an element at a midpoint, want > FP8Tol", tol)
	}
}

// TestReferenceActivations pins the reference's activations, GEMM1 bias
// and gpt-oss's gate/up interleaving to values from PyTorch: transformers
// 5.23's GptOssExperts._apply_gate (limit 7, alpha 1.702) and
// torch.nn.functional's silu and gelu, in float64. GEMM1 here is a K = 1
// product whose result plus the bias is h.
func TestReferenceActivations(t *testing.T) {
	gated := []float64{-2, 0.3, 1.7, 0.5, -1.25, 3} // gate rows, then up rows
	tests := []struct {
		act  moe.Activation
		h    []float64
		want []float64
	}{
		// Interleaved (gate, up) pairs; the first clamps both, the last up.
		{moe.SwigluOAI, []float64{8, -9, -3, 2.5, 0.7, 7.5},
			[]float64{-41.99971876981991, -0.06324958397725089, 4.295151613785201}},
		{moe.SiluGated, gated, []float64{-0.11920292202211755, -0.21541594380437212, 4.312227148073973}},
		{moe.GeluTanhGated, gated, []float64{-0.02270115295611247, -0.23171365442844902, 4.872317686653468}},
		{moe.GeluGated, gated, []float64{-0.02275013194817921, -0.23171678332085724, 4.8727161399314305}},
	}
	for _, tt := range tests {
		set := &moe.ExpertSet{Activation: tt.act, E: 2, K: 1, N: 3,
			SwigluLimit: moe.DefaultSwigluLimit, SwigluAlpha: moe.DefaultSwigluAlpha}
		// Expert 1's bias holds a quarter of h and GEMM1 the rest; expert
		// 0's bias must not be read.
		set.W13Bias = make([]float32, 2*len(tt.h))
		w13 := make([]float64, len(tt.h))
		for r, v := range tt.h {
			set.W13Bias[len(tt.h)+r] = float32(v / 4)
			set.W13Bias[r] = 1e3
			w13[r] = v - float64(float32(v/4))
		}
		got := referenceIntermediate(set, []float64{1}, w13, 1)
		for i := range tt.want {
			// Loose enough for alpha and limit travelling as float32 (1.702
			// is not one), far below any formula's error.
			if math.Abs(got[i]-tt.want[i]) > 1e-6*math.Max(1, math.Abs(tt.want[i])) {
				t.Errorf("%v: x[%d] = %v, want %v", tt.act, i, got[i], tt.want[i])
			}
		}
	}
}
