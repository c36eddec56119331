package scaling

import "math"

// Float32ToBF16 encodes f as bfloat16 (the top 16 bits of a float32),
// rounding to nearest even; NaN stays a quiet NaN of the same sign.
func Float32ToBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7FFFFFFF > 0x7F800000 {
		return uint16(b>>16) | 0x40
	}
	b += 0x7FFF + (b>>16)&1
	return uint16(b >> 16)
}

// BF16ToFloat32 decodes one bfloat16 value exactly.
func BF16ToFloat32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }
