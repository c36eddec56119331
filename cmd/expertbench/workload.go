package main

import (
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// model is one MoE layer shape of MOE_SPEC.md section 2.
type model struct {
	name       string
	activation moe.Activation
	e, topK    int
	k, n       int
	scoring    moe.Scoring
	bias       bool
	// groups and topKGroups restrict routing to the best expert groups.
	groups, topKGroups int
	scalingFactor      float32
	// block is the [Bn, Bk] of block-scaled checkpoints; zero means one
	// scale per expert.
	block [2]int
	// a13 is the layer's static GEMM1 input scale (staticA13), 0 when
	// its activations are quantized dynamically. A static layer also has
	// a static a2 scale, calibrated when its weights are drawn.
	a13 float32
}

var models = map[string]model{
	"nemotron": {name: "nemotron", activation: moe.Relu2, e: 128, topK: 6, k: 2688, n: 1856,
		scoring: moe.Sigmoid, bias: true, groups: 1, topKGroups: 1, scalingFactor: 2.5},
	"qwen3": {name: "qwen3", activation: moe.SiluGated, e: 128, topK: 8, k: 2048, n: 768,
		scoring: moe.Softmax},
	"mixtral": {name: "mixtral", activation: moe.SiluGated, e: 8, topK: 2, k: 4096, n: 14336,
		scoring: moe.Softmax},
	"deepseek": {name: "deepseek", activation: moe.SiluGated, e: 256, topK: 8, k: 7168, n: 2048,
		scoring: moe.Sigmoid, bias: true, groups: 8, topKGroups: 4, scalingFactor: 2.5, block: [2]int{128, 128}},
}

func (m model) rows1() int {
	if m.activation.Gated() {
		return 2 * m.n
	}
	return m.n
}

// weightBytes is the size of the layer's FP8 weights.
func (m model) weightBytes() int64 {
	return int64(m.e) * int64(m.k) * int64(m.rows1()+m.n)
}

func (m model) String() string {
	s := fmt.Sprintf("%s (E=%d top_k=%d K=%d N=%d %v", m.name, m.e, m.topK, m.k, m.n, m.activation)
	if m.block != [2]int{} {
		s += fmt.Sprintf(" block %dx%d", m.block[0], m.block[1])
	}
	if m.a13 > 0 {
		s += " static scales"
	}
	return s + ")"
}

// validate checks overridden sizes against the routing they must support.
func (m model) validate() error {
	switch {
	case m.e < 1 || m.k < 1 || m.n < 1:
		return fmt.Errorf("-e %d -k %d -n %d: want every size >= 1", m.e, m.k, m.n)
	case m.topK < 1 || m.topK > m.e:
		return fmt.Errorf("-topk %d: want 1..E (%d)", m.topK, m.e)
	case m.groups > 1 && m.e%m.groups != 0:
		return fmt.Errorf("%s routes over %d expert groups, which must divide E = %d", m.name, m.groups, m.e)
	case m.groups > 1 && m.topKGroups*(m.e/m.groups) < m.topK:
		return fmt.Errorf("%s keeps %d groups of %d experts, fewer than top_k %d", m.name, m.topKGroups, m.e/m.groups, m.topK)
	}
	return nil
}

// codeTable maps a uniform random byte to the FP8 code of a normal
// sample times codeScale, so that filling gigabytes of weights costs one
// table lookup per byte instead of a normal sample and an encode.
var codeTable = func() [256]byte {
	var t [256]byte
	for i := range t {
		// The normal quantile at the byte's bin center.
		p := (float64(i) + 0.5) / 256
		t[i] = scaling.Float32ToE4M3(float32(math.Sqrt2 * math.Erfinv(2*p-1) * codeScale))
	}
	return t
}()

// codeScale spreads the codes over E4M3's range (max 448) while keeping
// the tails finite.
const codeScale = 64

// randomCodes is n FP8 codes of normal samples times codeScale.
func randomCodes(rng *rand.ChaCha8, n int64) []byte {
	b := make([]byte, n)
	rng.Read(b)
	for i, x := range b {
		b[i] = codeTable[x]
	}
	return b
}

// codeWeightScale dequantizes randomCodes to about N(0, 1/cols) weights
// of a matrix with cols columns, which keeps activations of unit size
// through the layer.
func codeWeightScale(cols int) float32 {
	return float32(1 / (codeScale * math.Sqrt(float64(cols))))
}

// weightScale is a scale of the FP8 codes of a [e, rows, cols] weight:
// codeWeightScale per expert, or per block.
func (m model) weightScale(rows, cols int) client.Tensor {
	s := codeWeightScale(cols)
	if m.block == [2]int{} {
		v := make([]float32, m.e)
		for i := range v {
			v[i] = s
		}
		return client.FromFloat32(v, m.e)
	}
	nb, kb := (rows+m.block[0]-1)/m.block[0], (cols+m.block[1]-1)/m.block[1]
	v := make([]float32, m.e*nb*kb)
	for i := range v {
		v[i] = s
	}
	return client.FromFloat32(v, m.e, nb, kb)
}

// randomWeights is a layer of random expert weights for the model.
func (m model) randomWeights(seed uint64) *client.ExpertWeights {
	var key [32]byte
	for i := range 8 {
		key[i] = byte(seed >> (8 * i))
	}
	rng := rand.NewChaCha8(key)
	w := &client.ExpertWeights{
		Activation: m.activation,
		W13:        client.FromFP8(randomCodes(rng, int64(m.e)*int64(m.rows1())*int64(m.k)), m.e, m.rows1(), m.k),
		W2:         client.FromFP8(randomCodes(rng, int64(m.e)*int64(m.k)*int64(m.n)), m.e, m.k, m.n),
		W13Scale:   m.weightScale(m.rows1(), m.k),
		W2Scale:    m.weightScale(m.k, m.n),
		BlockShape: m.block,
	}
	if m.a13 > 0 {
		w.A13Scale = client.FromFloat32([]float32{m.a13})
		w.A2Scale = client.FromFloat32([]float32{m.calibrateA2(w.W13.Data)})
	}
	return w
}

// randn is n normal samples times scale.
func randn(rng *rand.Rand, n int, scale float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(rng.NormFloat64() * scale)
	}
	return v
}

