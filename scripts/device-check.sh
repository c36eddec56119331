#!/usr/bin/env bash
# device-check.sh runs ON the device machine, in one call, from the repo
# root, with the prebuilt build/ carried over (no Go there):
#   make cuda cuda-test-bin   # here, first
#   run: bash scripts/device-check.sh   (carry: ["build"])
# EXPERTD_BUILD=dir uses another carried folder (scripts/cuda-build.sh takes
# the same variable); DEVICE_CHECK_BENCH=0 skips bench/run.sh.
# It prints the GPU, runs the Go test binary of kernels/cuda against the
# library (correctness on every GEMM path, again with GEMM1 reading the
# hidden rows by token wherever it can, then the Nemotron timings), runs
# gemm_sm90_check's quick check in that mode too when it was built, runs
# compute-sanitizer memcheck on a small case, counts the tensor-core
# instructions in the library's SASS, and runs bench/run.sh if present.
# Everything that matters is also written under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
build="${EXPERTD_BUILD:-build}"  # the folder carried to the device
out="${OUT:-$build/device-out}"
mkdir -p "$out"
export EXPERTD_LIBRARY_PATH="$PWD/$build/libexpertd_cuda.so" EXPERTD_CUDA_REQUIRE=1
summary="$out/summary.txt"
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
status=0

say "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>&1)"
[[ -x "$build/cuda.test" && -f "$build/libexpertd_cuda.so" ]] || { say "$build/cuda.test or the library is missing: run make cuda cuda-test-bin first"; exit 2; }

say "== correctness (go test, every GEMM path, poisoned outputs)"
# The self-test in New uses EXPERTD_CUDA_GEMM; keep it on the portable path
# so a broken sm90 kernel fails its own cases instead of every test.
# TestDeepSeekV3Full needs ~12 GB of GPU memory and ~50 s (the CPU backend
# checks it); it skips on smaller cards.
EXPERTD_CUDA_GEMM=portable EXPERTD_CUDA_POISON=1 timeout 300 "$build/cuda.test" -test.v \
  -test.run 'TestCases|TestActivationCases|TestGateFirst|TestActivationCodes|TestSmall|TestMaskedRows|TestErrors|TestOpen|TestHeader|TestStructs|TestOptions|TestLibraryChecksStructs|TestBlockScales|TestDeepSeekV3Full|TestCUDAIPC|TestPinnedHost|TestConcurrentCallsOnOneSet|TestSharedMemoryFaults|TestCutlass|TestGatherFold|TestOneSetManySizes' -test.timeout 295s > "$out/test.log" 2>&1
rc=$?
grep -E 'rel-L2|FAIL|PASS|ok |device:|panic|unsupported|Error' "$out/test.log" | grep -v '^=== RUN' | head -150
say "correctness rc=$rc: $(grep -c -- '--- FAIL' "$out/test.log") failing tests, $(grep -c 'rel-L2.*vs reference' "$out/test.log") checked calls logged"
(( rc == 0 )) || status=1

# switch_pass TITLE LOG LIMIT_S PATTERN TESTS VAR=VALUE... runs TESTS again
# with the library switches given (read at init), prints the lines of the
# log matching PATTERN and counts the failures.
switch_pass() {
  local title="$1" log="$out/$2" limit="$3" pattern="$4" tests="$5" rc
  shift 5
  say "== correctness, $title ($*)"
  env "$@" EXPERTD_CUDA_GEMM=portable EXPERTD_CUDA_POISON=1 timeout "$limit" "$build/cuda.test" -test.v \
    -test.run "$tests" -test.timeout "$((limit - 5))s" > "$log" 2>&1
  rc=$?
  grep -E "$pattern" "$log" | grep -v '^=== RUN' | head -50
  say "correctness ($title) rc=$rc: $(grep -c -- '--- FAIL' "$log") failing tests, $(grep -c 'rel-L2.*vs reference' "$log") checked calls logged"
  (( rc == 0 )) || status=1
}

