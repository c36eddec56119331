package weights

import (
	"bytes"
	"strings"
	"testing"

	"github.com/expertd/expertd/moe"
)

// TestTransposedView reads stored bytes through, and a virtual matrix
// whole as the transpose of the one stored, over several bands of rows;
// a read of part of one, or across where the stored tensors end, fails
// rather than returning wrong bytes.
func TestTransposedView(t *testing.T) {
	// Three tiles of columns, the last short.
	const rows, cols, item = 7, 2*transposeTile + 6, halfBytes
	stored := make([]byte, 16+rows*cols*item)
	for i := range stored {
		stored[i] = byte(i * 7)
	}
	end := int64(len(stored))
	v := &transposedView{r: bytes.NewReader(stored), start: end, at: end, band: transposeBand}
	tt := v.add(0, "BF16", 16, rows, cols)
	if got := tt.Shape; len(got) != 2 || got[0] != cols || got[1] != rows || tt.DataOffsets != [2]int64{end, end + rows*cols*item} {
		t.Fatalf("tensor %+v", tt)
	}
	// One band; bands of 3 rows, the last short; a band of 1 row.
	for _, band := range []int64{transposeBand, 3 * cols * item, 1} {
		v.band = band
		got := make([]byte, rows*cols*item)
		if _, err := v.ReadAt(got, end); err != nil {
			t.Fatal(err)
		}
		for r := range rows {
			for c := range cols {
				s := stored[16+(r*cols+c)*item:][:item]
				if d := got[(c*rows+r)*item:][:item]; !bytes.Equal(d, s) {
					t.Fatalf("element (%d, %d) of the transpose is %v, want %v", c, r, d, s)
				}
			}
		}
	}
	head := make([]byte, 16)
	if _, err := v.ReadAt(head, 0); err != nil || !bytes.Equal(head, stored[:16]) {
		t.Errorf("stored bytes: %v, %v", head, err)
	}
	for _, r := range []struct {
		off int64
		n   int
	}{{end, 4}, {end + 2, rows * cols * item}, {end - 4, 8}} {
		if _, err := v.ReadAt(make([]byte, r.n), r.off); err == nil {
			t.Errorf("ReadAt(%d bytes at %d) succeeded", r.n, r.off)
		}
	}
}

// FuzzConfigSwiglu: a swiglu_limit or swiglu_alpha config.json gives
// that the config check accepts is one the set's layout rules take.
func FuzzConfigSwiglu(f *testing.F) {
	for _, s := range []string{`{"swiglu_limit":7.0}`, `{"swiglu_alpha":1.702,"swiglu_limit":1e39}`, `{"swiglu_limit":-1}`,
		`{"swiglu_alpha":1e-46}`, `{"swiglu_limit":0}`, `{"swiglu_alpha":"x"}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var c moeConfig
		if decodeConfig(b, &c) != nil {
			return
		}
		src := &Source{}
		if err := c.swiglu("", moe.SwigluOAI, src); err != nil {
			if !strings.Contains(err.Error(), "swiglu_") {
				t.Errorf("error %q names no key", err)
			}
			return
		}
		d := &moe.SetDecl{Activation: moe.SwigluOAI, SwigluLimit: src.SwigluLimit, SwigluAlpha: src.SwigluAlpha}
		d.Tensors[moe.SetW13] = fp8Decl(1, 2, 1)
		d.Tensors[moe.SetW2] = fp8Decl(1, 1, 1)
		d.Tensors[moe.SetW13Scale] = scaleDecl(nil, 1)
		d.Tensors[moe.SetW2Scale] = scaleDecl(nil, 1)
		if _, err := moe.CheckLayout("x", d); err != nil {
			t.Errorf("config.json %s accepted as limit %v, alpha %v; the layout rules refuse them: %v", b, src.SwigluLimit, src.SwigluAlpha, err)
		}
	})
}

// BenchmarkTransposedView reads a gpt-oss-120b expert's gate_up_proj
// (K = 2880, 2N = 5760, BF16) transposed.
func BenchmarkTransposedView(b *testing.B) {
	const rows, cols = 2880, 5760
	stored := make([]byte, rows*cols*2)
	v := &transposedView{r: bytes.NewReader(stored), start: int64(len(stored)), at: int64(len(stored)), band: transposeBand}
	v.add(0, "BF16", 0, rows, cols)
	dst := make([]byte, len(stored))
	b.SetBytes(int64(len(stored)))
	for b.Loop() {
		if _, err := v.ReadAt(dst, int64(len(stored))); err != nil {
			b.Fatal(err)
		}
	}
}
