package scaling

import "fmt"

// Folded holds the scales of a per-tensor or per-expert FP8 MoE layer
// folded into what a fused kernel's epilogues multiply by (FlashInfer's
// CUTLASS path names them so): GEMM1's accumulator times G1Alphas[e] is the
// dequantized pre-activation, the activation's output times A2GScale is
// GEMM2's quantized input, and GEMM2's accumulator times G2Alphas[e] is the
// expert's output.
type Folded struct {
	// G1Alphas[e] = w13_scale[e] · a13_scale.
	G1Alphas []float32
	// A2GScale = 1 / a2_scale: kernels multiply rather than divide.
	A2GScale float32
	// G2Alphas[e] = w2_scale[e] · a2_scale.
	G2Alphas []float32
}

// Fold folds per-tensor or per-expert weight scales and static per-tensor
// activation scales a13 and a2 (per-expert activation scales are first
// reduced with ReduceExpertScale) into Folded. Per-channel and block
// weight scales vary within an expert, so they do not fold and are an
// error, as are non-finite or non-positive activation scales, and weight
// scales that disagree on the number of experts. The expert count comes
// from the scales' E, or the length of a per-expert scale's Values.
func Fold(w13, w2 WeightScale, a13, a2 float32) (Folded, error) {
	e := 0
	for _, w := range []struct {
		name string
		ws   WeightScale
	}{{"w13_scale", w13}, {"w2_scale", w2}} {
		n := w.ws.E
		switch w.ws.Granularity {
		case PerTensor:
			if len(w.ws.Values) != 1 {
				return Folded{}, fmt.Errorf("%s: per-tensor scale has %d values, want 1", w.name, len(w.ws.Values))
			}
		case PerExpert:
			if n == 0 {
				n = len(w.ws.Values)
			}
			if len(w.ws.Values) != n {
				return Folded{}, fmt.Errorf("%s: per-expert scale has %d values for %d experts", w.name, len(w.ws.Values), n)
			}
		default:
			return Folded{}, fmt.Errorf("%s: a %v scale does not fold to per-expert alphas", w.name, w.ws.Granularity)
		}
		if n != 0 && e != 0 && n != e {
			return Folded{}, fmt.Errorf("w13_scale is for %d experts, w2_scale for %d", e, n)
		}
		if n != 0 {
			e = n
		}
	}
	if e == 0 {
		return Folded{}, fmt.Errorf("number of experts unknown: both weight scales are per-tensor with E unset")
	}
	for _, a := range []struct {
		name string
		v    float32
	}{{"a13_scale", a13}, {"a2_scale", a2}} {
		if !checkScale(a.v) {
			return Folded{}, fmt.Errorf("%s is %v: scales must be finite and > 0", a.name, a.v)
		}
	}
	a13, a2 = ClampScale(a13), ClampScale(a2)
	f := Folded{G1Alphas: make([]float32, e), A2GScale: 1 / a2, G2Alphas: make([]float32, e)}
	for i := range e {
		f.G1Alphas[i] = w13.Expert(i) * a13
		f.G2Alphas[i] = w2.Expert(i) * a2
	}
	return f, nil
}
