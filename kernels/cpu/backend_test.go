package cpu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// TestBackend runs the shared table: the four reference shapes scaled down
// and the spec's edge cases, against the float64 reference.
func TestBackend(t *testing.T) {
	kerneltest.CheckBackend(t, New(kernels.Config{}))
}

// TestFP32Output is the tight bar of the FP32 output path, on every third
// case of the table: with no output rounding the only differences from the
// float64 reference are float32 accumulation (~1e-7) and an intermediate
// value that lands on the other side of an FP8 rounding midpoint than the
// reference's (each such flip costs ~1e-4), errors the spec's 2e-2 would
// hide. The data is seeded, so the test is deterministic; a change of
// summation order can legitimately flip a code and would show here first.
func TestFP32Output(t *testing.T) {
	var cases []kerneltest.Case
	for i, c := range kerneltest.Cases() {
		if i%3 != 0 {
			continue
		}
		c.Opts = append(c.Opts[:len(c.Opts):len(c.Opts)], kerneltest.WithOutput(moe.Float32))
		c.Tol = 1e-5
		cases = append(cases, c)
	}
	kerneltest.CheckBackend(t, New(kernels.Config{}), cases...)
}

// TestActivations runs the table of the newer activations and expert
// biases at the spec's bar and, with FP32 output, at TestFP32Output's.
func TestActivations(t *testing.T) {
	cases := kerneltest.ActivationCases()
	for _, c := range kerneltest.ActivationCases() {
		c.Name += "/fp32-out/tight"
		c.Opts = append(c.Opts[:len(c.Opts):len(c.Opts)], kerneltest.WithOutput(moe.Float32))
		c.Tol = 1e-5
		cases = append(cases, c)
	}
	kerneltest.CheckBackend(t, New(kernels.Config{}), cases...)
}

// TestThreadsAgree checks the result is bit-identical whatever the number
// of goroutines: every output element is computed by exactly one work item
// in a fixed order, so scheduling must not leak into numerics.
func TestThreadsAgree(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	set, req := kerneltest.NewCase(rng, kerneltest.Qwen3.Scaled(136, 40), 24)
	var outs [][]byte
	for _, threads := range []int{1, 2, 5} {
		res, err := kerneltest.RunCase(context.Background(), New(kernels.Config{Threads: threads}), set, req)
		if err != nil {
			t.Fatal(err)
		}
		outs = append(outs, res.Output)
	}
	for i := 1; i < len(outs); i++ {
		if !bytes.Equal(outs[0], outs[i]) {
			t.Errorf("output with thread config %d differs from 1 thread", i)
		}
	}
}

func TestRegistered(t *testing.T) {
	b, err := kernels.Open("cpu", kernels.Config{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := b.Name(), "cpu"; got != want {
		t.Errorf("Name() = %q, want %q", got, want)
	}
	caps := b.Capabilities()
	if len(caps.Activations) != 5 || len(caps.Granularities) != 4 || len(caps.Devices) != 1 {
		t.Errorf("Capabilities() = %+v, want 5 activations, 4 granularities, 1 device", caps)
	}
}

func TestClosedSet(t *testing.T) {
	ctx := context.Background()
	b := New(kernels.Config{})
	set, req := kerneltest.NewCase(rand.New(rand.NewPCG(1, 2)), kerneltest.Mixtral.Scaled(32, 16), 2)
	l, err := b.Load(ctx, set)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := b.FusedMoE(ctx, l, req); !errors.Is(err, errClosed) {
		t.Errorf("FusedMoE on a closed set: err = %v, want %v", err, errClosed)
	}
}

// TestDeviceTensorsRefused: a device tensor or output (which the service
// never sends this backend) is refused as unsupported, without a look at
// the host bytes beside it, and a host call on the same set still runs.
func TestDeviceTensorsRefused(t *testing.T) {
	ctx := context.Background()
	b := New(kernels.Config{Threads: 1})
	set, req := kerneltest.NewCase(rand.New(rand.NewPCG(1, 4)), kerneltest.Mixtral.Scaled(32, 16), 2)
	l, err := b.Load(ctx, set)
	if err != nil {
		t.Fatal(err)
	}
	const addr = 0x7f0000001000
	tests := []struct {
		name string
		edit func(r *moe.Request)
	}{
		{"hidden", func(r *moe.Request) { r.Hidden.Dev, r.Hidden.Data = addr, nil }},
		{"logits", func(r *moe.Request) { r.Logits.Dev, r.Logits.Data = addr, nil }},
		{"output", func(r *moe.Request) { r.OutDev = addr }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := *req
			tt.edit(&r)
			res, err := b.FusedMoE(ctx, l, &r)
			if !errors.Is(err, kernels.ErrUnsupported) || !strings.Contains(fmt.Sprint(err), "device memory") {
				t.Errorf("FusedMoE = %v, %v; want an error wrapping kernels.ErrUnsupported about device memory", res, err)
			}
		})
	}
	if _, err := b.FusedMoE(ctx, l, req); err != nil {
		t.Errorf("FusedMoE on host memory after the refusals: %v", err)
	}
}

func TestCanceled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	b := New(kernels.Config{})
	set, req := kerneltest.NewCase(rand.New(rand.NewPCG(1, 3)), kerneltest.Mixtral.Scaled(32, 16), 2)
	l, err := b.Load(context.Background(), set)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.FusedMoE(ctx, l, req); !errors.Is(err, context.Canceled) {
		t.Errorf("FusedMoE with a canceled context: err = %v, want %v", err, context.Canceled)
	}
}

