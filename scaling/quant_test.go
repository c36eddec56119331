package scaling

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

func randn(rng *rand.Rand, n int, std float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(rng.NormFloat64() * std)
	}
	return v
}

// amax64 is max |x| computed independently of the package.
func amax64(v []float32) float64 {
	m := 0.0
	for _, x := range v {
		m = math.Max(m, math.Abs(float64(x)))
	}
	return m
}

// checkRoundTrip checks that q·s is within E4M3's rounding error of x: half
// a quantum, which is 2^-4 relative for normals and 2^-10 absolute (times
// the scale) for subnormals, with a little slack for the float32 division.
func checkRoundTrip(t *testing.T, x, got float32, s float32, what string) {
	t.Helper()
	bound := math.Max(math.Abs(float64(x))/16, float64(s)/1024) * (1 + 1e-5)
	if d := math.Abs(float64(got) - float64(x)); !(d <= bound) {
		t.Fatalf("%s: %v came back as %v (scale %v): error %v > %v", what, x, got, s, d, bound)
	}
}

func TestPerTensorScaleAndStatic(t *testing.T) {
	rng := newRNG()
	src := randn(rng, 5000, 3)
	s := PerTensorScale(src)
	if want := float32(amax64(src)) / 448; s != want {
		t.Fatalf("PerTensorScale = %v, want amax/448 = %v", s, want)
	}
	q := make([]uint8, len(src))
	QuantizeStatic(q, src, s)
	back := make([]float32, len(src))
	Dequantize(back, q, []float32{s}, 1, len(src), len(src))
	var num, den float64
	hit448 := false
	for i, x := range src {
		checkRoundTrip(t, x, back[i], s, "static")
		num += math.Pow(float64(back[i]-x), 2)
		den += math.Pow(float64(x), 2)
		hit448 = hit448 || math.Abs(float64(E4M3Table[q[i]])) == 448
	}
	if !hit448 {
		t.Errorf("the largest element did not map to ±448")
	}
	// E4M3's 3 mantissa bits give about 2.5% RMS relative error on randn.
	if rel := math.Sqrt(num / den); rel > 0.04 || rel < 0.005 {
		t.Errorf("relative L2 error %.4f, want about 0.025", rel)
	}
	t.Run("saturates", func(t *testing.T) {
		q := make([]uint8, 4)
		QuantizeStatic(q, []float32{1000, -1000, 448, float32(math.Inf(1))}, 1)
		if want := []uint8{0x7E, 0xFE, 0x7E, 0x7E}; string(q) != string(want) {
			t.Errorf("codes % x, want % x", q, want)
		}
	})
	t.Run("zeros", func(t *testing.T) {
		if got := PerTensorScale(make([]float32, 8)); got != MinScale {
			t.Errorf("PerTensorScale(zeros) = %v, want MinScale", got)
		}
	})
}

func TestQuantizeDynamic(t *testing.T) {
	tests := []struct {
		name              string
		rows, cols, group int
	}{
		{"per-token", 7, 300, 300},
		{"per-token M=1", 1, 64, 64},
		{"groups of 128, short last group", 5, 300, 128},
		{"groups of 16", 3, 64, 16},
		{"group wider than the row", 2, 10, 128},
	}
	rng := newRNG()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ng := (tt.cols + tt.group - 1) / tt.group
			src := randn(rng, tt.rows*tt.cols, 0.1)
			// A row of a different magnitude shows that scales are per row.
			for c := range tt.cols {
				src[c] *= 1000
			}
			q := make([]uint8, len(src))
			scales := make([]float32, tt.rows*ng)
			QuantizeDynamic(q, scales, src, tt.rows, tt.cols, tt.group)
			back := make([]float32, len(src))
			Dequantize(back, q, scales, tt.rows, tt.cols, tt.group)
			for r := range tt.rows {
				for g := range ng {
					lo, hi := r*tt.cols+g*tt.group, r*tt.cols+min((g+1)*tt.group, tt.cols)
					s := scales[r*ng+g]
					if want := float32(amax64(src[lo:hi])) / 448; s != want {
						t.Fatalf("row %d group %d: scale %v, want %v", r, g, s, want)
					}
					peak := 0.0
					for i := lo; i < hi; i++ {
						checkRoundTrip(t, src[i], back[i], s, "dynamic")
						peak = math.Max(peak, math.Abs(float64(E4M3Table[q[i]])))
					}
					if peak != 448 {
						t.Fatalf("row %d group %d: largest code %v, want 448", r, g, peak)
					}
				}
			}
		})
	}
	t.Run("zero and NaN groups", func(t *testing.T) {
		src := randn(rng, 3*8, 1)
		for i := range 4 {
			src[i] = 0 // row 0, group 0
		}
		src[13] = float32(math.NaN()) // row 1, group 1
		q := make([]uint8, len(src))
		scales := make([]float32, 6)
		QuantizeDynamic(q, scales, src, 3, 8, 4)
		if scales[0] != MinScale || string(q[:4]) != "\x00\x00\x00\x00" {
			t.Errorf("zero group: scale %v, codes % x; want MinScale and zeros", scales[0], q[:4])
		}
		if !math.IsNaN(float64(scales[3])) {
			t.Errorf("NaN group: scale %v, want NaN", scales[3])
		}
		for i, s := range scales {
			if i != 3 && !(s > 0) {
				t.Errorf("scale %d = %v: a NaN leaked into another group", i, s)
			}
		}
	})
	t.Run("short slices panic", func(t *testing.T) {
		defer func() {
			r := recover()
			if r == nil || !strings.Contains(r.(string), "needs 20 values, codes and 4 scales; have 20, 20 and 3") {
				t.Errorf("recover() = %v", r)
			}
		}()
		QuantizeDynamic(make([]uint8, 20), make([]float32, 3), make([]float32, 20), 2, 10, 5)
	})
}

