// Package safetensorstest writes .safetensors files for tests of the
// packages that read them, without protobuf, so the loader's own tests
// and the service's write files the same way.
package safetensorstest

import (
	"encoding/binary"
	"encoding/json"
	"maps"
	"os"
	"slices"
)

// Tensor is one tensor of a file: its safetensors dtype ("F8_E4M3",
// "BF16", "F32", ...), shape and little-endian bytes.
type Tensor struct {
	DType string
	Shape []int64
	Data  []byte
}

// Write writes tensors, in name order, and meta as __metadata__ (nil for
// none) as the .safetensors file path: the header's length, the JSON
// header padded to 8 bytes as the reference writer pads it, the data.
func Write(path string, tensors map[string]Tensor, meta map[string]string) error {
	hdr := map[string]any{}
	if meta != nil {
		hdr["__metadata__"] = meta
	}
	var data []byte
	for _, n := range slices.Sorted(maps.Keys(tensors)) {
		t := tensors[n]
		hdr[n] = map[string]any{"dtype": t.DType, "shape": t.Shape, "data_offsets": []int{len(data), len(data) + len(t.Data)}}
		data = append(data, t.Data...)
	}
	js, err := json.Marshal(hdr)
	if err != nil {
		return err
	}
	for len(js)%8 != 0 {
		js = append(js, ' ')
	}
	out := binary.LittleEndian.AppendUint64(nil, uint64(len(js)))
	return os.WriteFile(path, append(append(out, js...), data...), 0o644)
}