// TestChunks checks that splitting M into passes changes nothing, bit for
// bit, for every way hidden states can be scaled: each token's numerics are
// independent of the others' (per-token and per-group scales are per row;
// the FP8 products are exact whether weights are decoded first or not, and
// both paths sum in the same order). The service's dynamic batching relies
// on it. The Mixtral case has weight-row counts that are not multiples of
// 4 (the dot1 tails) and experts that cross decodeMinRows between one pass
// and five-token passes.
func TestChunks(t *testing.T) {
	deepseek, mixtral := kerneltest.DeepSeekV3.Scaled(136, 24), kerneltest.Mixtral.Scaled(77, 45)
	tests := []struct {
		name  string
		shape kerneltest.Shape
		opts  []kerneltest.Option
	}{
		{"bf16 dynamic per group", deepseek, nil},
		{"fp8 per token", deepseek, []kerneltest.Option{kerneltest.WithHidden(moe.Float8E4M3FN), kerneltest.WithGranularity(scaling.PerChannel)}},
		{"fp8 per group", deepseek, []kerneltest.Option{kerneltest.WithHidden(moe.Float8E4M3FN), kerneltest.WithHiddenScale(scaling.Block)}},
		{"fp8 per tensor", deepseek, []kerneltest.Option{kerneltest.WithHidden(moe.Float8E4M3FN), kerneltest.WithHiddenScale(scaling.PerTensor)}},
		{"fp32 static, precomputed", deepseek, []kerneltest.Option{kerneltest.WithHidden(moe.Float32), kerneltest.WithStaticScales(), kerneltest.WithPrecomputedRouting()}},
		{"odd rows, tiles decoded or not", mixtral, []kerneltest.Option{kerneltest.WithOutput(moe.Float32)}},
	}
	rng := rand.New(rand.NewPCG(5, 6))
	for _, tt := range tests {
		set, req := kerneltest.NewCase(rng, tt.shape, 23, tt.opts...)
		whole, err := kerneltest.RunCase(context.Background(), New(kernels.Config{}), set, req)
		if err != nil {
			t.Fatal(err)
		}
		chunked := New(kernels.Config{})
		chunked.chunk = 5
		parts, err := kerneltest.RunCase(context.Background(), chunked, set, req)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(whole.TopKIDs, parts.TopKIDs) {
			t.Errorf("%s: routing in passes of 5 tokens differs from one pass", tt.name)
		}
		if !bytes.Equal(whole.Output, parts.Output) {
			if !BatchInvariant() {
				t.Logf("%s: output in passes of 5 tokens differs from one pass, as expected with %s dot products", tt.name, simdKernel)
				continue
			}
			t.Errorf("%s: output in passes of 5 tokens differs from one pass", tt.name)
		}
	}
}
