// Package kerneltest holds the test helpers every FusedMoE backend is
// checked with: the reference model shapes of MOE_SPEC.md, a generator of
// fresh random cases, a float64 reference implementation, error metrics,
// and CheckBackend, which runs a backend through a table of cases (the four
// shapes scaled down plus the spec's edge cases) so that a backend's test
// is one call.
package kerneltest

import (
	"fmt"

	"github.com/expertd/expertd/moe"
)

// Shape is one model's MoE layer: its sizes, activation and routing.
// The presets below are values; copy one and change fields to scale it.
type Shape struct {
	Name       string
	Activation moe.Activation
	// E experts, TopK per token, hidden size K, intermediate size N.
	E, TopK, K, N int
	Scoring       moe.Scoring
	Renormalize   bool
	// Bias says the router has a correction bias (random per case).
	Bias bool
	// ExpertBias says the experts have GEMM1 and GEMM2 biases (random per
	// case), as gpt-oss's do.
	ExpertBias bool
	// SwigluLimit and SwigluAlpha are SwigluOAI's; 0 means gpt-oss's.
	SwigluLimit, SwigluAlpha float32
	// NumGroups and TopKGroups restrict top-k to the best groups.
	NumGroups, TopKGroups int
	// ScalingFactor multiplies routing weights (1 for none).
	ScalingFactor float32
	// Block is the checkpoint's [Bn, Bk] weight block, zero when the
	// checkpoint is not block-scaled.
	Block [2]int
}

// The reference shapes of MOE_SPEC.md section 2.
var (
	Nemotron = Shape{Name: "Nemotron", Activation: moe.Relu2, E: 128, TopK: 6, K: 2688, N: 1856,
		Scoring: moe.Sigmoid, Renormalize: true, Bias: true, NumGroups: 1, TopKGroups: 1, ScalingFactor: 2.5}
	Qwen3 = Shape{Name: "Qwen3", Activation: moe.SiluGated, E: 128, TopK: 8, K: 2048, N: 768,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1}
	Mixtral = Shape{Name: "Mixtral", Activation: moe.SiluGated, E: 8, TopK: 2, K: 4096, N: 14336,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1}
	DeepSeekV3 = Shape{Name: "DeepSeekV3", Activation: moe.SiluGated, E: 256, TopK: 8, K: 7168, N: 2048,
		Scoring: moe.Sigmoid, Renormalize: true, Bias: true, NumGroups: 8, TopKGroups: 4, ScalingFactor: 2.5,
		Block: [2]int{128, 128}}
)

// Shapes of models beyond MOE_SPEC.md's: gpt-oss-120b's
// layer (clamped SwiGLU with expert biases) and Qwen3-Next's (E = 512 with
// a small intermediate size).
var (
	GptOss = Shape{Name: "GptOss", Activation: moe.SwigluOAI, E: 128, TopK: 4, K: 2880, N: 2880,
		Scoring: moe.Softmax, Renormalize: true, ExpertBias: true, ScalingFactor: 1}
	Qwen3Next = Shape{Name: "Qwen3Next", Activation: moe.SiluGated, E: 512, TopK: 10, K: 2048, N: 512,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1}
)

// Shapes lists the reference shapes.
func Shapes() []Shape { return []Shape{Nemotron, Qwen3, Mixtral, DeepSeekV3} }

// Scaled returns s with hidden size k and intermediate size n, keeping E,
// top-k, routing and block shape, for tests that cannot afford full size.
func (s Shape) Scaled(k, n int) Shape {
	s.Name = fmt.Sprintf("%s/K=%d,N=%d", s.Name, k, n)
	s.K, s.N = k, n
	return s
}

// Rows1 is GEMM1's output rows per expert: 2N gated, N for ReLU².
func (s Shape) Rows1() int {
	if s.Activation.Gated() {
		return 2 * s.N
	}
	return s.N
}

// FLOPs is the multiply-add work of m tokens: 2 flops per MAC over both
// GEMMs of every (token, expert) pair.
func (s Shape) FLOPs(m int) float64 {
	return 2 * float64(m) * float64(s.TopK) * float64(s.K) * float64(s.Rows1()+s.N)
}
