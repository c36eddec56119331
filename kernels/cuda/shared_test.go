//go:build linux

package cuda

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"unsafe"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
)

// Memory from other places than Go's heap: device memory another process
// exported (CUDA IPC), page-locked host memory, and many calls on one set
// at once (the library's streams). Each result must equal, bit for bit,
// the same call's result from Go memory on one stream: the kernels are the
// same, only where the bytes come from and go to differs.

// sharedCase is a Nemotron-like case big enough to take several blocks.
func sharedCase(seed uint64) (*moe.ExpertSet, *moe.Request) {
	return kerneltest.NewCase(rand.New(rand.NewPCG(seed, 7)), kerneltest.Nemotron.Scaled(256, 128), 37)
}

// sharedCall loads a fresh sharedCase and runs its request from Go memory:
// the result the other memories must reproduce.
func sharedCall(t *testing.T) (*Backend, kernels.Loaded, *moe.Request, *moe.Result) {
	t.Helper()
	b := gpuBackend(t)
	set, req := sharedCase(rand.Uint64())
	l := mustLoad(t, b, set)
	want, err := b.FusedMoE(context.Background(), l, req)
	if err != nil {
		t.Fatal(err)
	}
	return b, l, req, want
}

// TestIPCHelperProcess is not a test: TestCUDAIPC runs the test binary
// again with EXPERTD_IPC_HELPER=bytes to play the other process. It
// allocates that many device bytes, prints their IPC handle in hex and
// holds them until its stdin closes.
func TestIPCHelperProcess(t *testing.T) {
	n, err := strconv.ParseInt(os.Getenv("EXPERTD_IPC_HELPER"), 10, 64)
	if err != nil {
		t.Skip("helper process for TestCUDAIPC")
	}
	b := gpuBackend(t)
	d, err := b.AllocDevice(n)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free()
	h, err := d.IPCHandle()
	if err != nil {
		t.Fatal(err)
	}
	fmt.Printf("handle %s\n", hex.EncodeToString(h))
	bufio.NewReader(os.Stdin).ReadString('\n') // until the parent is done
}

// ipcPeer starts the helper process with n device bytes and returns their
// handle and a function that ends the process.
func ipcPeer(t *testing.T, n int64) ([]byte, func()) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run", "^TestIPCHelperProcess$", "-test.v")
	cmd.Env = append(os.Environ(), fmt.Sprintf("EXPERTD_IPC_HELPER=%d", n))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stdout bytes.Buffer
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = pw, &stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pw.Close()
	sc := bufio.NewScanner(pr)
	var h []byte
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "handle "); ok {
			h, err = hex.DecodeString(v)
			break
		}
	}
	if h == nil || err != nil {
		stdin.Close()
		cmd.Wait()
		t.Fatalf("helper process gave no handle (%v); stderr:\n%s", err, stdout.String())
	}
	go func() {
		for sc.Scan() {
		}
	}()
	return h, func() { stdin.Close(); cmd.Wait(); pr.Close() }
}

// TestCUDAIPC runs a call whose hidden states, logits and output all live
// in device memory another process exported.
func TestCUDAIPC(t *testing.T) {
	b, l, req, want := sharedCall(t)
	ctx := context.Background()

	hb, lb := int64(len(req.Hidden.Data)), int64(len(req.Logits.Data))
	ob := int64(len(want.Output))
	const off = 4096                 // a region that does not start its allocation
	total := off + hb + lb + ob + hb // the last hb: other hidden states
	handle, done := ipcPeer(t, total)
	defer done()

	if _, err := b.OpenIPC(handle, 0, total+1); err == nil || !strings.Contains(err.Error(), "runs past the end") {
		t.Errorf("OpenIPC one byte too long: %v, want a bounds error", err)
	}
	if _, err := b.OpenIPC(handle[:10], 0, 1); err == nil {
		t.Error("OpenIPC with a 10-byte handle succeeded")
	}
	r, err := b.OpenIPC(handle, off, total-off)
	if err != nil {
		t.Fatalf("OpenIPC: %v", err)
	}
	r2, err := b.OpenIPC(handle, 0, total) // a second open shares the mapping
	if err != nil {
		t.Fatalf("second OpenIPC: %v", err)
	}
	if r2.Ptr()+off != r.Ptr() {
		t.Errorf("second open at 0x%x, first at 0x%x (offset %d): want one mapping", r2.Ptr(), r.Ptr(), off)
	}
	if err := r2.Close(); err != nil {
		t.Fatalf("closing the second open: %v", err)
	}
	defer r.Close()

	put := func(at uintptr, src []byte) {
		if err := b.call("copy", func() int32 {
			return b.lib.copyMem(int32(b.device), uint64(at), uint64(uintptr(unsafe.Pointer(&src[0]))), uint64(len(src)))
		}); err != nil {
			t.Fatal(err)
		}
	}
	put(r.Ptr(), req.Hidden.Data)
	put(r.Ptr()+uintptr(hb), req.Logits.Data)
	dreq := *req
	dreq.Hidden.Data, dreq.Hidden.Dev = nil, r.Ptr()
	dreq.Logits.Data, dreq.Logits.Dev = nil, r.Ptr()+uintptr(hb)
	dreq.OutDev = r.Ptr() + uintptr(hb+lb)
	// Device tensors are read in place and their addresses key the graph:
	// other hidden states at another address must not replay the first
	// address's graph, and going back must replay it.
	_, other := sharedCase(rand.Uint64())
	oreq := *req
	oreq.Hidden = other.Hidden
	wantOther, err := b.FusedMoE(ctx, l, &oreq)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(wantOther.Output, want.Output) {
		t.Fatal("the two hidden states give one output; the address check would prove nothing")
	}
	put(r.Ptr()+uintptr(hb+lb+ob), other.Hidden.Data)
	dother := dreq
	dother.Hidden.Dev = r.Ptr() + uintptr(hb+lb+ob)
	for i, tc := range []struct {
		req  *moe.Request
		want *moe.Result
	}{{&dreq, want}, {&dreq, want}, {&dreq, want}, {&dother, wantOther}, {&dother, wantOther}, {&dother, wantOther}, {&dreq, want}} {
		// The third call of each address replays a graph.
		res, err := b.FusedMoE(ctx, l, tc.req)
		if err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		if res.Output != nil {
			t.Errorf("call %d: Output has %d bytes with OutDev set, want nil", i, len(res.Output))
		}
		got := make([]byte, ob)
		kerneltest.Poison(got)
		if err := b.call("copy", func() int32 {
			return b.lib.copyMem(int32(b.device), uint64(uintptr(unsafe.Pointer(&got[0]))), uint64(dreq.OutDev), uint64(ob))
		}); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, tc.want.Output) {
			t.Errorf("call %d: output through CUDA IPC differs from the host call's", i)
		}
		if !slices.Equal(res.TopKIDs, tc.want.TopKIDs) || !slices.Equal(res.TopKWeights, tc.want.TopKWeights) {
			t.Errorf("call %d: routing through CUDA IPC differs from the host call's", i)
		}
	}
}