func TestQuantizeWeights(t *testing.T) {
	const e, rows, cols = 3, 20, 100 // blocks of [8, 32]: 3 × 4, neither divides
	rng := newRNG()
	tests := []struct {
		g      Granularity
		block  [2]int
		nScale int
		// region maps an element to its scale's index.
		region func(ex, r, c int) int
	}{
		{PerTensor, [2]int{}, 1, func(ex, r, c int) int { return 0 }},
		{PerExpert, [2]int{}, e, func(ex, r, c int) int { return ex }},
		{PerChannel, [2]int{}, e * rows, func(ex, r, c int) int { return ex*rows + r }},
		{Block, [2]int{8, 32}, e * 3 * 4, func(ex, r, c int) int { return ex*12 + (r/8)*4 + c/32 }},
	}
	for _, tt := range tests {
		t.Run(tt.g.String(), func(t *testing.T) {
			src := randn(rng, e*rows*cols, 1)
			for i := range src[:rows*cols] {
				src[i] *= 50 // expert 0 is larger, so per-expert scales differ
			}
			q, ws := QuantizeWeights(src, e, rows, cols, tt.g, tt.block)
			if ws.Granularity != tt.g || len(ws.Values) != tt.nScale || ws.E != e || ws.Rows != rows || ws.Cols != cols {
				t.Fatalf("got %v with %d values for [%d %d %d], want %v with %d for [%d %d %d]",
					ws.Granularity, len(ws.Values), ws.E, ws.Rows, ws.Cols, tt.g, tt.nScale, e, rows, cols)
			}
			// The scale must pass the validator with its own shape.
			if _, err := NewWeightScale(ws.Shape(), ws.Values, e, rows, cols, tt.block); err != nil {
				t.Fatalf("NewWeightScale(Shape() = %v): %v", ws.Shape(), err)
			}
			amax := make([]float64, tt.nScale)
			for i, x := range src {
				j := tt.region(i/(rows*cols), i/cols%rows, i%cols)
				amax[j] = math.Max(amax[j], math.Abs(float64(x)))
			}
			for j, a := range amax {
				if want := float32(a) / 448; ws.Values[j] != want {
					t.Fatalf("scale %d = %v, want %v", j, ws.Values[j], want)
				}
			}
			for i, x := range src {
				ex, r, c := i/(rows*cols), i/cols%rows, i%cols
				s := ws.At(ex, r, c)
				checkRoundTrip(t, x, E4M3Table[q[i]]*s, s, "weights")
			}
		})
	}
}

func TestQuantizeWeightsInto(t *testing.T) {
	const rows, cols = 10, 40
	rng := newRNG()
	src := randn(rng, rows*cols, 1)
	for _, g := range []Granularity{PerTensor, PerChannel, Block} {
		t.Run(g.String(), func(t *testing.T) {
			want, wantScale := QuantizeWeights(src, 1, rows, cols, g, [2]int{4, 16})
			dst := make([]uint8, len(src)+3)
			for i := range dst {
				dst[i] = 0xAA
			}
			ws := QuantizeWeightsInto(dst, src, 1, rows, cols, g, [2]int{4, 16})
			if string(dst[:len(src)]) != string(want) {
				t.Errorf("codes differ from QuantizeWeights'")
			}
			if string(dst[len(src):]) != "\xaa\xaa\xaa" {
				t.Errorf("wrote past len(src): % x", dst[len(src):])
			}
			if !slices.Equal(ws.Values, wantScale.Values) || ws.Granularity != g {
				t.Errorf("scale %v %v, want %v %v", ws.Granularity, ws.Values, g, wantScale.Values)
			}
		})
	}
	t.Run("short dst panics", func(t *testing.T) {
		defer func() {
			if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "codes") {
				t.Errorf("recover() = %v, want a panic naming the codes", r)
			}
		}()
		QuantizeWeightsInto(make([]uint8, len(src)-1), src, 1, rows, cols, PerTensor, [2]int{})
	})
}
