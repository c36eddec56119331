package cuda

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// The GPU tests skip when no library or GPU is present (CI), unless
// EXPERTD_CUDA_REQUIRE=1 (scripts/device-check.sh sets it) makes that a
// failure.

var (
	testOnce    sync.Once
	testBackend *Backend
	testErr     error
)

func gpuBackend(t *testing.T) *Backend {
	t.Helper()
	testOnce.Do(func() {
		var o Options
		if o, testErr = ParseOptions(envOptions()); testErr == nil {
			testBackend, testErr = New(kernels.Config{LibraryPath: os.Getenv("EXPERTD_LIBRARY_PATH"), Options: o})
		}
	})
	if testErr != nil {
		if os.Getenv("EXPERTD_CUDA_REQUIRE") == "1" {
			t.Fatalf("cuda backend: %v", testErr)
		}
		t.Skipf("no cuda backend here: %v", testErr)
	}
	return testBackend
}

func TestOpenWithoutLibraryIsAnError(t *testing.T) {
	_, err := kernels.Open("cuda", kernels.Config{LibraryPath: t.TempDir() + "/missing/libexpertd_cuda.so"})
	if err == nil {
		t.Fatal("Open with a missing library succeeded")
	}
	if !errors.Is(err, errNoLibrary) {
		t.Errorf("Open: %v, want an error wrapping errNoLibrary", err)
	}
}

// envOptions are the test binary's backend options: each OptionKeys entry
// from its daemon variable (gemm from EXPERTD_CUDA_GEMM, poison from
// EXPERTD_CUDA_POISON, ...), as scripts/device-check.sh sets them.
func envOptions() map[string]string {
	kv := map[string]string{}
	for _, k := range OptionKeys {
		if v := os.Getenv("EXPERTD_CUDA_" + strings.ToUpper(strings.ReplaceAll(k, "-", "_"))); v != "" {
			kv[k] = v
		}
	}
	return kv
}

func TestParseOptionsRejectsBadValues(t *testing.T) {
	for _, tc := range []struct {
		kv   map[string]string
		want string
	}{
		{map[string]string{"gemm": "fastest"}, "gemm"},
		{map[string]string{"streams": "0"}, "streams"},
		{map[string]string{"streams": "x"}, "streams"},
		{map[string]string{"sync-spin": "1s"}, "sync-spin"},
		{map[string]string{"sm90-grid": "half"}, "sm90-grid"},
		{map[string]string{"pdl": "maybe"}, "pdl"},
		{map[string]string{"warp-speed": "1"}, "unknown option"},
	} {
		if _, err := ParseOptions(tc.kv); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseOptions(%v): %v, want an error naming %q", tc.kv, err, tc.want)
		}
	}
}

// TestNewValidatesTypedOptions checks New refuses out-of-range typed
// options before it looks for the library, and options of another type.
func TestNewValidatesTypedOptions(t *testing.T) {
	missing := t.TempDir() + "/missing/libexpertd_cuda.so"
	o := DefaultOptions()
	o.Streams = 0
	if _, err := New(kernels.Config{LibraryPath: missing, Options: o}); err == nil || !strings.Contains(err.Error(), `option streams="0"`) {
		t.Errorf("New with Streams 0: %v, want an error naming streams", err)
	}
	if _, err := New(kernels.Config{LibraryPath: missing, Options: map[string]string{"streams": "2"}}); err == nil || !strings.Contains(err.Error(), "want cuda.Options") {
		t.Errorf("New with a map: %v, want a type error", err)
	}
	if _, err := New(kernels.Config{LibraryPath: missing}); !errors.Is(err, errNoLibrary) {
		t.Errorf("New with default options: %v, want errNoLibrary", err)
	}
}

func TestOptionsRoundTrip(t *testing.T) {
	o := DefaultOptions()
	o.GEMM, o.Streams, o.PDL, o.SM90Grid, o.SyncSpin, o.HostTrace = "sm90", 3, false, "full", 50*time.Microsecond, true
	got, err := ParseOptions(o.Map())
	if err != nil || got != o {
		t.Errorf("ParseOptions(%v) = %+v, %v; want %+v", o.Map(), got, err, o)
	}
	if len(o.Map()) != len(OptionKeys) {
		t.Errorf("Map has %d keys, OptionKeys %d", len(o.Map()), len(OptionKeys))
	}
	c := o.c()
	if c.streams != 3 || c.pdl != 0 || c.sm90Persistent != 0 || c.syncSpinUS != 50 || c.hostTrace != 1 || c.size != optionsBytes {
		t.Errorf("c() = %+v", *c)
	}
}

func TestCodeErrorWrapsSentinels(t *testing.T) {
	for _, tc := range []struct {
		rc   int32
		want error
	}{{codeUnsupported, kernels.ErrUnsupported}, {codeOOM, kernels.ErrOutOfMemory}} {
		if err := codeError("moe", tc.rc, "x"); !errors.Is(err, tc.want) {
			t.Errorf("codeError(%s) = %v, want it to wrap %v", codeName(tc.rc), err, tc.want)
		}
	}
	if err := codeError("moe", codeCUDA, "boom"); errors.Is(err, kernels.ErrUnsupported) || !strings.Contains(err.Error(), "boom") {
		t.Errorf("codeError(ERR_CUDA) = %v", err)
	}
}

type gemmPath struct {
	name string
	gemm int64
	// unsupported says the library must refuse the set on this path with
	// ERR_UNSUPPORTED.
	unsupported bool
}

// paths lists the GEMM implementations to compare on this card for set
// (sm90 takes K and N multiples of 16, every weight-scale granularity, and
// in block mode Bk = 128; it is listed as unsupported for other blocks).
func paths(b *Backend, set *moe.ExpertSet) []gemmPath {
	ps := []gemmPath{{name: "portable", gemm: gemmPortable}, {name: "portable-f16", gemm: gemmPortableF16}}
	if strings.Contains(b.info, "gemm=sm90") && set.K%16 == 0 && set.N%16 == 0 {
		ps = append(ps, gemmPath{name: "sm90", gemm: gemmSM90, unsupported: !sm90Block(set)})
	}
	return ps
}

// sm90Block says whether the Hopper kernels take set's block shape: none,
// or Bk = 128 (one pipeline stage) with any Bn.
func sm90Block(set *moe.ExpertSet) bool {
	return set.Block == [2]int{} || set.Block[1] == 128
}

