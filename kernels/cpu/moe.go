package cpu

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"

	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// plan is one FusedMoE call's routing and token permutation.
//
// The M·TopK (token, slot) pairs are laid out grouped by expert: pair
// (t, j) routed to expert e sits at position pos[t*TopK+j], inside
// [off[e], off[e+1]). Each expert's GEMMs then run over contiguous rows.
type plan struct {
	m, topK int
	ids     []int32
	weights []float32
	off     []int   // [E+1]
	pos     []int32 // [M*TopK] pair -> position
	tok     []int32 // [M*TopK] position -> token
	expert  []int32 // [M*TopK] position -> expert
	iota    []int32 // [M*TopK] position -> position
}

func newPlan(set *moe.ExpertSet, m, topK int, ids []int32, weights []float32) *plan {
	p := &plan{m: m, topK: topK, ids: ids, weights: weights}
	n := m * topK
	p.off = make([]int, set.E+1)
	for _, e := range ids {
		p.off[e+1]++
	}
	for e := range set.E {
		p.off[e+1] += p.off[e]
	}
	next := append([]int(nil), p.off[:set.E]...)
	p.pos = make([]int32, n)
	p.tok = make([]int32, n)
	p.expert = make([]int32, n)
	p.iota = make([]int32, n)
	for i, e := range ids {
		at := next[e]
		next[e]++
		p.pos[i] = int32(at)
		p.tok[at] = int32(i / topK)
		p.expert[at] = e
	}
	for i := range p.iota {
		p.iota[i] = int32(i)
	}
	return p
}

// segments is how a reduction of length k splits into scale segments: Bk
// in block mode, one segment of k otherwise.
func segments(set *moe.ExpertSet, k int) (seg, nseg int) {
	if bk := set.Block[1]; bk > 0 {
		return bk, (k + bk - 1) / bk
	}
	return k, 1
}

// maxChunk bounds the tokens of one pass through the pipeline, and so its
// scratch (M·TopK·max(Rows1, K) float32: 134 MB for DeepSeek-V3 at 1024
// tokens). Each pass decodes the weights of its experts again, which at
// 1024 tokens per pass is a few percent of the GEMM work.
const maxChunk = 1024

// run is the whole op on a validated request: routing for every token,
// then the expert pipeline over chunks of at most maxChunk tokens.
func (b *Backend) run(ctx context.Context, set *moe.ExpertSet, req *moe.Request) (*moe.Result, error) {
	m, topK := req.M(), req.Routing.TopK
	var ids []int32
	var weights []float32
	if req.TopKIDs != nil {
		// Copied: the result must not alias the request's buffers.
		ids = append([]int32(nil), req.TopKIDs...)
		weights = append([]float32(nil), req.TopKWeights...)
	} else {
		ids = make([]int32, m*topK)
		weights = make([]float32, m*topK)
		logits := decodeFloats(req.Logits)
		e := set.E
		chunk := max(1, 4096/e) // tokens per work item: keep items ~µs-sized
		parallelFor(b.workers, (m+chunk-1)/chunk, func(_, c int) {
			t0, t1 := c*chunk, min((c+1)*chunk, m)
			moe.Route(ids[t0*topK:t1*topK], weights[t0*topK:t1*topK], logits[t0*e:t1*e], t1-t0, e, req.Routing)
		})
	}
	out := req.Out
	if n := m * set.K * req.OutDType.Size(); len(out) != n {
		if out != nil {
			return nil, fmt.Errorf("cpu: Out has %d bytes, want %d", len(out), n)
		}
		out = make([]byte, n)
	}
	for t0 := 0; t0 < m; t0 += b.chunk {
		t1 := min(t0+b.chunk, m)
		if err := b.pass(ctx, set, req, t0, t1, ids[t0*topK:t1*topK], weights[t0*topK:t1*topK],
			out[t0*set.K*req.OutDType.Size():t1*set.K*req.OutDType.Size()]); err != nil {
			return nil, err
		}
	}
	return &moe.Result{Output: out, TopKIDs: ids, TopKWeights: weights}, nil
}

// pass runs tokens [t0, t1) of req through the experts into out.
func (b *Backend) pass(ctx context.Context, set *moe.ExpertSet, req *moe.Request, t0, t1 int,
	ids []int32, weights []float32, out []byte) error {
	m, topK := t1-t0, req.Routing.TopK
	p := newPlan(set, m, topK, ids, weights)
	if err := ctx.Err(); err != nil {
		return err
	}

	// GEMM1 over the quantized hidden states.
	K, N, R1 := set.K, set.N, set.Rows1()
	seg1, nseg1 := segments(set, K)
	a, aS := b.quantizeHidden(set, req, t0, t1, seg1, nseg1)
	h := make([]float32, m*topK*R1)
	b.grouped(set, set.W13, set.W13Scale, R1, K, seg1, nseg1, a, aS, p, p.tok, h)
	if err := ctx.Err(); err != nil {
		return err
	}

	// Activation and requantization to FP8, per pair.
	seg2, nseg2 := segments(set, N)
	x := make([]float32, m*topK*N)
	xS := make([]float32, m*topK*nseg2)
	b.activate(set, h, p.expert, x, xS, m*topK, seg2, nseg2)
	if err := ctx.Err(); err != nil {
		return err
	}

	// GEMM2, reusing h as its output when it is large enough.
	var y []float32
	if R1 >= K {
		y = h[:m*topK*K]
	} else {
		y = make([]float32, m*topK*K)
	}
	b.grouped(set, set.W2, set.W2Scale, K, N, seg2, nseg2, x, xS, p, p.iota, y)
	b.combine(set, p, y, req.OutDType, out)
	return nil
}

