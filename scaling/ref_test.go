package scaling

import (
	"math"
	"sort"
)

// This file is an independent, slow model of the formats: code values come
// from the format's definition in float64, and encoding is "the nearest
// code by distance, ties to the even code" found by search. It shares no
// code with the encoders under test.

// format describes a binary floating-point format with 1 sign bit.
type format struct {
	name             string
	expBits, manBits int
	bias             int
	// finiteMax is the largest positive finite code; codes above it are
	// Inf or NaN.
	finiteMax uint32
	// saturate: overflow gives finiteMax (E4M3FN); otherwise IEEE, where
	// rounding treats Inf as the code after finiteMax, valued
	// 2^(emax+1).
	saturate bool
	// inf is the positive infinity code, or 0 when the format has none.
	inf uint32
}

var (
	fmtE4M3 = format{"E4M3FN", 4, 3, 7, 0x7E, true, 0}
	fmtE5M2 = format{"E5M2", 5, 2, 15, 0x7B, false, 0x7C}
	fmtFP16 = format{"FP16", 5, 10, 15, 0x7BFF, false, 0x7C00}
	fmtBF16 = format{"BF16", 8, 7, 127, 0x7F7F, false, 0x7F80}
)

func (f format) bits() int       { return 1 + f.expBits + f.manBits }
func (f format) signBit() uint32 { return 1 << (f.expBits + f.manBits) }
func (f format) magMask() uint32 { return f.signBit() - 1 }
func (f format) isNaN(c uint32) bool {
	m := c & f.magMask()
	if f.saturate { // E4M3FN: only S.1111.111
		return m == f.magMask()
	}
	return m > f.inf
}

// value is the exact value of a positive code c <= finiteMax+1 (the
// latter being 2^(emax+1), Inf's stand-in when rounding).
func (f format) value(c uint32) float64 {
	e := int(c >> f.manBits)
	m := float64(c & (1<<f.manBits - 1))
	if e == 0 {
		return m * math.Pow(2, float64(1-f.bias-f.manBits))
	}
	return (1 + m/math.Pow(2, float64(f.manBits))) * math.Pow(2, float64(e-f.bias))
}

// refTables holds the sorted positive values of each format, built before
// any (parallel) test runs.
var refTables = func() map[string][]float64 {
	m := map[string][]float64{}
	for _, f := range []format{fmtE4M3, fmtE5M2, fmtFP16, fmtBF16} {
		m[f.name] = f.buildTable()
	}
	return m
}()

// table returns the sorted positive values of f: every finite code's and,
// in IEEE formats, Inf's stand-in 2^(emax+1) last.
func (f format) table() []float64 { return refTables[f.name] }

func (f format) buildTable() []float64 {
	n := f.finiteMax + 1
	if !f.saturate {
		n++ // Inf's stand-in
	}
	t := make([]float64, n)
	for c := range t {
		t[c] = f.value(uint32(c))
	}
	return t
}

// refEncode is the reference encoder of x in f.
func (f format) refEncode(x float64) uint32 {
	var sign uint32
	if math.Signbit(x) {
		sign = f.signBit()
	}
	if math.IsNaN(x) {
		return sign | f.magMask() // some NaN; compare NaNs with f.same
	}
	a := math.Abs(x)
	t := f.table()
	// First value >= a.
	i := sort.SearchFloat64s(t, a)
	var c uint32
	switch {
	case i == len(t): // beyond the last value
		c = uint32(len(t) - 1)
	case t[i] == a || i == 0:
		c = uint32(i)
	default:
		lo, hi := a-t[i-1], t[i]-a
		switch {
		case lo < hi:
			c = uint32(i - 1)
		case hi < lo:
			c = uint32(i)
		case i%2 == 0:
			c = uint32(i)
		default:
			c = uint32(i - 1)
		}
	}
	if f.saturate && c > f.finiteMax {
		c = f.finiteMax
	}
	return sign | c
}

// refDecode is the value of any code, NaN for NaN codes.
func (f format) refDecode(c uint32) float64 {
	s := 1.0
	if c&f.signBit() != 0 {
		s = -1
	}
	m := c & f.magMask()
	switch {
	case f.isNaN(c):
		return math.NaN()
	case !f.saturate && m == f.inf:
		return math.Inf(int(s))
	}
	return s * f.value(m)
}

// same reports whether codes got and want are equal, or both NaN of the
// same sign (formats have many NaN codes; the encoders pick one).
func (f format) same(got, want uint32) bool {
	if f.isNaN(got) && f.isNaN(want) {
		return got&f.signBit() == want&f.signBit()
	}
	return got == want
}
