package client_test

import (
	"context"
	"fmt"
	"log"
	"math"
	"math/rand/v2"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/internal/testdaemon"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// quantize is how a caller turns float32 weights into FP8 E4M3FN codes
// with one scale per expert: scale = amax/448, code = E4M3(w/scale).
func quantize(w []float32, experts int) (codes []byte, scales []float32) {
	per := len(w) / experts
	codes = make([]byte, len(w))
	scales = make([]float32, experts)
	for e := range experts {
		var amax float32
		for _, x := range w[e*per : (e+1)*per] {
			amax = max(amax, float32(math.Abs(float64(x))))
		}
		scales[e] = amax / scaling.E4M3Max
		for i, x := range w[e*per : (e+1)*per] {
			codes[e*per+i] = scaling.Float32ToE4M3(x / scales[e])
		}
	}
	return codes, scales
}

func randomFloats(rng *rand.Rand, n int, scale float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(rng.NormFloat64() * scale)
	}
	return v
}

// Dial a server, upload one layer of experts and run tokens through it.
// The README shows this body.
func Example() {
	srv := testdaemon.MustServe() // an in-process daemon; yours listens on "localhost:50051"
	defer srv.Stop()
	ctx := context.Background()
	c, err := client.Dial(ctx, srv.Addr)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	// One layer: E experts, hidden size K, intermediate size N; M tokens.
	const E, K, N, M = 4, 64, 32, 3
	rng := rand.New(rand.NewPCG(1, 2))
	randn := func(n int, scale float64) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = float32(rng.NormFloat64() * scale)
		}
		return v
	}

	// FP8 E4M3FN weights with one scale per output channel (a row of
	// w13 [E, 2N, K] or w2 [E, K, N]); LoadExperts streams them in chunks.
	w13, s13, err := client.QuantizeFP8(randn(E*2*N*K, 1), E*2*N, K, K)
	if err != nil {
		log.Fatal(err)
	}
	w2, s2, err := client.QuantizeFP8(randn(E*K*N, 1), E*K, N, N)
	if err != nil {
		log.Fatal(err)
	}
	w13.Shape, s13.Shape, w2.Shape, s2.Shape = []int{E, 2 * N, K}, []int{E, 2 * N}, []int{E, K, N}, []int{E, K}
	info, err := c.LoadExperts(ctx, "layer0", &client.ExpertWeights{
		Activation: moe.SiluGated, W13: w13, W2: w2, W13Scale: s13, W2Scale: s2,
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("loaded %s: E=%d K=%d N=%d, %s scales, %d bytes\n", info.Name, info.NumExperts, info.HiddenSize,
		info.IntermediateSize, info.W13ScaleGranularity, info.Bytes)

	res, err := c.FusedMoE(ctx, &client.FusedMoERequest{
		ExpertSet:    "layer0",
		Hidden:       client.BFloat16FromFloat32(randn(M*K, 0.1), M, K),
		RouterLogits: client.FromFloat32(randn(M*E, 1), M, E),
		Routing:      client.Routing{TopK: 2, Renormalize: true},
		OutputDType:  moe.Float32,
	})
	if err != nil {
		log.Fatal(err)
	}
	out, err := res.Output.Float32s() // [M, K]
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("output %v %v (%d values) from the %s backend\n", res.Output.Shape, res.Output.DType, len(out), res.Backend)
	// Output:
	// loaded layer0: E=4 K=64 N=32, per-channel scales, 26624 bytes
	// output [3 64] float32 (192 values) from the cpu backend
}

// Upload a layer in chunks and watch the progress.
func ExampleClient_LoadExperts() {
	srv := testdaemon.MustServe()
	defer srv.Stop()
	ctx := context.Background()
	c, err := client.Dial(ctx, srv.Addr)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	// Nemotron-style ReLU² experts: w1 is [E, N, K], w2 [E, K, N].
	const E, K, N = 8, 128, 64
	rng := rand.New(rand.NewPCG(3, 4))
	w1, s1 := quantize(randomFloats(rng, E*N*K, 1), E)
	w2, s2 := quantize(randomFloats(rng, E*K*N, 1), E)
	info, err := c.LoadExperts(ctx, "nemotron/layer1", &client.ExpertWeights{
		Activation: moe.Relu2,
		W13:        client.FromFP8(w1, E, N, K),
		W2:         client.FromFP8(w2, E, K, N),
		W13Scale:   client.FromFloat32(s1, E),
		W2Scale:    client.FromFloat32(s2, E),
	},
		client.ChunkBytes(32<<10),
		client.OnProgress(func(p client.Progress) {
			fmt.Printf("sent %6d of %d bytes\n", p.SentBytes, p.TotalBytes)
		}))
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("loaded", info.Name, info.Activation, info.W13ScaleGranularity)
	// Output:
	// sent      0 of 131136 bytes
	// sent  32768 of 131136 bytes
	// sent  65536 of 131136 bytes
	// sent  98304 of 131136 bytes
	// sent 131072 of 131136 bytes
	// sent 131104 of 131136 bytes
	// sent 131136 of 131136 bytes
	// loaded nemotron/layer1 relu2 per-expert
}

// Run a layer with weights sent inline and routing precomputed by the
// caller, and ask for the routing back.
func ExampleClient_FusedMoE() {
	srv := testdaemon.MustServe()
	defer srv.Stop()
	ctx := context.Background()
	c, err := client.Dial(ctx, srv.Addr)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	const E, K, N, M = 4, 32, 16, 2
	rng := rand.New(rand.NewPCG(5, 6))
	w13, s13 := quantize(randomFloats(rng, E*2*N*K, 1), E)
	w2, s2 := quantize(randomFloats(rng, E*K*N, 1), E)
	res, err := c.FusedMoE(ctx, &client.FusedMoERequest{
		Weights: &client.ExpertWeights{
			Activation: moe.SiluGated,
			W13:        client.FromFP8(w13, E, 2*N, K),
			W2:         client.FromFP8(w2, E, K, N),
			W13Scale:   client.FromFloat32(s13, E),
			W2Scale:    client.FromFloat32(s2, E),
		},
		Hidden:        client.FromFloat32(randomFloats(rng, M*K, 0.1), M, K),
		TopKIDs:       client.FromInt32([]int32{0, 3, 2, 1}, M, 2),
		TopKWeights:   client.FromFloat32([]float32{0.7, 0.3, 0.5, 0.5}, M, 2),
		ReturnRouting: true,
	})
	if err != nil {
		log.Fatal(err)
	}
	ids, _ := res.TopKIDs.Int32s()
	fmt.Println("output", res.Output.DType, res.Output.Shape, "routed to", ids)
	// Output:
	// output bfloat16 [2 32] routed to [0 3 2 1]
}

// Tensors are built from Go slices with a shape and decoded back.
func ExampleFromFloat32() {
	t := client.FromFloat32([]float32{1, -2.5, 3, 0.125, 1e-3, 448}, 2, 3)
	fmt.Println(t.DType, t.Shape, len(t.Data), "bytes")

	bf := client.BFloat16FromFloat32([]float32{1, -2.5, 3.14159}, 3)
	v, _ := bf.Float32s()
	fmt.Println(bf.DType, v)

	bad := client.FromFloat32([]float32{1, 2, 3}, 2, 2)
	fmt.Println(bad.Validate())
	// Output:
	// float32 [2 3] 24 bytes
	// bfloat16 [1 -2.5 3.140625]
	// float32 shape [2 2] needs 16 bytes, got 12
}

// List the loaded sets and the server's limits.
func ExampleClient_ListExperts() {
	srv := testdaemon.MustServe()
	defer srv.Stop()
	ctx := context.Background()
	c, err := client.Dial(ctx, srv.Addr)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	for _, name := range []string{"b", "a"} {
		w13, s13 := quantize(randomFloats(rand.New(rand.NewPCG(7, 8)), 2*2*8*16, 1), 2)
		w2, s2 := quantize(randomFloats(rand.New(rand.NewPCG(9, 10)), 2*16*8, 1), 2)
		if _, err := c.LoadExperts(ctx, name, &client.ExpertWeights{
			Activation: moe.SiluGated,
			W13:        client.FromFP8(w13, 2, 16, 16), W2: client.FromFP8(w2, 2, 16, 8),
			W13Scale: client.FromFloat32(s13, 2), W2Scale: client.FromFloat32(s2, 2),
		}); err != nil {
			log.Fatal(err)
		}
	}
	sets, err := c.ListExperts(ctx)
	if err != nil {
		log.Fatal(err)
	}
	for _, s := range sets {
		fmt.Println(s.Name, s.NumExperts, s.HiddenSize, s.IntermediateSize, s.Bytes)
	}
	info, err := c.ServerInfo(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("backend", info.Backends[0].Name, "max message bytes", info.Limits.MaxMessageBytes)
	// Output:
	// a 2 16 8 784
	// b 2 16 8 784
	// backend cpu max message bytes 16777216
}
