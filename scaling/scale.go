package scaling

import "math"

// MinScale is the smallest quantization scale expertd uses: near-zero
// scales turn into NaN in FP8 kernels on Hopper (seen in FlashInfer), and
// an all-zero tensor would otherwise get a zero scale and 0/0 codes.
const MinScale = 1e-10

// ClampScale returns max(s, MinScale). NaN stays NaN, so that validation
// downstream still sees it and rejects it.
func ClampScale(s float32) float32 {
	if s < MinScale {
		return MinScale
	}
	return s
}

// ReduceExpertScale reduces per-expert activation scales ([E], as ModelOpt
// writes them) to the one static scale kernels use: the max, as vLLM does,
// so that no expert's inputs saturate. NaN propagates; an empty v gives NaN
// so that a caller's validation catches it.
func ReduceExpertScale(v []float32) float32 {
	if len(v) == 0 {
		return float32(math.NaN())
	}
	m := v[0]
	for _, x := range v[1:] {
		if x > m || x != x {
			m = x
		}
		if m != m {
			break
		}
	}
	return ClampScale(m)
}

// checkScale reports whether s is usable as a scale: finite and > 0.
func checkScale(s float32) bool {
	return s > 0 && !math.IsInf(float64(s), 1)
}
