package kerneltest

import (
	"encoding/binary"
	"math"
	"slices"
	"sort"

	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// Reference computes the FusedMoE op of MOE_SPEC.md section 1 in float64,
// with deliberately plain code (sorts, triple loops, per-element scales, no
// blocking, no goroutines) so that it shares no structure with a fast
// backend. It quantizes activations to FP8 exactly as the spec says (the
// same scaling package codecs and quantizers a backend uses; those are
// tested against ml_dtypes on their own): BF16/FP32 hidden states with the
// static A13Scale or dynamically per token (per group of Bk in block mode),
// the intermediate with the static A2Scale or dynamically likewise.
//
// It returns the output [M, K] before output rounding, and the routing used.
func Reference(set *moe.ExpertSet, req *moe.Request) (out []float64, ids []int32, w []float32) {
	out, ids, w, _ = ReferenceTol(set, req)
	return out, ids, w
}

// KnifeEdge is how close, relative to its own size, a scaled intermediate
// element may lie to an E4M3 rounding midpoint and still round either way
// on a correct backend. The intermediate is the one FP8-quantized value a
// backend derives from its own arithmetic, and Hopper's FP8 tensor cores
// accumulate with about 14 mantissa bits; ReLU² doubles the relative error
// and the dynamic scale's amax carries it too. 2^-11 leaves a margin over
// that.
const KnifeEdge = 1.0 / 2048

// ReferenceTol is Reference plus the relative-L2 bound a backend's output
// must meet against it: FP8Tol, plus what rounding the knife-edge
// intermediate elements (see KnifeEdge) the other way moves the output,
// relative to its norm: the root sum of squares of each such step times
// its router weight and its W2 column's norm, since the flips are
// independent and their columns nearly orthogonal. One flip of an element
// near the top of the E4M3 range moves a small case's one-token output by
// several percent; at the reference shapes' sizes the slack is
// negligible, and a case without knife-edge elements keeps the bar exactly.
func ReferenceTol(set *moe.ExpertSet, req *moe.Request) (out []float64, ids []int32, w []float32, tol float64) {
	e := Expect(set, req)
	return e.Out, e.IDs, e.Weights, e.Tol
}

// Expected is ReferenceTol's answer for one request, kept so that a
// backend's result can be judged with the routing it chose where a float32
// router may legitimately choose otherwise (For).
type Expected struct {
	Out     []float64
	IDs     []int32
	Weights []float32
	Tol     float64
	// Routing is the reference's own routing, which IDs and Weights follow
	// except on the tokens For adopted from a backend.
	Routing *Routing

	set    *moe.ExpertSet
	req    *moe.Request
	slack2 []float64 // per token: the squared knife-edge slack of its rows
}

// Expect computes ReferenceTol's output, routing and bound for req.
func Expect(set *moe.ExpertSet, req *moe.Request) *Expected {
	rt := ReferenceRouting(set, req)
	e := &Expected{IDs: rt.IDs, Routing: rt, set: set, req: req,
		Out: make([]float64, req.M()*set.K), slack2: make([]float64, req.M())}
	e.fill(rt.IDs, rt.Weights, nil)
	return e
}

// For is the expectation for a backend whose top-k ids came back as got: e
// itself when got is e.IDs; when got differs only on Ambiguous tokens and
// only as Routing.Check allows, a copy of e whose ids, weights and output
// rows on those tokens follow got's choice (the reference's weights for
// got's ids, its output for that routing), and those tokens; otherwise e
// and Check's error.
func (e *Expected) For(got []int32) (*Expected, []int, error) {
	if slices.Equal(got, e.IDs) {
		return e, nil, nil
	}
	toks, err := e.Routing.Check(got)
	if err != nil {
		return e, nil, err
	}
	ids, w64 := e.Routing.follow(got, toks)
	f := *e
	f.IDs, f.Out, f.slack2 = ids, slices.Clone(e.Out), slices.Clone(e.slack2)
	for _, t := range toks {
		clear(f.Out[t*e.set.K : (t+1)*e.set.K])
	}
	f.fill(ids, w64, toks)
	return &f, toks, nil
}

// fill computes the output rows and slack of the tokens toks (every token
// when nil) for the routing ids, w64, then the weights and the bound.
func (e *Expected) fill(ids []int32, w64 []float64, toks []int) {
	set, k := e.set, e.req.Routing.TopK
	if toks == nil {
		toks = make([]int, e.req.M())
		for t := range toks {
			toks[t] = t
		}
	}
	a := referenceHidden(set, e.req)
	w13 := map[int32][]float64{}
	w2 := map[int32][]float64{}
	w2Norms := map[int32][]float64{}
	for _, t := range toks {
		e.slack2[t] = 0
		for j := range k {
			ex := ids[t*k+j]
			if w13[ex] == nil {
				w13[ex] = dequantExpert(set.W13, set.W13Scale, int(ex), set.Rows1(), set.K)
				w2[ex] = dequantExpert(set.W2, set.W2Scale, int(ex), set.K, set.N)
				w2Norms[ex] = columnNorms(w2[ex], set.K, set.N)
			}
			x := referenceIntermediate(set, a[t*set.K:(t+1)*set.K], w13[ex], int(ex))
			xq, flip := requantize(set, x)
			for r := range set.K {
				var y float64
				for n := range set.N {
					y += xq[n] * w2[ex][r*set.N+n]
				}
				if set.W2Bias != nil {
					y += float64(set.W2Bias[int(ex)*set.K+r])
				}
				e.Out[t*set.K+r] += w64[t*k+j] * y
			}
			for n, d := range flip {
				c := w64[t*k+j] * d * w2Norms[ex][n]
				e.slack2[t] += c * c
			}
		}
	}
	e.Weights = make([]float32, len(w64))
	for i, x := range w64 {
		e.Weights[i] = float32(x)
	}
	var slack2, norm2 float64
	for _, s := range e.slack2 {
		slack2 += s
	}
	for _, v := range e.Out {
		norm2 += v * v
	}
	e.Tol = FP8Tol
	if slack2 > 0 && norm2 > 0 {
		e.Tol += math.Sqrt(slack2 / norm2)
	}
}

// columnNorms is the L2 norm of each column of a [rows, cols] matrix.
func columnNorms(w []float64, rows, cols int) []float64 {
	out := make([]float64, cols)
	for r := range rows {
		for c := range cols {
			out[c] += w[r*cols+c] * w[r*cols+c]
		}
	}
	for c := range out {
		out[c] = math.Sqrt(out[c])
	}
	return out
}

// referenceHidden is the GEMM1 input dequantized: the FP8 value times its scale.
func referenceHidden(set *moe.ExpertSet, req *moe.Request) []float64 {
	m, kk := req.M(), set.K
	bk := set.Block[1]
	out := make([]float64, m*kk)
	if req.Hidden.DType == moe.Float8E4M3FN {
		for t := range m {
			for c := range kk {
				g := 0
				if bk > 0 {
					g = c / bk
				}
				out[t*kk+c] = float64(scaling.E4M3Table[req.Hidden.Data[t*kk+c]]) * float64(req.HiddenScaleAt(set, t, g))
			}
		}
		return out
	}
	src := make([]float32, m*kk)
	for i := range src {
		if req.Hidden.DType == moe.BFloat16 {
			src[i] = scaling.BF16ToFloat32(binary.LittleEndian.Uint16(req.Hidden.Data[2*i:]))
		} else {
			src[i] = math.Float32frombits(binary.LittleEndian.Uint32(req.Hidden.Data[4*i:]))
		}
	}
	for t := range m {
		row := quantizeRow(set.A13Scale, src[t*kk:(t+1)*kk], bk)
		copy(out[t*kk:], row)
	}
	return out
}

// quantizeRow quantizes one row to FP8 (static scale, else dynamic per row
// or per group of bk) and returns the dequantized values.
func quantizeRow(static *float32, row []float32, bk int) []float64 {
	out, _, _ := quantizeRowScales(static, row, bk)
	return out
}

// quantizeRowScales is quantizeRow that also returns the scales and the
// group size they apply to.
func quantizeRowScales(static *float32, row []float32, bk int) (out []float64, scales []float32, group int) {
	n := len(row)
	q := make([]uint8, n)
	if static != nil {
		sc := scaling.ClampScale(*static)
		scaling.QuantizeStatic(q, row, sc)
		scales, group = []float32{sc}, n
	} else {
		group = n
		if bk > 0 {
			group = bk
		}
		scales = make([]float32, ceilDiv(n, group))
		scaling.QuantizeDynamic(q, scales, row, 1, n, group)
	}
	out = make([]float64, n)
	for i := range out {
		out[i] = float64(scaling.E4M3Table[q[i]]) * float64(scales[i/group])
	}
	return out, scales, group
}

// dequantExpert is one expert's [rows, cols] weights as float64.
func dequantExpert(w []byte, ws scaling.WeightScale, e, rows, cols int) []float64 {
	out := make([]float64, rows*cols)
	for r := range rows {
		for c := range cols {
			out[r*cols+c] = float64(scaling.E4M3Table[w[(e*rows+r)*cols+c]]) * float64(ws.At(e, r, c))
		}
	}
	return out
}

// referenceIntermediate is GEMM1, its bias and the activation for one
// token row routed to expert e.
func referenceIntermediate(set *moe.ExpertSet, a []float64, w13 []float64, e int) []float64 {
	kk, n := set.K, set.N
	h := make([]float64, set.Rows1())
	for r := range h {
		for c := range kk {
			h[r] += a[c] * w13[r*kk+c]
		}
		if set.W13Bias != nil {
			h[r] += float64(set.W13Bias[e*len(h)+r])
		}
	}
	x := make([]float64, n)
	for i := range x {
		if set.Activation == moe.Relu2 {
			x[i] = math.Pow(math.Max(h[i], 0), 2)
			continue
		}
		gr, ur := set.GateUp(i)
		g, u := h[gr], h[ur]
		switch set.Activation {
		case moe.SwigluOAI:
			limit, alpha := float64(set.SwigluLimit), float64(set.SwigluAlpha)
			g = math.Min(g, limit)
			u = math.Max(-limit, math.Min(u, limit))
			x[i] = g / (1 + math.Exp(-alpha*g)) * (u + 1)
		case moe.GeluTanhGated:
			x[i] = 0.5 * g * (1 + math.Tanh(math.Sqrt(2/math.Pi)*(g+0.044715*g*g*g))) * u
		case moe.GeluGated:
			x[i] = 0.5 * g * (1 + math.Erf(g/math.Sqrt2)) * u
		default: // moe.SiluGated
			x[i] = g / (1 + math.Exp(-g)) * u
		}
	}
	return x
}

// requantize is the intermediate's FP8 quantization, dequantized, and for
// each element the size of the step to the other rounding when the element
// lies within KnifeEdge of a rounding midpoint (0 otherwise).
func requantize(set *moe.ExpertSet, x []float64) (xq, flip []float64) {
	row := make([]float32, len(x))
	for i, v := range x {
		row[i] = float32(v)
	}
	xq, scales, group := quantizeRowScales(set.A2Scale, row, set.Block[1])
	flip = make([]float64, len(x))
	for i, v := range x {
		s := float64(scales[i/group])
		flip[i] = s * knifeEdgeStep(math.Abs(v)/s)
	}
	return xq, flip
}

// e4m3Grid is every finite non-negative E4M3 value, ascending.
var e4m3Grid = func() []float64 {
	var g []float64
	for _, v := range scaling.E4M3Table {
		if v >= 0 && !math.Signbit(float64(v)) { // NaN and -0 fail one of these
			g = append(g, float64(v))
		}
	}
	sort.Float64s(g)
	return g
}()

// knifeEdgeStep is the distance between v's two E4M3 neighbours (v ≥ 0,
// scaled) when v lies within KnifeEdge·v of their midpoint, so a backend
// may round it to either; 0 otherwise, and for v at or beyond the largest
// value, which saturates either way.
func knifeEdgeStep(v float64) float64 {
	i := sort.SearchFloat64s(e4m3Grid, v) // e4m3Grid[i-1] < v <= e4m3Grid[i]
	if i == 0 || i == len(e4m3Grid) {
		return 0
	}
	lo, hi := e4m3Grid[i-1], e4m3Grid[i]
	if math.Abs(v-(lo+hi)/2) > KnifeEdge*v {
		return 0
	}
	return hi - lo
}

// intermediateAmax is the largest |intermediate| over every routed pair
// under dynamic quantization, for calibrating a static A2Scale.
func intermediateAmax(set *moe.ExpertSet, req *moe.Request) float64 {
	ids := ReferenceRouting(set, req).IDs
	a := referenceHidden(set, req)
	k := req.Routing.TopK
	var mx float64
	for i, e := range ids {
		t := i / k
		w13 := dequantExpert(set.W13, set.W13Scale, int(e), set.Rows1(), set.K)
		for _, v := range referenceIntermediate(set, a[t*set.K:(t+1)*set.K], w13, int(e)) {
			mx = math.Max(mx, math.Abs(v))
		}
	}
	return mx
}

// RelL2 is ‖got−want‖₂/‖want‖₂; +Inf when any element of got is NaN or
// infinite or the lengths differ, so broken output never passes.
func RelL2(got []float32, want []float64) float64 {
	if len(got) != len(want) {
		return math.Inf(1)
	}
	var num, den float64
	for i, g := range got {
		x := float64(g)
		if math.IsNaN(x) || math.IsInf(x, 0) {
			return math.Inf(1)
		}
		num += (x - want[i]) * (x - want[i])
		den += want[i] * want[i]
	}
	if den == 0 {
		if num == 0 {
			return 0
		}
		return math.Inf(1)
	}
	return math.Sqrt(num / den)
}
