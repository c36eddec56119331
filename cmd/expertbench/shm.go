package main

import (
	"context"
	"fmt"

	"github.com/expertd/expertd/client"
)

// shmUsage documents -shm.
const shmUsage = "pass hidden states and logits, and receive outputs, through POSIX shared memory (the daemon must run with -shared-memory on this host)"

// toSharedMemory moves worker w's requests into one POSIX region
// registered on c: each request's hidden states, logits and output get
// their own page-aligned slots, so calls send references and responses
// carry no output bytes. The small correction bias stays inline. free
// unregisters the region and releases the memory.
func toSharedMemory(ctx context.Context, c *client.Client, w int, reqs []*client.FusedMoERequest, cfg config) (free func(), err error) {
	const page = 4096
	outBytes, size := slots(reqs, cfg, page)
	shm, err := client.CreateSharedMemory("", size)
	if err != nil {
		return nil, err
	}
	name := fmt.Sprintf("expertbench-%d", w)
	rctx, cancel := cfg.dial.Call(ctx)
	defer cancel()
	region, err := c.RegisterSharedMemory(rctx, name, shm, 0, size)
	if err != nil {
		shm.Close()
		return nil, err
	}
	// Both processes hold a mapping now; nothing stays in /dev/shm if
	// either dies.
	shm.Unlink() //nolint:errcheck // Close unlinks again and reports
	put := func(off int64, t *client.Tensor) (err error) {
		*t, err = region.Put(off, *t)
		return err
	}
	if _, err := place(reqs, region, outBytes, page, put); err != nil {
		shm.Close()
		return nil, err
	}
	return func() {
		ctx, cancel := cfg.dial.Call(context.Background())
		defer cancel()
		c.UnregisterSharedMemory(ctx, name) //nolint:errcheck // the connection's end frees it too
		shm.Close()
	}, nil
}

func alignUp(n, align int64) int64 { return (n + align - 1) / align * align }

// place lays worker requests out in a region as slots sizes it: for each
// request its hidden states and logits, which put writes at their offsets
// (and replaces with references), then its output's slot, which the
// request's OutputShm points at. It returns the first output's offset.
func place(reqs []*client.FusedMoERequest, region *client.Region, outBytes, align int64, put func(off int64, t *client.Tensor) error) (out0 int64, err error) {
	var off int64
	for i, r := range reqs {
		for _, t := range []*client.Tensor{&r.Hidden, &r.RouterLogits} {
			n := alignUp(int64(len(t.Data)), align)
			if err := put(off, t); err != nil {
				return 0, err
			}
			off += n
		}
		if i == 0 {
			out0 = off
		}
		r.OutputShm = region.Ref(off, outBytes)
		off += alignUp(outBytes, align)
	}
	return out0, nil
}

// slots sizes a region holding each request's hidden states, logits and
// output in slots aligned to align bytes: the output's bytes and the
// region's.
func slots(reqs []*client.FusedMoERequest, cfg config, align int64) (outBytes, size int64) {
	outBytes = int64(cfg.tokens) * int64(cfg.model.k) * int64(cfg.out.Size())
	for _, r := range reqs {
		size += alignUp(int64(len(r.Hidden.Data)), align) + alignUp(int64(len(r.RouterLogits.Data)), align) + alignUp(outBytes, align)
	}
	return outBytes, size
}
