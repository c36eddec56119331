package scaling

import (
	"encoding/json"
	"math"
	"os"
	"testing"
)

// golden is testdata/fp8_golden.json, written by testdata/gen_golden.py
// with numpy and ml_dtypes.
type golden struct {
	NumPy          string   `json:"numpy"`
	MLDtypes       string   `json:"ml_dtypes"`
	Inputs         []uint32 `json:"inputs"`
	E4M3FN         []uint8  `json:"e4m3fn"`
	E4M3FNCast     []uint8  `json:"e4m3fn_cast"`
	E5M2           []uint8  `json:"e5m2"`
	BFloat16       []uint16 `json:"bfloat16"`
	Float16        []uint16 `json:"float16"`
	DecodeE4M3FN   []uint32 `json:"decode_e4m3fn"`
	DecodeE5M2     []uint32 `json:"decode_e5m2"`
	BFloat16Codes  []uint16 `json:"bfloat16_codes"`
	DecodeBFloat16 []uint32 `json:"decode_bfloat16"`
	Float16Codes   []uint16 `json:"float16_codes"`
	DecodeFloat16  []uint32 `json:"decode_float16"`
}

// uint8s decodes a JSON array of numbers (encoding/json would take []uint8
// for base64).
type uint8s []uint8

func (u *uint8s) UnmarshalJSON(b []byte) error {
	var v []uint16
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*u = make([]uint8, len(v))
	for i, x := range v {
		(*u)[i] = uint8(x)
	}
	return nil
}

func loadGolden(t *testing.T) golden {
	t.Helper()
	b, err := os.ReadFile("testdata/fp8_golden.json")
	if err != nil {
		t.Fatalf("%v (regenerate with scaling/testdata/gen_golden.sh)", err)
	}
	var raw struct {
		golden
		E4M3FN     uint8s `json:"e4m3fn"`
		E4M3FNCast uint8s `json:"e4m3fn_cast"`
		E5M2       uint8s `json:"e5m2"`
	}
	if err := json.Unmarshal(b, &raw); err != nil {
		t.Fatal(err)
	}
	g := raw.golden
	g.E4M3FN, g.E4M3FNCast, g.E5M2 = raw.E4M3FN, raw.E4M3FNCast, raw.E5M2
	n := len(g.Inputs)
	if n < 1000 || len(g.E4M3FN) != n || len(g.E4M3FNCast) != n || len(g.E5M2) != n || len(g.BFloat16) != n || len(g.Float16) != n ||
		len(g.DecodeE4M3FN) != 256 || len(g.DecodeE5M2) != 256 ||
		len(g.BFloat16Codes) != len(g.DecodeBFloat16) || len(g.Float16Codes) != len(g.DecodeFloat16) {
		t.Fatalf("golden file is inconsistent: %d inputs", n)
	}
	return g
}

// TestGoldenEncode checks every encoder against ml_dtypes (numpy for
// float16) on the golden inputs: boundaries of every format, specials,
// randn at three magnitudes and random bit patterns. NaNs match as NaNs of
// the same sign; the formats have several NaN codes.
func TestGoldenEncode(t *testing.T) {
	g := loadGolden(t)
	t.Logf("golden from numpy %s, ml_dtypes %s: %d inputs", g.NumPy, g.MLDtypes, len(g.Inputs))
	for i, b := range g.Inputs {
		x := math.Float32frombits(b)
		checks := []struct {
			f         format
			got, want uint32
		}{
			{fmtE4M3, uint32(Float32ToE4M3(x)), uint32(g.E4M3FN[i])},
			{fmtE5M2, uint32(Float32ToE5M2(x)), uint32(g.E5M2[i])},
			{fmtBF16, uint32(Float32ToBF16(x)), uint32(g.BFloat16[i])},
			{fmtFP16, uint32(Float32ToFP16(x)), uint32(g.Float16[i])},
		}
		for _, c := range checks {
			if !c.f.same(c.got, c.want) {
				t.Errorf("input %d, %v (%#08x): %s %#x, ml_dtypes %#x", i, x, b, c.f.name, c.got, c.want)
			}
		}
	}
}

// TestGoldenE4M3Saturation pins down the one documented difference from a
// plain ml_dtypes cast: where the cast gives NaN for a number (it rounds
// past 448, or is ±Inf), expertd saturates to ±448; everywhere else the two
// agree exactly.
func TestGoldenE4M3Saturation(t *testing.T) {
	g := loadGolden(t)
	differ := 0
	for i, b := range g.Inputs {
		x := math.Float32frombits(b)
		got, cast := Float32ToE4M3(x), g.E4M3FNCast[i]
		castNaN := cast&0x7F == 0x7F
		switch {
		case castNaN && !math.IsNaN(float64(x)):
			differ++
			if math.Abs(float64(x)) < 464 {
				t.Errorf("%v: ml_dtypes gives NaN below the saturation threshold 464", x)
			}
			if got&0x7F != 0x7E {
				t.Errorf("%v: got %#02x, want ±448 (saturated)", x, got)
			}
		case !fmtE4M3.same(uint32(got), uint32(cast)):
			t.Errorf("%v (%#08x): got %#02x, ml_dtypes cast %#02x", x, b, got, cast)
		}
	}
	if differ < 100 {
		t.Errorf("only %d inputs beyond E4M3's range: the golden inputs do not exercise saturation", differ)
	}
	t.Logf("%d inputs saturate here and are NaN in a plain cast", differ)
}

// TestGoldenDecode checks the decoders against ml_dtypes' decoding of every
// FP8 code and of sampled BF16 and FP16 codes.
func TestGoldenDecode(t *testing.T) {
	g := loadGolden(t)
	same := func(got float32, want uint32) bool {
		w := math.Float32frombits(want)
		if w != w {
			return got != got
		}
		return math.Float32bits(got) == want
	}
	for c := range 256 {
		if got := E4M3Table[c]; !same(got, g.DecodeE4M3FN[c]) {
			t.Errorf("E4M3 %#02x: %v, ml_dtypes %v", c, got, math.Float32frombits(g.DecodeE4M3FN[c]))
		}
		if got := E5M2Table[c]; !same(got, g.DecodeE5M2[c]) {
			t.Errorf("E5M2 %#02x: %v, ml_dtypes %v", c, got, math.Float32frombits(g.DecodeE5M2[c]))
		}
	}
	for i, c := range g.BFloat16Codes {
		if got := BF16ToFloat32(c); !same(got, g.DecodeBFloat16[i]) {
			t.Errorf("BF16 %#04x: %v, ml_dtypes %v", c, got, math.Float32frombits(g.DecodeBFloat16[i]))
		}
	}
	for i, c := range g.Float16Codes {
		if got := FP16ToFloat32(c); !same(got, g.DecodeFloat16[i]) {
			t.Errorf("FP16 %#04x: %v, numpy %v", c, got, math.Float32frombits(g.DecodeFloat16[i]))
		}
	}
}