// extraCases add shapes whose K and N are multiples of 16 (the sm90
// kernels' domain, at scaled-down sizes) and larger M, so every GEMM path
// and every token-tile size runs.
func extraCases() []kerneltest.Case {
	nemo := kerneltest.Nemotron.Scaled(512, 384)
	qwen := kerneltest.Qwen3.Scaled(512, 256)
	mix := kerneltest.Mixtral.Scaled(256, 512)
	odd := kerneltest.Shape{Name: "odd", Activation: moe.SiluGated, E: 6, TopK: 3, K: 77, N: 45,
		Scoring: moe.Sigmoid, Bias: true, NumGroups: 3, TopKGroups: 2, ScalingFactor: 1.5}
	oddRelu := kerneltest.Shape{Name: "odd-relu2", Activation: moe.Relu2, E: 5, TopK: 2, K: 33, N: 71,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1}
	return []kerneltest.Case{
		{Name: "odd/K=77,N=45/M=11", Shape: odd, M: 11},
		{Name: "odd/K=77,N=45/M=1/fp32-in/fp32-out", Shape: odd, M: 1,
			Opts: []kerneltest.Option{kerneltest.WithHidden(moe.Float32), kerneltest.WithOutput(moe.Float32)}},
		{Name: "odd/relu2/K=33,N=71/M=29/static", Shape: oddRelu, M: 29, Opts: []kerneltest.Option{kerneltest.WithStaticScales()}},
		{Name: "odd/relu2/K=33,N=71/M=7/fp8-in-per-tensor", Shape: oddRelu, M: 7,
			Opts: []kerneltest.Option{kerneltest.WithHidden(moe.Float8E4M3FN), kerneltest.WithHiddenScale(scaling.PerTensor)}},
		{Name: "x16/Nemotron/M=1", Shape: nemo, M: 1},
		{Name: "x16/Nemotron/M=64", Shape: nemo, M: 64},
		{Name: "x16/Nemotron/M=300/static", Shape: nemo, M: 300, Opts: []kerneltest.Option{kerneltest.WithStaticScales()}},
		{Name: "x16/Qwen3/M=200/per-expert", Shape: qwen, M: 200, Opts: []kerneltest.Option{kerneltest.WithGranularity(scaling.PerExpert)}},
		{Name: "x16/Qwen3/M=3/static/fp8-in", Shape: qwen, M: 3, Opts: []kerneltest.Option{kerneltest.WithStaticScales(), kerneltest.WithHidden(moe.Float8E4M3FN)}},
		{Name: "x16/Mixtral/M=160", Shape: mix, M: 160},
		{Name: "x16/Mixtral/M=700/all-to-one", Shape: mix, M: 700, Opts: []kerneltest.Option{kerneltest.WithAllTokensTo(3)}},
	}
}

