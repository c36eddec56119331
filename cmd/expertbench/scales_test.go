package main

import (
	"context"
	"encoding/binary"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// TestBenchStaticScales loads a -scales static layer of both activations
// on the CPU backend and calls it with BF16 and with FP8 hidden states:
// the set must report static a13 and a2 scales and the summary say so.
// A later run without -load calls the static set, and is refused on a
// dynamic one.
func TestBenchStaticScales(t *testing.T) {
	addr := startServer(t)
	c, err := client.Dial(context.Background(), addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, model := range []string{"nemotron", "qwen3"} {
		for _, hidden := range []string{"bf16", "fp8"} {
			t.Run(model+"/"+hidden, func(t *testing.T) {
				set := "static-" + model + "-" + hidden
				stdout, stderr, err := runBench(t, "-addr", addr, "-model", model, "-e", "8", "-k", "48", "-n", "40", "-scales", "static",
					"-hidden", hidden, "-load", "-keep", "-set", set, "-m", "3", "-c", "2", "-calls", "7", "-no-rtt")
				if err != nil {
					t.Fatalf("run: %v\nstderr:\n%s", err, stderr)
				}
				if !strings.Contains(stdout, "N=40 "+models[model].activation.String()+" static scales)") || !strings.Contains(stdout, "calls        7 in ") {
					t.Errorf("summary does not name the static scales or count 7 calls:\n%s", stdout)
				}
				ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
				defer cancel()
				sets, err := c.ListExperts(ctx)
				if err != nil {
					t.Fatal(err)
				}
				var found bool
				for _, s := range sets {
					if s.Name == set {
						found = true
						if !s.StaticA13Scale || !s.StaticA2Scale {
							t.Errorf("set %s: static a13 %v, a2 %v; want both static", set, s.StaticA13Scale, s.StaticA2Scale)
						}
					}
				}
				if !found {
					t.Fatalf("set %s not loaded: %v", set, sets)
				}
				if _, stderr, err := runBench(t, "-addr", addr, "-model", model, "-e", "8", "-k", "48", "-n", "40", "-scales", "static",
					"-hidden", hidden, "-set", set, "-m", "2", "-c", "1", "-calls", "3", "-no-rtt"); err != nil {
					t.Errorf("a run on the loaded static set: %v\nstderr:\n%s", err, stderr)
				}
			})
		}
	}

	if _, stderr, err := runBench(t, "-addr", addr, "-model", "qwen3", "-e", "8", "-k", "48", "-n", "40",
		"-load", "-keep", "-set", "dynamic", "-calls", "1", "-no-rtt"); err != nil {
		t.Fatalf("loading a dynamic set: %v\nstderr:\n%s", err, stderr)
	}
	_, _, err = runBench(t, "-addr", addr, "-model", "qwen3", "-e", "8", "-k", "48", "-n", "40", "-scales", "static",
		"-set", "dynamic", "-calls", "1", "-no-rtt")
	if want := `-scales static: set "dynamic" has dynamic activation scales`; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("-scales static on a dynamic set = %v, want an error containing %q", err, want)
	}
}

// TestCalibrateA2 checks calibrateA2 against bench/peer.py's
// calibrate_a2_scale written out in float64: every routed pair of the
// calibration batch, each expert's weights dequantized with the scales
// randomWeights sends.
func TestCalibrateA2(t *testing.T) {
	for _, name := range []string{"nemotron", "qwen3"} {
		t.Run(name, func(t *testing.T) {
			m := models[name]
			m.e, m.k, m.n = 8, 48, 40
			m.a13 = m.staticA13()
			w := m.randomWeights(uint64(time.Now().UnixNano()))
			a2, ok := scalar(t, w.A2Scale)
			if a13, _ := scalar(t, w.A13Scale); !ok || a13 != m.a13 {
				t.Fatalf("a13_scale %v, want m.a13 %v", a13, m.a13)
			}

			hidden, logits := m.calibration()
			if want := scaling.ClampScale(absMax(hidden) / scaling.E4M3Max); m.a13 != want {
				t.Errorf("a13 %v, want the calibration batch's amax/448 %v", m.a13, want)
			}
			r := moe.Routing{TopK: m.topK, Renormalize: true, Scoring: m.scoring, NumGroups: m.groups, TopKGroups: m.topKGroups, ScalingFactor: 1}
			if m.bias {
				r.CorrectionBias = m.correctionBias()
			}
			ids := make([]int32, calibrationTokens*m.topK)
			moe.Route(ids, make([]float32, len(ids)), logits, calibrationTokens, m.e, r)
			rows := m.rows1()
			var amax float64
			for i, e := range ids {
				tok := hidden[i/m.topK*m.k : (i/m.topK+1)*m.k]
				s13 := float64(math.Float32frombits(binary.LittleEndian.Uint32(w.W13Scale.Data[4*e:])))
				h := make([]float64, rows)
				for j := range h {
					for c, x := range tok {
						q := float64(scaling.E4M3Table[scaling.Float32ToE4M3(x/m.a13)]) * float64(m.a13)
						h[j] += q * float64(scaling.E4M3Table[w.W13.Data[(int(e)*rows+j)*m.k+c]]) * s13
					}
				}
				for j := range m.n {
					var v float64
					if m.activation == moe.Relu2 {
						v = math.Pow(math.Max(h[j], 0), 2)
					} else {
						g, u := h[j], h[m.n+j]
						v = g / (1 + math.Exp(-g)) * u
					}
					amax = math.Max(amax, math.Abs(v))
				}
			}
			want := amax / scaling.E4M3Max
			if rel := math.Abs(float64(a2)-want) / want; rel > 1e-4 {
				t.Errorf("a2 %v, want %v (peer.py's calibration; relative difference %.2g)", a2, want, rel)
			}
		})
	}
}

// TestStaticFP8Request: with static scales an FP8 request carries its
// hidden states quantized at the layer's a13, and that one scale.
func TestStaticFP8Request(t *testing.T) {
	m := models["nemotron"]
	m.e, m.k, m.n = 8, 48, 40
	m.a13 = m.staticA13()
	seed := uint64(time.Now().UnixNano())
	r := m.request(rand.New(rand.NewPCG(seed, 1)), "s", 3, moe.BFloat16, true)
	if s, ok := scalar(t, r.HiddenScale); !ok || s != m.a13 {
		t.Errorf("hidden_states_scale %v (shape %v), want the one value a13 = %v", s, r.HiddenScale.Shape, m.a13)
	}
	hidden, _ := m.tokens(rand.New(rand.NewPCG(seed, 1)), 3)
	want := make([]byte, len(hidden))
	scaling.QuantizeStatic(want, hidden, m.a13)
	if r.Hidden.DType != moe.Float8E4M3FN || string(r.Hidden.Data) != string(want) {
		t.Errorf("hidden_states are %v, not the tokens quantized at a13", r.Hidden.DType)
	}
}

// scalar is the one FP32 value of t, and whether it holds exactly one.
func scalar(t *testing.T, v client.Tensor) (float32, bool) {
	t.Helper()
	if v.DType != moe.Float32 || len(v.Data) != 4 {
		return 0, false
	}
	return math.Float32frombits(binary.LittleEndian.Uint32(v.Data)), true
}

func absMax(v []float32) float32 {
	var mx float32
	for _, x := range v {
		mx = max(mx, float32(math.Abs(float64(x))))
	}
	return mx
}
