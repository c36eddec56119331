package e2e

import (
	"path/filepath"
	"testing"
)

// TestBenchReport runs the GPU benchmarks' tests that need no GPU:
// bench/test_moe_bench.py (the report's arithmetic: shares of the card's
// ceilings, the targets per model and M, the header, --ceilings),
// bench/test_host_trace.py (host_trace.py's arguments and how it splits
// and reports a profiler trace) and bench/test_ncu_summary.py (how
// ncu_summary.py splits an Nsight Compute export into calls and labels
// their kernels). Torch's absence skips what needs it, which fails here
// where torchRequired.
func TestBenchReport(t *testing.T) {
	python := pythonPath(t)
	for _, file := range []string{"test_moe_bench.py", "test_host_trace.py", "test_ncu_summary.py"} {
		t.Run(file, func(t *testing.T) {
			t.Logf("$ python -m pytest -q bench/%s", file)
			if pytest(t, python, 4*defaultTimeout, filepath.Join(repoRoot(t), "bench", file)) {
				return
			}
			if torchRequired() {
				t.Fatal("pytest ran no tests")
			}
			t.Skipf("bench/%s skipped its tests: no torch in this Python (scripts/e2e-setup.sh installs it)", file)
		})
	}
}
