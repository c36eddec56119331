package scaling

import "math"

// Float32ToBF16 encodes f as bfloat16 (the top 16 bits of a float32),
// rounding to nearest even; overflow rounds to ±Inf and NaN stays a quiet
// NaN of the same sign.
func Float32ToBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7FFFFFFF > 0x7F800000 {
		return uint16(b>>16) | 0x40
	}
	return uint16(roundShift(b, 16)) // the sign bit rides along untouched
}

// BF16ToFloat32 decodes one bfloat16 value exactly.
func BF16ToFloat32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// Float32ToFP16 encodes f as IEEE binary16, rounding to nearest even, with
// subnormals, overflow to ±Inf (from 65520, the midpoint between 65504 and
// 2^16, up) and NaN to the quiet NaN 0x7E00 with f's sign.
func Float32ToFP16(f float32) uint16 {
	bits := math.Float32bits(f)
	sign := uint16(bits>>31) << 15
	abs := bits & 0x7FFFFFFF
	switch {
	case abs > 0x7F800000: // NaN
		return sign | 0x7E00
	case abs >= 0x477FF000: // >= 65520 rounds to Inf
		return sign | 0x7C00
	case abs >= 0x38800000: // >= 2^-14, the smallest normal
		return sign | uint16(roundShift(abs, 13)-(127-15)<<10)
	default: // subnormal: multiples of 2^-24
		return sign | uint16(math.RoundToEven(float64(math.Float32frombits(abs))*(1<<24)))
	}
}

// FP16ToFloat32 decodes one IEEE binary16 value exactly (NaN payloads kept).
func FP16ToFloat32(h uint16) float32 {
	sign := uint32(h>>15) << 31
	e := uint32(h>>10) & 0x1F
	m := uint32(h & 0x3FF)
	switch e {
	case 0: // zero or subnormal: m · 2^-24
		v := float32(m) * (1.0 / (1 << 24))
		return math.Float32frombits(sign | math.Float32bits(v))
	case 0x1F:
		return math.Float32frombits(sign | 0x7F800000 | m<<13)
	default:
		return math.Float32frombits(sign | (e+127-15)<<23 | m<<13)
	}
}
