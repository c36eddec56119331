package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/kerneltest"
)

// Sizes of the restart-under-load tests. Two execution slots and eight
// clients keep a queue of calls in the daemon (within its default bound of
// four queued calls per slot, so none is refused as busy), so that when
// the signal comes some calls have been admitted for a while: those are
// the ones a graceful drain must finish.
const (
	restartClients = 8
	// restartCallTimeout is every call's deadline; a call that takes
	// longer hung.
	restartCallTimeout = 5 * time.Second
	// admittedAge is how long before the signal a call must have started
	// for the test to count it as admitted by the server (past the
	// handler's drain check, waiting for or holding the slot). Younger
	// calls may still be on their way and be refused with Unavailable,
	// which is allowed.
	admittedAge = 10 * time.Millisecond
	// errorPause is how long a client waits after a failed call, as a
	// real caller would, instead of spinning while the daemon is down.
	errorPause = 10 * time.Millisecond
)

// outcome is one FusedMoE call as its caller saw it.
type outcome struct {
	client     int
	retries    bool
	start, end time.Time
	code       codes.Code
	err        error
	relErr     float64
}

// TestRestartUnderLoad stops the daemon in the middle of a load of
// concurrent SDK clients, starts it again on the same port, reloads the
// expert set, and checks what every caller saw. This is the contract
// docs/soak.md states for callers:
//
//   - a call either succeeds with the right numbers or fails with
//     Unavailable (the daemon is draining, gone or not yet back: retry,
//     as the SDK does on its own for up to about 2 s), or with NotFound
//     when it reached the restarted daemon before the set was reloaded
//     (sets live in memory: reload, then retry);
//   - no call hangs past its deadline, and none fails any other way;
//   - SIGTERM drains: every call admitted before the signal completes
//     with the right numbers, and the daemon exits 0;
//   - SIGKILL loses the calls in flight, which fail with Unavailable
//     (clients without retries see exactly that), never with wrong
//     numbers.
//
// Half the clients use the SDK's default retries, half none, so both
// kinds of caller are covered.
func TestRestartUnderLoad(t *testing.T) {
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGKILL} {
		t.Run(sig.String(), func(t *testing.T) { restartUnderLoad(t, sig) })
	}
}

