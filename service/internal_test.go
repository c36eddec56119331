package service

import (
	"bytes"
	"encoding/binary"
	"testing"
)

func TestCoverage(t *testing.T) {
	tests := []struct {
		name     string
		spans    [][2]int64
		size     int64
		wantErr  bool // on the last add
		complete bool
		gaps     string
	}{
		{"in order", [][2]int64{{0, 4}, {4, 8}, {8, 10}}, 10, false, true, ""},
		{"reverse", [][2]int64{{8, 10}, {4, 8}, {0, 4}}, 10, false, true, ""},
		{"middle last", [][2]int64{{0, 3}, {7, 10}, {3, 7}}, 10, false, true, ""},
		{"gaps", [][2]int64{{2, 3}, {5, 6}}, 10, false, false, "[0, 2) [3, 5) [6, 10)"},
		{"many gaps", [][2]int64{{1, 2}, {3, 4}, {5, 6}, {7, 8}}, 10, false, false, "[0, 1) [2, 3) [4, 5) ..."},
		{"overlap left", [][2]int64{{0, 4}, {3, 6}}, 10, true, false, ""},
		{"overlap right", [][2]int64{{4, 8}, {2, 5}}, 10, true, false, ""},
		{"contained", [][2]int64{{0, 10}, {3, 4}}, 10, true, false, ""},
		{"same", [][2]int64{{3, 4}, {3, 4}}, 10, true, false, ""},
		{"empty tensor", nil, 0, false, true, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var c coverage
			var err error
			for _, s := range tt.spans {
				if err = c.add(s[0], s[1]); err != nil {
					break
				}
			}
			if (err != nil) != tt.wantErr {
				t.Fatalf("add error = %v, want error %v", err, tt.wantErr)
			}
			if tt.wantErr {
				return
			}
			if got := c.complete(tt.size); got != tt.complete {
				t.Errorf("complete = %v, want %v (spans %v)", got, tt.complete, c.spans)
			}
			if !tt.complete {
				if got := c.gaps(tt.size); got != tt.gaps {
					t.Errorf("gaps = %q, want %q", got, tt.gaps)
				}
			}
		})
	}
}

// FuzzParseSafetensors checks the header parser never panics and that
// every offset it accepts lies inside the file.
func FuzzParseSafetensors(f *testing.F) {
	js := `{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"k":"v"}}`
	f.Add(append(append(binary.LittleEndian.AppendUint64(nil, uint64(len(js))), js...), make([]byte, 8)...))
	f.Add([]byte("\x02\x00\x00\x00\x00\x00\x00\x00{}"))
	f.Add([]byte("\xff\xff\xff\xff\xff\xff\xff\xff"))
	f.Fuzz(func(t *testing.T, b []byte) {
		st, err := parseSafetensors(bytes.NewReader(b), int64(len(b)))
		if err != nil {
			return
		}
		for name, tt := range st.tensors {
			if tt.DataOffsets[0] < 0 || tt.DataOffsets[1] < tt.DataOffsets[0] || st.base+tt.DataOffsets[1] > int64(len(b)) {
				t.Errorf("tensor %q: accepted offsets %v outside the file", name, tt.DataOffsets)
			}
			if _, _, err := st.read(name, "F8_E4M3", "F32", "BF16"); err == nil && st.base+tt.DataOffsets[1] > int64(len(b)) {
				t.Errorf("tensor %q read past the end", name)
			}
		}
	})
}
