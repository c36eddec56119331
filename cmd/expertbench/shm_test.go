package main

import (
	"os"
	"regexp"
	"testing"

	"github.com/expertd/expertd/internal/testdaemon"
	"github.com/expertd/expertd/service"
)

// TestBenchSharedMemory runs calls with -shm against a server with shared
// memory on, and checks that without it the run fails with the server's
// reason.
func TestBenchSharedMemory(t *testing.T) {
	if _, err := os.Stat("/dev/shm"); err != nil {
		t.Skipf("no /dev/shm: %v", err)
	}
	srv, err := testdaemon.Serve(service.Config{MaxConcurrent: 2, SharedMemory: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	args := []string{"-model", "nemotron", "-e", "8", "-k", "48", "-n", "40", "-load", "-m", "5", "-c", "2", "-calls", "11", "-duration", "20s", "-shm"}
	stdout, stderr, err := runBench(t, append([]string{"-addr", srv.Addr}, args...)...)
	if err != nil {
		t.Fatalf("run: %v\nstderr:\n%s", err, stderr)
	}
	if !regexp.MustCompile(`(?m)^calls +11 in `).MatchString(stdout) {
		t.Errorf("summary does not count 11 calls:\n%s", stdout)
	}

	_, stderr, err = runBench(t, append([]string{"-addr", startServer(t)}, args...)...)
	if err == nil || !regexp.MustCompile(`-shm: .*-shared-memory`).MatchString(err.Error()) {
		t.Errorf("-shm against a server without shared memory: %v, want an error naming -shared-memory\nstderr:\n%s", err, stderr)
	}
}
