package scaling

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// codec is one encoder/decoder pair under test with its reference format.
type codec struct {
	f      format
	encode func(float32) uint32
	decode func(uint32) float32
}

var codecs = []codec{
	{fmtE4M3, func(x float32) uint32 { return uint32(Float32ToE4M3(x)) }, func(c uint32) float32 { return E4M3ToFloat32(uint8(c)) }},
	{fmtE5M2, func(x float32) uint32 { return uint32(Float32ToE5M2(x)) }, func(c uint32) float32 { return E5M2ToFloat32(uint8(c)) }},
	{fmtFP16, func(x float32) uint32 { return uint32(Float32ToFP16(x)) }, func(c uint32) float32 { return FP16ToFloat32(uint16(c)) }},
	{fmtBF16, func(x float32) uint32 { return uint32(Float32ToBF16(x)) }, func(c uint32) float32 { return BF16ToFloat32(uint16(c)) }},
}

// TestDecodeAllCodes decodes every code of every format and checks the
// value against the reference and that encoding it gives the code back
// (for NaN codes: a NaN code of the same sign).
func TestDecodeAllCodes(t *testing.T) {
	for _, c := range codecs {
		t.Run(c.f.name, func(t *testing.T) {
			nans := 0
			for code := range uint32(1) << c.f.bits() {
				got, want := c.decode(code), c.f.refDecode(code)
				if math.IsNaN(want) {
					nans++
					if !math.IsNaN(float64(got)) || math.Signbit(float64(got)) != (code&c.f.signBit() != 0) {
						t.Fatalf("decode(%#x) = %v (sign %v), want NaN of the code's sign", code, got, math.Signbit(float64(got)))
					}
				} else if float64(got) != want || math.Signbit(float64(got)) != math.Signbit(want) {
					t.Fatalf("decode(%#x) = %v, want %v", code, got, want)
				}
				if back := c.encode(got); !c.f.same(back, code) {
					t.Fatalf("encode(decode(%#x) = %v) = %#x, want %#x", code, got, back, code)
				}
			}
			// E4M3FN: 0x7F and 0xFF; E5M2: 3 mantissas × 2 signs; FP16: 1023×2; BF16: 127×2.
			wantNaNs := map[string]int{"E4M3FN": 2, "E5M2": 6, "FP16": 2046, "BF16": 254}[c.f.name]
			if nans != wantNaNs {
				t.Errorf("%d NaN codes, want %d", nans, wantNaNs)
			}
		})
	}
}

// TestEncodeBoundaries checks, for every pair of adjacent positive codes
// (Inf counting as the code after the largest finite one in IEEE formats),
// that the midpoint rounds to the even code and its float32 neighbours
// (math.Nextafter32) round to the nearer code, in both signs; and that
// each code's own value encodes to itself.
func TestEncodeBoundaries(t *testing.T) {
	for _, c := range codecs {
		t.Run(c.f.name, func(t *testing.T) {
			t.Parallel()
			tab := c.f.table()
			checks := 0
			check := func(x float32, want uint32, what string) {
				t.Helper()
				checks++
				for _, s := range []float32{1, -1} {
					w := want
					if s < 0 {
						w |= c.f.signBit()
					}
					if got := c.encode(s * x); got != w {
						t.Fatalf("%s: encode(%v = %#08x) = %#x, want %#x", what, s*x, math.Float32bits(s*x), got, w)
					}
				}
			}
			for lo := range uint32(len(tab) - 1) {
				hi := lo + 1
				mid64 := (tab[lo] + tab[hi]) / 2
				mid := float32(mid64)
				if float64(mid) != mid64 {
					t.Fatalf("midpoint of %#x and %#x is not a float32", lo, hi)
				}
				even := lo
				if hi%2 == 0 {
					even = hi
				}
				wantHi := hi
				if c.f.saturate && hi > c.f.finiteMax {
					wantHi, even = c.f.finiteMax, c.f.finiteMax
				}
				check(float32(tab[lo]), lo, "code value")
				check(mid, even, fmt.Sprintf("midpoint of %#x and %#x", lo, hi))
				check(math.Nextafter32(mid, 0), lo, "just below the midpoint")
				check(math.Nextafter32(mid, float32(math.Inf(1))), wantHi, "just above the midpoint")
			}
			if checks < 4*(len(tab)-1) {
				t.Fatalf("only %d checks", checks)
			}
		})
	}
}

