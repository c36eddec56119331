package e2e

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
)

// TestSharedMemory drives the built daemon with -shared-memory through the
// SDK: tensors and the output in a POSIX region give the same bytes as the
// inline call and meet the float64 reference; the daemon unmaps the region
// when the client's connection closes.
func TestSharedMemory(t *testing.T) {
	if _, err := os.Stat("/dev/shm"); err != nil {
		t.Skipf("no /dev/shm: %v", err)
	}
	d := startDaemon(t, "-shared-memory")
	ctx := testContext(t)
	rng := newRand(t)
	c, err := client.Dial(ctx, d.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	shape := kerneltest.Nemotron.Scaled(256, 128)
	set, _ := kerneltest.NewCase(rng, shape, 1)
	if _, err := c.LoadExperts(ctx, "nemotron", clienttest.Weights(set)); err != nil {
		t.Fatalf("LoadExperts: %v", err)
	}
	shm, err := client.CreateSharedMemory("", 4<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer shm.Close()
	t.Logf("Go: region, err := c.RegisterSharedMemory(ctx, \"acts\", shm /* /dev/shm/%s */, 0, %d)", shm.Key(), shm.Size())
	region, err := c.RegisterSharedMemory(ctx, "acts", shm, 0, shm.Size())
	if err != nil {
		t.Fatalf("RegisterSharedMemory: %v", err)
	}
	if err := shm.Unlink(); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name string
		m    int
		opts []kerneltest.Option
	}{
		{"bf16 in, bf16 out", 64, nil},
		{"fp32 out", 17, []kerneltest.Option{kerneltest.WithOutput(moe.Float32)}},
		{"fp8 in with its scale", 33, []kerneltest.Option{kerneltest.WithHidden(moe.Float8E4M3FN)}},
		{"precomputed routing", 8, []kerneltest.Option{kerneltest.WithPrecomputedRouting(), kerneltest.WithOutput(moe.Float32)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Each case its own bound: the float64 references of the
			// cases before must not eat into this one's on a slow machine.
			ctx := testContext(t)
			req := tokens(rng, shape, tt.m, tt.opts...)
			r := clienttest.Request("nemotron", set, req)
			inline, err := c.FusedMoE(ctx, r)
			if err != nil {
				t.Fatalf("inline FusedMoE: %v", err)
			}
			// Every tensor of the request into the region, 4 KiB apart.
			var off int64
			for _, x := range []*client.Tensor{&r.Hidden, &r.HiddenScale, &r.RouterLogits, &r.TopKIDs, &r.TopKWeights} {
				if x.IsZero() {
					continue
				}
				if *x, err = region.Put(off, *x); err != nil {
					t.Fatal(err)
				}
				off += (int64(len(x.Data))/4096 + 1) * 4096
			}
			r.OutputShm = region.Ref(off, int64(len(inline.Output.Data)))
			res, err := c.FusedMoE(ctx, r)
			if err != nil {
				t.Fatalf("shm FusedMoE: %v", err)
			}
			if res.Output.Shm == nil {
				t.Fatalf("output came inline, want it in the region")
			}
			if !bytes.Equal(res.Output.Data, inline.Output.Data) {
				t.Errorf("shm output differs from the inline output")
			}
			got, err := res.Output.Float32s()
			if err != nil {
				t.Fatal(err)
			}
			checkAgainstReference(t, "shm output", got, set, req)
		})
	}

	maps := fmt.Sprintf("/proc/%d/maps", d.cmd.Process.Pid)
	mapped := func() bool {
		b, err := os.ReadFile(maps)
		if err != nil {
			t.Skipf("cannot read the daemon's mappings: %v", err)
		}
		return strings.Contains(string(b), "/dev/shm/"+shm.Key())
	}
	if !mapped() {
		t.Fatalf("the daemon does not map /dev/shm/%s", shm.Key())
	}
	c.Close()
	for deadline := time.Now().Add(defaultTimeout); mapped(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the daemon still maps /dev/shm/%s %v after the client closed", shm.Key(), defaultTimeout)
		}
	}
	// The log line can trail the unmap (the daemon unmaps, then logs, and
	// its output reaches the test through a pipe), so wait for it too.
	const cleanup = "shared memory unregistered: connection closed"
	for deadline := time.Now().Add(defaultTimeout); !strings.Contains(d.logs.String(), cleanup); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the daemon did not log the cleanup within %v:\n%s", defaultTimeout, d.logs.String())
		}
	}
}
