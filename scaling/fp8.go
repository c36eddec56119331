// Package scaling holds the number formats and quantization-scale math of
// expertd: FP8 (E4M3FN, E5M2), BF16 and FP16 codecs, the scale granularities
// of MOE_SPEC.md, activation quantization, and the folding of scales into
// the per-expert alphas that fused kernels consume.
//
// Every encoder rounds to nearest, ties to even, as the hardware converters
// (cvt.rn.satfinite on Hopper) and torch do.
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

// E4M3ToFloat32 decodes one FP8 E4M3FN code.
func E4M3ToFloat32(b uint8) float32 { return E4M3Table[b] }

// E5M2ToFloat32 decodes one FP8 E5M2 code.
func E5M2ToFloat32(b uint8) float32 { return E5M2Table[b] }

func decodeE4M3(b uint8) float32 {
	sign := float32(1)
	if b&0x80 != 0 {
		sign = -1
	}
	e := int(b>>3) & 0xF
	m := int(b & 0x7)
	switch {
	case e == 0xF && m == 0x7:
		return float32(math.NaN())
	case e == 0:
		return sign * float32(m) * (1.0 / 512) // subnormal: m * 2^-9
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
		return float32(math.NaN())
	case e == 0:
		return sign * float32(m) * float32(math.Ldexp(1, -16)) // m * 2^-16
	default:
		return sign * float32(math.Ldexp(1+float64(m)/4, e-15))
	}
}

// Float32ToE4M3 encodes f as FP8 E4M3FN, rounding to nearest even and
// saturating to ±448: E4M3FN has no infinity, and a quantizer that overflowed
// to NaN would poison a whole GEMM row. NaN stays NaN (0x7F, sign kept).
func Float32ToE4M3(f float32) uint8 {
	return encodeFP8(f, 3, 7, E4M3Max, true)
}

// Float32ToE5M2 encodes f as FP8 E5M2 with IEEE semantics: round to nearest
// even, overflow to ±Inf, NaN to a quiet NaN.
func Float32ToE5M2(f float32) uint8 {
	return encodeFP8(f, 2, 15, E5M2Max, false)
}

// encodeFP8 rounds f to a 1-sign, (7-manBits)-exponent, manBits-mantissa
// code with the given bias. Exact: all work is on float64, where every FP8
// value and every midpoint between two of them is representable.
func encodeFP8(f float32, manBits, bias int, maxFinite float64, saturate bool) uint8 {
	bits := math.Float32bits(f)
	sign := uint8(bits>>31) << 7
	x := math.Abs(float64(f))
	expBits := 7 - manBits
	if math.IsNaN(x) {
		if saturate { // E4M3FN: the only NaN is S.1111.111
			return sign | 0x7F
		}
		return sign | 0x7F // E5M2: exponent all ones, mantissa 11 (quiet)
	}
	minNormalExp := 1 - bias
	// Quantum (spacing) at x's binade, never below the subnormal spacing.
	e := minNormalExp
	if x >= math.Ldexp(1, minNormalExp) {
		_, e2 := math.Frexp(x) // x = frac * 2^e2, frac in [0.5,1)
		e = e2 - 1
	}
	q := math.Ldexp(1, e-manBits)
	r := math.RoundToEven(x/q) * q
	if r > maxFinite {
		if saturate {
			r = maxFinite
		} else {
			return sign | uint8(((1<<expBits)-1)<<manBits) // Inf
		}
	}
	if r == 0 {
		return sign
	}
	if r < math.Ldexp(1, minNormalExp) {
		return sign | uint8(r/math.Ldexp(1, minNormalExp-manBits))
	}
	frac, e2 := math.Frexp(r)
	exp := e2 - 1 + bias
	man := int((frac*2-1)*float64(int(1)<<manBits) + 0.5)
	return sign | uint8(exp<<manBits) | uint8(man)
}