// blockCases are block-scaled (DeepSeek-V3 style) and per-channel cases:
// scaled DeepSeek-V3 layers (sigmoid + bias, 8 groups, top 4 groups,
// [128, 128] blocks) at K, N multiples of 128; odd shapes whose last K and
// row blocks are partial (rows1 not a multiple of Bn, K and N not multiples
// of 128 or 16) and a Bk that is not a multiple of the portable GEMM's
// 64-byte stage; FP8 hidden states with per-group, per-token and
// per-tensor scales; static scales in block mode; M=1 and all tokens to one
// expert.
func blockCases() []kerneltest.Case {
	ds := kerneltest.DeepSeekV3.Scaled(512, 256)
	ds.E = 32 // 8 groups of 4: top-4 groups leave 16 candidates for top-8
	oddG := kerneltest.Shape{Name: "odd-gated", Activation: moe.SiluGated, E: 8, TopK: 3, K: 320, N: 200,
		Scoring: moe.Sigmoid, Renormalize: true, Bias: true, NumGroups: 4, TopKGroups: 2, ScalingFactor: 2.5,
		Block: [2]int{128, 128}}
	oddR := kerneltest.Shape{Name: "odd-relu2", Activation: moe.Relu2, E: 6, TopK: 2, K: 333, N: 77,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1, Block: [2]int{128, 128}}
	pc := kerneltest.Shape{Name: "pc", Activation: moe.SiluGated, E: 16, TopK: 4, K: 512, N: 256,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1}
	// K and N multiples of 16 but not of the sm90 tiles' 32/64/128 output
	// channels or 128-byte K stages: the last channel tile is partial.
	pcG := kerneltest.Shape{Name: "pc-gated", Activation: moe.SiluGated, E: 8, TopK: 2, K: 400, N: 208,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1}
	pcR := kerneltest.Shape{Name: "pc-relu2", Activation: moe.Relu2, E: 8, TopK: 2, K: 400, N: 208,
		Scoring: moe.Sigmoid, Renormalize: true, Bias: true, NumGroups: 1, TopKGroups: 1, ScalingFactor: 2.5}
	// Block sets the sm90 path takes (Bk = 128, K and N multiples of 16):
	// partial last K block, channel tile and row blocks; gate and up rows
	// of one channel tile in different row blocks (N = 208).
	x16G := pcG
	x16G.Name, x16G.Block = "x16-gated", [2]int{128, 128}
	x16R := pcR
	x16R.Name, x16R.Block = "x16-relu2", [2]int{128, 128}
	perCh := kerneltest.WithGranularity(scaling.PerChannel)
	fp8 := kerneltest.WithHidden(moe.Float8E4M3FN)
	type opts = []kerneltest.Option
	return []kerneltest.Case{
		{Name: "block/DeepSeekV3/K=512,N=256/M=1", Shape: ds, M: 1},
		{Name: "block/DeepSeekV3/K=512,N=256/M=64", Shape: ds, M: 64},
		{Name: "block/DeepSeekV3/K=512,N=256/M=130/fp32-out", Shape: ds, M: 130, Opts: opts{kerneltest.WithOutput(moe.Float32)}},
		{Name: "block/DeepSeekV3/K=512,N=256/M=40/fp8-in-per-group", Shape: ds, M: 40,
			Opts: opts{fp8, kerneltest.WithHiddenScale(scaling.Block)}},
		{Name: "block/DeepSeekV3/K=512,N=256/M=1/fp8-in-per-group", Shape: ds, M: 1,
			Opts: opts{fp8, kerneltest.WithHiddenScale(scaling.Block)}},
		{Name: "block/DeepSeekV3/K=512,N=256/M=24/fp8-in-per-token", Shape: ds, M: 24, Opts: opts{fp8}},
		{Name: "block/DeepSeekV3/K=512,N=256/M=50/all-to-one", Shape: ds, M: 50, Opts: opts{kerneltest.WithAllTokensTo(9)}},
		{Name: "block/DeepSeekV3/K=512,N=256/M=20/static", Shape: ds, M: 20, Opts: opts{kerneltest.WithStaticScales()}},
		{Name: "block/DeepSeekV3/K=512,N=256/M=9/precomputed", Shape: ds, M: 9, Opts: opts{kerneltest.WithPrecomputedRouting()}},
		{Name: "block/odd-gated/K=320,N=200/M=1", Shape: oddG, M: 1},
		{Name: "block/odd-gated/K=320,N=200/M=37", Shape: oddG, M: 37},
		{Name: "block/odd-gated/K=320,N=200/M=21/fp8-in-per-group", Shape: oddG, M: 21,
			Opts: opts{fp8, kerneltest.WithHiddenScale(scaling.Block)}},
		{Name: "block/odd-gated/K=320,N=200/M=70/all-to-one/static", Shape: oddG, M: 70,
			Opts: opts{kerneltest.WithAllTokensTo(2), kerneltest.WithStaticScales()}},
		{Name: "block/odd-gated/K=320,N=200/block-64x96/M=17", Shape: oddG, M: 17, Opts: opts{kerneltest.WithBlock(64, 96)}},
		{Name: "block/x16-gated/K=400,N=208/M=5", Shape: x16G, M: 5},
		{Name: "block/x16-gated/K=400,N=208/M=150", Shape: x16G, M: 150},
		{Name: "block/x16-gated/K=400,N=208/M=90/static", Shape: x16G, M: 90, Opts: opts{kerneltest.WithStaticScales()}},
		{Name: "block/x16-gated/K=400,N=208/block-64x128/M=33/fp8-in-per-group", Shape: x16G, M: 33,
			Opts: opts{kerneltest.WithBlock(64, 128), fp8, kerneltest.WithHiddenScale(scaling.Block)}},
		{Name: "block/x16-relu2/K=400,N=208/M=7", Shape: x16R, M: 7},
		{Name: "block/x16-relu2/K=400,N=208/M=300/fp32-out", Shape: x16R, M: 300, Opts: opts{kerneltest.WithOutput(moe.Float32)}},
		{Name: "block/DeepSeekV3/K=512,N=256/M=600", Shape: ds, M: 600},
		{Name: "block/odd-relu2/K=333,N=77/M=15", Shape: oddR, M: 15},
		{Name: "block/odd-relu2/K=333,N=77/M=6/fp8-in-per-group", Shape: oddR, M: 6,
			Opts: opts{fp8, kerneltest.WithHiddenScale(scaling.Block)}},
		{Name: "block/odd-relu2/K=333,N=77/M=12/fp32-in", Shape: oddR, M: 12, Opts: opts{kerneltest.WithHidden(moe.Float32)}},
		{Name: "per-channel/K=512,N=256/M=50/fp8-in-per-token", Shape: pc, M: 50,
			Opts: opts{kerneltest.WithGranularity(scaling.PerChannel), fp8}},
		{Name: "per-channel/K=512,N=256/M=1/fp8-in-per-token", Shape: pc, M: 1,
			Opts: opts{kerneltest.WithGranularity(scaling.PerChannel), fp8}},
		{Name: "per-channel/K=512,N=256/M=33/static", Shape: pc, M: 33,
			Opts: opts{kerneltest.WithGranularity(scaling.PerChannel), kerneltest.WithStaticScales()}},
		{Name: "per-channel/K=512,N=256/M=90/all-to-one", Shape: pc, M: 90,
			Opts: opts{kerneltest.WithGranularity(scaling.PerChannel), kerneltest.WithAllTokensTo(4)}},
		{Name: "per-channel/odd-relu2/K=333,N=77/M=19", Shape: oddR, M: 19,
			Opts: opts{kerneltest.WithGranularity(scaling.PerChannel), kerneltest.WithOutput(moe.Float32)}},
		{Name: "per-channel/gated/K=400,N=208/M=3", Shape: pcG, M: 3, Opts: opts{perCh}},
		{Name: "per-channel/gated/K=400,N=208/M=150", Shape: pcG, M: 150, Opts: opts{perCh}},
		{Name: "per-channel/gated/K=400,N=208/M=600/static", Shape: pcG, M: 600, Opts: opts{perCh, kerneltest.WithStaticScales()}},
		{Name: "per-channel/relu2/K=400,N=208/M=5/fp8-in", Shape: pcR, M: 5, Opts: opts{perCh, fp8}},
		{Name: "per-channel/relu2/K=400,N=208/M=150", Shape: pcR, M: 150, Opts: opts{perCh}},
		{Name: "per-channel/relu2/K=400,N=208/M=40/static", Shape: pcR, M: 40, Opts: opts{perCh, kerneltest.WithStaticScales()}},
	}
}

func decode64(dt moe.DType, b []byte) []float64 {
	return kerneltest.Widen(kerneltest.DecodeOutput(dt, b))
}

// caseSeed is a case's data seed: fresh each run, or EXPERTD_TEST_SEED's,
// which replays a case a failure message names by its seed (select the case
// with EXPERTD_TEST_CASE).
func caseSeed(t *testing.T) uint64 {
	v := os.Getenv("EXPERTD_TEST_SEED")
	if v == "" {
		return rand.Uint64()
	}
	seed, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		t.Fatalf("EXPERTD_TEST_SEED=%q: %v", v, err)
	}
	return seed
}

// wantCase says whether a table case runs: all of them, or with
// EXPERTD_TEST_CASE set those whose name contains it.
func wantCase(name string) bool {
	return strings.Contains(name, os.Getenv("EXPERTD_TEST_CASE"))
}

