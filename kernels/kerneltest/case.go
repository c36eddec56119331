package kerneltest

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"sync"

	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// Option adjusts a generated case.
type Option func(*caseConfig)

type caseConfig struct {
	gran        scaling.Granularity
	block       [2]int
	static      bool
	hidden      moe.DType
	hiddenGran  scaling.Granularity
	logits      moe.DType
	precomputed bool
	skewTo      int
	out         moe.DType
}

// WithGranularity sets the weight scale granularity. The default is Block
// for shapes with a block, per-tensor otherwise.
func WithGranularity(g scaling.Granularity) Option { return func(c *caseConfig) { c.gran = g } }

// WithBlock sets the weight block [Bn, Bk] (and so the activation group
// size); it implies Block granularity unless another is set after it.
func WithBlock(bn, bk int) Option {
	return func(c *caseConfig) { c.block, c.gran = [2]int{bn, bk}, scaling.Block }
}

// WithStaticScales gives the set static activation scales A13Scale and
// A2Scale, calibrated on the case's own data (amax/448 of the GEMM inputs
// under dynamic quantization), instead of dynamic quantization.
func WithStaticScales() Option { return func(c *caseConfig) { c.static = true } }

// WithHidden sets the hidden-state dtype: BFloat16 (default), Float32, or
// Float8E4M3FN, which the case quantizes itself and sends with its scale.
func WithHidden(dt moe.DType) Option { return func(c *caseConfig) { c.hidden = dt } }

// WithHiddenScale sets how FP8 hidden states are scaled: PerTensor (one
// value), PerChannel (one per token, the default) or Block (one per token and
// group of Bk; block mode only). Static scales force PerTensor.
func WithHiddenScale(g scaling.Granularity) Option { return func(c *caseConfig) { c.hiddenGran = g } }

// WithLogits sets the router-logit dtype: Float32 (default) or BFloat16.
func WithLogits(dt moe.DType) Option { return func(c *caseConfig) { c.logits = dt } }

// WithPrecomputedRouting sends random top-k ids (distinct per token) and
// positive weights instead of logits.
func WithPrecomputedRouting() Option { return func(c *caseConfig) { c.precomputed = true } }

// WithAllTokensTo makes every token pick expert e (first), the "all tokens
// to one expert" edge case: its logit and bias are raised far above the
// rest, or it is put first in precomputed ids.
func WithAllTokensTo(e int) Option { return func(c *caseConfig) { c.skewTo = e } }

// WithOutput sets the output dtype: BFloat16 (default) or Float32.
func WithOutput(dt moe.DType) Option { return func(c *caseConfig) { c.out = dt } }

// NewCase generates one FusedMoE problem of shape s with m tokens: hidden
// states randn/10, router logits randn, weights randn quantized to FP8 per
// expert at the chosen granularity, correction bias randn/10 when the shape
// has one. The set's slices are fresh; nothing is shared between calls.
func NewCase(rng *rand.Rand, s Shape, m int, opts ...Option) (*moe.ExpertSet, *moe.Request) {
	return newCase(rng, s, m, nil, opts...)
}

// weights is one generated set of quantized expert weights.
type weights struct {
	w13, w2           []uint8
	w13Scale, w2Scale scaling.WeightScale
}

// weightKey says everything weight generation depends on.
type weightKey struct {
	act   moe.Activation
	e, k  int
	n     int
	gran  scaling.Granularity
	block [2]int
}

var (
	weightMu    sync.Mutex
	weightCache = map[weightKey]*weights{}
)

// sharedWeights returns the process-wide weights for key, generating them
// on first use from a seed derived from the key. Quantizing E·(Rows1+N)·K
// weights is most of a case's cost under -race; sharing them between cases
// of one shape and granularity keeps CheckBackend fast while hidden states,
// logits and biases stay fresh per case.
func sharedWeights(key weightKey) *weights {
	weightMu.Lock()
	defer weightMu.Unlock()
	if w, ok := weightCache[key]; ok {
		return w
	}
	seed := uint64(key.act)<<56 ^ uint64(key.e)<<40 ^ uint64(key.k)<<20 ^ uint64(key.n) ^ uint64(key.gran)<<60
	w := genWeights(rand.New(rand.NewPCG(seed, uint64(key.block[0])<<16|uint64(key.block[1]))), key)
	weightCache[key] = w
	return w
}

