package cuda

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// TestStagedInputsAcrossCalls calls one set at M = 1 (FP8 hidden states
// with a per-tensor scale, sigmoid routing with a correction bias, as a
// Nemotron decode step) with the bias and the hidden scale the same as the
// last call's, different, and the same again; precomputed routing before
// and after a call that routes over it; a larger top_k, which grows the
// workspace but not the staging, with the same bias and scale; other M in
// between, growing both or laying their buffers over M = 1's. The host
// path sends a staged bias or hidden scale only when the workspace does
// not already hold its bytes, so each call must still see its own. Each
// sequence runs on a fresh load of the set (a fresh workspace), once from
// host memory (output and routing checked against the reference) and once
// with the hidden states, logits and output in device memory and no
// routing asked (only the bias, the scale and precomputed routing then go
// through the staging; a call with neither stages nothing), its output
// checked bit for bit against the host-memory call's.
func TestStagedInputsAcrossCalls(t *testing.T) {
	b := gpuBackend(t)
	ref := cpu.New(kernels.Config{})
	ctx := context.Background()
	seed := caseSeed(t)
	rng := rand.New(rand.NewPCG(seed, 0x57a6ed))
	// Every case shares the set's weights (Case.New), whatever its hidden
	// dtype and bias.
	nemo := kerneltest.Nemotron.Scaled(128, 64)
	fp8 := []kerneltest.Option{kerneltest.WithHidden(moe.Float8E4M3FN), kerneltest.WithHiddenScale(scaling.PerTensor)}
	set, one := kerneltest.Case{Shape: nemo, M: 1, Opts: fp8}.New(rng)

	// The M = 1 calls differ only in the staged inputs: bias B routes
	// otherwise than bias A (checked below), s2 scales the output.
	biasA := one.Routing.CorrectionBias
	biasB := make([]float32, len(biasA))
	for i, v := range biasA {
		biasB[i] = -10 * v
	}
	s1 := one.HiddenScale[0]
	s2 := 1.5 * s1
	type variant struct {
		req  *moe.Request
		want expected
	}
	variants := map[string]*variant{}
	add := func(name string, req *moe.Request) {
		variants[name] = &variant{req: req, want: expect(t, ref, name, set, req, req)}
	}
	routed := func(bias []float32, scale float32) *moe.Request {
		r := *one
		r.Routing.CorrectionBias = bias
		r.HiddenScale = []float32{scale}
		return &r
	}
	add("A,s1", routed(biasA, s1))
	add("B,s1", routed(biasB, s1))
	add("A,s2", routed(biasA, s2))
	add("B,s2", routed(biasB, s2))
	// Twice the routed pairs: a workspace about twice as large (the sorted
	// rows), the inputs where they were.
	wide := routed(biasA, s1)
	wide.Routing.TopK = 12
	add("A,s1,k=12", wide)
	if slices.Equal(variants["A,s1"].want.ref.IDs, variants["B,s1"].want.ref.IDs) {
		t.Fatal("bias B routes as bias A does: a stale bias would go unseen")
	}
	// B's routing, precomputed: the route kernels of the calls between
	// write A's where it lies in the workspace.
	pre := *one
	pre.Logits = moe.Tensor{}
	pre.Routing.CorrectionBias = nil
	pre.TopKIDs = variants["B,s1"].want.ref.IDs
	pre.TopKWeights = variants["B,s1"].want.ref.Weights
	add("pre", &pre)
	_, m4 := kerneltest.Case{Shape: nemo, M: 4, Opts: fp8}.New(rng)
	add("M=4", m4)
	// BF16 hidden states and no bias: from device memory, calls that stage
	// nothing. M = 1's routing results lie over M = 4's staged scale.
	plain := nemo
	plain.Bias = false
	for _, m := range []int{1, 96} {
		_, r := kerneltest.Case{Shape: plain, M: m}.New(rng)
		add(fmt.Sprintf("M=%d,bf16", m), r)
	}
	// The workspace grows at k=12, at the first M = 4 and at M = 96.
	steps := []string{"A,s1", "A,s1", "A,s1", "A,s1,k=12", "B,s1", "A,s1", "A,s2", "B,s2", "B,s2", "pre", "A,s1", "pre",
		"M=4", "M=1,bf16", "M=4", "B,s2", "A,s1", "M=96,bf16", "A,s1", "M=4", "A,s1", "B,s1", "pre", "pre", "B,s2"}

	// copyReq is r with fresh copies of its host slices, so no two calls'
	// staged inputs share an address: only their bytes can match.
	copyReq := func(r *moe.Request) *moe.Request {
		c := *r
		c.Routing.CorrectionBias = slices.Clone(r.Routing.CorrectionBias)
		c.HiddenScale = slices.Clone(r.HiddenScale)
		c.TopKIDs, c.TopKWeights = slices.Clone(r.TopKIDs), slices.Clone(r.TopKWeights)
		return &c
	}
	// Device memory per M and hidden size, [hidden | logits | out], kept
	// across calls so their device addresses key one graph.
	dev := map[[2]int]*DeviceBuffer{}
	defer func() {
		for _, d := range dev {
			d.Free()
		}
	}()
	// onDevice is r with its hidden states and logits copied to device
	// memory and its output there too, and the offset of that output.
	onDevice := func(r *moe.Request) (*moe.Request, *DeviceBuffer, int64) {
		hb, lb := int64(len(r.Hidden.Data)), int64(r.M()*set.E*4) // the cases' logits are FP32
		ob := int64(r.M() * set.K * r.OutDType.Size())
		key := [2]int{r.M(), len(r.Hidden.Data)}
		d := dev[key]
		if d == nil {
			var err error
			if d, err = b.AllocDevice(hb + lb + ob); err != nil {
				t.Fatal(err)
			}
			dev[key] = d
		}
		dr := copyReq(r)
		if err := d.CopyIn(0, r.Hidden.Data); err != nil {
			t.Fatal(err)
		}
		dr.Hidden.Data, dr.Hidden.Dev = nil, d.Ptr()
		if r.TopKIDs == nil {
			if err := d.CopyIn(hb, r.Logits.Data); err != nil {
				t.Fatal(err)
			}
			dr.Logits.Data, dr.Logits.Dev = nil, d.Ptr()+uintptr(hb)
		}
		dr.OutDev, dr.NoRouting = d.Ptr()+uintptr(hb+lb), true
		return dr, d, hb + lb
	}

	for _, p := range paths(b, set) {
		if p.unsupported {
			continue
		}
		name := func(mode string, i int) string {
			return fmt.Sprintf("staged (seed %d)/%s/%s/call%d/%s", seed, p.name, mode, i, steps[i])
		}
		host := make([][]byte, len(steps))
		l := mustLoad(t, b, set)
		for i, v := range steps {
			req := copyReq(variants[v].req)
			out := make([]byte, req.M()*set.K*req.OutDType.Size())
			kerneltest.Poison(out)
			res, err := b.run(ctx, l, req, out, p.gemm, true)
			if err != nil {
				t.Fatalf("%s: %v", name("host", i), err)
			}
			checkResult(t, name("host", i), set, req, variants[v].want, res, false)
			host[i] = out
		}
		l = mustLoad(t, b, set)
		for i, v := range steps {
			req, d, at := onDevice(variants[v].req)
			got := make([]byte, len(host[i]))
			kerneltest.Poison(got)
			if err := d.CopyIn(at, got); err != nil {
				t.Fatal(err)
			}
			if _, err := b.run(ctx, l, req, nil, p.gemm, true); err != nil {
				t.Fatalf("%s: %v", name("device", i), err)
			}
			if err := d.CopyOut(got, at); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, host[i]) {
				t.Errorf("%s: the output differs from the same call's from host memory", name("device", i))
			}
		}
	}
}
