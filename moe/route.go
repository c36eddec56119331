package moe

import (
	"math"
)

// Route computes top-k expert ids and weights for m tokens from their
// router logits ([m, e], row-major) following MOE_SPEC.md section 1:
//
//   - scores: softmax over the e logits, or a sigmoid of each logit;
//   - selection uses score + CorrectionBias when a bias is given (for either
//     scoring; models ship a bias only with sigmoid);
//   - with NumGroups > 1, the e experts form NumGroups contiguous groups, a
//     group's score is the sum of its top-2 selection scores (its single
//     score when a group has one expert), the best TopKGroups groups are kept
//     and the top-k is taken among their experts only;
//   - the weights are the unbiased scores at the chosen ids, divided by their
//     sum when Renormalize is set, then multiplied by ScalingFactor.
//
// A -Inf logit masks its expert: it scores 0 exactly (softmax and
// sigmoid), so it is chosen only when fewer than TopK experts score above
// 0, and then with weight 0. A row whose scores are all 0 (softmax of a
// row of -Inf, which the service refuses, or sigmoid of -Inf logits) is
// not renormalized: its weights stay 0, never 0/0. No finite or -Inf
// logits give a NaN weight.
//
// Ties, between experts or between groups, go to the lower id, so routing is
// a pure function of its inputs. A NaN logit never wins a comparison against
// a number: NaN sorts below every finite score (and below -Inf), again for
// determinism. ids and weights come out ordered by decreasing selection score.
//
// Scores are computed in float64 and weights rounded to float32 once at the
// end: routing costs O(m·e) against the GEMMs' O(m·k·N·K), and the extra
// precision keeps near-ties from depending on rounding order.
//
// ids and weights must hold m*r.TopK values.
func Route(ids []int32, weights []float32, logits []float32, m, e int, r Routing) {
	var sc router
	for t := range m {
		sc.token(ids[t*r.TopK:(t+1)*r.TopK], weights[t*r.TopK:(t+1)*r.TopK], logits[t*e:(t+1)*e], r)
	}
}

// router holds the per-token scratch of Route so a worker allocates once.
type router struct {
	score, sel, group []float64
	keep, taken       []bool
}

func grow(s []float64, n int) []float64 {
	if cap(s) < n {
		return make([]float64, n)
	}
	return s[:n]
}

func growBool(s []bool, n int) []bool {
	if cap(s) < n {
		s = make([]bool, n)
	}
	s = s[:n]
	clear(s)
	return s
}

// better reports whether a beats b as a selection score. With ties broken
// by the caller's scan order (ascending id, strict comparison) this gives
// "lower id wins"; NaN loses to everything, including another NaN.
func better(a, b float64) bool {
	if math.IsNaN(a) {
		return false
	}
	if math.IsNaN(b) {
		return true
	}
	return a > b
}

func (sc *router) token(ids []int32, weights []float32, logits []float32, r Routing) {
	e := len(logits)
	sc.score = grow(sc.score, e)
	sc.sel = grow(sc.sel, e)
	score, sel := sc.score, sc.sel

	switch r.Scoring {
	case Sigmoid:
		for i, x := range logits {
			score[i] = 1 / (1 + math.Exp(-float64(x)))
		}
	default: // Softmax
		mx := math.Inf(-1)
		for _, x := range logits {
			if float64(x) > mx {
				mx = float64(x)
			}
		}
		if math.IsInf(mx, -1) {
			// Every expert masked: softmax is 0/0 here. The service refuses
			// such a row; a backend still returns numbers, not NaN: every
			// score is 0, so the lowest ids are chosen with weight 0.
			clear(score)
			break
		}
		// A -Inf logit scores exp(-Inf) = 0 exactly; the row's largest
		// scores exp(0) = 1, so sum >= 1.
		var sum float64
		for i, x := range logits {
			score[i] = math.Exp(float64(x) - mx)
			sum += score[i]
		}
		for i := range score {
			score[i] /= sum
		}
	}
	for i := range sel {
		sel[i] = score[i]
		if r.CorrectionBias != nil {
			sel[i] += float64(r.CorrectionBias[i])
		}
	}

	// taken[i] marks experts already chosen or in a dropped group.
	sc.taken = growBool(sc.taken, e)
	taken := sc.taken
	if g := r.NumGroups; g > 1 {
		size := e / g
		sc.group = grow(sc.group, g)
		for gi := range g {
			sc.group[gi] = top2Sum(sel[gi*size : (gi+1)*size])
		}
		sc.keep = growBool(sc.keep, g)
		for range r.TopKGroups {
			best := -1
			for gi := range g {
				if sc.keep[gi] {
					continue
				}
				if best < 0 || better(sc.group[gi], sc.group[best]) {
					best = gi
				}
			}
			sc.keep[best] = true
		}
		// Experts of dropped groups are marked taken so the top-k scan skips them.
		for gi := range g {
			if !sc.keep[gi] {
				for i := gi * size; i < (gi+1)*size; i++ {
					taken[i] = true
				}
			}
		}
	}

	var sum float64
	for j := range ids {
		best := -1
		for i := range e {
			if taken[i] {
				continue
			}
			if best < 0 || better(sel[i], sel[best]) {
				best = i
			}
		}
		taken[best] = true
		ids[j] = int32(best)
		sum += score[best]
	}
	f := float64(r.ScalingFactor)
	if f == 0 { // the wire's "0 means 1", should an unmapped value get here
		f = 1
	}
	for j, id := range ids {
		w := score[id]
		if r.Renormalize && sum > 0 { // sum is 0 only if every score underflowed
			w /= sum
		}
		weights[j] = float32(w * f)
	}
}

// top2Sum is the sum of the two largest values of s (the one value when s
// has one), NaN counting as the lowest.
func top2Sum(s []float64) float64 {
	a, b := math.NaN(), math.NaN()
	for _, x := range s {
		switch {
		case better(x, a):
			a, b = x, a
		case better(x, b):
			b = x
		}
	}
	if len(s) == 1 {
		return a
	}
	return a + b
}
