//go:build unix

package capfile

import (
	"errors"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// TestOpenFIFO: a FIFO nothing writes is refused at once; a blocking open
// of it would never return.
func TestOpenFIFO(t *testing.T) {
	p := filepath.Join(t.TempDir(), "fifo")
	if err := syscall.Mkfifo(p, 0o600); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := ReadAll(p, 1<<20)
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, ErrNotRegular) {
			t.Fatalf("ReadAll(FIFO) = %v, want ErrNotRegular", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("ReadAll(FIFO) still blocked after 10 s")
	}
}
