package client_test

import (
	"bytes"
	"context"
	"fmt"
	"log"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/internal/testdaemon"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/service"
)

// Post calls through a call ring in a POSIX region instead of the socket.
// The daemon must run with -shared-memory -ring. The README shows this
// body.
func ExampleClient_OpenRing() {
	srv, err := testdaemon.Serve(service.Config{SharedMemory: true, Ring: true}) // an in-process expertd -shared-memory -ring
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

	// The ring takes client.RingSize(opts) bytes at the offset it is
	// opened at; tensors may follow it in the same region.
	opts := client.RingOptions{Slots: 4}
	shm, err := client.CreateSharedMemory("", client.RingSize(opts)+1<<20)
	if err != nil {
		log.Fatal(err)
	}
	defer shm.Close()
	region, err := c.RegisterSharedMemory(ctx, "ring", shm, 0, shm.Size())
	if err != nil {
		log.Fatal(err)
	}
	shm.Unlink()
	r, err := c.OpenRing(ctx, region, 0, opts)
	if err != nil {
		log.Fatal(err)
	}
	defer r.Close()

	// A small call with everything inline: every weight 1.0 (E4M3FN code
	// 0x38), one scale per expert, routing chosen by the caller.
	const E, K, N, M = 4, 32, 16, 2
	hidden := make([]float32, M*K)
	for i := range hidden {
		hidden[i] = float32(i%7) / 7
	}
	scales := client.FromFloat32([]float32{0.01, 0.01, 0.01, 0.01}, E)
	res, err := r.FusedMoE(ctx, &client.FusedMoERequest{
		Weights: &client.ExpertWeights{
			Activation: moe.SiluGated,
			W13:        client.FromFP8(bytes.Repeat([]byte{0x38}, E*2*N*K), E, 2*N, K),
			W2:         client.FromFP8(bytes.Repeat([]byte{0x38}, E*K*N), E, K, N),
			W13Scale:   scales,
			W2Scale:    scales,
		},
		Hidden:      client.FromFloat32(hidden, M, K),
		TopKIDs:     client.FromInt32([]int32{0, 3, 2, 1}, M, 2),
		TopKWeights: client.FromFloat32([]float32{0.7, 0.3, 0.5, 0.5}, M, 2),
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("output", res.Output.DType, res.Output.Shape, "through the ring")
	// Output:
	// output bfloat16 [2 32] through the ring
}