# Both GEMMs on CUTLASS wherever the set allows: static scales at any M;
# GEMM1 for ReLU² layers without bias.
switch_pass "both GEMMs on CUTLASS" test-cutlass.log 300 'FAIL|panic|GEMM|CUTLASS' \
  'TestCases|TestActivationCases|TestSmall|TestCutlass' EXPERTD_SM90_CUTLASS=1 EXPERTD_SM90_CUTLASS1=1
# GEMM1 alone on CUTLASS, the hand-written GEMM2 after it.
switch_pass "GEMM1 alone on CUTLASS" test-cutlass1.log 120 'FAIL|panic' \
  'TestCutlass' EXPERTD_SM90_CUTLASS=0 EXPERTD_SM90_CUTLASS1=1
# The sm90 path's GEMM1 reads the FP8 hidden rows by token on every call
# its 64- and 128-token tiles take (TestGatherFold's cases are all such
# calls); then never, where the rule would (the gather pass and TMA feed).
switch_pass "GEMM1 reading the hidden rows by token" test-gather.log 200 'FAIL|panic|Error' \
  'TestGatherFold|TestCases|TestActivationCases' EXPERTD_SM90_GATHER=1
switch_pass "GEMM1 after the gather pass" test-gather0.log 120 'FAIL|panic|Error' \
  'TestGatherFold|TestOneSetManySizes' EXPERTD_SM90_GATHER=0
if [[ -x "$build/gemm_sm90_check" ]]; then
  EXPERTD_SM90_GATHER=1 timeout 120 "$build/gemm_sm90_check" quick > "$out/gemm-check-gather.log" 2>&1
  rc=$?
  say "gemm_sm90_check quick (by token) rc=$rc: $(grep -c 'by-token.*ok' "$out/gemm-check-gather.log") by-token GEMM1 checks ok, $(grep -c FAIL "$out/gemm-check-gather.log") failing"
  (( rc == 0 )) || status=1
fi


say "== SASS instruction counts"
if command -v cuobjdump >/dev/null; then
  cuobjdump --dump-sass "$build/libexpertd_cuda.so" > "$out/sass.txt" 2>&1
  for op in QGMMA HGMMA QMMA HMMA; do say "$op: $(grep -c "$op" "$out/sass.txt")"; done
  gzip -f "$out/sass.txt"
else
  say "cuobjdump not found"
fi

say "== timing (Nemotron full shape)"
EXPERTD_CUDA_GEMM=portable EXPERTD_CUDA_TIMING=1 timeout 45 "$build/cuda.test" -test.v -test.run 'TestTiming' -test.timeout 40s > "$out/timing.log" 2>&1
say "timing rc=$?"
grep 'timing Nemotron' "$out/timing.log" | sed 's/^ *backend_test.go:[0-9]*: //' | tee -a "$summary"
grep -E 'FAIL|panic' "$out/timing.log" | head -5 | tee -a "$summary"

say "== compute-sanitizer memcheck (small case)"
if command -v compute-sanitizer >/dev/null; then
  EXPERTD_CUDA_GEMM=portable timeout 30 compute-sanitizer --tool memcheck --print-limit 20 "$build/cuda.test" -test.run 'TestSmall' -test.v > "$out/sanitizer.log" 2>&1
  say "sanitizer rc=$?: $(grep -E 'ERROR SUMMARY' "$out/sanitizer.log" | tail -1)"
  grep -E 'Invalid|ERROR SUMMARY|FAIL' "$out/sanitizer.log" | head -10
else
  say "compute-sanitizer not found"
fi

if [[ -x bench/run.sh && "${DEVICE_CHECK_BENCH:-1}" != 0 ]]; then
  say "== bench/run.sh"
  timeout 240 bench/run.sh > "$out/bench.txt" 2>&1
  say "bench rc=$?"
  tail -40 "$out/bench.txt"
fi
cat "$summary"
exit $status