// TestActivationCases runs kerneltest.ActivationCases (every newer
// activation, expert biases, E = 512, top_k = 16) and larger shapes of them
// through checkCase, so each GEMM path's epilogue runs them at several token
// tiles: the decode route (one FP8 token), per-channel and block scales
// (SwigluOAI's interleaved rows reordered at load, its block scales one row
// per block), token-major block tiles, static scales.
func TestActivationCases(t *testing.T) {
	b := gpuBackend(t)
	ref := cpu.New(kernels.Config{})
	oai := kerneltest.GptOss.Scaled(512, 256)
	oai.E = 16
	gelu := kerneltest.Shape{Name: "x16-gelu-bias", Activation: moe.GeluGated, E: 16, TopK: 4, K: 512, N: 256,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1, ExpertBias: true}
	geluTanh := gelu
	geluTanh.Name, geluTanh.Activation = "x16-gelu-tanh-bias", moe.GeluTanhGated
	relu := kerneltest.Nemotron.Scaled(512, 384)
	relu.Name, relu.ExpertBias = "x16-relu2-bias", true
	next := kerneltest.Qwen3Next.Scaled(256, 128)
	fp8 := kerneltest.WithHidden(moe.Float8E4M3FN)
	pc := kerneltest.WithGranularity(scaling.PerChannel)
	cases := append(kerneltest.ActivationCases(),
		kerneltest.Case{Name: "x16/GptOss/M=1", Shape: oai, M: 1},
		kerneltest.Case{Name: "x16/GptOss/M=1/fp8-in/per-channel", Shape: oai, M: 1, Opts: []kerneltest.Option{fp8, pc}},
		kerneltest.Case{Name: "x16/GptOss/M=200/per-channel", Shape: oai, M: 200, Opts: []kerneltest.Option{pc}},
		kerneltest.Case{Name: "x16/GptOss/M=300/block", Shape: oai, M: 300, Opts: []kerneltest.Option{kerneltest.WithBlock(128, 128)}},
		kerneltest.Case{Name: "x16/GeluGated/M=300/block", Shape: gelu, M: 300, Opts: []kerneltest.Option{kerneltest.WithBlock(128, 128)}},
		kerneltest.Case{Name: "x16/GeluTanhGated/M=64/static", Shape: geluTanh, M: 64, Opts: []kerneltest.Option{kerneltest.WithStaticScales()}},
		kerneltest.Case{Name: "x16/Relu2/M=300/block", Shape: relu, M: 300, Opts: []kerneltest.Option{kerneltest.WithBlock(128, 128)}},
		kerneltest.Case{Name: "x16/Relu2/M=1/fp8-in", Shape: relu, M: 1, Opts: []kerneltest.Option{fp8}},
		kerneltest.Case{Name: "x16/Qwen3Next/M=300", Shape: next, M: 300},
	)
	checkCases(t, b, ref, cases)
}

// TestCases runs the shared table plus extraCases and blockCases through
// checkCase.
func TestCases(t *testing.T) {
	b := gpuBackend(t)
	t.Logf("device: %s", b.info)
	checkCases(t, b, cpu.New(kernels.Config{}), append(append(kerneltest.Cases(), extraCases()...), blockCases()...))
}

// checkCases runs checkCase on each of the cases wantCase selects, on
// fresh data from the test's seed.
func checkCases(t *testing.T, b *Backend, ref kernels.Backend, cases []kerneltest.Case) {
	t.Helper()
	for _, c := range cases {
		if !wantCase(c.Name) {
			continue
		}
		// Weights are shared between cases of one shape and granularity
		// (generated once from a seed derived from them, see Case.New);
		// hidden states, logits and biases are fresh.
		seed := caseSeed(t)
		set, req := c.New(rand.New(rand.NewPCG(seed, 0xc0da)))
		checkCase(t, b, ref, fmt.Sprintf("%s (seed %d)", c.Name, seed), set, req)
	}
}

// gatherFoldCases are calls whose sm90 token tiles are 64 or 128 tokens
// (17 to 256 routed pairs per expert on average), the tiles whose GEMM1 can
// read the FP8 hidden rows by token (sm90_gather_fold): BF16 and FP32
// hidden states (quantized once per token for it) and FP8 ones with
// per-token and single scales, static scales, ReLU² and SiLU-gated,
// per-tensor and per-channel weights, a K whose last 128-byte stage is
// partial (400, 272), all tokens to one expert, precomputed routing, and
// expert runs that end in padding rows.
func gatherFoldCases() []kerneltest.Case {
	gated := kerneltest.Shape{Name: "fold-gated", Activation: moe.SiluGated, E: 8, TopK: 2, K: 400, N: 208,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1}
	relu := kerneltest.Shape{Name: "fold-relu2", Activation: moe.Relu2, E: 8, TopK: 2, K: 400, N: 208,
		Scoring: moe.Sigmoid, Renormalize: true, Bias: true, NumGroups: 1, TopKGroups: 1, ScalingFactor: 2.5}
	// 4096 routed pairs and more at 128-token tiles, small enough for the
	// references: prefill-shaped calls.
	wide := kerneltest.Shape{Name: "fold-wide-relu2", Activation: moe.Relu2, E: 32, TopK: 4, K: 256, N: 128,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1}
	wideG := kerneltest.Shape{Name: "fold-wide-gated", Activation: moe.SiluGated, E: 32, TopK: 4, K: 272, N: 96,
		Scoring: moe.Sigmoid, Renormalize: true, Bias: true, NumGroups: 4, TopKGroups: 2, ScalingFactor: 2.5}
	fp8 := kerneltest.WithHidden(moe.Float8E4M3FN)
	perCh := kerneltest.WithGranularity(scaling.PerChannel)
	type opts = []kerneltest.Option
	return []kerneltest.Case{
		{Name: "fold/gated/K=400,N=208/M=150", Shape: gated, M: 150},
		{Name: "fold/gated/K=400,N=208/M=500/fp8-in-per-token", Shape: gated, M: 500, Opts: opts{fp8}},
		{Name: "fold/gated/K=400,N=208/M=500/fp8-in-per-tensor", Shape: gated, M: 500,
			Opts: opts{fp8, kerneltest.WithHiddenScale(scaling.PerTensor)}},
		{Name: "fold/gated/K=400,N=208/M=300/all-to-one", Shape: gated, M: 300, Opts: opts{kerneltest.WithAllTokensTo(5)}},
		{Name: "fold/gated/K=400,N=208/M=150/precomputed/per-channel", Shape: gated, M: 150,
			Opts: opts{kerneltest.WithPrecomputedRouting(), perCh}},
		{Name: "fold/relu2/K=400,N=208/M=150/fp8-in/per-channel", Shape: relu, M: 150, Opts: opts{fp8, perCh}},
		{Name: "fold/relu2/K=400,N=208/M=600/static", Shape: relu, M: 600, Opts: opts{kerneltest.WithStaticScales()}},
		{Name: "fold/relu2/K=400,N=208/M=600/fp32-in/fp32-out", Shape: relu, M: 600,
			Opts: opts{kerneltest.WithHidden(moe.Float32), kerneltest.WithOutput(moe.Float32)}},
		{Name: "fold/wide-relu2/K=256,N=128/M=1024", Shape: wide, M: 1024},
		{Name: "fold/wide-gated/K=272,N=96/M=1100/fp8-in", Shape: wideG, M: 1100, Opts: opts{fp8}},
	}
}

