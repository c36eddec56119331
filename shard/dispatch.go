package shard

import "fmt"

// Dispatch is one call's routing split by shard: which (token, slot) pairs
// each shard computes, and under which of its local expert ids.
//
// A pair is named by its flat index t·TopK+j into the call's [M, TopK]
// topk ids and weights. Each shard computes its pairs independently (a
// pair's result w[t,j]·y[t,j] depends only on token t and expert id[t,j]),
// and the combine step (Combine) adds every pair's result into its token's
// output, in slot order, whichever shard computed it.
type Dispatch struct {
	// TopK is the number of slots per token.
	TopK int
	// Pairs[s] are the flat pair indexes routed to shard s, ascending (so
	// grouped by token, and in slot order within a token).
	Pairs [][]int
	// LocalIDs[s][i] is the local expert id, on shard s, of pair Pairs[s][i].
	LocalIDs [][]int32
}

// Dispatch splits the routing ids ([M, topK] global expert ids, row-major)
// by shard. Every id must be in [0, E) and distinct within its token: an
// error names the first element that is not, in the words of the wire's
// topk_ids field.
func (m *Map) Dispatch(ids []int32, topK int) (*Dispatch, error) {
	if topK < 1 || topK > m.NumExperts() {
		return nil, fmt.Errorf("top_k %d: want in [1, %d]", topK, m.NumExperts())
	}
	if len(ids)%topK != 0 {
		return nil, fmt.Errorf("%d topk ids do not fill rows of top_k = %d", len(ids), topK)
	}
	s := m.NumShards()
	d := &Dispatch{TopK: topK, Pairs: make([][]int, s), LocalIDs: make([][]int32, s)}
	for i, id := range ids {
		if id < 0 || int(id) >= m.NumExperts() {
			return nil, fmt.Errorf("topk_ids: element %d is %d: want an expert id in [0, %d)", i, id, m.NumExperts())
		}
		for j := i - i%topK; j < i; j++ {
			if ids[j] == id {
				return nil, fmt.Errorf("topk_ids: element %d repeats expert %d of token %d: want distinct ids per token", i, id, i/topK)
			}
		}
		o := m.owner[id]
		d.Pairs[o] = append(d.Pairs[o], i)
		d.LocalIDs[o] = append(d.LocalIDs[o], int32(m.local[id]))
	}
	return d, nil
}

// Tokens is the number of distinct tokens with at least one pair on shard s.
func (d *Dispatch) Tokens(s int) int {
	n, last := 0, -1
	for _, p := range d.Pairs[s] {
		if t := p / d.TopK; t != last {
			n, last = n+1, t
		}
	}
	return n
}
