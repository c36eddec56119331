package e2e

import (
	"context"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

var (
	benchOnce sync.Once
	benchPath string
	benchErr  error
)

// benchBinary builds ./cmd/expertbench once per test binary, beside the
// daemon.
func benchBinary(t *testing.T) string {
	t.Helper()
	daemonBinary(t) // creates buildDir
	benchOnce.Do(func() {
		benchPath = filepath.Join(buildDir, "expertbench")
		ctx, cancel := context.WithTimeout(context.Background(), buildTimeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, "go", "build", "-o", benchPath, "./cmd/expertbench")
		cmd.Dir = repoRoot(t)
		if out, err := cmd.CombinedOutput(); err != nil {
			benchErr = err
			t.Logf("go build ./cmd/expertbench: %v\n%s", err, out)
		}
	})
	if benchErr != nil {
		t.Fatal(benchErr)
	}
	return benchPath
}

// soakSummary is the part of expertbench -soak -json the test reads.
type soakSummary struct {
	Calls      int            `json:"calls"`
	Good       int            `json:"good_calls"`
	Malformed  int            `json:"malformed_calls"`
	Checked    int            `json:"checked"`
	Wrong      int            `json:"wrong"`
	Expected   map[string]int `json:"expected_by_code"`
	Unexpected map[string]int `json:"unexpected_by_code"`
	Before     *struct {
		Goroutines int `json:"goroutines"`
	} `json:"server_before"`
	End *struct {
		Goroutines int   `json:"goroutines"`
		RSS        int64 `json:"rss_bytes"`
	} `json:"server_end"`
	Failures []string `json:"failures"`
}

// TestSoak runs the CI-length soak against the real daemon: 16 clients for
// 10 s on three small layers (gated, ReLU², block-scaled) with 5 %
// malformed calls, every good response checked against the float64
// reference, and the daemon's goroutines and RSS read from its /metrics.
// expertbench itself judges (exit 1 on a wrong answer, an unexpected
// status or growth); the test checks it judged something. docs/soak.md
// has the long run.
func TestSoak(t *testing.T) {
	bench := benchBinary(t)
	// Batching on, so that merged calls meet malformed ones and every
	// answer is still checked (the daemon's default is off).
	d := startDaemon(t, "-admin-addr", "127.0.0.1:0", "-batch-window", "500us")
	if d.Admin == "" {
		t.Fatal("the daemon did not log its admin address")
	}
	args := []string{"-soak", "-addr", d.Addr, "-admin-addr", d.Admin, "-c", "16", "-duration", "10s",
		"-bad-share", "0.05", "-m", "32", "-progress", "2s", "-json"}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bench, args...)
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	t.Logf("$ expertbench %s", shellJoin(args))
	err := cmd.Run()
	t.Logf("stderr:\n%s", stderr.String())
	if err != nil {
		t.Fatalf("expertbench -soak: %v\nstdout:\n%s\ndaemon log tail:\n%s", err, stdout.String(), tail(d.logs.String(), 4000))
	}
	var s soakSummary
	if err := json.Unmarshal([]byte(stdout.String()), &s); err != nil {
		t.Fatalf("parsing the summary: %v\n%s", err, stdout.String())
	}
	t.Logf("summary:\n%s", stdout.String())
	if s.Good == 0 || s.Malformed == 0 || s.Checked != s.Expected["good:OK"] || s.Checked == 0 || s.Wrong != 0 ||
		len(s.Unexpected) != 0 || len(s.Failures) != 0 || s.Before == nil || s.End == nil || s.End.RSS == 0 {
		t.Errorf("soak summary %+v: want good and malformed calls, every success checked, nothing wrong or unexpected, server figures", s)
	}
}

// tail is the last n bytes of s.
func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}
