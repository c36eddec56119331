package cuda

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// deviceGiB reads the memory size from the library's device description
// ("NVIDIA H200 (sm_90, 132 SMs, 139 GiB, gemm=sm90)"), 0 if absent.
func deviceGiB(info string) int {
	m := regexp.MustCompile(`(\d+) GiB`).FindStringSubmatch(info)
	if m == nil {
		return 0
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// randomFP8 fills n bytes with random E4M3 codes of |value| < 2 (the
// exponent's top bit clear, so never NaN), in parallel: a full DeepSeek-V3
// layer is 11 GB.
func randomFP8(seed uint64, n int) []byte {
	buf := make([]byte, n)
	const chunk = 64 << 20
	var wg sync.WaitGroup
	for c := 0; c*chunk < n; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(c)))
			part := buf[c*chunk : min((c+1)*chunk, n)]
			i := 0
			for ; i+8 <= len(part); i += 8 {
				binary.LittleEndian.PutUint64(part[i:], rng.Uint64()&0xBFBFBFBFBFBFBFBF)
			}
			for ; i < len(part); i++ {
				part[i] = uint8(rng.Uint32()) & 0xBF
			}
		}()
	}
	wg.Wait()
	return buf
}

// randomBlockSet is shape s's layer with random FP8 weights and random
// block scales, made without quantizing (which would take minutes at full
// size).
func randomBlockSet(rng *rand.Rand, s kerneltest.Shape) *moe.ExpertSet {
	bn, bk := s.Block[0], s.Block[1]
	scale := func(rows, cols int) scaling.WeightScale {
		v := make([]float32, s.E*((rows+bn-1)/bn)*((cols+bk-1)/bk))
		for i := range v {
			v[i] = 0.05 + 0.1*rng.Float32()
		}
		return scaling.WeightScale{Granularity: scaling.Block, Values: v, Block: s.Block, E: s.E, Rows: rows, Cols: cols}
	}
	return &moe.ExpertSet{Activation: s.Activation, E: s.E, K: s.K, N: s.N, Block: s.Block,
		W13: randomFP8(rng.Uint64(), s.E*s.Rows1()*s.K), W2: randomFP8(rng.Uint64(), s.E*s.K*s.N),
		W13Scale: scale(s.Rows1(), s.K), W2Scale: scale(s.K, s.N)}
}

// TestDeepSeekV3Full runs the full DeepSeek-V3 layer (E=256, top-8 of 8
// groups / top-4 groups, K=7168, N=2048, [128, 128] blocks: 11.3 GB of FP8
// weights) at M=64 with BF16 and with per-group FP8 hidden states, on
// AUTO's GEMM (sm90 for block sets where it takes them, unless
// the sm90-block option is off) and, on a card that has sm90, the portable GEMM
// too, three calls each: against
// the CPU backend on every token and the float64 reference on two. It needs
// EXPERTD_LIBRARY_PATH and a GPU with >= 24 GiB, and about a minute, most of it
// making and uploading the weights and the references.
func TestDeepSeekV3Full(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	b := gpuBackend(t)
	if gib := deviceGiB(b.info); gib < 24 {
		t.Skipf("%s: needs a GPU with >= 24 GiB", b.info)
	}
	const m = 64
	s := kerneltest.DeepSeekV3
	seed := rand.Uint64()
	rng := rand.New(rand.NewPCG(seed, 11))
	set := randomBlockSet(rng, s)
	ctx := context.Background()
	l, err := b.Load(ctx, set)
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	defer l.Close()
	ref := cpu.New(kernels.Config{})
	cl := mustLoad(t, ref, set)

	// Routing from a tiny case of the same E, top-k and routing; hidden
	// states randn/10 at full K.
	tiny := s
	tiny.K, tiny.N, tiny.Block = 8, 8, [2]int{}
	_, req := kerneltest.NewCase(rng, tiny, m)
	hidden := make([]float32, m*s.K)
	for i := range hidden {
		hidden[i] = float32(rng.NormFloat64() * 0.1)
	}
	bf16 := moe.Tensor{DType: moe.BFloat16, Shape: []int{m, s.K}, Data: make([]byte, 2*len(hidden))}
	for i, x := range hidden {
		binary.LittleEndian.PutUint16(bf16.Data[2*i:], scaling.Float32ToBF16(x))
	}
	ng := (s.K + s.Block[1] - 1) / s.Block[1]
	fp8 := moe.Tensor{DType: moe.Float8E4M3FN, Shape: []int{m, s.K}, Data: make([]byte, len(hidden))}
	fp8Scale := make([]float32, m*ng)
	scaling.QuantizeDynamic(fp8.Data, fp8Scale, hidden, m, s.K, s.Block[1])

	for _, v := range []struct {
		name   string
		hidden moe.Tensor
		scale  []float32
	}{{"bf16-in", bf16, nil}, {"fp8-in-per-group", fp8, fp8Scale}} {
		r := *req
		r.Hidden, r.HiddenScale = v.hidden, v.scale
		name := fmt.Sprintf("DeepSeekV3/M=%d/%s (seed %d)", m, v.name, seed)
		cres, err := ref.FusedMoE(ctx, cl, &r)
		if err != nil {
			t.Fatalf("%s: cpu backend: %v", name, err)
		}
		toks := []int{0, m - 1}
		want, _, _ := kerneltest.Reference(set, kerneltest.SubRequest(&r, toks))
		fc := &fullCase{set: set, req: &r, routing: kerneltest.ReferenceRouting(set, &r), cpu: ref, cl: cl,
			cpuOut: decode64(r.OutDType, cres.Output), toks: toks, want: want}
		// AUTO is sm90 on a Hopper card; portable is the fallback
		// everywhere else, so check it at full size too.
		gemms := []gemmPath{{name: "auto", gemm: gemmAuto}}
		if strings.Contains(b.info, "gemm=sm90") {
			gemms = append(gemms, gemmPath{name: "portable", gemm: gemmPortable})
		}
		for _, g := range gemms {
			for call := range 3 {
				name := name + "/" + g.name
				if !fc.check(t, b, l, g.gemm, name, call) {
					break
				}
			}
		}
	}
}

