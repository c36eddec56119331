package main

import (
	"context"
	"fmt"

	"github.com/expertd/expertd/client"
)

// ringUsage documents -ring.
const ringUsage = "post calls through a shared-memory call ring (client.OpenRing) instead of RPCs; tensors inline, or in shared memory with -shm or -cuda-ipc (the daemon must run with -shared-memory -ring on this host)"

// openRing opens worker w's call ring in a POSIX object of its own, with
// one slot per call the worker has in flight (one) and slots large enough
// for its requests and, unless outputs go to shared memory, responses.
// free closes the ring and the memory.
func openRing(ctx context.Context, c *client.Client, w int, reqs []*client.FusedMoERequest, cfg config) (r *client.Ring, free func(), err error) {
	slot := int64(64 << 10)
	if !cfg.shm && !cfg.cudaIPC {
		outBytes, _ := slots(reqs, cfg, 1)
		for _, q := range reqs {
			// Tensor bytes plus the fields and framing around them.
			slot = max(slot, alignUp(int64(len(q.Hidden.Data)+len(q.RouterLogits.Data)+len(q.HiddenScale.Data))+outBytes+16<<10, 64))
		}
	}
	opts := client.RingOptions{Slots: 1, SlotBytes: int(slot), Spin: cfg.ringSpin}
	shm, err := client.CreateSharedMemory("", client.RingSize(opts))
	if err != nil {
		return nil, nil, err
	}
	name := fmt.Sprintf("expertbench-ring-%d", w)
	rctx, cancel := cfg.dial.Call(ctx)
	defer cancel()
	region, err := c.RegisterSharedMemory(rctx, name, shm, 0, shm.Size())
	if err != nil {
		shm.Close()
		return nil, nil, err
	}
	shm.Unlink() //nolint:errcheck // Close unlinks again and reports
	if r, err = c.OpenRing(rctx, region, 0, opts); err != nil {
		shm.Close()
		return nil, nil, err
	}
	return r, func() {
		r.Close() //nolint:errcheck // exit path
		ctx, cancel := cfg.dial.Call(context.Background())
		defer cancel()
		c.UnregisterSharedMemory(ctx, name) //nolint:errcheck // the connection's end frees it too
		shm.Close()
	}, nil
}
