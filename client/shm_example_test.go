package client_test

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"math/rand/v2"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/internal/testdaemon"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/service"
)

// Pass hidden states and logits to a daemon on the same host through
// shared memory, and read the output where the daemon wrote it. The daemon
// must run with -shared-memory. The README shows this body.
func ExampleClient_RegisterSharedMemory() {
	srv, err := testdaemon.Serve(service.Config{SharedMemory: true}) // an in-process expertd -shared-memory
	if err != nil {
		log.Fatal(err)
	}
	defer srv.Stop()
	ctx := context.Background()
	c, err := client.Dial(ctx, srv.Addr)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	// A layer of ReLU² experts: random FP8 E4M3FN codes below 32 in
	// magnitude, one scale per expert.
	const E, K, N, M = 4, 64, 32, 3
	rng := rand.New(rand.NewPCG(5, 6))
	fp8 := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.IntN(0x60)) | byte(rng.IntN(2))<<7
		}
		return b
	}
	randn := func(n int) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = float32(rng.NormFloat64())
		}
		return v
	}
	scales := client.FromFloat32([]float32{0.01, 0.01, 0.01, 0.01}, E)
	if _, err := c.LoadExperts(ctx, "layer0", &client.ExpertWeights{
		Activation: moe.Relu2, W13: client.FromFP8(fp8(E*N*K), E, N, K), W2: client.FromFP8(fp8(E*K*N), E, K, N),
		W13Scale: scales, W2Scale: scales,
	}); err != nil {
		log.Fatal(err)
	}

	// One object for everything (/dev/shm/expertd-<pid>-<random>, mode
	// 0600); the daemon maps the region registered over it. Unlink once
	// registered: both processes keep their mapping, and nothing is left
	// in /dev/shm if either dies.
	shm, err := client.CreateSharedMemory("", 1<<20)
	if err != nil {
		log.Fatal(err)
	}
	defer shm.Close()
	region, err := c.RegisterSharedMemory(ctx, "acts", shm, 0, shm.Size())
	if err != nil {
		log.Fatal(err)
	}
	shm.Unlink()

	// Put copies into the region; Region.Tensor instead views bytes a
	// producer already wrote there.
	hidden, err := region.Put(0, client.BFloat16FromFloat32(randn(M*K), M, K))
	if err != nil {
		log.Fatal(err)
	}
	logits, err := region.Put(4096, client.FromFloat32(randn(M*E), M, E))
	if err != nil {
		log.Fatal(err)
	}
	req := &client.FusedMoERequest{
		ExpertSet:    "layer0",
		Hidden:       hidden,
		RouterLogits: logits,
		Routing:      client.Routing{TopK: 2, Renormalize: true},
		OutputDType:  moe.Float32,
		OutputShm:    region.Ref(8192, M*K*4), // the output is written here
	}
	res, err := c.FusedMoE(ctx, req)
	if err != nil {
		log.Fatal(err)
	}
	out, err := res.Output.Float32s() // read in place from the region
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("output %v %v (%d values) in region %q at offset %d\n", res.Output.Shape, res.Output.DType, len(out),
		res.Output.Shm.Region, res.Output.Shm.Offset)

	// The same call with everything inline gives the same bytes.
	req.Hidden.Shm, req.RouterLogits.Shm, req.OutputShm = nil, nil, nil
	inline, err := c.FusedMoE(ctx, req)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("same as inline:", bytes.Equal(res.Output.Data, inline.Output.Data))
	// Output:
	// output [3 64] float32 (192 values) in region "acts" at offset 8192
	// same as inline: true
}

// Keep activations in a GPU process's device memory: the daemon, on the
// same host and running the cuda backend with -shared-memory, reads the
// hidden states and logits there and writes the output there, with no
// copy through either host. A PyTorch process exports a tensor's storage
// with
//
//	_, h, size, offset, *_ = t.untyped_storage()._share_cuda_()
//
// and hands the handle (h[-64:]: torch puts a version and a type byte
// before it), offset and size to the caller; the tensor's bytes start
// t.storage_offset() * t.element_size() into the region. It must
// synchronize the stream that wrote them before each call. (Not run: it
// needs a GPU and a daemon.)
func ExampleClient_RegisterCUDASharedMemory() {
	ctx := context.Background()
	c, err := client.Dial(ctx, "localhost:50051")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	var handle []byte             // from _share_cuda_()
	var storageOffset, size int64 // from _share_cuda_() too
	region, err := c.RegisterCUDASharedMemory(ctx, "acts", handle, storageOffset, size)
	if err != nil {
		log.Fatal(err)
	}
	// One storage holding [M, K] BF16 hidden states, [M, E] FP32 logits
	// and room for the [M, K] BF16 output, one after the other.
	const M, K, E = 4, 2688, 128
	hidden, err := region.Tensor(moe.BFloat16, 0, M, K)
	if err != nil {
		log.Fatal(err)
	}
	logits, err := region.Tensor(moe.Float32, M*K*2, M, E)
	if err != nil {
		log.Fatal(err)
	}
	res, err := c.FusedMoE(ctx, &client.FusedMoERequest{
		ExpertSet:    "layer0",
		Hidden:       hidden,
		RouterLogits: logits,
		Routing:      client.Routing{TopK: 6},
		OutputShm:    region.Ref(M*K*2+M*E*4, M*K*2),
	})
	if err != nil {
		log.Fatal(err)
	}
	// The output is in the GPU process's storage when the call returns.
	fmt.Println("output at byte", res.Output.Shm.Offset, "of region", res.Output.Shm.Region)
}
