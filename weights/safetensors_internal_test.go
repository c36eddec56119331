package weights

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"strings"
	"testing"
)

// FuzzParseSafetensors checks the header parser never panics and that
// every offset it accepts lies inside the file.
func FuzzParseSafetensors(f *testing.F) {
	js := `{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"k":"v"}}`
	f.Add(append(append(binary.LittleEndian.AppendUint64(nil, uint64(len(js))), js...), make([]byte, 8)...))
	f.Add([]byte("\x02\x00\x00\x00\x00\x00\x00\x00{}"))
	f.Add([]byte("\xff\xff\xff\xff\xff\xff\xff\xff"))
	f.Add([]byte("\x08\x00\x00\x00\x00\x00\x00\x00{}      "))
	f.Add([]byte("\x04\x00\x00\x00\x00\x00\x00\x00{}{}"))
	f.Add([]byte("\x0d\x00\x00\x00\x00\x00\x00\x00{\"a\":1,\"a\":2}"))
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

// TestParseSafetensorsMemory: parsing streams the header, so it allocates
// about what the parsed entries hold, not copies of the whole header.
func TestParseSafetensorsMemory(t *testing.T) {
	var hdr strings.Builder
	hdr.WriteString(`{"__metadata__":{"pad":"` + strings.Repeat("x", 8<<20) + `"}`)
	for i := range 2000 {
		fmt.Fprintf(&hdr, `,"model.layers.0.mlp.experts.%d.up_proj.weight":{"dtype":"F8_E4M3","shape":[1,1],"data_offsets":[0,1]}`, i)
	}
	hdr.WriteString("}")
	b := append(binary.LittleEndian.AppendUint64(nil, uint64(hdr.Len())), hdr.String()...)
	b = append(b, 0)
	r := bytes.NewReader(b)
	allocs := testing.Benchmark(func(tb *testing.B) {
		for range tb.N {
			if _, err := parseSafetensors(r, int64(len(b))); err != nil {
				tb.Fatal(err)
			}
		}
	}).AllocedBytesPerOp()
	// The header's bytes, once, and the 2000 small entries; a second
	// copy of the header (json.RawMessage values, the metadata kept as a
	// string) would double it.
	t.Logf("a %d-byte header: %d bytes allocated", hdr.Len(), allocs)
	if limit := int64(hdr.Len()) * 3 / 2; allocs > limit {
		t.Errorf("parsing a %d-byte header allocates %d bytes, want at most %d", hdr.Len(), allocs, limit)
	}
}
