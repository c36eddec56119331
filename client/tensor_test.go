package client_test

import (
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// newRand is a fresh random source per test, its seed logged for replay.
func newRand(t *testing.T) *rand.Rand {
	seed := uint64(time.Now().UnixNano())
	t.Logf("random seed %d", seed)
	return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
}

func randn(rng *rand.Rand, n int, scale float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(rng.NormFloat64() * scale)
	}
	return v
}

func TestTensorRoundTrip(t *testing.T) {
	rng := newRand(t)
	v := randn(rng, 6*5, 1)
	bf := make([]uint16, len(v))
	codes := make([]byte, len(v))
	want8 := make([]float32, len(v))
	wantBF := make([]float32, len(v))
	for i, x := range v {
		bf[i] = scaling.Float32ToBF16(x)
		wantBF[i] = scaling.BF16ToFloat32(bf[i])
		codes[i] = scaling.Float32ToE4M3(x)
		want8[i] = scaling.E4M3ToFloat32(codes[i])
	}
	tests := []struct {
		name      string
		t         client.Tensor
		wantDType moe.DType
		want      []float32
	}{
		{"float32", client.FromFloat32(v, 6, 5), moe.Float32, v},
		{"bfloat16 bits", client.FromBFloat16(bf, 6, 5), moe.BFloat16, wantBF},
		{"bfloat16 rounded", client.BFloat16FromFloat32(v, 6, 5), moe.BFloat16, wantBF},
		{"fp8", client.FromFP8(codes, 30), moe.Float8E4M3FN, want8},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.t.DType != tc.wantDType {
				t.Errorf("dtype = %v, want %v", tc.t.DType, tc.wantDType)
			}
			if err := tc.t.Validate(); err != nil {
				t.Fatalf("Validate() = %v", err)
			}
			got, err := tc.t.Float32s()
			if err != nil {
				t.Fatalf("Float32s() = %v", err)
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("Float32s() = %v, want %v", got, tc.want)
			}
			back, err := client.TensorFromProto(tc.t.Proto())
			if err != nil {
				t.Fatalf("TensorFromProto(Proto()) = %v", err)
			}
			if back.DType != tc.t.DType || !slices.Equal(back.Shape, tc.t.Shape) || !slices.Equal(back.Data, tc.t.Data) {
				t.Errorf("proto round trip = %+v, want %+v", back, tc.t)
			}
		})
	}
}

func TestInt32s(t *testing.T) {
	rng := newRand(t)
	v := make([]int32, 12)
	for i := range v {
		v[i] = rng.Int32() - math.MaxInt32/2
	}
	got, err := client.FromInt32(v, 3, 4).Int32s()
	if err != nil || !slices.Equal(got, v) {
		t.Errorf("Int32s() = %v, %v; want %v", got, err, v)
	}
	if _, err := client.FromFloat32([]float32{1}, 1).Int32s(); err == nil {
		t.Error("Int32s() of a float32 tensor: no error")
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name    string
		t       client.Tensor
		wantErr string
	}{
		{"scalar", client.FromFloat32([]float32{2}), ""},
		{"empty dim", client.FromFloat32(nil, 0, 4), ""},
		{"too few values", client.FromFloat32([]float32{1, 2, 3}, 2, 2), "needs 16 bytes, got 12"},
		{"too many codes", client.FromFP8([]byte{1, 2, 3}, 2), "needs 2 bytes, got 3"},
		{"negative dim", client.Tensor{DType: moe.Int32, Shape: []int{-1}}, "negative"},
		{"no dtype", client.Tensor{Shape: []int{1}, Data: []byte{0}}, "unknown dtype"},
		{"dtype beyond the contract", client.Tensor{DType: moe.DType(99), Shape: []int{1}, Data: []byte{0}}, "unknown dtype"},
		{"overflowing shape", client.Tensor{DType: moe.Float32, Shape: []int{1 << 30, 1 << 30, 1 << 30}}, "more than 2^40 elements"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.t.Validate()
			if tc.wantErr == "" {
				if err != nil {
					t.Errorf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("Validate() = %v, want an error containing %q", err, tc.wantErr)
			}
		})
	}
}

func TestIsZero(t *testing.T) {
	if !(client.Tensor{}).IsZero() {
		t.Error("zero Tensor: IsZero() = false")
	}
	if client.FromFloat32([]float32{}).IsZero() {
		t.Error("empty FP32 scalar-shaped tensor: IsZero() = true")
	}
	if (client.Tensor{}).Proto() != nil {
		t.Error("zero Tensor: Proto() != nil")
	}
}

func TestQuantizeFP8(t *testing.T) {
	// Row 0 has amax 448 (scale 1, every value exact), row 1 amax 4 in its
	// first group of 2 and 0.5 in its second.
	v := []float32{448, -1, 2, 0.5, -4, 1, 0.25, -0.5}
	tests := []struct {
		name       string
		group      int
		wantShape  []int
		wantScales []float32
	}{
		{"per token", 4, []int{2}, []float32{1, 4.0 / 448}},
		{"per group of 2", 2, []int{2, 2}, []float32{448.0 / 448, 2.0 / 448, 4.0 / 448, 0.5 / 448}},
		{"short last group", 3, []int{2, 2}, []float32{1, 0.5 / 448, 4.0 / 448, 0.5 / 448}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			codes, scales, err := client.QuantizeFP8(v, 2, 4, tt.group)
			if err != nil {
				t.Fatal(err)
			}
			if got, want := codes.Shape, []int{2, 4}; !slices.Equal(got, want) || codes.DType != moe.Float8E4M3FN {
				t.Errorf("codes: %v %v, want FP8 %v", codes.DType, got, want)
			}
			if got := scales.Shape; !slices.Equal(got, tt.wantShape) {
				t.Errorf("scales shape %v, want %v", got, tt.wantShape)
			}
			got, err := scales.Float32s()
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tt.wantScales) {
				t.Errorf("scales %v, want %v", got, tt.wantScales)
			}
			// Dequantized, every value is within FP8's half-ulp (1/16 relative).
			groups := len(tt.wantScales) / 2
			for i, x := range v {
				r, c := i/4, i%4
				deq := scaling.E4M3ToFloat32(codes.Data[i]) * tt.wantScales[r*groups+c/tt.group]
				if d := math.Abs(float64(deq - x)); d > math.Abs(float64(x))/16 {
					t.Errorf("value %d: %g dequantizes to %g", i, x, deq)
				}
			}
		})
	}
	for _, bad := range []struct{ rows, cols, group int }{{2, 3, 3}, {0, 8, 8}, {2, 4, 0}} {
		if _, _, err := client.QuantizeFP8(v, bad.rows, bad.cols, bad.group); err == nil {
			t.Errorf("QuantizeFP8(%d values, %d, %d, %d): no error", len(v), bad.rows, bad.cols, bad.group)
		}
	}
}
