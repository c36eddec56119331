package main

import (
	"bytes"
	"context"
	"fmt"
	"io"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cuda"
)

// cudaIPCUsage documents -cuda-ipc.
const cudaIPCUsage = "pass hidden states and logits, and receive outputs, in GPU memory shared through CUDA IPC (the daemon must run the cuda backend with -shared-memory on this host; expertbench allocates the memory through the kernel library, see -cuda-lib)"

// openGPU opens the kernel library expertbench allocates device memory
// with (the daemon's library; lib empty searches as the daemon does).
func openGPU(lib string) (*cuda.Backend, error) {
	return cuda.New(kernels.Config{LibraryPath: lib})
}

// toCUDAIPC moves worker w's requests into one device allocation shared
// with the daemon through CUDA IPC: each request's hidden states, logits
// and output get their own 256-byte aligned slots, so calls send
// references, responses carry none of the output, and no tensor byte
// crosses the host. Worker 0 first checks that its first request gives
// the same output bytes both ways (inline, then through the GPU memory).
// free unregisters the region and frees the memory.
func toCUDAIPC(ctx context.Context, c *client.Client, gpu *cuda.Backend, w int, reqs []*client.FusedMoERequest, cfg config, stderr io.Writer) (free func(), err error) {
	const align = 256
	outBytes, size := slots(reqs, cfg, align)
	var want []byte
	if w == 0 {
		cctx, cancel := cfg.dial.Call(ctx)
		defer cancel()
		res, err := c.FusedMoE(cctx, reqs[0])
		if err != nil {
			return nil, fmt.Errorf("inline reference call: %w", err)
		}
		want = res.Output.Data
	}
	mem, err := gpu.AllocDevice(size)
	if err != nil {
		return nil, err
	}
	handle, err := mem.IPCHandle()
	if err != nil {
		mem.Free()
		return nil, err
	}
	name := fmt.Sprintf("expertbench-cuda-%d", w)
	rctx, cancel := cfg.dial.Call(ctx)
	defer cancel()
	region, err := c.RegisterCUDASharedMemory(rctx, name, handle, 0, size)
	if err != nil {
		mem.Free()
		return nil, err
	}
	free = func() {
		ctx, cancel := cfg.dial.Call(context.Background())
		defer cancel()
		c.UnregisterSharedMemory(ctx, name) //nolint:errcheck // the connection's end frees it too
		mem.Free()
	}
	put := func(off int64, t *client.Tensor) error {
		if err := mem.CopyIn(off, t.Data); err != nil {
			return err
		}
		*t = client.Tensor{DType: t.DType, Shape: t.Shape, Shm: region.Ref(off, int64(len(t.Data)))}
		return nil
	}
	out0, err := place(reqs, region, outBytes, align, put)
	if err != nil {
		free()
		return nil, err
	}
	if want != nil {
		cctx, cancel := cfg.dial.Call(ctx)
		defer cancel()
		if _, err := c.FusedMoE(cctx, reqs[0]); err != nil {
			free()
			return nil, fmt.Errorf("first call through CUDA IPC: %w", err)
		}
		got := make([]byte, outBytes)
		if err := mem.CopyOut(got, out0); err != nil {
			free()
			return nil, err
		}
		if !bytes.Equal(got, want) {
			free()
			return nil, fmt.Errorf("the output through CUDA IPC differs from the inline call's (%d bytes)", len(got))
		}
		fmt.Fprintf(stderr, "expertbench: cuda-ipc output of a %d-token call matches the inline call's, byte for byte\n", cfg.tokens)
	}
	return free, nil
}
