package scaling

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

// WeightScale dequantizes one [E, Rows, Cols] FP8 weight tensor.
type WeightScale struct {
	Granularity Granularity
	// Values are row-major in the granularity's shape.
	Values []float32
	// Block is [Bn, Bk] for Block granularity.
	Block [2]int
}
