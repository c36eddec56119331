//go:build linux

package cuda

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
)

// A lane on the GPU, rung from another process as a caller's stream would
// ring it, with copies instead of stream operations: the daemon's side of
// the protocol (the stream waits, the graph with its gate, the launcher
// thread, closing) against the set's own results.

// TestLaneHelperProcess is not a test: TestLaneOnDevice runs the test
// binary again with EXPERTD_LANE_HELPER set to the lane's flags handle (in
// hex). It maps the flags and, for each line on its stdin, makes one call
// (done = 0, doorbell = 1, wait for done) and prints "rang" or "timeout".
func TestLaneHelperProcess(t *testing.T) {
	h, err := hex.DecodeString(os.Getenv("EXPERTD_LANE_HELPER"))
	if err != nil || len(h) != IPCHandleBytes {
		t.Skip("helper process for TestLaneOnDevice")
	}
	b := gpuBackend(t)
	r, err := b.OpenIPC(h, 0, laneFlagsBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	put := func(off int, v uint32) {
		src := binary.LittleEndian.AppendUint32(nil, v)
		if err := b.call("copy", func() int32 {
			return b.lib.copyMem(int32(b.device), uint64(r.Ptr())+uint64(off), uint64(uintptr(unsafe.Pointer(&src[0]))), 4)
		}); err != nil {
			t.Fatal(err)
		}
	}
	get := func(off int) uint32 {
		dst := make([]byte, 4)
		if err := b.call("copy", func() int32 {
			return b.lib.copyMem(int32(b.device), uint64(uintptr(unsafe.Pointer(&dst[0]))), uint64(r.Ptr())+uint64(off), 4)
		}); err != nil {
			t.Fatal(err)
		}
		return binary.LittleEndian.Uint32(dst)
	}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		put(laneDone, 0)
		put(laneDoorbell, 1)
		deadline, answer := time.Now().Add(20*time.Second), "rang"
		for get(laneDone) != 1 {
			if time.Now().After(deadline) {
				answer = "timeout"
				break
			}
		}
		fmt.Println(answer)
	}
}

// TestLaneOnDevice opens a lane on device buffers, rings it from another
// process with three hidden states in turn and checks each output equals
// the set's own call's, bit for bit; then closes it with calls still
// enqueued.
func TestLaneOnDevice(t *testing.T) {
	b, l, req, want := sharedCall(t)
	hb, lb, ob := int64(len(req.Hidden.Data)), int64(len(req.Logits.Data)), int64(len(want.Output))
	d, lane, err := laneOnDevice(b, l, req, ob, 4)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free()
	closed := false
	defer func() {
		if !closed {
			lane.Close()
		}
	}()
	t.Logf("lane: MPS %v, skips on close %v", lane.MPS(), lane.SkipsOnClose())

	cmd := exec.Command(os.Args[0], "-test.run", "^TestLaneHelperProcess$", "-test.v")
	cmd.Env = append(os.Environ(), "EXPERTD_LANE_HELPER="+hex.EncodeToString(lane.Flags().Handle))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { stdin.Close(); cmd.Wait() }()
	answers := bufio.NewScanner(stdout)
	ring := func() {
		t.Helper()
		fmt.Fprintln(stdin, "ring")
		for answers.Scan() {
			switch a := answers.Text(); {
			case a == "rang":
				return
			case a == "timeout" || strings.HasPrefix(a, "--- FAIL"):
				t.Fatalf("helper: %s\n%s", a, stderr.String())
			}
		}
		t.Fatalf("helper ended: %v\n%s", answers.Err(), stderr.String())
	}
	got := make([]byte, ob)
	cases := []struct{ hidden, want []byte }{{req.Hidden.Data, want.Output}}
	for range 2 {
		_, other := sharedCase(uint64(len(cases)) + 100)
		oreq := *req
		oreq.Hidden = other.Hidden
		res, err := b.FusedMoE(t.Context(), l, &oreq)
		if err != nil {
			t.Fatal(err)
		}
		cases = append(cases, struct{ hidden, want []byte }{other.Hidden.Data, res.Output})
	}
	for i, c := range cases {
		if err := d.CopyIn(0, c.hidden); err != nil {
			t.Fatal(err)
		}
		kerneltest.Poison(got)
		if err := d.CopyIn(hb+lb, got); err != nil {
			t.Fatal(err)
		}
		ring()
		if err := d.CopyOut(got, hb+lb); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, c.want) {
			t.Errorf("call %d: the lane's output differs from the set's own call's", i)
		}
	}
	// The launcher counts a call when it wakes for the call's event, which
	// may come after the caller saw done.
	for deadline := time.Now().Add(10 * time.Second); lane.Served() < uint64(len(cases)) && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	if n := lane.Served(); n != uint64(len(cases)) {
		t.Errorf("Served = %d, want %d", n, len(cases))
	}
	// Closing releases the calls still enqueued (four) and returns.
	done := make(chan error, 1)
	go func() { done <- lane.Close() }()
	select {
	case err := <-done:
		closed = true
		if err != nil {
			t.Errorf("Close: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Close did not return: the enqueued calls were not released")
	}
	if lane.SkipsOnClose() {
		// Released calls skip the work: the output is the last call's.
		if err := d.CopyOut(got, hb+lb); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, cases[len(cases)-1].want) {
			t.Error("closing the lane changed the output: the released calls ran")
		}
	}
}

