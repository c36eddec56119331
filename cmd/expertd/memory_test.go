package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// heldBytes is the heap memory the process holds from the OS: in use plus
// free but not yet returned.
func heldBytes() uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapInuse + ms.HeapIdle - ms.HeapReleased
}

// rssBytes is the process's resident set, 0 where /proc is missing.
func rssBytes() uint64 {
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		return 0
	}
	var size, rss uint64
	fmt.Sscan(string(b), &size, &rss)
	return rss * uint64(os.Getpagesize())
}

// TestIdleMemoryReturned is the issue 14 flood at a smaller scale: 16
// FusedMoEStreams of 6 calls of 256 KiB hidden states and outputs. Once
// the daemon has been idle for -idle-free-memory, the heap it holds from
// the OS is back near where it started (without the reclaim, the pooled
// buffers stay live until the runtime's next forced collection, minutes
// later). It logs the figures README's limits section quotes.
func TestIdleMemoryReturned(t *testing.T) {
	const idle = 300 * time.Millisecond
	addr, _ := startDaemon(t, "-idle-free-memory", idle.String(), "-max-queued", "256")
	conn := dial(t, addr, insecure.NewCredentials(), grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))
	c := pb.NewExpertServiceClient(conn)
	// The burst takes a while under the race detector on a small machine.
	ctx, cancel := context.WithTimeout(context.Background(), 3*defaultTestTimeout)
	defer cancel()
	runtime.GC()
	runtime.GC()
	baseHeld, baseRSS := heldBytes(), rssBytes()

	// 256 KiB of FP32 hidden states and output per call; N = 1 and top_k
	// 1 keep the compute small (it is the bytes that matter), also under
	// the race detector.
	const streams, perStream, e, k, n, m = 16, 6, 4, 32, 1, 2048
	rng := rand.New(rand.NewPCG(1, 2))
	req := inlineRequest(rng)
	fp8 := pb.DataType_DATA_TYPE_FLOAT8_E4M3FN
	req.GetWeights().W13 = tensor(fp8, randFP8(rng, e*n*k), e, n, k)
	req.GetWeights().W2 = tensor(fp8, randFP8(rng, e*k*n), e, k, n)
	req.Routing = &pb.Routing{TopK: 1}
	req.HiddenStates = tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(randF32(rng, m*k)...), m, k)
	req.RouterLogits = tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(randF32(rng, m*e)...), m, e)
	req.OutputDtype = pb.DataType_DATA_TYPE_FLOAT32
	var wg sync.WaitGroup
	errs := make(chan error, streams)
	for range streams {
		wg.Go(func() {
			s, err := c.FusedMoEStream(ctx)
			if err != nil {
				errs <- err
				return
			}
			for range perStream {
				if err := s.Send(req); err != nil {
					_, err = s.Recv() // the status that ended the stream
					errs <- err
					return
				}
			}
			s.CloseSend()
			for range perStream {
				if _, err := s.Recv(); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("burst: %v", err)
	}
	burstHeld, burstRSS := heldBytes(), rssBytes()
	time.Sleep(idle*5/4 + 700*time.Millisecond)
	idleHeld, idleRSS := heldBytes(), rssBytes()
	t.Logf("heap held from the OS: %d MiB before, %d MiB after the burst, %d MiB %v later; RSS %d, %d, %d MiB",
		baseHeld>>20, burstHeld>>20, idleHeld>>20, idle*5/4+700*time.Millisecond, baseRSS>>20, burstRSS>>20, idleRSS>>20)
	if idleHeld > baseHeld+16<<20 {
		t.Errorf("idle for %v, the process holds %d MiB of heap, %d MiB more than before the burst", idle, idleHeld>>20, (idleHeld-baseHeld)>>20)
	}
}
