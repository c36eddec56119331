package main

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/internal/clip"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// scalesUsage documents -scales.
const scalesUsage = "activation scales of the layer: dynamic (per token, quantized by the server), or static (a per-tensor a13 and a2 that -load " +
	"calibrates as bench/peer.py's calibrate_a2_scale does: the bench's kind of layer; -hidden fp8 then sends a13 as one per-tensor scale, " +
	"and without -load the set must have been loaded with -scales static)"

// calibrationTokens is the size of the batch static scales are calibrated
// on, bench/peer.py's.
const calibrationTokens = 256

// calibration is the layer's calibration batch: calibrationTokens tokens
// drawn as the bench's calls draw theirs, from a seed fixed by the shape
// (not correctionBias's), so that every expertbench run derives
// the same a13 for a set that another run loaded.
func (m model) calibration() (hidden, logits []float32) {
	return m.tokens(rand.New(rand.NewPCG(uint64(m.k)<<32|uint64(m.n), uint64(m.e)<<1|1)), calibrationTokens)
}

// staticA13 is the static GEMM1 input scale: the calibration batch's
// hidden-state amax / 448, as a static-scale checkpoint's calibration
// sets it. Calls draw other tokens of the same distribution, whose few
// larger values saturate, as they do under any static scale.
func (m model) staticA13() float32 {
	hidden, _ := m.calibration()
	return scaling.PerTensorScale(hidden)
}

// calibrateA2 is the static GEMM2 input scale of a layer whose W13 holds
// the FP8 codes w13 (dequantized by codeWeightScale per expert): the
// largest |activation(GEMM1)| over the calibration batch's routed
// (token, expert) pairs, its hidden states quantized at m.a13, / 448 —
// bench/peer.py's calibrate_a2_scale, in float32. Each hit expert's rows
// are decoded once and run on all of the expert's tokens, the experts
// spread over the CPUs: for the full Nemotron layer that is 256·6 pairs of
// 1856·2688 multiply-adds, 7.7e9, once per load.
func (m model) calibrateA2(w13 []byte) float32 {
	hidden, logits := m.calibration()
	q := make([]uint8, len(hidden))
	scaling.QuantizeStatic(q, hidden, m.a13)
	a := hidden // dequantized in place: the GEMM1 input the server sees
	scaling.Dequantize(a, q, []float32{m.a13}, 1, len(a), len(a))

	r := moe.Routing{TopK: m.topK, Renormalize: true, Scoring: m.scoring,
		NumGroups: m.groups, TopKGroups: m.topKGroups, ScalingFactor: 1}
	if m.bias {
		r.CorrectionBias = m.correctionBias()
	}
	ids := make([]int32, calibrationTokens*m.topK)
	moe.Route(ids, make([]float32, len(ids)), logits, calibrationTokens, m.e, r)
	byExpert := make([][]int, m.e)
	for i, e := range ids {
		byExpert[e] = append(byExpert[e], i/m.topK)
	}

	rows, k, n := m.rows1(), m.k, m.n
	ws := codeWeightScale(k)
	var (
		next atomic.Int64
		mu   sync.Mutex
		amax float32
		wg   sync.WaitGroup
	)
	for range runtime.GOMAXPROCS(0) {
		wg.Go(func() {
			row := make([]float32, k)
			var mx float32
			for e := int(next.Add(1) - 1); e < m.e; e = int(next.Add(1) - 1) {
				toks := byExpert[e]
				if len(toks) == 0 {
					continue
				}
				h := make([]float32, len(toks)*rows)
				for j := range rows {
					off := (e*rows + j) * k
					for c, b := range w13[off : off+k] {
						row[c] = scaling.E4M3Table[b] * ws
					}
					for i, t := range toks {
						var s float32
						for c, x := range a[t*k : (t+1)*k] {
							s += x * row[c]
						}
						h[i*rows+j] = s
					}
				}
				for i := range toks {
					mx = max(mx, activationAmax(m.activation, h[i*rows:(i+1)*rows], n))
				}
			}
			mu.Lock()
			amax = max(amax, mx)
			mu.Unlock()
		})
	}
	wg.Wait()
	return scaling.ClampScale(amax / scaling.E4M3Max)
}

// activationAmax is the largest |activation| of one GEMM1 output row h:
// relu(h)² for ReLU², silu(gate)·up for the gated models (gate rows [0,
// n), up rows [n, 2n), vLLM's order), the two activations of the models
// table.
func activationAmax(act moe.Activation, h []float32, n int) float32 {
	var mx float32
	if act == moe.Relu2 {
		for _, v := range h {
			v = max(v, 0)
			mx = max(mx, v*v)
		}
		return mx
	}
	for j, g := range h[:n] {
		x := g / (1 + float32(math.Exp(float64(-g)))) * h[n+j]
		mx = max(mx, float32(math.Abs(float64(x))))
	}
	return mx
}

// checkStaticSet refuses -scales static without -load on a set whose
// activation scales are dynamic: its calls would time the other kind of
// layer under this one's label. An absent set is left to the first
// call's NotFound.
func checkStaticSet(ctx context.Context, c *client.Client, cfg config) error {
	ctx, cancel := cfg.dial.Call(ctx)
	defer cancel()
	sets, err := c.ListExperts(ctx)
	if err != nil {
		return fmt.Errorf("-scales static: listing the loaded sets: %w", err)
	}
	for _, s := range sets {
		if s.Name == cfg.set && !(s.StaticA13Scale && s.StaticA2Scale) {
			return fmt.Errorf("-scales static: set %s has dynamic activation scales; load it with -load -scales static", clip.Quote(cfg.set))
		}
	}
	return nil
}