// decodeFloats widens FP32 or BF16 tensor bytes to float32.
func decodeFloats(t moe.Tensor) []float32 {
	n := t.Numel()
	out := make([]float32, n)
	switch t.DType {
	case moe.BFloat16:
		for i := range out {
			out[i] = scaling.BF16ToFloat32(binary.LittleEndian.Uint16(t.Data[2*i:]))
		}
	default: // moe.Float32
		for i := range out {
			out[i] = math.Float32frombits(binary.LittleEndian.Uint32(t.Data[4*i:]))
		}
	}
	return out
}

// quantizeHidden returns the GEMM1 input as decoded FP8 values [M, K] and
// their scales [M, nseg]. FP8 input comes with its own scale (1, M or
// M·nseg values); BF16/FP32 input is quantized here: with the static
// A13Scale when the set has one, else dynamically per token (per group of
// Bk in block mode).
func (b *Backend) quantizeHidden(set *moe.ExpertSet, req *moe.Request, t0, t1, seg, nseg int) ([]float32, []float32) {
	m, k := t1-t0, set.K
	a := make([]float32, m*k)
	aS := make([]float32, m*nseg)
	if req.Hidden.DType == moe.Float8E4M3FN {
		decodeFP8(a, req.Hidden.Data[t0*k:t1*k])
		for t := range m {
			for s := range nseg {
				aS[t*nseg+s] = req.HiddenScaleAt(set, t0+t, s)
			}
		}
		return a, aS
	}
	sz := req.Hidden.DType.Size()
	src := decodeFloats(moe.Tensor{DType: req.Hidden.DType, Shape: []int{m, k}, Data: req.Hidden.Data[t0*k*sz : t1*k*sz]})
	q := make([]uint8, m*k)
	if set.A13Scale != nil {
		sc := scaling.ClampScale(*set.A13Scale)
		scaling.QuantizeStatic(q, src, sc)
		for i := range aS {
			aS[i] = sc
		}
	} else {
		scaling.QuantizeDynamic(q, aS, src, m, k, seg)
	}
	decodeFP8(a, q)
	return a, aS
}

// grouped runs one grouped GEMM: for every expert with tokens, its rows of
// a (selected by rows[off[e]:off[e+1]]) against all R rows of its weights
// w [E, R, k], into c[position, R]. Work items are (expert, weight tile)
// pairs so that even one token's six experts spread over every core.
func (b *Backend) grouped(set *moe.ExpertSet, w []byte, ws scaling.WeightScale, R, k, seg, nseg int,
	a, aS []float32, p *plan, rows []int32, c []float32) {
	tr := tileRows(k)
	type item struct{ e, r0 int }
	var items []item
	for e := range set.E {
		if p.off[e] == p.off[e+1] {
			continue
		}
		for r0 := 0; r0 < R; r0 += tr {
			items = append(items, item{e, r0})
		}
	}
	scratch := make([][]float32, b.workers)
	scales := make([][]float32, b.workers)
	bk := set.Block[1]
	parallelFor(b.workers, len(items), func(wk, i int) {
		it := items[i]
		rt := min(tr, R-it.r0)
		if scratch[wk] == nil {
			scratch[wk] = make([]float32, tr*k)
			scales[wk] = make([]float32, tr*nseg)
		}
		base := (it.e*R + it.r0) * k
		lo, hi := p.off[it.e], p.off[it.e+1]
		g := gemmArgs{
			a: a, rows: rows[lo:hi], aS: aS,
			wq: w[base : base+rt*k], rt: rt,
			k: k, seg: seg, nseg: nseg,
			c: c, out: p.iota[lo:hi], ldc: R, col0: it.r0,
		}
		if hi-lo >= decodeMinRows {
			g.w = scratch[wk][:rt*k]
			decodeFP8(g.w, g.wq)
		}
		g.wS = scales[wk][:rt*nseg]
		for r := range rt {
			for s := range nseg {
				g.wS[r*nseg+s] = ws.At(it.e, it.r0+r, s*bk)
			}
		}
		gemmTile(&g)
	})
}

