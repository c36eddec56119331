//go:build unix

package capfile

import (
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// A FIFO with no writer is refused at once instead of blocking the open.
func TestOpenFIFO(t *testing.T) {
	p := filepath.Join(t.TempDir(), "fifo")
	if err := syscall.Mkfifo(p, 0o600); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := ReadFile(p, 1<<20)
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "not a regular file (a named pipe)") {
			t.Fatalf("ReadFile of a FIFO: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("ReadFile of a FIFO blocked")
	}
	if err := Check(p, 1); err == nil {
		t.Fatal("Check accepted a FIFO")
	}
}