// tokens is tokens random tokens: hidden states randn/10 [tokens, K] and
// FP32 router logits randn [tokens, E].
func (m model) tokens(rng *rand.Rand, tokens int) (hidden, logits []float32) {
	return randn(rng, tokens*m.k, 0.1), randn(rng, tokens*m.e, 1)
}

// request is a FusedMoE call of tokens random tokens on the loaded set:
// m.tokens' hidden states in BF16, or with fp8 in E4M3, quantized with
// the layer's static a13 scale (one per-tensor hidden_states_scale, as a
// static-scale model's FP8 path produces them) or dynamically per token
// (per token and group on block-scaled models); its logits; and for
// models that have one the layer's correction bias.
func (m model) request(rng *rand.Rand, set string, tokens int, out moe.DType, fp8 bool) *client.FusedMoERequest {
	hidden, logits := m.tokens(rng, tokens)
	r := &client.FusedMoERequest{
		ExpertSet:    set,
		RouterLogits: client.FromFloat32(logits, tokens, m.e),
		Routing: client.Routing{TopK: m.topK, Renormalize: true, Scoring: m.scoring,
			NumGroups: m.groups, TopKGroups: m.topKGroups, ScalingFactor: m.scalingFactor},
		OutputDType: out,
	}
	switch {
	case !fp8:
		r.Hidden = client.BFloat16FromFloat32(hidden, tokens, m.k)
	case m.a13 > 0:
		q := make([]byte, len(hidden))
		scaling.QuantizeStatic(q, hidden, m.a13)
		r.Hidden, r.HiddenScale = client.FromFP8(q, tokens, m.k), client.FromFloat32([]float32{m.a13}, 1)
	default:
		// One scale per token, or per token and group of Bk in block mode.
		group := m.k
		if m.block[1] > 0 {
			group = m.block[1]
		}
		var err error
		if r.Hidden, r.HiddenScale, err = client.QuantizeFP8(hidden, tokens, m.k, group); err != nil {
			panic(err) // the model's shape is validated at start-up
		}
	}
	if m.bias {
		r.Routing.CorrectionBias = client.FromFloat32(m.correctionBias(), m.e)
	}
	return r
}

// correctionBias is the layer's routing bias [E], randn/10 from a seed
// fixed by the shape. It belongs to the layer like its weights, so every
// call sends the same one, as a model's callers do; the server batches
// only calls that agree on it.
func (m model) correctionBias() []float32 {
	return randn(rand.New(rand.NewPCG(uint64(m.e), uint64(m.k)<<32|uint64(m.n))), m.e, 0.1)
}