// activate adds the GEMM1 bias of each of the n GEMM1 output rows of h
// (row p from expert expert[p]), applies the activation and requantizes it
// to FP8: static A2Scale when set, else dynamic per row (per group of Bk
// in block mode). x receives the decoded FP8 values [n, N], xS the scales
// [n, nseg].
func (b *Backend) activate(set *moe.ExpertSet, h []float32, expert []int32, x, xS []float32, n, seg, nseg int) {
	N, R1 := set.N, set.Rows1()
	const chunk = 16
	qs := make([][]uint8, b.workers)
	parallelFor(b.workers, (n+chunk-1)/chunk, func(wk, c int) {
		p0, p1 := c*chunk, min((c+1)*chunk, n)
		if qs[wk] == nil {
			qs[wk] = make([]uint8, chunk*N)
		}
		q := qs[wk][:(p1-p0)*N]
		act := x[p0*N : p1*N]
		for p := p0; p < p1; p++ {
			hr := h[p*R1 : (p+1)*R1]
			if set.W13Bias != nil {
				e := int(expert[p])
				for r, v := range set.W13Bias[e*R1 : (e+1)*R1] {
					hr[r] += v
				}
			}
			activateRow(set, act[(p-p0)*N:(p-p0+1)*N], hr)
		}
		if set.A2Scale != nil {
			sc := scaling.ClampScale(*set.A2Scale)
			scaling.QuantizeStatic(q, act, sc)
			for i := p0 * nseg; i < p1*nseg; i++ {
				xS[i] = sc
			}
		} else {
			scaling.QuantizeDynamic(q, xS[p0*nseg:p1*nseg], act, p1-p0, N, seg)
		}
		decodeFP8(act, q)
	})
}

// activateRow writes the activation of one GEMM1 output row h (bias
// added) into x.
func activateRow(set *moe.ExpertSet, x, h []float32) {
	switch set.Activation {
	case moe.Relu2:
		for j := range x {
			v := max(h[j], 0)
			x[j] = v * v
		}
		return
	case moe.SwigluOAI:
		limit, alpha := set.SwigluLimit, set.SwigluAlpha
		for j := range x {
			gr, ur := set.GateUp(j)
			g := min(h[gr], limit)
			u := min(max(h[ur], -limit), limit)
			x[j] = g * sigmoid(alpha*g) * (u + 1)
		}
		return
	}
	var f func(float32) float32
	switch set.Activation {
	case moe.GeluTanhGated:
		f = geluTanh
	case moe.GeluGated:
		f = gelu
	default: // moe.SiluGated
		f = func(g float32) float32 { return g * sigmoid(g) }
	}
	for j := range x {
		gr, ur := set.GateUp(j)
		x[j] = f(h[gr]) * h[ur]
	}
}

func sigmoid(x float32) float32 { return 1 / (1 + float32(math.Exp(float64(-x)))) }

// geluTanh is GELU's tanh approximation (PyTorch's approximate="tanh").
func geluTanh(x float32) float32 {
	const c = 0.7978845608028654 // sqrt(2/pi)
	return 0.5 * x * (1 + float32(math.Tanh(c*(float64(x)+0.044715*float64(x)*float64(x)*float64(x)))))
}

// gelu is the exact, erf-based GELU.
func gelu(x float32) float32 { return 0.5 * x * (1 + float32(math.Erf(float64(x)/math.Sqrt2))) }

// combine adds each pair's GEMM2 bias, sums each token's expert outputs
// weighted by its routing weights, in slot order, and encodes the [M, K]
// result into out.
func (b *Backend) combine(set *moe.ExpertSet, p *plan, y []float32, dt moe.DType, out []byte) {
	k := set.K
	// Poison first (0xFF is NaN in FP32 and BF16): an element the loop
	// below missed reads NaN, which fails every check, not a plausible zero.
	for i := range out {
		out[i] = 0xFF
	}
	const chunk = 8
	parallelFor(b.workers, (p.m+chunk-1)/chunk, func(_, c int) {
		acc := make([]float32, k)
		for t := c * chunk; t < min((c+1)*chunk, p.m); t++ {
			clear(acc)
			for j := range p.topK {
				w := p.weights[t*p.topK+j]
				yr := y[int(p.pos[t*p.topK+j])*k:][:k]
				if set.W2Bias != nil {
					e := int(p.ids[t*p.topK+j])
					for i, v := range set.W2Bias[e*k : (e+1)*k] {
						acc[i] += w * (yr[i] + v)
					}
					continue
				}
				for i, v := range yr {
					acc[i] += w * v
				}
			}
			if dt == moe.Float32 {
				o := out[t*k*4 : (t+1)*k*4]
				for i, v := range acc {
					binary.LittleEndian.PutUint32(o[4*i:], math.Float32bits(v))
				}
			} else {
				o := out[t*k*2 : (t+1)*k*2]
				for i, v := range acc {
					binary.LittleEndian.PutUint16(o[2*i:], scaling.Float32ToBF16(v))
				}
			}
		}
	})
}
