package shard

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// Combine is the finalize step of a dispatched call: it adds up each
// token's pair results into the call's [M, k] output in dtype out (BF16 or
// FP32). rows[s] are shard s's results, one row of k FP32 values
// (little-endian) per pair in the order of d.Pairs[s], each w·y rounded
// once to FP32 as a shard computes it.
//
// A token's rows are summed from zero in slot order in float32 and the sum
// is rounded to out once: that is a single daemon's own combine loop, so
// the result is the one daemon's bit for bit, and BF16 partials (which
// would round twice) are never needed.
func (d *Dispatch) Combine(rows [][]byte, k int, out moe.DType) ([]byte, error) {
	if out != moe.Float32 && out != moe.BFloat16 {
		return nil, fmt.Errorf("combine: output dtype %v: want FLOAT32 or BFLOAT16", out)
	}
	if len(rows) != len(d.Pairs) {
		return nil, fmt.Errorf("combine: results of %d shards, want %d", len(rows), len(d.Pairs))
	}
	// where[p] locates pair p's row: shard and row index.
	type loc struct{ shard, row int32 }
	n := 0
	for _, pairs := range d.Pairs {
		n += len(pairs)
	}
	where := make([]loc, n)
	for s, pairs := range d.Pairs {
		if want := len(pairs) * 4 * k; len(rows[s]) != want {
			return nil, fmt.Errorf("combine: shard %d returned %d bytes, want %d (%d FP32 rows of %d)", s, len(rows[s]), want, len(pairs), k)
		}
		for r, p := range pairs {
			where[p] = loc{int32(s), int32(r)}
		}
	}
	m := n / d.TopK
	acc := make([]float32, k)
	res := make([]byte, m*k*out.Size())
	for t := range m {
		clear(acc)
		for j := range d.TopK {
			l := where[t*d.TopK+j]
			row := rows[l.shard][int(l.row)*4*k:][:4*k]
			for x := range acc {
				acc[x] += math.Float32frombits(binary.LittleEndian.Uint32(row[4*x:]))
			}
		}
		encodeRow(res[t*k*out.Size():], acc, out)
	}
	return res, nil
}

// encodeRow writes v as dt, FP32 or BF16 (round to nearest even).
func encodeRow(dst []byte, v []float32, dt moe.DType) {
	if dt == moe.Float32 {
		for i, x := range v {
			binary.LittleEndian.PutUint32(dst[4*i:], math.Float32bits(x))
		}
		return
	}
	for i, x := range v {
		binary.LittleEndian.PutUint16(dst[2*i:], scaling.Float32ToBF16(x))
	}
}
