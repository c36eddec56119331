package kerneltest

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"sort"

	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// f32Unit is float32's unit roundoff: a correctly rounded float32 operation
// lands within f32Unit·|x| of its exact result x.
const f32Unit = 0x1p-24

// f32Tiny bounds what float32 loses on a score in its subnormal range,
// where the relative bounds do not hold (or that it flushes to 0).
const f32Tiny = 0x1p-126

// Routing is the reference's routing of a request (MOE_SPEC.md section 1,
// in float64) and, per token, whether a float32 router may route it
// otherwise.
type Routing struct {
	// IDs are the reference's top-k ids, [M, TopK], ordered by decreasing
	// selection value; Weights are their weights in float64.
	IDs     []int32
	Weights []float64
	// Ambiguous marks the tokens where two selection values that decide
	// the ids or their order (two chosen experts, a chosen expert against
	// a candidate left out, a kept group against a dropped one) lie within
	// float32 rounding of each other (selBounds): a correct float32 router
	// may route such a token otherwise. Nil with precomputed routing.
	Ambiguous []bool

	req *moe.Request
	e   int
}

// ReferenceRouting is the routing Reference uses: req's precomputed ids and
// weights when it has them, else MOE_SPEC.md's routing by sorting: scores in
// float64, selection on score+bias, groups by the sum of their top-2
// selection values, ties to the lower id (stable sorts over ascending ids),
// weights the unbiased scores, renormalized, times the scaling factor.
func ReferenceRouting(set *moe.ExpertSet, req *moe.Request) *Routing {
	m, k, e := req.M(), req.Routing.TopK, set.E
	rt := &Routing{req: req, e: e}
	if req.TopKIDs != nil {
		rt.IDs = slices.Clone(req.TopKIDs)
		rt.Weights = make([]float64, len(req.TopKWeights))
		for i, x := range req.TopKWeights {
			rt.Weights[i] = float64(x)
		}
		return rt
	}
	rt.IDs = make([]int32, m*k)
	rt.Weights = make([]float64, m*k)
	rt.Ambiguous = make([]bool, m)
	for t := range m {
		score, sel, bound := tokenScores(req, e, t)
		ids, kept := topK(sel, req.Routing, k)
		for j, id := range ids {
			rt.IDs[t*k+j] = int32(id)
		}
		copy(rt.Weights[t*k:], routeWeights(score, rt.IDs[t*k:(t+1)*k], req.Routing))
		rt.Ambiguous[t] = ambiguous(sel, bound, ids, kept, req.Routing)
	}
	return rt
}

// Check compares a backend's top-k ids got, [M, TopK], with the reference's
// and returns the tokens where they differ. A token may differ only where
// it is Ambiguous, and only as a float32 router could route it: got's ids,
// in their order, must rank first among the candidates of some kept groups
// for some selection values each within its float32 bound (selBounds) of
// the reference's, ties to the lower id. Otherwise the error names the
// first token routed in a way that no float32 rounding explains.
func (r *Routing) Check(got []int32) ([]int, error) {
	if len(got) != len(r.IDs) {
		return nil, fmt.Errorf("%d top-k ids, want %d", len(got), len(r.IDs))
	}
	k := r.req.Routing.TopK
	var differ []int
	bad, first := 0, ""
	for t := range r.req.M() {
		g, w := got[t*k:(t+1)*k], r.IDs[t*k:(t+1)*k]
		if slices.Equal(g, w) {
			continue
		}
		if r.Ambiguous == nil {
			bad++
			if first == "" {
				first = fmt.Sprintf("token %d: ids %v, precomputed %v", t, g, w)
			}
			continue
		}
		if !r.Ambiguous[t] {
			bad++
			if first == "" {
				first = fmt.Sprintf("token %d: ids %v, reference %v, whose selection values no float32 rounding reorders", t, g, w)
			}
			continue
		}
		_, sel, bound := tokenScores(r.req, r.e, t)
		if !possible(sel, bound, g, r.req.Routing) {
			bad++
			if first == "" {
				first = fmt.Sprintf("token %d: ids %v, reference %v: not a choice among the experts tied with them at float32 precision",
					t, g, w)
			}
			continue
		}
		differ = append(differ, t)
	}
	if bad > 0 {
		return differ, fmt.Errorf("top-k ids of %d tokens differ from the reference's beyond float32 rounding; %s", bad, first)
	}
	return differ, nil
}