func genWeights(rng *rand.Rand, key weightKey) *weights {
	r1 := key.n
	if key.act.Gated() {
		r1 = 2 * key.n
	}
	var w weights
	w.w13, w.w13Scale = scaling.QuantizeWeights(randn(rng, key.e*r1*key.k, 1), key.e, r1, key.k, key.gran, key.block)
	w.w2, w.w2Scale = scaling.QuantizeWeights(randn(rng, key.e*key.k*key.n, 1), key.e, key.k, key.n, key.gran, key.block)
	return &w
}

// newCase is NewCase with the weights taken from the process-wide cache
// when shared is set.
func newCase(rng *rand.Rand, s Shape, m int, shared func(weightKey) *weights, opts ...Option) (*moe.ExpertSet, *moe.Request) {
	c := caseConfig{block: s.Block, hidden: moe.BFloat16, hiddenGran: scaling.PerChannel,
		logits: moe.Float32, skewTo: -1, out: moe.BFloat16}
	for _, o := range opts {
		o(&c)
	}
	if c.gran == 0 {
		c.gran = scaling.PerTensor
		if c.block != [2]int{} {
			c.gran = scaling.Block
		}
	}
	if c.gran != scaling.Block {
		c.block = [2]int{}
	}

	set := &moe.ExpertSet{Activation: s.Activation, E: s.E, K: s.K, N: s.N, Block: c.block}
	key := weightKey{act: s.Activation, e: s.E, k: s.K, n: s.N, gran: c.gran, block: c.block}
	var w *weights
	if shared != nil {
		w = shared(key)
	} else {
		w = genWeights(rng, key)
	}
	set.W13, set.W13Scale, set.W2, set.W2Scale = w.w13, w.w13Scale, w.w2, w.w2Scale
	if s.Activation == moe.SwigluOAI {
		set.SwigluLimit, set.SwigluAlpha = s.SwigluLimit, s.SwigluAlpha
		if set.SwigluLimit == 0 {
			set.SwigluLimit = moe.DefaultSwigluLimit
		}
		if set.SwigluAlpha == 0 {
			set.SwigluAlpha = moe.DefaultSwigluAlpha
		}
	}
	if s.ExpertBias {
		// Of the order of the GEMM outputs they are added to, so a backend
		// that drops or misplaces one misses the bar by far.
		set.W13Bias = randn(rng, s.E*s.Rows1(), 0.5)
		set.W2Bias = randn(rng, s.E*s.K, 0.5)
	}

	hidden := randn(rng, m*s.K, 0.1)
	req := &moe.Request{
		Routing: moe.Routing{TopK: s.TopK, Renormalize: s.Renormalize, Scoring: s.Scoring,
			NumGroups: s.NumGroups, TopKGroups: s.TopKGroups, ScalingFactor: s.ScalingFactor},
		OutDType: c.out,
	}
	if req.Routing.ScalingFactor == 0 {
		req.Routing.ScalingFactor = 1
	}
	if s.Bias {
		req.Routing.CorrectionBias = randn(rng, s.E, 0.1)
	}

	if c.precomputed {
		req.TopKIDs = make([]int32, m*s.TopK)
		req.TopKWeights = make([]float32, m*s.TopK)
		for t := range m {
			perm := rng.Perm(s.E)
			if c.skewTo >= 0 {
				for i, e := range perm {
					if e == c.skewTo {
						perm[0], perm[i] = perm[i], perm[0]
					}
				}
			}
			for j := range s.TopK {
				req.TopKIDs[t*s.TopK+j] = int32(perm[j])
				req.TopKWeights[t*s.TopK+j] = 0.1 + 0.9*rng.Float32()
			}
		}
	} else {
		logits := randn(rng, m*s.E, 1)
		if c.skewTo >= 0 {
			for t := range m {
				logits[t*s.E+c.skewTo] = 10
			}
			if req.Routing.CorrectionBias != nil {
				req.Routing.CorrectionBias[c.skewTo] = 10
			}
		}
		req.Logits = floatTensor(c.logits, logits, m, s.E)
	}

	if c.static {
		a13 := scaling.ClampScale(amax(hidden) / scaling.E4M3Max)
		set.A13Scale = &a13
	}
	if c.hidden == moe.Float8E4M3FN {
		q := make([]uint8, m*s.K)
		switch {
		case c.static || c.hiddenGran == scaling.PerTensor:
			sc := scaling.ClampScale(amax(hidden) / scaling.E4M3Max)
			if c.static {
				sc = *set.A13Scale
			}
			scaling.QuantizeStatic(q, hidden, sc)
			req.HiddenScale = []float32{sc}
		case c.hiddenGran == scaling.Block && c.block[1] > 0:
			req.HiddenScale = make([]float32, m*ceilDiv(s.K, c.block[1]))
			scaling.QuantizeDynamic(q, req.HiddenScale, hidden, m, s.K, c.block[1])
		default:
			req.HiddenScale = make([]float32, m)
			scaling.QuantizeDynamic(q, req.HiddenScale, hidden, m, s.K, s.K)
		}
		req.Hidden = moe.Tensor{DType: moe.Float8E4M3FN, Shape: []int{m, s.K}, Data: q}
	} else {
		req.Hidden = floatTensor(c.hidden, hidden, m, s.K)
	}
	if c.static {
		// Calibrate A2 on this very data so static quantization neither
		// saturates much nor wastes range.
		a2 := scaling.ClampScale(float32(intermediateAmax(set, req)) / scaling.E4M3Max)
		set.A2Scale = &a2
	}
	return set, req
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

func randn(rng *rand.Rand, n int, scale float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(rng.NormFloat64() * scale)
	}
	return v
}