// fullCase is one TestDeepSeekV3Full request and what its calls must
// return: the CPU backend's output cpuOut (every token), the reference's
// want (tokens toks; the whole layer in float64 takes too long), and the
// reference's routing.
type fullCase struct {
	set     *moe.ExpertSet
	req     *moe.Request
	routing *kerneltest.Routing
	cpu     kernels.Backend
	cl      kernels.Loaded
	cpuOut  []float64
	toks    []int
	want    []float64
}

// check runs one call on gemm and checks it; false when the call failed
// outright. The CPU backend routes as the reference does, so on the tokens
// the call routed otherwise at float32 precision (Routing.Check) both
// references run again with the call's routing.
func (fc *fullCase) check(t *testing.T, b *Backend, l kernels.Loaded, gemm int64, name string, call int) bool {
	t.Helper()
	r, k := fc.req, fc.set.K
	out := make([]byte, r.M()*k*r.OutDType.Size())
	kerneltest.Poison(out)
	res, err := b.run(context.Background(), l, r, out, gemm, true)
	if err != nil {
		t.Errorf("%s/call%d: %v", name, call, err)
		return false
	}
	if n := kerneltest.Unwritten(out, r.OutDType.Size()); n > 0 {
		t.Errorf("%s/call%d: %d output elements left unwritten", name, call, n)
	}
	cpuOut, want := fc.cpuOut, fc.want
	flipped, err := fc.routing.Check(res.TopKIDs)
	if err != nil {
		t.Errorf("%s/call%d: %v", name, call, err)
	}
	if len(flipped) > 0 {
		t.Logf("%s/call%d: tokens %v routed among experts tied at float32 precision otherwise than the reference", name, call, flipped)
		pre := fc.routing.Precomputed(res.TopKIDs, flipped)
		cres, err := fc.cpu.FusedMoE(context.Background(), fc.cl, kerneltest.SubRequest(pre, flipped))
		if err != nil {
			t.Fatalf("%s: cpu backend: %v", name, err)
		}
		cpuOut = slices.Clone(cpuOut)
		row := k * r.OutDType.Size()
		for i, tk := range flipped {
			copy(cpuOut[tk*k:(tk+1)*k], decode64(r.OutDType, cres.Output[i*row:(i+1)*row]))
		}
		if slices.ContainsFunc(fc.toks, func(tk int) bool { return slices.Contains(flipped, tk) }) {
			want, _, _ = kerneltest.Reference(fc.set, kerneltest.SubRequest(pre, fc.toks))
		}
	}
	got := kerneltest.DecodeOutput(r.OutDType, res.Output)
	var gotSub []float32
	for _, tk := range fc.toks {
		gotSub = append(gotSub, got[tk*k:(tk+1)*k]...)
	}
	eCPU, eRef := kerneltest.RelL2(got, cpuOut), kerneltest.RelL2(gotSub, want)
	if !(eCPU <= kerneltest.FP8Tol) || !(eRef <= kerneltest.FP8Tol) {
		t.Errorf("%s/call%d: rel-L2 %.3g vs cpu, %.3g vs reference (tokens %v); want <= %g", name, call, eCPU, eRef, fc.toks, kerneltest.FP8Tol)
	} else {
		t.Logf("%s/call%d: rel-L2 %.3g vs cpu, %.3g vs reference (tokens %v), %.3f ms", name, call, eCPU, eRef, fc.toks, float64(res.KernelNanos)/1e6)
	}
	return true
}