// Precomputed is r's request with its routing precomputed: r's ids and
// weights, except that the tokens toks are routed as got, with the
// reference's weights for got's ids; for running a backend or Reference on
// the routing a backend chose (toks from Check).
func (r *Routing) Precomputed(got []int32, toks []int) *moe.Request {
	ids, w64 := r.follow(got, toks)
	req := *r.req
	req.TopKIDs = ids
	req.TopKWeights = make([]float32, len(w64))
	for i, x := range w64 {
		req.TopKWeights[i] = float32(x)
	}
	return &req
}

// follow is r's ids and weights with the tokens toks routed as got instead:
// got's ids and the reference's weights for them.
func (r *Routing) follow(got []int32, toks []int) ([]int32, []float64) {
	k := r.req.Routing.TopK
	ids, w := slices.Clone(r.IDs), slices.Clone(r.Weights)
	for _, t := range toks {
		copy(ids[t*k:(t+1)*k], got[t*k:(t+1)*k])
		score, _, _ := tokenScores(r.req, r.e, t)
		copy(w[t*k:], routeWeights(score, ids[t*k:(t+1)*k], r.req.Routing))
	}
	return ids, w
}

// tokenScores is token t's scores (the weights' source) and selection
// values (score plus correction bias, what top-k ranks) in float64, and for
// each expert a bound on how far a float32 router's selection value may lie
// from sel. The bound follows a float32 router's chain, as the CUDA
// kernels run it (route.cuh; expf within 2 ulp, i.e. 4·u relative with u =
// f32Unit, the other operations correctly rounded), each step's error
// relative to the exact value:
//
//   - sigmoid: expf(−x) 4u, 1 + that u, the reciprocal u: 6u;
//   - softmax: x − max rounds by u·|x − max|, which exp turns into a
//     relative error of that size, expf 4u, the product by 1/sum u; the
//     sum's own error (each term's, plus (E−1)·u for adding E non-negative
//     terms in any order, plus u for the reciprocal) is one factor common
//     to the row, which scales every score alike and so changes no
//     comparison between them unless a bias is added;
//   - with a bias: the common factor times the score, and u of the sum
//     score + bias, absolute, since a bias can cancel most of the score;
//   - f32Tiny for a score in float32's subnormal range.
//
// The sum is doubled to cover second-order terms and the reference's own
// float64 rounding. Renormalization and the scaling factor apply to the
// weights only, after selection; group scores get their bound in
// groupScores.
func tokenScores(req *moe.Request, e, t int) (score, sel, bound []float64) {
	r := req.Routing
	score = make([]float64, e)
	for i := range e {
		if req.Logits.DType == moe.BFloat16 {
			score[i] = float64(scaling.BF16ToFloat32(binary.LittleEndian.Uint16(req.Logits.Data[2*(t*e+i):])))
		} else {
			score[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(req.Logits.Data[4*(t*e+i):])))
		}
	}
	rel := make([]float64, e) // each score's own relative error bound
	var common float64        // the row's common relative error bound
	if r.Scoring == moe.Sigmoid {
		for i, x := range score {
			score[i] = 1 / (1 + math.Exp(-x))
			rel[i] = 6 * f32Unit
		}
	} else {
		mx := math.Inf(-1)
		for _, x := range score {
			mx = math.Max(mx, x)
		}
		var sum, sumErr float64
		for i, x := range score {
			d := x - mx
			score[i] = math.Exp(d)
			sum += score[i]
			if score[i] > 0 {
				rel[i] = (4 + math.Abs(d)) * f32Unit
				sumErr += score[i] * rel[i]
				rel[i] += f32Unit // the product by 1/sum
			}
		}
		for i := range score {
			if math.IsInf(mx, -1) {
				score[i] = 0 // every expert masked: 0, as moe.Route defines it, not 0/0
				continue
			}
			score[i] /= sum
		}
		if sum > 0 {
			common = sumErr/sum + float64(e)*f32Unit
		}
	}
	sel = make([]float64, e)
	bound = make([]float64, e)
	for i, s := range score {
		sel[i] = s
		b := rel[i] * s
		if r.CorrectionBias != nil {
			sel[i] += float64(r.CorrectionBias[i])
			b += common*s + f32Unit*math.Abs(sel[i])
		}
		if s > 0 {
			b += f32Tiny
		}
		if !math.IsInf(sel[i], 0) && !math.IsNaN(sel[i]) {
			bound[i] = 2 * b
		}
	}
	return score, sel, bound
}

