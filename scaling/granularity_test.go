package scaling

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

func newRNG() *rand.Rand { return rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64())) }

// positive returns n fresh random scales in (0.001, 1.001).
func positive(rng *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = 0.001 + rng.Float32()
	}
	return v
}

func TestNewWeightScale(t *testing.T) {
	const e, rows, cols = 4, 10, 300
	blk := [2]int{4, 128} // ceil(10/4) = 3, ceil(300/128) = 3
	tests := []struct {
		name    string
		shape   []int
		block   [2]int
		want    Granularity
		wantErr string // substring; "" means no error
	}{
		{"scalar", nil, [2]int{}, PerTensor, ""},
		{"[1]", []int{1}, [2]int{}, PerTensor, ""},
		{"[1] in block mode", []int{1}, blk, PerTensor, ""},
		{"[E]", []int{e}, [2]int{}, PerExpert, ""},
		{"[E, rows]", []int{e, rows}, [2]int{}, PerChannel, ""},
		{"[E, rows] in block mode", []int{e, rows}, blk, PerChannel, ""},
		{"block", []int{e, 3, 3}, blk, Block, ""},
		{"block shape without block", []int{e, 3, 3}, [2]int{}, 0,
			"bad scale shape [4 3 3] for weights [4 10 300]: want [] or [1] (per-tensor), [4] (per-expert) or [4 10] (per-channel)"},
		{"block shape floor instead of ceil", []int{e, 2, 2}, blk, 0,
			"want [] or [1] (per-tensor), [4] (per-expert), [4 10] (per-channel) or [4 3 3] (block [4 128])"},
		{"[E-1]", []int{e - 1}, [2]int{}, 0, "bad scale shape [3]"},
		{"[rows]", []int{rows}, [2]int{}, 0, "bad scale shape [10]"},
		{"[E, cols]", []int{e, cols}, [2]int{}, 0, "bad scale shape [4 300]"},
		{"[1, 1]", []int{1, 1}, [2]int{}, 0, "bad scale shape [1 1]"},
		{"4-D", []int{e, 3, 3, 1}, blk, 0, "bad scale shape [4 3 3 1]"},
		{"half a block", []int{e, 3, 3}, [2]int{4, 0}, 0, "block [4 0] must be [Bn, Bk] with both >= 1, or zero"},
		{"negative block", []int{e}, [2]int{-1, -1}, 0, "block [-1 -1] must be"},
	}
	rng := newRNG()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n := 1
			for _, d := range tt.shape {
				n *= d
			}
			vals := positive(rng, n)
			ws, err := NewWeightScale(tt.shape, vals, e, rows, cols, tt.block)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, tt.wantErr)
				}
				if !errors.Is(err, errShape) {
					t.Errorf("err = %v does not wrap errShape", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("unexpected error %v", err)
			}
			if ws.Granularity != tt.want {
				t.Errorf("granularity %v, want %v", ws.Granularity, tt.want)
			}
			if ws.E != e || ws.Rows != rows || ws.Cols != cols {
				t.Errorf("E, Rows, Cols = %d, %d, %d, want %d, %d, %d", ws.E, ws.Rows, ws.Cols, e, rows, cols)
			}
			if !slices.Equal(ws.Values, vals) {
				t.Errorf("values changed: %v, want %v", ws.Values, vals)
			}
			if ws.Granularity == Block && ws.Block != tt.block {
				t.Errorf("block %v, want %v", ws.Block, tt.block)
			}
			if ws.Granularity != Block && ws.Block != [2]int{} {
				t.Errorf("block %v set on a %v scale", ws.Block, ws.Granularity)
			}
			wantShape := tt.shape
			if len(wantShape) == 1 && tt.want == PerTensor {
				wantShape = nil
			}
			if got := ws.Shape(); !slices.Equal(got, wantShape) && !(len(got) == 0 && len(wantShape) == 0) {
				t.Errorf("Shape() = %v, want %v", got, wantShape)
			}
			vals[0] = -1 // the scale must own its values
			if ws.Values[0] < 0 {
				t.Errorf("WeightScale aliases the caller's values")
			}
		})
	}
}

