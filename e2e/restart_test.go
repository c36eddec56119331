package e2e

import (
	"context"
	"encoding/json"
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
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
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
	// inFlightAge is how long before the signal a call must have started
	// for the test to report it as in flight at the signal. It only
	// describes the run: which calls the daemon had admitted is read from
	// its own log (drainLog), since on a loaded machine a call can take
	// longer than any fixed age to reach the handler.
	inFlightAge = 10 * time.Millisecond
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
//   - SIGTERM drains: every call the daemon admitted before the signal
//     completes with the right numbers, and the daemon exits 0;
//   - no answer is lost: every call a daemon logs as OK reached its
//     caller (after SIGTERM exactly; SIGKILL may cut an answer between
//     the daemon's log line and the wire).
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
	var reqs []*moe.Request
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

	d2 := startDaemon(t, flags...)
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

	// Stop the second daemon so that its log is complete, then hold what
	// the callers saw against what the daemons say they did.
	d2.stop(t)
	counts := map[string]int{}
	inFlight, inFlightOK := 0, 0
	for _, o := range outcomes {
		kind := o.code.String()
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
		if o.start.Before(signalled.Add(-inFlightAge)) && o.end.After(signalled) {
			inFlight++
			if o.err == nil {
				inFlightOK++
			}
		}
	}
	t.Logf("%d calls: %v; %d in flight for over %v at the signal, %d of them succeeded", len(outcomes), counts, inFlight, inFlightAge, inFlightOK)
	if counts[codes.Unavailable.String()] == 0 {
		t.Errorf("no call saw Unavailable: the daemon was never observed down")
	}

	first, second := drainLog(t, d.logs.String()), drainLog(t, d2.logs.String())
	served := first.ok + second.ok
	t.Logf("the daemons logged %d FusedMoE calls OK (%d before the restart, %d of them during the drain); the callers got %d",
		served, first.ok, first.drained, counts[codes.OK.String()])
	if got := counts[codes.OK.String()]; got > served || (sig == syscall.SIGTERM && got != served) {
		t.Errorf("callers got %d OK answers, the daemons logged %d: answers were lost (or invented)", got, served)
	}
	if sig == syscall.SIGTERM {
		// Between "draining" and the exit, the first daemon may only finish
		// what it had admitted (OK) and refuse the rest (Unavailable).
		for code, n := range first.afterDrain {
			if code != codes.OK.String() && code != codes.Unavailable.String() {
				t.Errorf("during the drain the daemon ended %d FusedMoE calls with %s, want OK or Unavailable", n, code)
			}
		}
		if first.drained == 0 {
			t.Errorf("the daemon finished no admitted call during the drain: the test did not exercise it")
		}
		if logs := d.logs.String(); strings.Contains(logs, "still running at the drain deadline") {
			t.Errorf("the drain hit its deadline:\n%s", logs)
		}
	}
}

// callLog is what a daemon's JSON log says of its FusedMoE calls.
type callLog struct {
	// ok counts the calls it finished with OK.
	ok int
	// afterDrain counts the calls it finished after logging "draining",
	// by code; drained is afterDrain's OK.
	afterDrain map[string]int
	drained    int
}

// drainLog reads the "finished call" lines the logging middleware writes
// for FusedMoE. The middleware logs a call when its handler returns, before
// the answer is sent, so a daemon that stopped cleanly has logged every
// call it answered.
func drainLog(t *testing.T, logs string) callLog {
	t.Helper()
	l := callLog{afterDrain: map[string]int{}}
	draining := false
	for line := range strings.Lines(logs) {
		var rec struct {
			Msg    string `json:"msg"`
			Method string `json:"grpc.method"`
			Code   string `json:"grpc.code"`
		}
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("daemon log line is not JSON: %v: %q", err, line)
		}
		switch {
		case rec.Msg == "draining":
			draining = true
		case rec.Msg == "finished call" && rec.Method == "FusedMoE":
			if rec.Code == codes.OK.String() {
				l.ok++
			}
			if draining {
				l.afterDrain[rec.Code]++
			}
		}
	}
	l.drained = l.afterDrain[codes.OK.String()]
	return l
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