// TestGatherFold runs gatherFoldCases through checkCase, then a call whose
// precomputed ids include invalid ones (-1 and E), whose pairs every path
// must drop: its expected output is the same call with those pairs given a
// valid id and weight 0. scripts/device-check.sh runs it three ways: by the
// library's rule, with EXPERTD_SM90_GATHER=1, where the sm90 path's GEMM1
// reads the hidden rows by token on every case, and with =0, where it never
// does.
func TestGatherFold(t *testing.T) {
	b := gpuBackend(t)
	ref := cpu.New(kernels.Config{})
	checkCases(t, b, ref, gatherFoldCases())

	name := "fold/gated/K=400,N=208/M=300/precomputed-with-invalid-ids"
	if !wantCase(name) {
		return
	}
	seed := caseSeed(t)
	gated := gatherFoldCases()[0].Shape
	set, req := kerneltest.NewCase(rand.New(rand.NewPCG(seed, 0x6a7)), gated, 300, kerneltest.WithPrecomputedRouting())
	refReq := *req
	refReq.TopKIDs = slices.Clone(req.TopKIDs)
	refReq.TopKWeights = slices.Clone(req.TopKWeights)
	for i := range req.TopKIDs {
		switch {
		case i%5 == 1:
			req.TopKIDs[i] = -1
		case i%7 == 3:
			req.TopKIDs[i] = int32(set.E)
		default:
			continue
		}
		// The library drops the pair whatever its weight; the references
		// get a valid pair that adds nothing.
		refReq.TopKWeights[i] = 0
	}
	checkCaseAgainst(t, b, ref, fmt.Sprintf("%s (seed %d)", name, seed), set, req, &refReq)
}

// TestOneSetManySizes calls one loaded set at several large M in an order
// where the workspace grows only once (the largest M first), so every later
// call lays its buffers out over what an earlier, larger call left there.
// The multi-block align keeps counters in the workspace from call to call;
// each call must still find them zeroed, wherever its other buffers lie.
func TestOneSetManySizes(t *testing.T) {
	b := gpuBackend(t)
	ref := cpu.New(kernels.Config{})
	// E = 32, top_k 4: M >= 2048 is 8192 routed pairs or more, where the
	// align runs over many blocks.
	wide := kerneltest.Shape{Name: "sizes-relu2", Activation: moe.Relu2, E: 32, TopK: 4, K: 256, N: 128,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1}
	seed := caseSeed(t)
	rng := rand.New(rand.NewPCG(seed, 0x512e5))
	var l kernels.Loaded
	for i, m := range []int{4096, 2048, 3000, 2600, 2048, 4096} {
		set, req := kerneltest.Case{Shape: wide, M: m}.New(rng)
		if l == nil {
			var err error
			if l, err = b.Load(context.Background(), set); err != nil {
				t.Fatalf("Load: %v", err)
			}
			defer l.Close()
		}
		checkLoaded(t, b, ref, l, fmt.Sprintf("sizes/relu2/K=256,N=128/call%d/M=%d (seed %d)", i, m, seed), set, req, req)
	}
}

// TestCasesMixedBlock runs block sets whose weight scales are not block
// scales (the service accepts any granularity with a weight_block_shape):
// activations are still quantized per group of Bk, and the backend expands
// the weight scales to the library's block layout.
func TestCasesMixedBlock(t *testing.T) {
	b := gpuBackend(t)
	ref := cpu.New(kernels.Config{})
	// K=400, N=208 (multiples of 16) is on the sm90 path too, whose block
	// kernel then gets Bn = 1 for per-channel weights.
	for _, kn := range [][2]int{{320, 200}, {400, 208}} {
		shape := kerneltest.Shape{Name: "mixed", Activation: moe.SiluGated, E: 8, TopK: 2, K: kn[0], N: kn[1],
			Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1}
		for _, g := range []scaling.Granularity{scaling.PerTensor, scaling.PerExpert, scaling.PerChannel} {
			seed := rand.Uint64()
			set, req := kerneltest.NewCase(rand.New(rand.NewPCG(seed, 7)), shape, 23, kerneltest.WithGranularity(g))
			set.Block = [2]int{128, 128}
			checkCase(t, b, ref, fmt.Sprintf("mixed/K=%d,N=%d/%v-weights/block-128x128 (seed %d)", kn[0], kn[1], g, seed), set, req)
		}
	}
}

// checkCase runs one case on every GEMM path, three calls each (direct,
// graph capture, graph replay): rel-L2 against the float64 reference and
// the CPU backend ref within kerneltest.ReferenceTol's bound, exact routing
// ids, every output element written (poisoned first), no NaN; a path that
// cannot take the set must report kernels.ErrUnsupported.
func checkCase(t *testing.T, b *Backend, ref kernels.Backend, name string, set *moe.ExpertSet, req *moe.Request) {
	t.Helper()
	checkCaseAgainst(t, b, ref, name, set, req, req)
}

// checkCaseAgainst is checkCase with the expected output computed from
// refReq instead of req (the same call but for what the references cannot
// take). Precomputed routing must come back as req gave it.
func checkCaseAgainst(t *testing.T, b *Backend, ref kernels.Backend, name string, set *moe.ExpertSet, req, refReq *moe.Request) {
	t.Helper()
	l, err := b.Load(context.Background(), set)
	if err != nil {
		t.Errorf("%s: Load: %v", name, err)
		return
	}
	defer l.Close()
	checkLoaded(t, b, ref, l, name, set, req, refReq)
}

// checkLoaded is checkCaseAgainst on a set already loaded as l (set holds
// the same weights and scales as the set l was loaded from).
func checkLoaded(t *testing.T, b *Backend, ref kernels.Backend, l kernels.Loaded, name string, set *moe.ExpertSet, req, refReq *moe.Request) {
	t.Helper()
	checkPaths(t, b, l, name, set, req, expect(t, ref, name, set, req, refReq))
}

// expect is what req's calls must return, computed from refReq (see
// checkCaseAgainst) by the float64 reference and the CPU backend ref.
func expect(t *testing.T, ref kernels.Backend, name string, set *moe.ExpertSet, req, refReq *moe.Request) expected {
	t.Helper()
	want := expected{ref: kerneltest.Expect(set, refReq)}
	if req.TopKIDs != nil {
		want.ids, want.weights = req.TopKIDs, req.TopKWeights
	}
	cres, err := ref.FusedMoE(context.Background(), mustLoad(t, ref, set), refReq)
	if err != nil {
		t.Fatalf("%s: cpu backend: %v", name, err)
	}
	want.cpu = decode64(req.OutDType, cres.Output)
	return want
}

