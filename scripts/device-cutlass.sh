#!/usr/bin/env bash
# device-cutlass.sh runs ON the device machine, in one call, from the repo
# root: CUTLASS's SM90 grouped FP8 GEMMs beside expertd's Hopper kernels on
# the same prefill GEMMs (Nemotron and Qwen3, M = 1024, 4096, 8192).
#   here, first: scripts/cutlass-bench-build.sh && scripts/sm90-ab-build.sh
#   run: bash scripts/device-cutlass.sh
#        (carry: ["build/cutlass_grouped_bench", "build/gemm_sm90_ab"])
# Both tools flush L2 (256 MB) before each timed launch and take the median.
# gemm_sm90_ab's "SUM new" lines are expertd's GEMM1 + GEMM2 (GEMM1 with
# its activation and FP8 output, GEMM2 with the pair weights and scatter);
# the "SUM cutlass" lines add CUTLASS's fastest checked configuration of
# each GEMM (BF16 out, per-expert alpha). CB_M / AB_M override the M list.
# The log goes to $OUT/cutlass-bench.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-build/device-out}"
mkdir -p "$out"
log="$out/cutlass-bench.log"
m="${CB_M:-1024,4096,8192}"
{
  status=0
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1)"
  echo "== CUTLASS 4.2 ptr-array grouped GEMMs (build/cutlass_grouped_bench)"
  CB_M="$m" timeout 150 build/cutlass_grouped_bench || { echo "cutlass_grouped_bench: exit $?"; status=1; }
  echo "== expertd's SM90 GEMMs (build/gemm_sm90_ab ab; 'new' and 'base' are the same tree)"
  AB_CASES=nemotron,qwen3 AB_M="${AB_M:-$m}" timeout 120 build/gemm_sm90_ab ab || { echo "gemm_sm90_ab: exit $?"; status=1; }
  echo "== summary (GEMM1 + GEMM2 ms)"
  exit $status
} 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
grep -E '^SUM (cutlass|new)' "$log" | sort -s -k3,3 -k5,5n | tee -a "$log"
exit "$status"
