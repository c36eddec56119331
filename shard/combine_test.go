package shard

import (
	"encoding/binary"
	"math"
	"strings"
	"testing"

	"github.com/expertd/expertd/moe"
)

// f32Rows encodes one FP32 row per value list, concatenated.
func f32Rows(vals ...float32) []byte {
	b := make([]byte, 4*len(vals))
	for i, v := range vals {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
	}
	return b
}

// dispatch is ids dispatched on placement, whose shards hold every expert.
func dispatch(t *testing.T, placement [][]int, ids []int32, topK int) *Dispatch {
	t.Helper()
	var e int
	for _, p := range placement {
		e += len(p)
	}
	m, err := New(e, placement)
	if err == nil {
		var d *Dispatch
		if d, err = m.Dispatch(ids, topK); err == nil {
			return d
		}
	}
	t.Fatal(err)
	return nil
}

func TestCombine(t *testing.T) {
	tests := []struct {
		name      string
		placement [][]int
		ids       []int32
		topK      int
		rows      [][]byte
		out       moe.DType
		want      []byte
	}{
		{
			// Slot order gives (1e8 + 1) - 1e8 = 0 in float32; summing
			// shard by shard would give (1e8 - 1e8) + 1 = 1.
			name: "slot order", placement: [][]int{{0, 2}, {1}}, ids: []int32{0, 1, 2}, topK: 3,
			rows: [][]byte{f32Rows(1e8, -1e8), f32Rows(1)}, out: moe.Float32,
			want: f32Rows(0),
		},
		{
			// 1+2^-8 and 2^-8 sum to 1+2^-7, a BF16 value (0x3f81);
			// rounding the first to BF16 before the sum would give 1.
			name: "one rounding to BF16", placement: [][]int{{0}, {1}}, ids: []int32{0, 1}, topK: 2,
			rows: [][]byte{f32Rows(1 + 1.0/256), f32Rows(1.0 / 256)}, out: moe.BFloat16,
			want: []byte{0x81, 0x3f},
		},
		{
			name: "two tokens, k 2, a shard without pairs", placement: [][]int{{0}, {1}, {2}}, ids: []int32{0, 2, 2, 0}, topK: 2,
			rows: [][]byte{f32Rows(1, 2, 3, 4), nil, f32Rows(10, 20, 30, 40)}, out: moe.Float32,
			want: f32Rows(11, 22, 33, 44),
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := dispatch(t, tc.placement, tc.ids, tc.topK)
			k := len(tc.want) / tc.out.Size() / (len(tc.ids) / tc.topK)
			got, err := d.Combine(tc.rows, k, tc.out)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != string(tc.want) {
				t.Errorf("Combine = %x, want %x", got, tc.want)
			}
		})
	}
}

func TestCombineErrors(t *testing.T) {
	d := dispatch(t, [][]int{{0}, {1}}, []int32{0, 1}, 2)
	tests := []struct {
		name    string
		rows    [][]byte
		out     moe.DType
		wantErr string
	}{
		{"short row", [][]byte{f32Rows(1), f32Rows(1, 2)}, moe.Float32, "shard 0 returned 4 bytes, want 8"},
		{"missing shard", [][]byte{f32Rows(1, 2)}, moe.Float32, "results of 1 shards, want 2"},
		{"fp8 out", [][]byte{f32Rows(1, 2), f32Rows(3, 4)}, moe.Float8E4M3FN, "want FLOAT32 or BFLOAT16"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := d.Combine(tc.rows, 2, tc.out); err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("Combine = %v, want an error containing %q", err, tc.wantErr)
			}
		})
	}
}
