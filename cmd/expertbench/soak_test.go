package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/internal/testdaemon"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/service"
)

// soakTestTokens is the token limit of the soak tests' servers, so that
// the over-limit malformed kind stays small.
const soakTestTokens = 64

func startSoakServer(t *testing.T) string {
	t.Helper()
	srv, err := testdaemon.Serve(service.Config{MaxConcurrent: 2, MaxTokens: soakTestTokens})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	return srv.Addr
}

// soakArgs are a small, quick soak: sets scaled to K=64, N=32.
func soakArgs(addr string, extra ...string) []string {
	return append([]string{"-addr", addr, "-soak", "-k", "64", "-n", "32", "-m", "12", "-c", "4",
		"-duration", "1500ms", "-progress", "500ms", "-bad-share", "0.3", "-seed", fmt.Sprint(time.Now().UnixNano())}, extra...)
}

// TestSoak runs a short soak against a healthy in-process server: it must
// pass, with good and malformed calls, every good response checked, and
// malformed calls answered with their expected codes only.
func TestSoak(t *testing.T) {
	addr := startSoakServer(t)
	stdout, stderr, err := runBench(t, soakArgs(addr, "-json")...)
	if err != nil {
		t.Fatalf("run: %v\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
	}
	var r soakResult
	if err := json.Unmarshal([]byte(stdout), &r); err != nil {
		t.Fatalf("parsing the JSON summary: %v\n%s", err, stdout)
	}
	t.Logf("%d calls, %d good, %d malformed, expected %v", r.Calls, r.Good, r.Malformed, r.Expected)
	if r.Good == 0 || r.Malformed == 0 || r.Checked != r.Expected["good:OK"] || r.Wrong != 0 || len(r.Unexpected) != 0 || len(r.Sets) != 3 {
		t.Errorf("summary %+v: want good and malformed calls, every OK checked, nothing wrong or unexpected, 3 sets", r)
	}
	for _, code := range []string{"malformed:InvalidArgument", "malformed:NotFound", "good:OK"} {
		if r.Expected[code] == 0 {
			t.Errorf("no %s among the expected outcomes %v", code, r.Expected)
		}
	}
	if r.WorstRelL2 <= 0 || r.WorstRelL2 > 2e-2 {
		t.Errorf("worst relative L2 %g, want in (0, 2e-2]", r.WorstRelL2)
	}
	if !strings.Contains(stderr, "malformed") || !strings.Contains(stderr, "loaded 3 sets") {
		t.Errorf("stderr lacks the load and progress lines:\n%s", stderr)
	}
	c, err := client.Dial(context.Background(), addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if sets, err := c.ListExperts(context.Background()); err != nil || len(sets) != 0 {
		t.Errorf("after the soak ListExperts = %v, %v; want the sets unloaded", sets, err)
	}
}

// TestMalformedKinds sends every kind of malformed request once, on every
// set it applies to, and checks the server's code: the soak counts any
// other as unexpected, so a kind whose expectation is wrong would fail
// every soak.
func TestMalformedKinds(t *testing.T) {
	addr := startSoakServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	c, err := client.Dial(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	pool := testPool(t, ctx, c)
	for _, kind := range malformedKinds {
		t.Run(kind.name, func(t *testing.T) {
			tried := 0
			for _, e := range pool {
				if kind.applies != nil && !kind.applies(e, soakTestTokens) {
					continue
				}
				tried++
				_, err := c.RPC().FusedMoE(ctx, breakRequest(&kind, e, soakTestTokens))
				if got := status.Code(err); got != kind.want || status.Convert(err).Message() == "" {
					t.Errorf("%s (M=%d): %v, want %v with a message", e.setName, e.req.M(), err, kind.want)
				}
			}
			if tried == 0 {
				t.Errorf("applies to no set")
			}
		})
	}
	// The good requests the kinds start from must themselves pass.
	for _, e := range pool {
		if _, err := c.RPC().FusedMoE(ctx, e.wire); err != nil {
			t.Errorf("good request on %s (M=%d): %v", e.setName, e.req.M(), err)
		}
	}
}

// testPool loads the soak sets (scaled down) and returns one request of
// M=5 on each.
func testPool(t *testing.T, ctx context.Context, c *client.Client) []*poolEntry {
	t.Helper()
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
	var pool []*poolEntry
	for _, ss := range soakSets("t", 64, 32) {
		set, _ := kerneltest.NewCase(rng, ss.shape, 1, ss.opts...)
		e := newSoakEntry(rng, ss, set, 5)
		if _, err := c.LoadExperts(ctx, ss.name, clienttest.Weights(e.set)); err != nil {
			t.Fatal(err)
		}
		pool = append(pool, e)
	}
	return pool
}

// corruptBackend is the CPU backend with every output's second half zeroed,
// a server that answers wrongly.
type corruptBackend struct{ kernels.Backend }

func (b corruptBackend) FusedMoE(ctx context.Context, l kernels.Loaded, req *moe.Request) (*moe.Result, error) {
	res, err := b.Backend.FusedMoE(ctx, l, req)
	if err == nil {
		clear(res.Output[len(res.Output)/2:])
	}
	return res, err
}

// TestSoakCatchesWrongAnswers: against a server that returns wrong numbers
// the soak must fail, say so, and count the wrong answers.
func TestSoakCatchesWrongAnswers(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	backend := corruptBackend{cpu.New(kernels.Config{})}
	svc := service.New(service.Config{MaxConcurrent: 2, MaxTokens: soakTestTokens}, backend, nil)
	gs := grpc.NewServer()
	svc.Register(gs)
	go gs.Serve(lis) //nolint:errcheck // returns when stopped
	t.Cleanup(gs.Stop)

	stdout, stderr, err := runBench(t, soakArgs(lis.Addr().String(), "-duration", "500ms")...)
	if !errors.Is(err, errSoakFailed) || !strings.Contains(err.Error(), "wrong answers") {
		t.Fatalf("run = %v, want a soak failure for wrong answers\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
	}
	if !strings.Contains(stdout, "verdict      FAIL") || strings.Contains(stdout, " 0 wrong") {
		t.Errorf("summary does not report the wrong answers:\n%s", stdout)
	}
}

// fakeMetrics serves /metrics whose RSS and goroutine count grow by the
// given steps on every scrape; from the failAfter-th scrape on (when > 0)
// it answers 500.
func fakeMetrics(t *testing.T, rssStep int64, goroutineStep int, failAfter int64) string {
	t.Helper()
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		i := n.Add(1)
		if failAfter > 0 && i >= failAfter {
			http.Error(w, "broken", http.StatusInternalServerError)
			return
		}
		fmt.Fprintf(w, "# HELP go_goroutines Number of goroutines.\n# TYPE go_goroutines gauge\ngo_goroutines %d\n", 20+int(i)*goroutineStep)
		fmt.Fprintf(w, "go_memstats_heap_inuse_bytes %d\n", 8<<20+i*rssStep/2)
		fmt.Fprintf(w, "process_resident_memory_bytes %.6e\n", float64(40<<20+i*rssStep))
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// TestSoakServerGrowth: server figures are reported, and growth over the
// thresholds fails the run.
func TestSoakServerGrowth(t *testing.T) {
	addr := startSoakServer(t)
	defer func(d time.Duration) { settleTimeout = d }(settleTimeout)
	settleTimeout = 500 * time.Millisecond
	tests := []struct {
		name          string
		rssStep       int64
		goroutineStep int
		failAfter     int64
		wantErr       string
	}{
		{"steady", 0, 0, 0, ""},
		{"rss", 100 << 20, 0, 0, "server RSS grew"},
		{"goroutines", 0, 10, 0, "server goroutines"},
		{"metrics fail during the load", 0, 0, 3, "scrapes of the daemon's metrics failed"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			admin := fakeMetrics(t, tc.rssStep, tc.goroutineStep, tc.failAfter)
			stdout, stderr, err := runBench(t, soakArgs(addr, "-duration", "1s", "-progress", "200ms", "-admin-addr", admin, "-max-rss-growth-mib", "64")...)
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("run: %v\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
				}
				if !strings.Contains(stdout, "goroutines   20 idle before, 20 idle after") || !strings.Contains(stdout, "growth +0.0 MiB") {
					t.Errorf("summary lacks the server figures:\n%s", stdout)
				}
				return
			}
			if !errors.Is(err, errSoakFailed) || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("run = %v, want a soak failure containing %q\nstdout:\n%s", err, tc.wantErr, stdout)
			}
		})
	}
}

func TestParseStats(t *testing.T) {
	tests := []struct {
		name, text string
		want       serverStats
		wantErr    string
	}{
		{"all", "go_goroutines 12\nprocess_resident_memory_bytes 4.5e+07\ngo_memstats_heap_inuse_bytes 1048576\n",
			serverStats{Goroutines: 12, RSS: 45000000, HeapInuse: 1 << 20}, ""},
		{"labelled series ignored", "go_goroutines{x=\"1\"} 99\ngo_goroutines 3\nprocess_resident_memory_bytes 1\ngo_memstats_heap_inuse_bytes 2\n",
			serverStats{Goroutines: 3, RSS: 1, HeapInuse: 2}, ""},
		{"missing", "go_goroutines 12\n", serverStats{}, "lack process_resident_memory_bytes"},
		{"not a number", "go_goroutines x\n", serverStats{}, `"x" is not a number`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseStats(strings.NewReader(tc.text))
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Errorf("parseStats = %v, want an error containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Errorf("parseStats = %+v, %v; want %+v", got, err, tc.want)
			}
		})
	}
}