// laneOnDevice puts req's hidden states, logits and an output of outBytes
// in one device buffer ([hidden | logits | out], the caller's to free once
// the lane is closed), the logits copied in, and opens a lane of depth on
// them.
func laneOnDevice(b *Backend, l kernels.Loaded, req *moe.Request, outBytes int64, depth int) (*DeviceBuffer, kernels.Lane, error) {
	if len(req.HiddenScale) > 0 {
		return nil, nil, errors.New("the request has hidden scales, which a lane refuses")
	}
	hb, lb := int64(len(req.Hidden.Data)), int64(len(req.Logits.Data))
	d, err := b.AllocDevice(hb + lb + outBytes)
	if err != nil {
		return nil, nil, err
	}
	if err := d.CopyIn(hb, req.Logits.Data); err != nil {
		d.Free()
		return nil, nil, err
	}
	dreq := *req
	dreq.Hidden.Data, dreq.Hidden.Dev = nil, d.Ptr()
	dreq.Logits.Data, dreq.Logits.Dev = nil, d.Ptr()+uintptr(hb)
	dreq.OutDev = d.Ptr() + uintptr(hb+lb)
	lane, err := b.OpenLane(l, &dreq, depth)
	if err != nil {
		d.Free()
		return nil, nil, fmt.Errorf("OpenLane: %w", err)
	}
	return d, lane, nil
}

// TestLaneWaitingBlocksNothing opens a lane and leaves it waiting (nobody
// rings it: its stream holds stream memory waits), then takes every other
// path of the backend that allocates or frees, each under a limit that
// names the step that hangs: a CUDA call that synchronizes the device
// would wait for the lane's stream forever.
func TestLaneWaitingBlocksNothing(t *testing.T) {
	b, l, req, want := sharedCall(t)
	ctx := t.Context()
	d, lane, err := laneOnDevice(b, l, req, int64(len(want.Output)), 2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Free() })
	// Runs before the set's cleanup and the buffer's: a step that hung
	// resumes once the lane closes.
	var once sync.Once
	closeLane := func() (err error) {
		once.Do(func() { err = lane.Close() })
		return err
	}
	t.Cleanup(func() { closeLane() })
	within := func(step string, f func() error) {
		t.Helper()
		done := make(chan error, 1)
		go func() { done <- f() }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("%s: %v", step, err)
			}
		case <-time.After(60 * time.Second):
			t.Fatalf("HUNG: %s did not return in 60 s with a lane open and waiting", step)
		}
	}

	// The same set at eight times the tokens: its stream's workspace and
	// pinned staging grow, freeing the old ones.
	big := *req
	big.Hidden.Shape = []int{8 * req.M(), req.Hidden.Shape[1]}
	big.Hidden.Data = bytes.Repeat(req.Hidden.Data, 8)
	big.Logits.Shape = []int{8 * req.M(), req.Logits.Shape[1]}
	big.Logits.Data = bytes.Repeat(req.Logits.Data, 8)
	within("a call of a new, larger M", func() error {
		_, err := b.FusedMoE(ctx, l, &big)
		return err
	})

	set2, req2 := sharedCase(rand.Uint64())
	var l2 kernels.Loaded
	within("loading a second set", func() (err error) {
		l2, err = b.Load(ctx, set2)
		return err
	})
	within("a call on the second set", func() error {
		_, err := b.FusedMoE(ctx, l2, req2)
		return err
	})
	within("unloading the second set", func() error { return l2.Close() })

	mem, err := syscall.Mmap(-1, 0, 1<<20, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(mem)
	var unpin func() error
	within("pinning host memory", func() (err error) {
		unpin, err = b.PinHost(mem)
		return err
	})
	within("unpinning it", func() error { return unpin() })

	var d2 *DeviceBuffer
	var lane2 kernels.Lane
	within("opening a second lane", func() (err error) {
		d2, lane2, err = laneOnDevice(b, l, req, int64(len(want.Output)), 2)
		return err
	})
	within("closing the second lane", func() error { return lane2.Close() })
	within("freeing the second lane's device buffer", func() error { return d2.Free() })
	within("closing the waiting lane", closeLane)
}
