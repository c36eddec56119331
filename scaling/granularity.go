package scaling

import (
	"errors"
	"fmt"
	"math"
)

// Granularity says how many values a quantization scale has and which
// elements each one covers.
type Granularity int

const (
	// PerTensor: one scale for the whole tensor (shape [] or [1]).
	PerTensor Granularity = iota + 1
	// PerExpert: one scale per expert (shape [E]).
	PerExpert
	// PerChannel: one scale per output row of each expert (shape [E, rows]);
	// for activations, one per token ([M]).
	PerChannel
	// Block: one scale per [Bn, Bk] tile (shape [E, ceil(rows/Bn), ceil(K/Bk)]);
	// for activations, one per token and K group ([M, ceil(K/Bk)]).
	Block
)

func (g Granularity) String() string {
	switch g {
	case PerTensor:
		return "per-tensor"
	case PerExpert:
		return "per-expert"
	case PerChannel:
		return "per-channel"
	case Block:
		return "block"
	}
	return "unknown"
}

// WeightScale dequantizes one [E, Rows, Cols] FP8 weight tensor: element
// (e, row, col) is E4M3Table[w[(e·Rows+row)·Cols+col]] · At(e, row, col).
type WeightScale struct {
	Granularity Granularity
	// Values are row-major in the granularity's shape.
	Values []float32
	// Block is [Bn, Bk] for Block granularity.
	Block [2]int
	// E, Rows and Cols are the shape of the weight tensor being scaled.
	// PerTensor and PerExpert scales work without them (At ignores them);
	// NewWeightScale and QuantizeWeights always set them.
	E, Rows, Cols int
}

// At returns the scale of weight element (e, row, col), whatever the
// granularity. It does not check bounds beyond what indexing Values does.
func (w WeightScale) At(e, row, col int) float32 {
	switch w.Granularity {
	case PerTensor:
		return w.Values[0]
	case PerExpert:
		return w.Values[e]
	case PerChannel:
		return w.Values[e*w.Rows+row]
	case Block:
		nb, kb := ceilDiv(w.Rows, w.Block[0]), ceilDiv(w.Cols, w.Block[1])
		return w.Values[(e*nb+row/w.Block[0])*kb+col/w.Block[1]]
	}
	panic(fmt.Sprintf("scaling: WeightScale.At with granularity %v", w.Granularity))
}

// Expert returns the one scale of expert e. It is defined for PerTensor and
// PerExpert scales only, and panics for the others, whose scale varies
// within an expert (use At).
func (w WeightScale) Expert(e int) float32 {
	switch w.Granularity {
	case PerTensor:
		return w.Values[0]
	case PerExpert:
		return w.Values[e]
	}
	panic(fmt.Sprintf("scaling: WeightScale.Expert needs a per-tensor or per-expert scale, have %v", w.Granularity))
}

// errShape is wrapped by every shape error of NewWeightScale.
var errShape = errors.New("bad scale shape")

// errValue is wrapped by every value error of NewWeightScale.
var errValue = errors.New("bad scale value")

// NewWeightScale classifies and validates the scale of an [e, rows, cols]
// weight tensor. The shape says the granularity: [] or [1] per-tensor,
// [e] per-expert, [e, rows] per-channel and, when block = [Bn, Bk] is not
// zero, [e, ceil(rows/Bn), ceil(cols/Bk)] block (an [1] scale with e = 1 is
// per-tensor). Any other shape is an error naming the shapes expected.
// Every value must be finite and > 0 (the error names the first bad
// index); the values are copied and clamped to MinScale.
func NewWeightScale(shape []int, values []float32, e, rows, cols int, block [2]int) (WeightScale, error) {
	if e < 1 || rows < 1 || cols < 1 {
		return WeightScale{}, fmt.Errorf("%w: weight shape [%d %d %d] must have every dimension >= 1", errShape, e, rows, cols)
	}
	if (block[0] > 0) != (block[1] > 0) || block[0] < 0 || block[1] < 0 {
		return WeightScale{}, fmt.Errorf("%w: block %v must be [Bn, Bk] with both >= 1, or zero", errShape, block)
	}
	ws := WeightScale{E: e, Rows: rows, Cols: cols}
	switch {
	case len(shape) == 0 || len(shape) == 1 && shape[0] == 1:
		ws.Granularity = PerTensor
	case len(shape) == 1 && shape[0] == e:
		ws.Granularity = PerExpert
	case len(shape) == 2 && shape[0] == e && shape[1] == rows:
		ws.Granularity = PerChannel
	case block != [2]int{} && len(shape) == 3 && shape[0] == e &&
		shape[1] == ceilDiv(rows, block[0]) && shape[2] == ceilDiv(cols, block[1]):
		ws.Granularity, ws.Block = Block, block
	default:
		want := fmt.Sprintf("[] or [1] (per-tensor), [%d] (per-expert) or [%d %d] (per-channel)", e, e, rows)
		if block != [2]int{} {
			want = fmt.Sprintf("[] or [1] (per-tensor), [%d] (per-expert), [%d %d] (per-channel) or [%d %d %d] (block %v)",
				e, e, rows, e, ceilDiv(rows, block[0]), ceilDiv(cols, block[1]), block)
		}
		return WeightScale{}, fmt.Errorf("%w %v for weights [%d %d %d]: want %s", errShape, shape, e, rows, cols, want)
	}
	n := 1
	for _, d := range shape {
		n *= d
	}
	if len(values) != n {
		return WeightScale{}, fmt.Errorf("%w: shape %v has %d elements, got %d values", errShape, shape, n, len(values))
	}
	ws.Values = make([]float32, n)
	for i, v := range values {
		if !checkScale(v) {
			return WeightScale{}, fmt.Errorf("%w: element %d is %v: scales must be finite and > 0", errValue, i, v)
		}
		ws.Values[i] = ClampScale(v)
	}
	return ws, nil
}

// Shape returns the shape of w.Values for its granularity: [] for
// per-tensor, [E], [E, Rows] or [E, ceil(Rows/Bn), ceil(Cols/Bk)].
func (w WeightScale) Shape() []int {
	switch w.Granularity {
	case PerExpert:
		return []int{w.E}
	case PerChannel:
		return []int{w.E, w.Rows}
	case Block:
		return []int{w.E, ceilDiv(w.Rows, w.Block[0]), ceilDiv(w.Cols, w.Block[1])}
	}
	return []int{}
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

// amaxScale is the scale that maps amax to E4M3Max.
func amaxScale(amax float32) float32 { return ClampScale(amax / E4M3Max) }

// absMax is the largest |x| in v; NaN propagates, as in torch's amax, so a
// NaN input poisons its scale rather than hiding.
func absMax(v []float32) float32 {
	var m float32
	for _, x := range v {
		a := float32(math.Abs(float64(x)))
		if a > m {
			m = a
		} else if a != a {
			return a
		}
	}
	return m
}