// expected is what a call must return: its output within ref's tolerance
// of the float64 reference's and of the CPU backend's cpu (rel-L2), and
// its routing: with precomputed ids, ids and weights as given; otherwise
// ref's, except where ref.For accepts a float32 router's choice among tied
// experts.
type expected struct {
	ref     *kerneltest.Expected
	cpu     []float64
	ids     []int32
	weights []float32
}

// forCall is want for a call that routed as got: the reference's answer
// for that routing (ref.For), and the CPU backend's output with the rows
// of the tokens it routed otherwise replaced by the reference's, since the
// CPU backend routes as the reference does. The error says got's routing
// is wrong.
func (want expected) forCall(got []int32, width int) (ref *kerneltest.Expected, cpu []float64, flipped []int, err error) {
	if want.ids != nil {
		if !slices.Equal(got, want.ids) {
			err = errors.New("topk ids differ from the precomputed ones")
		}
		return want.ref, want.cpu, nil, err
	}
	ref, flipped, err = want.ref.For(got)
	if len(flipped) == 0 {
		return ref, want.cpu, nil, err
	}
	cpu = slices.Clone(want.cpu)
	for _, tok := range flipped {
		copy(cpu[tok*width:(tok+1)*width], ref.Out[tok*width:(tok+1)*width])
	}
	return ref, cpu, flipped, nil
}

// TestExpectedForCall (no GPU): checkPaths's expectation for a call that
// routes kerneltest.NearTie's tied token the float32 way is the
// reference's for that routing, with the CPU backend's rows of that token
// replaced by the reference's; a call that routes outside the tie fails,
// and precomputed ids must come back exactly.
func TestExpectedForCall(t *testing.T) {
	set, req, got := kerneltest.NearTie(false)
	res, err := kernels.Run(t.Context(), cpu.New(kernels.Config{}), set, req)
	if err != nil {
		t.Fatal(err)
	}
	k := set.K
	want := expected{ref: kerneltest.Expect(set, req), cpu: decode64(req.OutDType, res.Output)}
	ref, cpuOut, flipped, err := want.forCall(got, k)
	if err != nil || !slices.Equal(flipped, []int{0}) || !slices.Equal(ref.IDs, got) {
		t.Fatalf("forCall(%v) = ids %v, flipped %v, %v; want those ids, [0], nil", got, ref.IDs, flipped, err)
	}
	if !slices.Equal(cpuOut[:k], ref.Out[:k]) || !slices.Equal(cpuOut[k:], want.cpu[k:]) {
		t.Error("forCall's cpu rows: want token 0's from the reference, token 1's from the CPU backend")
	}
	if want.cpu[0] == cpuOut[0] {
		t.Error("forCall changed want.cpu in place")
	}
	if _, _, _, err := want.forCall([]int32{0, 3, 0, 1}, k); err == nil {
		t.Error("forCall accepted expert 3 on the tied token")
	}
	want.ids, want.weights = want.ref.IDs, want.ref.Weights
	if _, _, _, err := want.forCall(got, k); err == nil {
		t.Error("forCall accepted precomputed ids changed")
	}
	if _, _, _, err := want.forCall(want.ids, k); err != nil {
		t.Errorf("forCall refused precomputed ids as given: %v", err)
	}
}

// checkPaths is checkCase's comparison of req's calls on l, on every GEMM
// path, against want.
func checkPaths(t *testing.T, b *Backend, l kernels.Loaded, name string, set *moe.ExpertSet, req *moe.Request, want expected) {
	t.Helper()
	ctx := context.Background()
	for _, p := range paths(b, set) {
		if p.unsupported {
			out := make([]byte, req.M()*set.K*req.OutDType.Size())
			if _, err := b.run(ctx, l, req, out, p.gemm, true); !errors.Is(err, kernels.ErrUnsupported) {
				t.Errorf("%s/%s: got %v, want kernels.ErrUnsupported", name, p.name, err)
			}
			continue
		}
		for call := range 3 {
			out := make([]byte, req.M()*set.K*req.OutDType.Size())
			kerneltest.Poison(out)
			res, err := b.run(ctx, l, req, out, p.gemm, true)
			name := fmt.Sprintf("%s/%s/call%d", name, p.name, call)
			if err != nil {
				t.Errorf("%s: %v", name, err)
				break
			}
			checkResult(t, name, set, req, want, res, call == 0)
		}
	}
}

// checkResult compares the result of one of req's calls from and to host
// memory (its output poisoned first) against want; logged says to log the
// errors of a result that passes.
func checkResult(t *testing.T, name string, set *moe.ExpertSet, req *moe.Request, want expected, res *moe.Result, logged bool) {
	t.Helper()
	if n := kerneltest.Unwritten(res.Output, req.OutDType.Size()); n > 0 {
		t.Errorf("%s: %d output elements left unwritten", name, n)
	}
	got := kerneltest.DecodeOutput(req.OutDType, res.Output)
	if i := slices.IndexFunc(got, func(v float32) bool { return math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) }); i >= 0 {
		t.Errorf("%s: output[%d] = %v", name, i, got[i])
	}
	ref, cpuOut, flipped, err := want.forCall(res.TopKIDs, set.K)
	if err != nil {
		t.Errorf("%s: %v", name, err)
	} else if len(flipped) > 0 {
		t.Logf("%s: tokens %v routed among experts tied at float32 precision otherwise than the reference", name, flipped)
	}
	tol := ref.Tol
	eRef := kerneltest.RelL2(got, ref.Out)
	eCPU := kerneltest.RelL2(got, cpuOut)
	if !(eRef <= tol) || !(eCPU <= tol) {
		t.Errorf("%s: rel-L2 %.3g vs reference, %.3g vs cpu; want <= %.3g", name, eRef, eCPU, tol)
	} else if logged {
		t.Logf("%s: rel-L2 %.3g vs reference, %.3g vs cpu, %.3f ms", name, eRef, eCPU, float64(res.KernelNanos)/1e6)
	}
	wantW := ref.Weights
	if want.weights != nil {
		wantW = want.weights
	}
	if e := kerneltest.RelL2(res.TopKWeights, kerneltest.Widen(wantW)); !(e <= 1e-5) {
		t.Errorf("%s: topk weights rel-L2 %.3g", name, e)
	}
}