// TestEncodeSpecials covers saturation, overflow, infinities, NaN, signed
// zero and values below the smallest subnormal, with explicit codes.
func TestEncodeSpecials(t *testing.T) {
	inf := float32(math.Inf(1))
	nan := float32(math.NaN())
	negNaN := math.Float32frombits(0xFFC00001)
	tiny := math.Float32frombits(1) // smallest float32 subnormal
	tests := []struct {
		name string
		x    float32
		e4m3 uint8
		e5m2 uint8
		fp16 uint16
		bf16 uint16
	}{
		{"+0", 0, 0x00, 0x00, 0x0000, 0x0000},
		{"-0", float32(math.Copysign(0, -1)), 0x80, 0x80, 0x8000, 0x8000},
		{"+tiny", tiny, 0x00, 0x00, 0x0000, 0x0000},
		{"-tiny", -tiny, 0x80, 0x80, 0x8000, 0x8000},
		{"1", 1, 0x38, 0x3C, 0x3C00, 0x3F80},
		{"-2", -2, 0xC0, 0xC0, 0xC000, 0xC000},
		{"E4M3 smallest subnormal 2^-9", 1.0 / 512, 0x01, 0x18, 0x1800, 0x3B00},
		{"2^-10 ties to 0 in E4M3", 1.0 / 1024, 0x00, 0x14, 0x1400, 0x3A80},
		{"E4M3 smallest normal 2^-6", 1.0 / 64, 0x08, 0x24, 0x2400, 0x3C80},
		{"E5M2 smallest subnormal 2^-16", 1.0 / 65536, 0x00, 0x01, 0x0100, 0x3780},
		{"448 = E4M3 max", 448, 0x7E, 0x5F, 0x5F00, 0x43E0},
		{"464 would be 0x7F: saturates", 464, 0x7E, 0x5F, 0x5F40, 0x43E8},
		{"480 ties up to 512 in E5M2", 480, 0x7E, 0x60, 0x5F80, 0x43F0},
		{"-1e6", -1e6, 0xFE, 0xFC, 0xFC00, 0xC974},
		{"57344 = E5M2 max", 57344, 0x7E, 0x7B, 0x7B00, 0x4760},
		{"61440 ties to Inf in E5M2", 61440, 0x7E, 0x7C, 0x7B80, 0x4770},
		{"65504 = FP16 max", 65504, 0x7E, 0x7C, 0x7BFF, 0x4780},
		{"65520 ties to Inf in FP16", 65520, 0x7E, 0x7C, 0x7C00, 0x4780},
		{"float32 max rounds to Inf in BF16", math.MaxFloat32, 0x7E, 0x7C, 0x7C00, 0x7F80},
		{"+Inf", inf, 0x7E, 0x7C, 0x7C00, 0x7F80},
		{"-Inf", -inf, 0xFE, 0xFC, 0xFC00, 0xFF80},
		{"NaN", nan, 0x7F, 0x7F, 0x7E00, 0x7FC0},
		{"-NaN with payload", negNaN, 0xFF, 0xFF, 0xFE00, 0xFFC0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Float32ToE4M3(tt.x); got != tt.e4m3 {
				t.Errorf("Float32ToE4M3(%v) = %#02x, want %#02x", tt.x, got, tt.e4m3)
			}
			if got := Float32ToE5M2(tt.x); got != tt.e5m2 {
				t.Errorf("Float32ToE5M2(%v) = %#02x, want %#02x", tt.x, got, tt.e5m2)
			}
			if got := Float32ToFP16(tt.x); got != tt.fp16 {
				t.Errorf("Float32ToFP16(%v) = %#04x, want %#04x", tt.x, got, tt.fp16)
			}
			if got := Float32ToBF16(tt.x); got != tt.bf16 {
				t.Errorf("Float32ToBF16(%v) = %#04x, want %#04x", tt.x, got, tt.bf16)
			}
		})
	}
}

