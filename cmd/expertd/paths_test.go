package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/expertd/expertd/internal/clip"
	"github.com/expertd/expertd/internal/clitest"
	"github.com/expertd/expertd/service/servicetest"
)

// runErr runs the daemon with args until it fails to start, with a bound
// on the wait: a start that blocks (on a FIFO, say) is a failure too.
// served reports whether it listened first, as it does while its manifest
// loads.
func runErr(t *testing.T, args ...string) (err error, logText string, served bool) {
	t.Helper()
	var logs servicetest.LogBuffer
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ready := make(chan listening, 1)
	done := make(chan error, 1)
	base := []string{"-listen", "127.0.0.1:0", "-admin-addr", "", "-backend", "cpu"}
	go func() { done <- run(ctx, append(base, args...), func(string) string { return "" }, &logs, ready) }()
	deadline := time.After(time.Minute)
	for {
		select {
		case err := <-done:
			return err, logs.String(), served
		case <-ready:
			served = true
		case <-deadline:
			t.Fatalf("run %q still running after a minute; want a start-up error", args)
		}
	}
}

// sparse writes a file of size bytes that takes no disk.
func sparse(t *testing.T, path string, size int64) {
	t.Helper()
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, size); err != nil {
		t.Fatal(err)
	}
}

// TestManifestLongName: a megabyte set name in the manifest reaches no
// error or log line whole.
func TestManifestLongName(t *testing.T) {
	dir := t.TempDir()
	name := strings.Repeat("n", 1<<20)
	for _, tc := range []struct {
		name, manifest, want string
	}{
		{"duplicate", `{"sets": [{"safetensors": {"name": "` + name + `", "path": "a.safetensors"}}, {"safetensors": {"name": "` + name + `", "path": "b.safetensors"}}]}`,
			"is also sets[0]'s"},
		{"missing file", `{"waitForFiles": "1ms", "sets": [{"safetensors": {"name": "` + name + `", "path": "a.safetensors"}}]}`,
			"did not appear"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			man := filepath.Join(dir, tc.name+".json")
			os.WriteFile(man, []byte(tc.manifest), 0o600)
			err, logs, _ := runErr(t, "-weights-dir", dir, "-manifest", man)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("run = %v; want an error with %q", clip.To(err.Error(), 300), tc.want)
			}
			if n := len(err.Error()); n > clip.Line {
				t.Errorf("the start-up error is %d bytes, more than %d", n, clip.Line)
			}
			for _, l := range strings.Split(logs, "\n") {
				if len(l) > 4*clip.Line {
					t.Errorf("a log line of %d bytes: %.200s", len(l), l)
				}
			}
		})
	}
}

// TestUsageLinesBounded: a megabyte flag value, bad to the flag package
// or to validation, reaches stderr in lines of at most clip.Line bytes.
func TestUsageLinesBounded(t *testing.T) {
	big := strings.Repeat("9", 1<<20)
	for _, args := range [][]string{{"-max-tokens", big + "x"}, {"-backend", big}, {"-log-level", big}} {
		var stderr servicetest.LogBuffer
		if err := run(context.Background(), args, func(string) string { return "" }, &stderr, nil); err != errUsage {
			t.Fatalf("run(%.20q) = %.200v, want errUsage", args, err)
		}
		clitest.CheckLines(t, stderr.String())
	}
}
