package e2e

import (
	"path/filepath"
	"testing"
)

// TestBenchReport runs bench/test_moe_bench.py, the GPU benchmark's report
// arithmetic (shares of the card's ceilings, the targets per model and M,
// the header, --ceilings), which needs torch but no GPU. Without torch the
// file skips its tests, which fails here where torchRequired.
func TestBenchReport(t *testing.T) {
	python := pythonPath(t)
	t.Logf("$ python -m pytest -q bench/test_moe_bench.py")
	if pytest(t, python, 4*defaultTimeout, filepath.Join(repoRoot(t), "bench", "test_moe_bench.py")) {
		return
	}
	if torchRequired() {
		t.Fatal("pytest ran no tests")
	}
	t.Skip("bench/test_moe_bench.py skipped its tests: no torch in this Python (scripts/e2e-setup.sh installs it)")
}
