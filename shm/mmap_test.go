package shm

import (
	"strings"
	"testing"
)

// TestCheckKey: keys are single names under /dev/shm.
func TestCheckKey(t *testing.T) {
	for key, want := range map[string]string{
		"a": "a", "/a": "a", "torch_123.buf-0": "torch_123.buf-0", "..": "", "/../x": "", "a/b": "", "//a": "",
		"a..b": "", ".": "", "/.": "", "": "", "/": "", "é": "", strings.Repeat("x", 255): strings.Repeat("x", 255), strings.Repeat("x", 256): "",
	} {
		got, err := CheckKey(key)
		if got != want || (err == nil) != (want != "") {
			t.Errorf("CheckKey(%q) = %q, %v; want %q", key, got, err, want)
		}
	}
}
