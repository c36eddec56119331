//go:build (linux || darwin) && (amd64 || arm64)

package cuda

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/scaling"
)

// fakeLibrary builds testdata/fakecuda/fakecuda.c (a library with the ABI's
// symbols and no GPU behind them) with the given -D flags, or skips the
// test when there is no C compiler.
func fakeLibrary(t *testing.T, flags ...string) string {
	t.Helper()
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skipf("no C compiler to build the fake library: %v", err)
	}
	src := "../../testdata/fakecuda/fakecuda.c"
	if _, err := os.Stat(src); err != nil {
		src = "testdata/fakecuda/fakecuda.c" // run from the repository root
	}
	out := filepath.Join(t.TempDir(), libName)
	args := append([]string{"-shared", "-fPIC", "-o", out}, flags...)
	if b, err := exec.Command(cc, append(args, src)...).CombinedOutput(); err != nil {
		t.Fatalf("building the fake library: %v\n%s", err, b)
	}
	return out
}

// TestOpenFaults checks that each way the library or device can fail at
// start makes New return an error saying what failed (never a panic, never
// a backend that serves): backend=auto falls back on it, backend=cuda
// stops with it.
func TestOpenFaults(t *testing.T) {
	garbage := filepath.Join(t.TempDir(), libName)
	if err := os.WriteFile(garbage, []byte("\x7fELF but not really a shared library"), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		lib     func(t *testing.T) string
		wantMsg []string
		// noLibrary says the error marks a missing library.
		noLibrary bool
	}{
		{"missing", func(t *testing.T) string { return filepath.Join(t.TempDir(), "none", libName) }, []string{"library not found"}, true},
		{"not a library", func(*testing.T) string { return garbage }, []string{"cuda: dlopen"}, false},
		{"wrong ABI version", func(t *testing.T) string { return fakeLibrary(t, "-DFAKE_ABI=999") },
			[]string{fmt.Sprintf("speaks ABI 999, this binary speaks %d: rebuild one of them", abiVersion)}, false},
		{"missing symbol", func(t *testing.T) string { return fakeLibrary(t, "-DFAKE_OMIT_MOE") }, []string{"missing symbol expertd_moe"}, false},
		{"no device", func(t *testing.T) string { return fakeLibrary(t, "-DFAKE_INIT_RC=5") },
			[]string{"init: ERR_NO_DEVICE: fake: no CUDA device"}, false},
		{"self-test computes garbage", func(t *testing.T) string { return fakeLibrary(t) },
			[]string{"self-test on fake device failed", "rel-L2"}, false},
		{"self-test CUDA error", func(t *testing.T) string { return fakeLibrary(t, "-DFAKE_MOE_RC=4") },
			[]string{"self-test on fake device failed", "ERR_CUDA: fake: an illegal memory access"}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := kernels.Open("cuda", kernels.Config{LibraryPath: tt.lib(t)})
			if err == nil {
				b.Close()
				t.Fatal("Open succeeded")
			}
			for _, m := range tt.wantMsg {
				if !strings.Contains(err.Error(), m) {
					t.Errorf("Open: %v, want it to say %q", err, m)
				}
			}
			if got := errors.Is(err, errNoLibrary); got != tt.noLibrary {
				t.Errorf("errors.Is(%v, errNoLibrary) = %v, want %v", err, got, tt.noLibrary)
			}
		})
	}
}

// TestCallFaults runs calls on a fake library whose kernel fails, with the
// backend built by hand (a real one would not pass its self-test): each
// failure is an error that keeps the library's message and wraps the
// sentinel the service maps to a status, the next call fails the same way
// instead of hanging, and sets still free.
func TestCallFaults(t *testing.T) {
	tests := []struct {
		name    string
		rc      string
		want    error // sentinel, or nil for "no sentinel"
		wantMsg string
	}{
		{"CUDA error", "4", nil, "cuda: moe: ERR_CUDA: fake: an illegal memory access was encountered"},
		{"out of memory", "3", kernels.ErrOutOfMemory, "ERR_OOM"},
		{"unsupported", "2", kernels.ErrUnsupported, "ERR_UNSUPPORTED"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			lib, err := openLibrary(fakeLibrary(t, "-DFAKE_MOE_RC="+tt.rc))
			if err != nil {
				t.Fatal(err)
			}
			b := &Backend{lib: lib, info: "fake device", live: map[*loaded]struct{}{}}
			defer b.Close()
			set, req := kerneltest.NewCase(rand.New(rand.NewPCG(rand.Uint64(), 3)), kerneltest.Qwen3.Scaled(64, 32), 4,
				kerneltest.WithGranularity(scaling.PerExpert))
			l, err := b.Load(context.Background(), set)
			if err != nil {
				t.Fatalf("Load: %v", err)
			}
			for i := range 2 {
				res, err := b.FusedMoE(context.Background(), l, req)
				if err == nil {
					t.Fatalf("call %d: succeeded with %d output bytes, want the kernel's error", i, len(res.Output))
				}
				if !strings.Contains(err.Error(), tt.wantMsg) {
					t.Errorf("call %d: %v, want it to say %q", i, err, tt.wantMsg)
				}
				for _, s := range []error{kernels.ErrOutOfMemory, kernels.ErrUnsupported} {
					if got := errors.Is(err, s); got != (s == tt.want) {
						t.Errorf("call %d: errors.Is(%v, %v) = %v", i, err, s, got)
					}
				}
			}
			if err := l.Close(); err != nil {
				t.Errorf("freeing the set after failed calls: %v", err)
			}
		})
	}
}
