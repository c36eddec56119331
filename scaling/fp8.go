// Package scaling holds the number formats and quantization-scale math of
// expertd: the FP8 E4M3FN and E5M2, BF16 and FP16 codecs; the scale
// granularities of MOE_SPEC.md (per-tensor, per-expert, per-channel or
// per-token, and [Bn, Bk] block) with the validation of a scale's shape;
// quantization and dequantization of activations and weights; and the
// folding of per-tensor and per-expert scales into the alphas that fused
// kernels consume.
//
// Every encoder rounds to nearest, ties to even, as the hardware converters
// (cvt.rn on Hopper), torch and ml_dtypes do, and handles subnormals, -0
// and NaN. Out of range, the formats differ on purpose:
//   - E4M3FN has no infinity; Float32ToE4M3 saturates to ±448 (±Inf too), as
//     cvt.rn.satfinite and torch's clamp-then-cast quantizers do. A plain
//     ml_dtypes or torch cast gives NaN there instead, which in a quantizer
//     would poison a whole GEMM row.
//   - E5M2, BF16 and FP16 follow IEEE 754: overflow rounds to ±Inf.
//
// NaN encodes to a NaN of the same sign: 0x7F/0xFF in both FP8 formats,
// 0x7E00/0xFE00 in FP16, and in BF16 the input's top payload bits with the
// quiet bit set (0x7FC0 for the usual quiet NaN).
//
// A scale s dequantizes a code q as decode(q)·s, so quantizing x stores
// encode(x/s); scales are clamped to MinScale because near-zero scales turn
// into NaN on the GPU.
package scaling

import "math"

// E4M3Max is the largest finite FP8 E4M3FN magnitude.
const E4M3Max = 448.0

// E5M2Max is the largest finite FP8 E5M2 magnitude.
const E5M2Max = 57344.0

// E4M3Table decodes every FP8 E4M3FN code; index it by the byte.
// A table beats bit manipulation in the CPU backend's inner loops.
var E4M3Table = func() (t [256]float32) {
	for i := range t {
		t[i] = decodeE4M3(uint8(i))
	}
	return t
}()

// E5M2Table decodes every FP8 E5M2 code.
var E5M2Table = func() (t [256]float32) {
	for i := range t {
		t[i] = decodeE5M2(uint8(i))
	}
	return t
}()

// E4M3ToFloat32 decodes one FP8 E4M3FN code exactly.
func E4M3ToFloat32(b uint8) float32 { return E4M3Table[b] }

// E5M2ToFloat32 decodes one FP8 E5M2 code exactly.
func E5M2ToFloat32(b uint8) float32 { return E5M2Table[b] }

// nanWithSign is a quiet float32 NaN whose sign bit is that of the code,
// so that decode then encode gives a NaN code of the same sign back.
func nanWithSign(b uint8) float32 {
	return math.Float32frombits(uint32(b>>7)<<31 | 0x7FC00000)
}

func decodeE4M3(b uint8) float32 {
	sign := float32(1)
	if b&0x80 != 0 {
		sign = -1
	}
	e := int(b>>3) & 0xF
	m := int(b & 0x7)
	switch {
	case e == 0xF && m == 0x7:
		return nanWithSign(b)
	case e == 0:
		return sign * float32(m) * (1.0 / 512) // subnormal: m · 2^-9
	default:
		return sign * float32(math.Ldexp(1+float64(m)/8, e-7))
	}
}

func decodeE5M2(b uint8) float32 {
	sign := float32(1)
	if b&0x80 != 0 {
		sign = -1
	}
	e := int(b>>2) & 0x1F
	m := int(b & 0x3)
	switch {
	case e == 0x1F && m == 0:
		return sign * float32(math.Inf(1))
	case e == 0x1F:
		return nanWithSign(b)
	case e == 0:
		return sign * float32(m) * (1.0 / 65536) // subnormal: m · 2^-16
	default:
		return sign * float32(math.Ldexp(1+float64(m)/4, e-15))
	}
}

// Float32ToE4M3 encodes f as FP8 E4M3FN, rounding to nearest even and
// saturating to ±448 (±Inf included): E4M3FN has no infinity, and a
// quantizer that overflowed to NaN would poison a whole GEMM row. NaN
// encodes to 0x7F or 0xFF, keeping its sign.
func Float32ToE4M3(f float32) uint8 {
	bits := math.Float32bits(f)
	sign := uint8(bits>>31) << 7
	abs := bits & 0x7FFFFFFF
	switch {
	case abs > 0x7F800000: // NaN
		return sign | 0x7F
	case abs >= 0x43E00000: // >= 448, Inf included
		return sign | 0x7E
	case abs >= 0x3C800000: // >= 2^-6, the smallest normal
		return sign | uint8(roundShift(abs, 20)-(127-7)<<3)
	default: // subnormal: multiples of 2^-9, up to 8·2^-9 = the smallest normal's code
		return sign | uint8(math.RoundToEven(float64(math.Float32frombits(abs))*512))
	}
}

// Float32ToE5M2 encodes f as FP8 E5M2 with IEEE semantics: round to nearest
// even, overflow to ±Inf (from 61440, the midpoint between 57344 and 2^16,
// up), NaN to 0x7F or 0xFF, keeping its sign.
func Float32ToE5M2(f float32) uint8 {
	bits := math.Float32bits(f)
	sign := uint8(bits>>31) << 7
	abs := bits & 0x7FFFFFFF
	switch {
	case abs > 0x7F800000: // NaN
		return sign | 0x7F
	case abs >= 0x47700000: // >= 61440 rounds to Inf
		return sign | 0x7C
	case abs >= 0x38800000: // >= 2^-14, the smallest normal
		return sign | uint8(roundShift(abs, 21)-(127-15)<<2)
	default: // subnormal: multiples of 2^-16
		return sign | uint8(math.RoundToEven(float64(math.Float32frombits(abs))*65536))
	}
}

// roundShift drops the low n bits of the magnitude bits abs, rounding to
// nearest even. A mantissa that rounds up carries into the exponent field,
// which is exactly the next binade, so normals need no special case.
func roundShift(abs uint32, n uint) uint32 {
	return (abs + (1<<(n-1) - 1) + (abs>>n)&1) >> n
}