func amax(v []float32) float32 {
	var m float32
	for _, x := range v {
		m = max(m, float32(math.Abs(float64(x))))
	}
	return m
}

// floatTensor encodes v as an [rows, cols] FP32 or BF16 tensor.
func floatTensor(dt moe.DType, v []float32, rows, cols int) moe.Tensor {
	t := moe.Tensor{DType: dt, Shape: []int{rows, cols}, Data: make([]byte, len(v)*dt.Size())}
	for i, x := range v {
		if dt == moe.BFloat16 {
			binary.LittleEndian.PutUint16(t.Data[2*i:], scaling.Float32ToBF16(x))
		} else {
			binary.LittleEndian.PutUint32(t.Data[4*i:], math.Float32bits(x))
		}
	}
	return t
}

// DecodeOutput widens an FP32 or BF16 output buffer to float32.
func DecodeOutput(dt moe.DType, b []byte) []float32 {
	out := make([]float32, len(b)/dt.Size())
	for i := range out {
		if dt == moe.BFloat16 {
			out[i] = scaling.BF16ToFloat32(binary.LittleEndian.Uint16(b[2*i:]))
		} else {
			out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
		}
	}
	return out
}

// PoisonByte fills output buffers before a run: 0xFF bytes are NaN in FP32,
// BF16 and FP8 E4M3FN alike, so an element a kernel forgot to write fails
// every comparison.
const PoisonByte = 0xFF

// Poison fills b with PoisonByte.
func Poison(b []byte) {
	for i := range b {
		b[i] = PoisonByte
	}
}

// Unwritten counts the elements of size bytes in b that still hold the
// poison pattern.
func Unwritten(b []byte, size int) int {
	n := 0
	for i := 0; i+size <= len(b); i += size {
		all := true
		for _, x := range b[i : i+size] {
			all = all && x == PoisonByte
		}
		if all {
			n++
		}
	}
	return n
}

// NearTie is a request of E = 4, top_k 2, sigmoid scores with a correction
// bias, two tokens, on which a correct float32 router routes token 0
// otherwise than the float64 reference, and the ids such a router gives.
// Token 0's logits are all equal and two experts differ only by one
// float32 ulp of their bias, far below the ulp of score + bias: the
// reference takes the one with the larger bias, a float32 router finds the
// two equal and takes the lower id. Token 1's selection values lie far
// apart. With groups, experts {0, 1} and {2, 3} form two groups of which
// one is kept, and the two groups tie the same way.
func NearTie(groups bool) (*moe.ExpertSet, *moe.Request, []int32) {
	s := Shape{Name: "near-tie", Activation: moe.SiluGated, E: 4, TopK: 2, K: 32, N: 16,
		Scoring: moe.Sigmoid, Renormalize: true, Bias: true, ScalingFactor: 2.5}
	set, req := NewCase(rand.New(rand.NewPCG(1, 2)), s, 2)
	const b = 0.01
	up := math.Nextafter32(b, 1)
	req.Routing.CorrectionBias = []float32{0.05, b, up, -0.2}
	logits := []float32{0.3, 0.3, 0.3, 0.3, 2, 1, 0, -1}
	if groups {
		req.Routing.NumGroups, req.Routing.TopKGroups = 2, 1
		req.Routing.CorrectionBias = []float32{b, b, b, up}
		logits = []float32{0.3, 0.3, 0.3, 0.3, 2, 1, -1, -2}
	}
	req.Logits = floatTensor(moe.Float32, logits, 2, 4)
	return set, req, []int32{0, 1, 0, 1}
}