func restartUnderLoad(t *testing.T, sig syscall.Signal) {
	addr := freePort(t)
	flags := []string{"-listen", addr, "-max-concurrent", "2", "-shutdown-timeout", "10s"}
	d := startDaemon(t, flags...)
	ctx := testContext(t)
	rng := newRand(t)

	// A gated layer big enough that a call takes milliseconds on the CPU
	// backend (so that the queue holds calls for a while), small enough
	// that its float64 reference is cheap under -race.
	s := kerneltest.Qwen3.Scaled(128, 64)
	s.E = 32
	set, _ := kerneltest.NewCase(rng, s, 1)
	var reqs []*kernels.Request
	var refs [][]float64
	for _, m := range []int{96, 40, 128, 64} {
		req := tokens(rng, s, m)
		want, _, _ := kerneltest.Reference(set, req)
		reqs, refs = append(reqs, req), append(refs, want)
	}
	load := func() time.Time {
		t.Helper()
		c, err := client.Dial(ctx, addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := c.LoadExperts(ctx, "m", clienttest.Weights(set)); err != nil {
			t.Fatalf("LoadExperts: %v", err)
		}
		return time.Now()
	}
	load()

	var (
		mu        sync.Mutex
		outcomes  []outcome
		stop      atomic.Bool
		wg        sync.WaitGroup
		succeeded atomic.Int64
	)
	for w := range restartClients {
		retries := w%2 == 0
		opts := []client.Option{}
		if !retries {
			opts = append(opts, client.WithMaxAttempts(1))
		}
		c, err := client.Dial(ctx, addr, opts...)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		wrng := rand.New(rand.NewPCG(rng.Uint64(), uint64(w)))
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				i := wrng.IntN(len(reqs))
				callCtx, cancel := context.WithTimeout(ctx, restartCallTimeout)
				o := outcome{client: w, retries: retries, start: time.Now()}
				res, err := c.FusedMoE(callCtx, clienttest.Request("m", set, reqs[i]))
				o.end = time.Now()
				cancel()
				o.code, o.err = status.Code(err), err
				if err == nil {
					got, derr := res.Output.Float32s()
					if derr != nil {
						o.code, o.err = codes.DataLoss, derr
					}
					o.relErr = kerneltest.RelL2(got, refs[i])
					succeeded.Add(1)
				}
				mu.Lock()
				outcomes = append(outcomes, o)
				mu.Unlock()
				if err != nil {
					time.Sleep(errorPause)
				}
			}
		}()
	}

	// Let every client get going, then signal.
	for deadline := time.Now().Add(10 * time.Second); succeeded.Load() < 4*restartClients; {
		if time.Now().After(deadline) {
			stop.Store(true)
			wg.Wait()
			t.Fatalf("only %d calls succeeded in 10s before the signal", succeeded.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	mu.Lock()
	var lat []time.Duration
	for _, o := range outcomes {
		lat = append(lat, o.end.Sub(o.start))
	}
	mu.Unlock()
	slices.Sort(lat)
	t.Logf("call latency before the signal: median %v, max %v", lat[len(lat)/2].Round(time.Millisecond), lat[len(lat)-1].Round(time.Millisecond))
	signalled := time.Now()
	d.signal(t, sig)
	t.Logf("%v sent after %d successful calls; the daemon was gone %v later", sig, succeeded.Load(), time.Since(signalled).Round(time.Millisecond))

	startDaemon(t, flags...)
	restarted := time.Now()
	reloaded := load()
	t.Logf("restarted %v and reloaded %v after the signal", restarted.Sub(signalled).Round(time.Millisecond), reloaded.Sub(signalled).Round(time.Millisecond))

	// Run until every client has succeeded again after the reload.
	recovered := func() bool {
		mu.Lock()
		defer mu.Unlock()
		back := map[int]bool{}
		for _, o := range outcomes {
			if o.err == nil && o.start.After(reloaded) {
				back[o.client] = true
			}
		}
		return len(back) == restartClients
	}
	deadline := time.Now().Add(10 * time.Second)
	for !recovered() && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	stop.Store(true)
	wg.Wait()
	if !recovered() {
		t.Errorf("not every client succeeded within 10s of the reload")
	}
	t.Logf("clients back %v after the reload", time.Since(reloaded).Round(time.Millisecond))

	counts := map[string]int{}
	admitted, admittedOK := 0, 0
	for _, o := range outcomes {
		kind := o.code.String()
		inFlight := o.start.Before(signalled.Add(-admittedAge)) && o.end.After(signalled)
		switch {
		case o.end.Sub(o.start) > restartCallTimeout+time.Second:
			t.Errorf("client %d: a call hung for %v (deadline %v): %v", o.client, o.end.Sub(o.start), restartCallTimeout, o.err)
		case o.err == nil && o.relErr > kerneltest.FP8Tol:
			kind = "wrong"
			t.Errorf("client %d: a call at %v succeeded with relative L2 error %.3g against the reference", o.client, o.start.Sub(signalled), o.relErr)
		case o.err == nil:
		case o.code == codes.Unavailable:
		case o.code == codes.NotFound && o.start.Before(reloaded) && o.end.After(signalled):
			// The call (or its last retry) reached the new daemon before
			// the reload.
		default:
			t.Errorf("client %d (retries %v): a call started %v after the signal failed with %v, want OK, Unavailable, or NotFound before the reload",
				o.client, o.retries, o.start.Sub(signalled), o.err)
		}
		counts[kind]++
		if inFlight {
			admitted++
			if o.err == nil {
				admittedOK++
			} else if sig == syscall.SIGTERM {
				t.Errorf("client %d: a call admitted %v before SIGTERM was lost: %v", o.client, signalled.Sub(o.start), o.err)
			} else if !o.retries && o.code != codes.Unavailable {
				t.Errorf("client %d (no retries): a call in flight at SIGKILL failed with %v, want Unavailable", o.client, o.err)
			}
		}
	}
	t.Logf("%d calls: %v; %d in flight for over %v at the signal, %d of them succeeded", len(outcomes), counts, admitted, admittedAge, admittedOK)
	if admitted == 0 {
		t.Errorf("no call was in flight for %v at the signal: the test did not exercise the drain", admittedAge)
	}
	if counts[codes.Unavailable.String()] == 0 {
		t.Errorf("no call saw Unavailable: the daemon was never observed down")
	}
	if sig == syscall.SIGTERM {
		if logs := d.logs.String(); strings.Contains(logs, "still running at the drain deadline") {
			t.Errorf("the drain hit its deadline:\n%s", logs)
		}
	}
}

// signal sends sig to the daemon and waits for it to exit. After SIGTERM it
// must have drained and exited 0; after any other signal it must have died
// of it.
func (d *daemon) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if sig == syscall.SIGTERM {
		d.stop(t)
		return
	}
	d.stopped.Do(func() {
		d.cmd.Process.Signal(sig) //nolint:errcheck // done says how it ended
		select {
		case err := <-d.done:
			if err == nil || !strings.Contains(err.Error(), fmt.Sprint(sig)) {
				t.Errorf("expertd ended with %v after %v, want the signal", err, sig)
			}
		case <-time.After(15 * time.Second):
			t.Errorf("expertd still running 15s after %v", sig)
		}
	})
}
