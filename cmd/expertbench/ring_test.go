package main

import (
	"os"
	"regexp"
	"testing"

	"github.com/expertd/expertd/internal/testdaemon"
	"github.com/expertd/expertd/service"
)

// TestBenchRing runs calls through a call ring, with inline and with shm
// tensors, and checks that a server without rings refuses with its
// reason.
func TestBenchRing(t *testing.T) {
	if _, err := os.Stat("/dev/shm"); err != nil {
		t.Skipf("no /dev/shm: %v", err)
	}
	srv, err := testdaemon.Serve(service.Config{MaxConcurrent: 2, SharedMemory: true, Ring: true, RingSpin: service.DefaultRingSpin})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	args := []string{"-model", "nemotron", "-e", "8", "-k", "48", "-n", "40", "-load", "-m", "5", "-c", "2", "-calls", "11", "-duration", "20s", "-ring"}
	for _, extra := range [][]string{nil, {"-shm"}} {
		stdout, stderr, err := runBench(t, append(append([]string{"-addr", srv.Addr}, args...), extra...)...)
		if err != nil {
			t.Fatalf("run %v: %v\nstderr:\n%s", extra, err, stderr)
		}
		if !regexp.MustCompile(`(?m)^calls +11 in `).MatchString(stdout) {
			t.Errorf("summary %v does not count 11 calls:\n%s", extra, stdout)
		}
	}

	noRing, err := testdaemon.Serve(service.Config{MaxConcurrent: 2, SharedMemory: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(noRing.Stop)
	_, stderr, err := runBench(t, append([]string{"-addr", noRing.Addr}, args...)...)
	if err == nil || !regexp.MustCompile(`-ring: .*start expertd with -ring`).MatchString(err.Error()) {
		t.Errorf("-ring against a server without rings: %v, want an error naming -ring\nstderr:\n%s", err, stderr)
	}
}