func TestNewWeightScaleValues(t *testing.T) {
	tests := []struct {
		name    string
		bad     float32
		at      int
		wantErr string
	}{
		{"zero", 0, 2, "element 2 is 0: scales must be finite and > 0"},
		{"negative", -0.5, 0, "element 0 is -0.5"},
		{"-0", float32(math.Copysign(0, -1)), 1, "element 1 is -0"},
		{"NaN", float32(math.NaN()), 3, "element 3 is NaN"},
		{"+Inf", float32(math.Inf(1)), 1, "element 1 is +Inf"},
		{"-Inf", float32(math.Inf(-1)), 2, "element 2 is -Inf"},
	}
	rng := newRNG()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			vals := positive(rng, 4)
			vals[tt.at] = tt.bad
			_, err := NewWeightScale([]int{4}, vals, 4, 8, 8, [2]int{})
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) || !errors.Is(err, errValue) {
				t.Fatalf("err = %v, want one wrapping errValue containing %q", err, tt.wantErr)
			}
		})
	}
	t.Run("tiny values are clamped", func(t *testing.T) {
		ws, err := NewWeightScale([]int{3}, []float32{1e-30, 0.5, math.SmallestNonzeroFloat32}, 3, 8, 8, [2]int{})
		if err != nil {
			t.Fatal(err)
		}
		if want := []float32{MinScale, 0.5, MinScale}; !slices.Equal(ws.Values, want) {
			t.Errorf("values %v, want %v", ws.Values, want)
		}
	})
	t.Run("value count", func(t *testing.T) {
		_, err := NewWeightScale([]int{3}, []float32{1, 2}, 3, 8, 8, [2]int{})
		if want := "shape [3] has 3 elements, got 2 values"; err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("err = %v, want %q", err, want)
		}
	})
	t.Run("weight dims", func(t *testing.T) {
		_, err := NewWeightScale(nil, []float32{1}, 0, 8, 8, [2]int{})
		if want := "weight shape [0 8 8] must have every dimension >= 1"; err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("err = %v, want %q", err, want)
		}
	})
}

// TestWeightScaleAt checks At and Expert against index arithmetic written
// out per granularity, on shapes whose blocks do not divide the weights.
func TestWeightScaleAt(t *testing.T) {
	const e, rows, cols = 3, 7, 13
	blk := [2]int{3, 4} // 3 row blocks (3,3,1), 4 col blocks (4,4,4,1)
	rng := newRNG()
	tests := []struct {
		name  string
		shape []int
		block [2]int
		index func(ex, r, c int) int
	}{
		{"per-tensor", nil, [2]int{}, func(ex, r, c int) int { return 0 }},
		{"per-expert", []int{e}, [2]int{}, func(ex, r, c int) int { return ex }},
		{"per-channel", []int{e, rows}, [2]int{}, func(ex, r, c int) int { return ex*rows + r }},
		{"block", []int{e, 3, 4}, blk, func(ex, r, c int) int { return ex*12 + (r/3)*4 + c/4 }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n := 1
			for _, d := range tt.shape {
				n *= d
			}
			vals := positive(rng, n)
			ws, err := NewWeightScale(tt.shape, vals, e, rows, cols, tt.block)
			if err != nil {
				t.Fatal(err)
			}
			seen := map[int]bool{}
			for ex := range e {
				for r := range rows {
					for c := range cols {
						i := tt.index(ex, r, c)
						seen[i] = true
						if got, want := ws.At(ex, r, c), vals[i]; got != want {
							t.Fatalf("At(%d, %d, %d) = %v, want %v", ex, r, c, got, want)
						}
					}
				}
			}
			if len(seen) != n {
				t.Errorf("At reached %d of %d scales", len(seen), n)
			}
		})
	}
	t.Run("Expert", func(t *testing.T) {
		vals := positive(rng, e)
		pe, _ := NewWeightScale([]int{e}, vals, e, rows, cols, [2]int{})
		pt, _ := NewWeightScale(nil, vals[:1], e, rows, cols, [2]int{})
		for ex := range e {
			if got := pe.Expert(ex); got != vals[ex] {
				t.Errorf("per-expert Expert(%d) = %v, want %v", ex, got, vals[ex])
			}
			if got := pt.Expert(ex); got != vals[0] {
				t.Errorf("per-tensor Expert(%d) = %v, want %v", ex, got, vals[0])
			}
		}
		pc, _ := NewWeightScale([]int{e, rows}, positive(rng, e*rows), e, rows, cols, [2]int{})
		defer func() {
			if recover() == nil {
				t.Errorf("Expert on a per-channel scale did not panic")
			}
		}()
		pc.Expert(0)
	})
}

func TestGranularityString(t *testing.T) {
	for g, want := range map[Granularity]string{PerTensor: "per-tensor", PerExpert: "per-expert",
		PerChannel: "per-channel", Block: "block", 0: "unknown", 9: "unknown"} {
		if got := g.String(); got != want {
			t.Errorf("Granularity(%d).String() = %q, want %q", int(g), got, want)
		}
	}
}
