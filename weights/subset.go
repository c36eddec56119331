package weights

import (
	"slices"
)

// ExpertSubset picks the experts of a layer a set serves: given the
// layer's expert count E, the global ids of the set's experts in local-id
// order (the set's expert i is the layer's expert ids[i]). A shard of an
// expert-parallel deployment passes its shard.Map's Experts.
type ExpertSubset func(numExperts int) ([]int, error)

// pick checks the ids: in range, each once, at least one.
func (p ExpertSubset) pick(numExperts int) ([]int, error) {
	const field = "experts"
	ids, err := p(numExperts)
	if err != nil {
		return nil, invalidf(field, "%v", err)
	}
	if len(ids) == 0 {
		return nil, invalidf(field, "no experts of the layer's %d selected", numExperts)
	}
	seen := make([]bool, numExperts)
	for _, e := range ids {
		if e < 0 || e >= numExperts {
			return nil, invalidf(field, "expert %d out of range [0, %d)", e, numExperts)
		}
		if seen[e] {
			return nil, invalidf(field, "expert %d selected twice", e)
		}
		seen[e] = true
	}
	return slices.Clone(ids), nil
}

// fillMax is local with every value replaced by the max of all, or nil
// when the layer has no static input scales.
func fillMax(local, all []float32) []float32 {
	if local == nil || len(all) == 0 {
		return local
	}
	m := slices.Max(all)
	out := make([]float32, len(local))
	for i := range out {
		out[i] = m
	}
	return out
}