// TestPinnedHost runs calls whose input and output live in page-locked
// mmap'ed memory, as a registered POSIX shared-memory region does.
func TestPinnedHost(t *testing.T) {
	b, l, req, want := sharedCall(t)
	ctx := context.Background()
	hb, ob := len(req.Hidden.Data), len(want.Output)
	mem, err := syscall.Mmap(-1, 0, hb+ob, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(mem)
	unpin, err := b.PinHost(mem)
	if err != nil {
		t.Fatalf("PinHost: %v", err)
	}
	copy(mem, req.Hidden.Data)
	preq := *req
	preq.Hidden.Data = mem[:hb:hb]
	preq.Out = mem[hb:]
	for call := range 3 {
		kerneltest.Poison(preq.Out)
		if _, err := b.FusedMoE(ctx, l, &preq); err != nil {
			t.Fatalf("call %d: %v", call, err)
		}
		if !bytes.Equal(preq.Out, want.Output) {
			t.Errorf("call %d: output through pinned memory differs from the Go-memory call's", call)
		}
	}
	if err := unpin(); err != nil {
		t.Errorf("unpin: %v", err)
	}
	if err := unpin(); err == nil {
		t.Error("a second unpin succeeded")
	}
}

// TestConcurrentCallsOnOneSet runs different requests on one set from many
// goroutines: with several streams per set, each call's lane (workspace,
// staging, graphs) must be its own.
func TestConcurrentCallsOnOneSet(t *testing.T) {
	b := gpuBackend(t)
	ctx := context.Background()
	set, _ := sharedCase(1)
	l := mustLoad(t, b, set)
	const n = 8
	reqs := make([]*moe.Request, n)
	wants := make([][]byte, n)
	for i := range reqs {
		_, reqs[i] = kerneltest.NewCase(rand.New(rand.NewPCG(1, 7)), kerneltest.Nemotron.Scaled(256, 128), 5+9*i)
		// Same weights (seed 1), different tokens: fresh hidden states.
		rng := rand.New(rand.NewPCG(rand.Uint64(), uint64(i)))
		for j := range reqs[i].Hidden.Data {
			if j%2 == 1 { // BF16 high bytes: keep them finite and moderate
				reqs[i].Hidden.Data[j] = byte(0x3c + rng.IntN(4))
			}
		}
		res, err := b.FusedMoE(ctx, l, reqs[i])
		if err != nil {
			t.Fatal(err)
		}
		wants[i] = res.Output
	}
	var wg sync.WaitGroup
	errs := make(chan error, n*4)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for round := range 4 {
				res, err := b.FusedMoE(ctx, l, reqs[i])
				if err != nil {
					errs <- err
					return
				}
				if !bytes.Equal(res.Output, wants[i]) {
					errs <- fmt.Errorf("request %d (M=%d) round %d: output differs from its lone call's", i, reqs[i].M(), round)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestSharedMemoryFaults checks the errors before any GPU work.
func TestSharedMemoryFaults(t *testing.T) {
	lib, err := openLibrary(fakeLibrary(t))
	if err != nil {
		t.Fatal(err)
	}
	b := &Backend{lib: lib, info: "fake device", live: map[*loaded]struct{}{}}
	defer b.Close()
	if _, err := b.OpenIPC(make([]byte, 63), 0, 1); err == nil || !strings.Contains(err.Error(), "63 bytes, want 64") {
		t.Errorf("OpenIPC(63-byte handle) = %v, want a length error", err)
	}
	if _, err := b.OpenIPC(make([]byte, 64), -1, 1); err == nil {
		t.Error("OpenIPC at offset -1 succeeded")
	}
	if _, err := b.OpenIPC(make([]byte, 64), 0, 8); !errors.Is(err, kernels.ErrUnsupported) {
		t.Errorf("OpenIPC on a library without a GPU = %v, want kernels.ErrUnsupported", err)
	}
	if _, err := b.PinHost(make([]byte, 8)); !errors.Is(err, kernels.ErrUnsupported) {
		t.Errorf("PinHost on a library without a GPU = %v, want kernels.ErrUnsupported", err)
	}
	if _, err := b.AllocDevice(0); err == nil {
		t.Error("AllocDevice(0) succeeded")
	}
}
