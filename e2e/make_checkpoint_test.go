package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestMakeCheckpointWithoutTorch checks that make_checkpoint.py, which the
// README's walk-through runs, tells a Python without torch what it needs
// instead of failing with a traceback: -S leaves out site-packages, and
// with them torch.
func TestMakeCheckpointWithoutTorch(t *testing.T) {
	python := pythonPath(t)
	dir := filepath.Join(t.TempDir(), "ckpt")
	script := filepath.Join(repoRoot(t), "clients/python/tests/make_checkpoint.py")
	out, err := exec.Command(python, "-S", script, "deepseek_v3-block-fp8", dir).CombinedOutput()
	if err == nil {
		t.Fatalf("make_checkpoint.py without site-packages succeeded:\n%s", out)
	}
	if !strings.Contains(string(out), "lacks torch") || !strings.Contains(string(out), ".tools/e2e/venv/bin/python") || strings.Contains(string(out), "Traceback") {
		t.Errorf("make_checkpoint.py without torch printed\n%s\nwant one line naming torch and .tools/e2e/venv/bin/python, no traceback", out)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("it created %s anyway (%v)", dir, err)
	}
}
