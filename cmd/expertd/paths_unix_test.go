//go:build unix

package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestStartupPathChecks: every path flag that names something missing, of
// the wrong kind, too large or unreadable stops the start with one line
// naming the flag, before anything listens or reads it.
func TestStartupPathChecks(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	os.WriteFile(file, []byte("x"), 0o600)
	missing := filepath.Join(dir, "missing")
	huge := filepath.Join(dir, "huge")
	sparse(t, huge, 5<<30)
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	locked := filepath.Join(dir, "locked")
	os.Mkdir(locked, 0o000)
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"weights dir missing", []string{"-weights-dir", missing}, "-weights-dir: stat " + missing + ": no such file"},
		{"weights dir a file", []string{"-weights-dir", file}, "-weights-dir: " + file + ": not a directory"},
		{"manifest a directory", []string{"-weights-dir", dir, "-manifest", dir}, "-manifest: " + strconv.Quote(filepath.Base(dir)) + ": not a regular file (a directory)"},
		{"manifest a FIFO", []string{"-weights-dir", dir, "-manifest", fifo}, "-manifest: \"fifo\": not a regular file (a named pipe)"},
		{"manifest 5 GiB", []string{"-weights-dir", dir, "-manifest", huge}, "-manifest: \"huge\" is 5368709120 bytes, over the size cap of 4 MiB"},
		{"tokens file a FIFO", []string{"-auth-tokens-file", fifo}, "-auth-tokens-file: \"fifo\": not a regular file (a named pipe)"},
		{"tokens file missing", []string{"-auth-tokens-file", missing}, "-auth-tokens-file: \"missing\": no such file"},
		{"tls cert missing", []string{"-tls-cert", missing, "-tls-key", file}, "-tls-cert: \"missing\": no such file"},
		{"tls key a directory", []string{"-tls-cert", file, "-tls-key", dir}, "-tls-key: " + strconv.Quote(filepath.Base(dir)) + ": not a regular file"},
		{"client ca 5 GiB", []string{"-tls-cert", file, "-tls-key", file, "-tls-client-ca", huge}, "-tls-client-ca: \"huge\" is 5368709120 bytes, over the size cap"},
		{"library a directory", []string{"-library-path", dir}, "-library-path: " + strconv.Quote(filepath.Base(dir)) + ": not a regular file (a directory)"},
		{"socket directory missing", []string{"-listen", "unix://" + missing + "/x.sock"}, "the socket's directory: stat " + missing},
		{"socket directory a file", []string{"-listen", "unix:" + file + "/x.sock"}, "the socket's directory: " + file + ": not a directory"},
	}
	if os.Geteuid() != 0 {
		tests = append(tests, struct {
			name string
			args []string
			want string
		}{"weights dir unreadable", []string{"-weights-dir", locked}, "-weights-dir: open " + locked + ": permission denied"})
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err, logs, served := runErr(t, tc.args...)
			if served {
				t.Error("the daemon listened")
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") {
				t.Fatalf("run = %v; want one line with %q", err, tc.want)
			}
			if logs != "" {
				t.Errorf("the daemon logged before its flags were checked: %s", logs)
			}
		})
	}
}