func mustLoad(t *testing.T, b kernels.Backend, set *moe.ExpertSet) kernels.Loaded {
	t.Helper()
	l, err := b.Load(context.Background(), set)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// TestSmall is the short case compute-sanitizer runs.
func TestSmall(t *testing.T) {
	b := gpuBackend(t)
	ctx := context.Background()
	for _, c := range []kerneltest.Case{
		{Name: "odd", Shape: kerneltest.Shape{Name: "odd", Activation: moe.SiluGated, E: 6, TopK: 3, K: 77, N: 45,
			Scoring: moe.Sigmoid, Bias: true, NumGroups: 3, TopKGroups: 2, ScalingFactor: 1.5}, M: 11},
		{Name: "x16", Shape: kerneltest.Nemotron.Scaled(256, 128), M: 33},
		{Name: "block", Shape: kerneltest.Shape{Name: "block", Activation: moe.SiluGated, E: 8, TopK: 3, K: 320, N: 200,
			Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1, Block: [2]int{128, 128}}, M: 9},
		{Name: "block/x16", Shape: kerneltest.Shape{Name: "block16", Activation: moe.SiluGated, E: 8, TopK: 3, K: 400, N: 208,
			Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1, Block: [2]int{128, 128}}, M: 9},
		{Name: "block/x16-relu2/fp8-in-per-group", Shape: kerneltest.Shape{Name: "block16r", Activation: moe.Relu2, E: 4, TopK: 2,
			K: 256, N: 144, Scoring: moe.Softmax, ScalingFactor: 1, Block: [2]int{128, 128}}, M: 70,
			Opts: []kerneltest.Option{kerneltest.WithHidden(moe.Float8E4M3FN), kerneltest.WithHiddenScale(scaling.Block)}},
		{Name: "per-channel", Shape: kerneltest.Shape{Name: "pc", Activation: moe.Relu2, E: 4, TopK: 2, K: 96, N: 70,
			Scoring: moe.Softmax, ScalingFactor: 1}, M: 5, Opts: []kerneltest.Option{kerneltest.WithGranularity(scaling.PerChannel)}},
		{Name: "per-channel/x16", Shape: kerneltest.Shape{Name: "pc16", Activation: moe.SiluGated, E: 4, TopK: 2, K: 96, N: 48,
			Scoring: moe.Softmax, ScalingFactor: 1}, M: 5, Opts: []kerneltest.Option{kerneltest.WithGranularity(scaling.PerChannel)}},
		// 150 rows per expert with static scales: GEMM2 on CUTLASS on the
		// Hopper path (cutlass_test.go).
		{Name: "cutlass", Shape: kerneltest.Shape{Name: "cutlass", Activation: moe.Relu2, E: 4, TopK: 2, K: 256, N: 144,
			Scoring: moe.Softmax, ScalingFactor: 1, ExpertBias: true}, M: 300, Opts: []kerneltest.Option{kerneltest.WithStaticScales()}},
	} {
		if !wantCase(c.Name) {
			continue
		}
		seed := caseSeed(t)
		set, req := kerneltest.NewCase(rand.New(rand.NewPCG(seed, 1)), c.Shape, c.M, c.Opts...)
		l := mustLoad(t, b, set)
		ref := kerneltest.Expect(set, req)
		for _, p := range paths(b, set) {
			if p.unsupported {
				continue
			}
			out := make([]byte, req.M()*set.K*req.OutDType.Size())
			res, err := b.run(ctx, l, req, out, p.gemm, false)
			if err != nil {
				t.Errorf("%s/%s: %v", c.Name, p.name, err)
				continue
			}
			want, _, err := ref.For(res.TopKIDs)
			if err != nil {
				t.Errorf("%s/%s (seed %d): %v", c.Name, p.name, seed, err)
			}
			if e := kerneltest.RelL2(kerneltest.DecodeOutput(req.OutDType, res.Output), want.Out); !(e <= want.Tol) {
				t.Errorf("%s/%s (seed %d): rel-L2 %.3g, want <= %.3g", c.Name, p.name, seed, e, want.Tol)
			}
		}
	}
}

// TestMaskedRows: the GPU router scores -Inf as 0, like the CPU backend:
// a softmax row of -Inf (device logits go unscanned) gets weights 0, a row
// with fewer unmasked experts than top_k pads with weight-0 picks, and no
// weight or output is NaN.
func TestMaskedRows(t *testing.T) {
	b := gpuBackend(t)
	for _, renorm := range []bool{false, true} {
		shape := kerneltest.Shape{Name: "masked", Activation: moe.SiluGated, E: 4, TopK: 3, K: 128, N: 64,
			Scoring: moe.Softmax, Renormalize: renorm, ScalingFactor: 1}
		set, req := kerneltest.NewCase(rand.New(rand.NewPCG(rand.Uint64(), 1)), shape, 3, kerneltest.WithLogits(moe.Float32))
		ninf := math.Float32bits(float32(math.Inf(-1)))
		for i := range 4 {
			binary.LittleEndian.PutUint32(req.Logits.Data[4*i:], ninf) // row 0: all masked
			if i != 2 {
				binary.LittleEndian.PutUint32(req.Logits.Data[4*(4+i):], ninf) // row 1: expert 2 only
			}
		}
		l := mustLoad(t, b, set)
		res, err := b.FusedMoE(context.Background(), l, req)
		if err != nil {
			t.Fatal(err)
		}
		// Softmax of one finite logit is 1, renormalized or not.
		want := []float32{0, 0, 0, 1, 0, 0}
		if got := res.TopKWeights[:6]; !slices.Equal(got, want) || res.TopKIDs[3] != 2 {
			t.Errorf("renormalize %v: ids %v weights %v, want expert 2 first in row 1 and weights %v", renorm, res.TopKIDs[:6], got, want)
		}
		for i, x := range kerneltest.DecodeOutput(req.OutDType, res.Output) {
			if x != x || math.IsInf(float64(x), 0) {
				t.Fatalf("renormalize %v: output element %d is %v", renorm, i, x)
			}
		}
	}
}

// TestErrorsAreErrors checks that bad calls come back as Go errors.
func TestErrorsAreErrors(t *testing.T) {
	b := gpuBackend(t)
	ctx := context.Background()
	set, req := kerneltest.NewCase(rand.New(rand.NewPCG(rand.Uint64(), 2)), kerneltest.Qwen3.Scaled(64, 32), 4)
	l := mustLoad(t, b, set)
	bad := *req
	bad.Routing.TopK = 200
	if _, err := b.FusedMoE(ctx, l, &bad); err == nil {
		t.Error("top_k=200 with 128 experts succeeded")
	}
	if err := b.call("set_free", func() int32 { return b.lib.setFree(1 << 60) }); err == nil || !strings.Contains(err.Error(), "ERR_NOT_FOUND") {
		t.Errorf("set_free(unknown) = %v, want ERR_NOT_FOUND", err)
	}
	l.Close()
	if _, err := b.FusedMoE(ctx, l, req); err == nil {
		t.Error("call on a closed set succeeded")
	}
}

// TestTiming measures the full Nemotron layer at the spec's token counts
// (EXPERTD_CUDA_TIMING=1 only: it uploads 1.28 GB of weights). Weights are
// random finite FP8 bytes; numbers, not correctness, are the point here.
func TestTiming(t *testing.T) {
	if os.Getenv("EXPERTD_CUDA_TIMING") != "1" {
		t.Skip("set EXPERTD_CUDA_TIMING=1")
	}
	b := gpuBackend(t)
	s := kerneltest.Nemotron
	rng := rand.New(rand.NewPCG(rand.Uint64(), 3))
	randFP8 := func(n int) []byte {
		buf := make([]byte, n)
		for i := 0; i+8 <= n; i += 8 {
			binary.LittleEndian.PutUint64(buf[i:], rng.Uint64()&0xBFBFBFBFBFBFBFBF) // exponent top bit clear: |v| < 2, never NaN
		}
		return buf
	}
	set := &moe.ExpertSet{Activation: s.Activation, E: s.E, K: s.K, N: s.N,
		W13: randFP8(s.E * s.N * s.K), W2: randFP8(s.E * s.K * s.N),
		W13Scale: scaling.WeightScale{Granularity: scaling.PerTensor, Values: []float32{0.05}},
		W2Scale:  scaling.WeightScale{Granularity: scaling.PerTensor, Values: []float32{0.05}}}
	ctx := context.Background()
	l, err := b.Load(ctx, set)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	perExpert := float64(2 * s.N * s.K)
	for _, m := range []int{1, 16, 256, 1024, 8192} {
		_, req := kerneltest.NewCase(rng, kerneltest.Shape{Name: "t", Activation: s.Activation, E: s.E, TopK: s.TopK, K: 8, N: 8,
			Scoring: s.Scoring, Renormalize: true, Bias: true, ScalingFactor: 2.5}, m)
		hidden := make([]byte, m*s.K*2)
		for i := 0; i < m*s.K; i++ {
			binary.LittleEndian.PutUint16(hidden[2*i:], scaling.Float32ToBF16(float32(rng.NormFloat64()*0.1)))
		}
		req.Hidden = moe.Tensor{DType: moe.BFloat16, Shape: []int{m, s.K}, Data: hidden}
		for _, p := range append([]gemmPath{{name: "auto", gemm: gemmAuto}}, paths(b, set)...) {
			if p.name == "portable-f16" || p.name == "sm90" {
				continue // auto is sm90 where it exists; f16 is the Ampere path
			}
			for _, graph := range []bool{true, false} {
				if !graph && m > 16 {
					continue
				}
				var ms []float64
				var wall []time.Duration
				var res *moe.Result
				for i := range 13 {
					out := make([]byte, m*s.K*2)
					t0 := time.Now()
					res, err = b.run(ctx, l, req, out, p.gemm, graph)
					if err != nil {
						break
					}
					if i >= 3 {
						ms = append(ms, float64(res.KernelNanos)/1e6)
						wall = append(wall, time.Since(t0))
					}
				}
				if err != nil {
					t.Errorf("M=%d gemm=%s graph=%v: %v", m, p.name, graph, err)
					continue
				}
				sort.Float64s(ms)
				slices.Sort(wall)
				hit := map[int32]bool{}
				for _, e := range res.TopKIDs {
					hit[e] = true
				}
				bytes := float64(len(hit))*perExpert + float64(m*s.K*4)
				flops := s.FLOPs(m)
				floor := math.Max(bytes/4.28e12, flops/1471e12) * 1e3
				t.Logf("timing Nemotron M=%d gemm=%s graph=%v: kernel %.3f ms (median of 10), wall %.3f ms, experts hit %d, floor %.3f ms, ratio %.1fx, %.0f TFLOP/s, %.2f TB/s",
					m, p.name, graph, ms[len(ms)/2], float64(wall[len(wall)/2].Microseconds())/1e3, len(hit), floor, ms[len(ms)/2]/floor,
					flops/ms[len(ms)/2]/1e9, bytes/ms[len(ms)/2]/1e9)
			}
		}
	}
}

// TestPackCallRouting checks that a call asks the library for its routing
// results only when the request wants them back: with NoRouting the
// call's routing outputs stay null, so the library copies nothing off the
// device for them. It needs no GPU.
func TestPackCallRouting(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	shape := kerneltest.Qwen3.Scaled(128, 48)
	for _, noRouting := range []bool{false, true} {
		set, req := kerneltest.NewCase(rng, shape, 3)
		req.NoRouting = noRouting
		out := make([]byte, req.M()*set.K*req.OutDType.Size())
		c, ids, w, err := packCall(set, req, out, 0, false, new(float32))
		if err != nil {
			t.Fatal(err)
		}
		n := req.M() * shape.TopK
		asked := c.topKIDsOut.data != 0 && c.topKWeightsOut.data != 0
		if noRouting {
			if asked || ids != nil || w != nil {
				t.Errorf("NoRouting: routing outputs %#x/%#x, %d/%d values, want none", c.topKIDsOut.data, c.topKWeightsOut.data, len(ids), len(w))
			}
			continue
		}
		if !asked || len(ids) != n || len(w) != n {
			t.Errorf("routing wanted: outputs %#x/%#x, %d/%d values, want %d each", c.topKIDsOut.data, c.topKWeightsOut.data, len(ids), len(w), n)
		}
	}
}

// TestGateFirst: SwigluOAI's interleaved GEMM1 rows (gate 2j, up 2j+1)
// reach the library gate rows first, per expert, whole rows at a time; the
// other gated activations' rows are already in that order.
func TestGateFirst(t *testing.T) {
	set := &moe.ExpertSet{Activation: moe.SwigluOAI, E: 2, N: 3, K: 2}
	// Expert e's row r is {10e + r, -(10e + r)}.
	var v []int
	for e := range set.E {
		for r := range set.Rows1() {
			v = append(v, 10*e+r, -(10*e + r))
		}
	}
	got := gateFirst(set, v, set.K)
	want := []int{0, 0, 2, -2, 4, -4, 1, -1, 3, -3, 5, -5, 10, -10, 12, -12, 14, -14, 11, -11, 13, -13, 15, -15}
	if !slices.Equal(got, want) {
		t.Errorf("SwigluOAI: gateFirst = %v, want %v", got, want)
	}
	set.Activation = moe.GeluGated
	if got := gateFirst(set, v, set.K); !slices.Equal(got, v) {
		t.Errorf("GeluGated: gateFirst = %v, want the rows unchanged", got)
	}
}