// key is a selection value as the routers rank it: NaN below every number.
func key(x float64) float64 {
	if math.IsNaN(x) {
		return math.Inf(-1)
	}
	return x
}

// groupScores is each group's score, the sum of its top-2 selection values
// (its one value when a group has one expert), with a bound on a float32
// router's: a top-2 sum moves by at most its members' two largest bounds,
// and float32 rounds the sum by u of its size (doubled, as in
// tokenScores).
func groupScores(sel, bound []float64, groups int) (score, gbound []float64) {
	size := len(sel) / groups
	score = make([]float64, groups)
	gbound = make([]float64, groups)
	for g := range groups {
		members := slices.Clone(sel[g*size : (g+1)*size])
		sort.Slice(members, func(i, j int) bool { return key(members[i]) > key(members[j]) })
		score[g] = members[0]
		var b0, b1 float64 // the two largest bounds
		for _, b := range bound[g*size : (g+1)*size] {
			if b > b0 {
				b0, b1 = b, b0
			} else if b > b1 {
				b1 = b
			}
		}
		d := b0
		if size > 1 {
			score[g] += members[1]
			d += b1
		}
		if !math.IsInf(score[g], 0) && !math.IsNaN(score[g]) {
			gbound[g] = d + 2*f32Unit*(math.Abs(score[g])+d)
		}
	}
	return score, gbound
}

// topK is the reference's selection for one token, by sorting: the groups
// kept (nil without groups), then the k best of their experts, NaN last,
// ties to the lower id.
func topK(sel []float64, r moe.Routing, k int) (ids, kept []int) {
	e := len(sel)
	candidates := make([]int, 0, e)
	if r.NumGroups > 1 {
		size := e / r.NumGroups
		gscore, _ := groupScores(sel, make([]float64, e), r.NumGroups)
		groups := make([]int, r.NumGroups)
		for g := range groups {
			groups[g] = g
		}
		sort.SliceStable(groups, func(i, j int) bool { return key(gscore[groups[i]]) > key(gscore[groups[j]]) })
		kept = groups[:r.TopKGroups]
		sort.Ints(kept)
		for _, g := range kept {
			for i := g * size; i < (g+1)*size; i++ {
				candidates = append(candidates, i)
			}
		}
	} else {
		for i := range e {
			candidates = append(candidates, i)
		}
	}
	sort.SliceStable(candidates, func(i, j int) bool { return key(sel[candidates[i]]) > key(sel[candidates[j]]) })
	return candidates[:k], kept
}

// routeWeights is MOE_SPEC.md's weights for the chosen ids: their unbiased
// scores, divided by their sum when renormalizing, times the scaling factor.
func routeWeights(score []float64, ids []int32, r moe.Routing) []float64 {
	var sum float64
	for _, id := range ids {
		sum += score[id]
	}
	f := float64(r.ScalingFactor)
	if f == 0 {
		f = 1
	}
	w := make([]float64, len(ids))
	for j, id := range ids {
		w[j] = score[id]
		if r.Renormalize && sum > 0 {
			w[j] /= sum
		}
		w[j] *= f
	}
	return w
}

// span is the interval a float32 router's value may take around a float64
// value v with bound b.
type span struct{ lo, hi float64 }

func spans(v, b []float64) []span {
	s := make([]span, len(v))
	for i := range v {
		s[i] = span{key(v[i]) - b[i], key(v[i]) + b[i]}
	}
	return s
}

// mayBeat reports whether a float32 router may rank item a (value span sa)
// ahead of item b: a's value above b's, or equal with a the lower id.
func mayBeat(a int, sa span, b int, sb span) bool {
	return sa.hi > sb.lo || (sa.hi == sb.lo && a < b)
}

// ambiguous reports whether a float32 router may route a token otherwise
// than the reference's ids (and kept groups): some pair whose order
// decides them may compare either way.
func ambiguous(sel, bound []float64, ids, kept []int, r moe.Routing) bool {
	sp := spans(sel, bound)
	cand := make([]bool, len(sel))
	if r.NumGroups > 1 {
		gscore, gbound := groupScores(sel, bound, r.NumGroups)
		gsp := spans(gscore, gbound)
		size := len(sel) / r.NumGroups
		for _, a := range kept {
			for i := a * size; i < (a+1)*size; i++ {
				cand[i] = true
			}
			for d := range r.NumGroups {
				if !slices.Contains(kept, d) && mayBeat(d, gsp[d], a, gsp[a]) {
					return true
				}
			}
		}
	} else {
		for i := range cand {
			cand[i] = true
		}
	}
	for j, a := range ids {
		cand[a] = false
		for _, b := range ids[j+1:] {
			if mayBeat(b, sp[b], a, sp[a]) {
				return true
			}
		}
	}
	// A candidate left out may beat some chosen expert exactly when it may
	// beat the easiest one to beat: the lowest bottom, the highest id.
	low := ids[0]
	for _, a := range ids {
		if sp[a].lo < sp[low].lo || (sp[a].lo == sp[low].lo && a > low) {
			low = a
		}
	}
	for c, ok := range cand {
		if ok && mayBeat(c, sp[c], low, sp[low]) {
			return true
		}
	}
	return false
}

