package capfile

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestReadFile(t *testing.T) {
	dir := t.TempDir()
	small := filepath.Join(dir, "small")
	if err := os.WriteFile(small, []byte("hello"), 0o600); err != nil {
		t.Fatal(err)
	}
	if b, err := ReadFile(small, 5); err != nil || string(b) != "hello" {
		t.Fatalf("ReadFile at the cap = %q, %v; want hello", b, err)
	}
	if _, err := ReadFile(small, 4); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("ReadFile over the cap: %v; want ErrTooLarge", err)
	}
	if _, err := ReadFile(dir, 1<<20); err == nil || !strings.Contains(err.Error(), "not a regular file (a directory)") {
		t.Fatalf("ReadFile of a directory: %v", err)
	}
	if _, err := ReadFile(filepath.Join(dir, "missing"), 1); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("ReadFile of a missing file: %v; want ErrNotExist", err)
	}
}

// A sparse file far over the cap is refused from its size, before any read:
// the test's cap on memory would otherwise be exceeded by the read.
func TestReadFileSparse(t *testing.T) {
	p := filepath.Join(t.TempDir(), "sparse")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(4 << 30); err != nil {
		t.Skipf("no sparse files here: %v", err)
	}
	f.Close()
	start := time.Now()
	if _, err := ReadFile(p, 4<<20); !errors.Is(err, ErrTooLarge) || !strings.Contains(err.Error(), "4294967296 bytes") {
		t.Fatalf("ReadFile of a 4 GiB file: %v; want ErrTooLarge naming its size", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("took %v: the file was read", d)
	}
}
