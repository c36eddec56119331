package shm

import (
	"fmt"
	"runtime/debug"
	"strings"

	"github.com/expertd/expertd/internal/clip"
)

// Dir is where POSIX shm_open objects live.
const Dir = "/dev/shm"

// MaxKey is NAME_MAX, the longest file name Dir takes.
const MaxKey = 255

// Path is the file of the object named key.
func Path(key string) string { return Dir + "/" + key }

// Mapping is a read-write shared mapping of [off, off+size) of one object
// under Dir, made by Open (a daemon mapping a caller's object) or Create
// (a caller making one). The descriptor is closed once the object is
// mapped (the mapping keeps the object), so a mapping costs no file
// descriptor: a daemon bounds its mappings, while descriptors are bounded
// by nothing it controls.
type Mapping struct {
	mem []byte
	// lo is the region's start within mem (mmap offsets are page-aligned).
	lo, size int64
}

// Bytes is the mapped region's bytes.
func (m *Mapping) Bytes() []byte { return m.mem[m.lo : m.lo+m.size] }

// Pages is the whole mapping: the region's bytes and, before them, the
// rest of the first page (what a backend page-locks).
func (m *Mapping) Pages() []byte { return m.mem }

// Check fails if the object no longer backs the region's last page:
// touching a page past the object's end faults (SIGBUS), and the last
// page is the first to go when the object shrinks, so while it reads the
// whole region does. (A shrink within that page only zeroes its tail.)
// It reads one byte, under Guard, where fstat would need the descriptor
// kept open.
func (m *Mapping) Check() error {
	if err := Guard(func() { readByte(m.mem[len(m.mem)-1:]) }); err != nil {
		return fmt.Errorf("its object no longer covers the region (%v); was it shrunk?", err)
	}
	return nil
}

// readByte loads b[0]; noinline keeps the load from being optimized away.
//
//go:noinline
func readByte(b []byte) byte { return b[0] }

// Close unmaps.
func (m *Mapping) Close() error { return unmap(m.mem) }

// Guard runs f, turning a panic in it, a memory fault included (touching
// a shared mapping past its object's end), into an error instead of a
// crash.
func Guard(f func()) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("memory fault: %v", p)
		}
	}()
	f()
	return nil
}

// CheckKey returns the object name of a POSIX key ("/name" or "name"):
// one file name, so a daemon opens Dir/<name> and nothing else.
func CheckKey(key string) (string, error) {
	k := strings.TrimPrefix(key, "/")
	if len(k) < 1 || len(k) > MaxKey {
		return "", invalidf("key", "%s: want 1-%d characters after an optional leading /", clip.Quote(key), MaxKey)
	}
	for _, c := range k {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.ContainsRune("._-", c)) {
			return "", invalidf("key", "%s: character %q is not in [A-Za-z0-9._-]; the key is one name under /dev/shm", clip.Quote(key), c)
		}
	}
	if strings.Contains(k, "..") || k == "." {
		return "", invalidf("key", "%s: must not be \".\" or contain \"..\"", clip.Quote(key))
	}
	return k, nil
}