// possible reports whether a float32 router could route a token to got (in
// that order): distinct ids in range, from groups that it could keep, that
// it could rank first, in got's order, among the candidates of those
// groups.
func possible(sel, bound []float64, got []int32, r moe.Routing) bool {
	e := len(sel)
	seen := make([]bool, e)
	for _, id := range got {
		if id < 0 || int(id) >= e || seen[id] {
			return false
		}
		seen[id] = true
	}
	sp := spans(sel, bound)
	if r.NumGroups <= 1 {
		all := make([]int, e)
		for i := range all {
			all[i] = i
		}
		return canRank(got, all, sp)
	}
	size := e / r.NumGroups
	gscore, gbound := groupScores(sel, bound, r.NumGroups)
	gsp := spans(gscore, gbound)
	var need []int
	for _, id := range got {
		if g := int(id) / size; !slices.Contains(need, g) {
			need = append(need, g)
		}
	}
	return anyKept(gsp, need, r.TopKGroups, func(kept []int) bool {
		var cand []int
		for _, g := range kept {
			for i := g * size; i < (g+1)*size; i++ {
				cand = append(cand, i)
			}
		}
		return canRank(got, cand, sp)
	})
}

// canRank reports whether some values within the spans sp rank got first,
// in its order, among the candidates cand (which hold got). Greedy from the
// bottom: the others at their lowest, each of got's at the least value that
// beats the one below it, which leaves the most room above.
func canRank(got []int32, cand []int, sp []span) bool {
	prev, prevV := -1, math.Inf(-1)
	for _, c := range cand {
		if slices.Contains(got, int32(c)) {
			continue
		}
		if prev < 0 || sp[c].lo > prevV || (sp[c].lo == prevV && c < prev) {
			prev, prevV = c, sp[c].lo
		}
	}
	for j := len(got) - 1; j >= 0; j-- {
		g := int(got[j])
		v := sp[g].lo
		if prev >= 0 && !(v > prevV || (v == prevV && g < prev)) {
			v = prevV
			if g > prev {
				v = math.Nextafter(prevV, math.Inf(1))
			}
			if v > sp[g].hi {
				return false
			}
		}
		prev, prevV = g, v
	}
	return true
}

// anyKept reports whether f holds for some set of n groups, holding need,
// that a float32 router could keep: each kept group may beat each dropped
// one (the kept at the top of their spans, the dropped at the bottom).
func anyKept(gsp []span, need []int, n int, f func(kept []int) bool) bool {
	// Only the groups at the boundary are free: one that fewer than n
	// groups may beat is always kept, one that n groups surely beat never.
	need = slices.Clone(need)
	var rest []int
	for g := range gsp {
		above, below := 0, 0
		for h := range gsp {
			if h != g && mayBeat(h, gsp[h], g, gsp[g]) {
				above++
			}
			if h != g && !mayBeat(g, gsp[g], h, gsp[h]) {
				below++
			}
		}
		switch in := slices.Contains(need, g); {
		case below >= n && in:
			return false
		case above < n && !in:
			need = append(need, g)
		case below < n && !in:
			rest = append(rest, g)
		}
	}
	if len(need) > n {
		return false
	}
	kept := slices.Clone(need)
	var try func(from int) bool
	try = func(from int) bool {
		if len(kept) == n {
			for _, a := range kept {
				for d := range gsp {
					if !slices.Contains(kept, d) && !mayBeat(a, gsp[a], d, gsp[d]) {
						return false
					}
				}
			}
			return f(slices.Sorted(slices.Values(kept)))
		}
		for i := from; i < len(rest); i++ {
			kept = append(kept, rest[i])
			if try(i + 1) {
				return true
			}
			kept = kept[:len(kept)-1]
		}
		return false
	}
	return try(0)
}