// TestEncodeSampled compares every encoder with the reference on float32
// bit patterns spread over the whole space (a stride prime to every
// field width) and on random ones.
func TestEncodeSampled(t *testing.T) {
	stride := uint32(3001)
	if testing.Short() {
		stride = 104729
	}
	for _, c := range codecs {
		t.Run(c.f.name, func(t *testing.T) {
			t.Parallel()
			// One generator a subtest: the subtests run in parallel, and a
			// rand.Rand is not safe for concurrent use.
			rng := rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
			n := 0
			try := func(b uint32) {
				n++
				x := math.Float32frombits(b)
				if got, want := c.encode(x), c.f.refEncode(float64(x)); !c.f.same(got, want) {
					t.Fatalf("encode(%v = %#08x) = %#x, want %#x", x, b, got, want)
				}
			}
			for b := uint64(0); b < 1<<32; b += uint64(stride) {
				try(uint32(b))
			}
			for range 20000 {
				try(rng.Uint32())
			}
			t.Logf("%d inputs", n)
		})
	}
}

// FuzzFloat32ToE4M3 compares the E4M3FN encoder with the reference, and
// checks that decoding gives a value no farther from the input than half
// a quantum (saturation aside).
func FuzzFloat32ToE4M3(f *testing.F) {
	for _, b := range []uint32{0, 0x80000000, 0x3F800000, 0x43E00000, 0x43E80000, 0x3A800000, 0x7F800000, 0x7FC00000, 0x00000001, 0x3C7FFFFF} {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b uint32) {
		x := math.Float32frombits(b)
		got, want := uint32(Float32ToE4M3(x)), fmtE4M3.refEncode(float64(x))
		if !fmtE4M3.same(got, want) {
			t.Fatalf("Float32ToE4M3(%v = %#08x) = %#02x, want %#02x", x, b, got, want)
		}
	})
}

// FuzzFloat32ToE5M2 compares the E5M2 encoder with the reference.
func FuzzFloat32ToE5M2(f *testing.F) {
	for _, b := range []uint32{0, 0x80000000, 0x47600000, 0x47700000, 0x376FFFFF, 0xFF800000, 0xFFC00000} {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b uint32) {
		x := math.Float32frombits(b)
		got, want := uint32(Float32ToE5M2(x)), fmtE5M2.refEncode(float64(x))
		if !fmtE5M2.same(got, want) {
			t.Fatalf("Float32ToE5M2(%v = %#08x) = %#02x, want %#02x", x, b, got, want)
		}
	})
}

// FuzzFloat32ToHalf compares the FP16 and BF16 encoders with the reference.
func FuzzFloat32ToHalf(f *testing.F) {
	for _, b := range []uint32{0, 0x80000000, 0x477FE000, 0x477FF000, 0x7F7FFFFF, 0x33000000, 0x7F800001} {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b uint32) {
		x := math.Float32frombits(b)
		if got, want := uint32(Float32ToFP16(x)), fmtFP16.refEncode(float64(x)); !fmtFP16.same(got, want) {
			t.Fatalf("Float32ToFP16(%v = %#08x) = %#04x, want %#04x", x, b, got, want)
		}
		if got, want := uint32(Float32ToBF16(x)), fmtBF16.refEncode(float64(x)); !fmtBF16.same(got, want) {
			t.Fatalf("Float32ToBF16(%v = %#08x) = %#04x, want %#04x", x, b, got, want)
		}
	})
}
