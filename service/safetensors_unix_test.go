//go:build unix

package service_test

import (
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// TestLoadSafetensorsFIFO loads a FIFO in the weights directory, which
// nothing writes: opening it for reading would block for ever. Each call
// must come back at once with InvalidArgument, and leave no goroutine
// behind (issue 14).
func TestLoadSafetensorsFIFO(t *testing.T) {
	dir := t.TempDir()
	if err := syscall.Mkfifo(filepath.Join(dir, "f.safetensors"), 0o600); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	c, _, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: dir}, &fakeBackend{})
	src := &pb.LoadExpertsRequest_SafetensorsSource{Name: "f", Path: "f.safetensors", Preset: pb.NamingPreset_NAMING_PRESET_NEMOTRON_H}
	call := func() error {
		done := make(chan error, 1)
		go func() {
			_, err := loadSafetensors(t, c, src)
			done <- err
		}()
		select {
		case err := <-done:
			return err
		case <-time.After(5 * time.Second):
			t.Fatal("LoadExperts of a FIFO still blocked after 5 s")
			return nil
		}
	}
	call() // warm the connection's goroutines
	before := runtime.NumGoroutine()
	for range 20 {
		err := call()
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), `safetensors.path: "f.safetensors" is not a regular file`) {
			t.Fatalf("got %v, want InvalidArgument: not a regular file", err)
		}
	}
	// Stream goroutines wind down asynchronously; give them a moment.
	deadline := time.Now().Add(2 * time.Second)
	for runtime.NumGoroutine() > before+2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before+2 {
		t.Errorf("goroutines %d -> %d after 20 loads of a FIFO", before, n)
	}
}
