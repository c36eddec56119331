package capfile

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestReadAll(t *testing.T) {
	dir := t.TempDir()
	small := filepath.Join(dir, "small.json")
	if err := os.WriteFile(small, []byte("{}"), 0o600); err != nil {
		t.Fatal(err)
	}
	exact := filepath.Join(dir, "exact")
	if err := os.WriteFile(exact, make([]byte, 1024), 0o600); err != nil {
		t.Fatal(err)
	}
	// A sparse 4 GiB file: refused from its size, before any read (a read
	// of it whole would take seconds and 4 GiB).
	huge := filepath.Join(dir, "huge.json")
	f, err := os.Create(huge)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(4 << 30); err != nil {
		t.Skipf("cannot make a sparse 4 GiB file here: %v", err)
	}
	f.Close()

	tests := []struct {
		name    string
		path    string
		max     int64
		want    string // contents, when wantErr is nil
		wantErr error
		wantMsg string
	}{
		{"small", small, 1 << 20, "{}", nil, ""},
		{"exactly the cap", exact, 1024, string(make([]byte, 1024)), nil, ""},
		{"one byte over", exact, 1023, "", ErrTooLarge, `"exact" is 1024 bytes, over the size cap of 1023 bytes`},
		{"sparse 4 GiB", huge, 64 << 20, "", ErrTooLarge, `"huge.json" is 4294967296 bytes, over the size cap of 64 MiB`},
		{"directory", dir, 1 << 20, "", ErrNotRegular, "not a regular file"},
		{"missing", filepath.Join(dir, "nope"), 1 << 20, "", fs.ErrNotExist, `"nope": `},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ReadAll(tt.path, tt.max)
			if tt.wantErr == nil {
				if err != nil || string(got) != tt.want {
					t.Fatalf("ReadAll = %d bytes, %v; want %d bytes", len(got), err, len(tt.want))
				}
				return
			}
			if !errors.Is(err, tt.wantErr) || !strings.Contains(err.Error(), tt.wantMsg) {
				t.Fatalf("ReadAll error %v, want %v containing %q", err, tt.wantErr, tt.wantMsg)
			}
			// Only the base name: the absolute path stays out of messages.
			if strings.Contains(err.Error(), dir) {
				t.Errorf("error %q names the directory %s", err, dir)
			}
		})
	}
}

// TestReadOpenedGrown: a file that passes Check and then grows is read
// only up to the cap.
func TestReadOpenedGrown(t *testing.T) {
	p := filepath.Join(t.TempDir(), "grows")
	if err := os.WriteFile(p, []byte("ab"), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := Open(p, 4)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := os.WriteFile(p, []byte("abcdefgh"), 0o600); err != nil {
		t.Fatal(err)
	}
	// read, not ReadOpened: the file has grown past the cap after Open's
	// check, which is the case the capped read guards.
	if _, err := read(f, 4); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("read of a grown file: %v, want ErrTooLarge", err)
	}
}

func TestSize(t *testing.T) {
	for n, want := range map[int64]string{64 << 20: "64 MiB", 4 << 10: "4 KiB", 1023: "1023 bytes", 1<<20 + 1: "1048577 bytes"} {
		if got := Size(n); got != want {
			t.Errorf("Size(%d) = %q, want %q", n, got, want)
		}
	}
}
