#!/usr/bin/env bash
# device-abi5.sh runs ON the device machine: the ABI 5 kernels (branch acts3) against
# main's library. Here, first: on acts3, EXPERTD_BUILD=build/v2 scripts/cuda-build.sh and
# CGO_ENABLED=0 go test -c -o build/v2/cuda.test ./kernels/cuda; main's library in build/, and
# scripts/sm90-ab-build.sh. Carry ["build/v2", "build/libexpertd_cuda.so", "build/gemm_sm90_ab"].
# Steps: correctness of every activation case on every GEMM path; Qwen3 and Qwen3-Next timed
# with both libraries; Qwen3-Next's token tiles (gemm_sm90_ab).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-build/device-out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
echo "#### 1. correctness (ABI 5 library)"
EXPERTD_LIBRARY_PATH="$PWD/build/v2/libexpertd_cuda.so" EXPERTD_CUDA_REQUIRE=1 EXPERTD_CUDA_GEMM=portable EXPERTD_CUDA_POISON=1 \
  timeout 150 build/v2/cuda.test -test.v -test.run 'TestCases|TestSmall|TestMaskedRows|TestActivationCases|TestGateFirst|TestActivationCodes|TestBlockScales|TestErrors|TestLibraryChecksStructs|TestStructs|TestUnsupported|TestCUDAIPC|TestPinnedHost|TestConcurrentCallsOnOneSet' -test.timeout 145s > "$OUT/v2-test.log" 2>&1
echo "rc=$? fails=$(grep -c -- '--- FAIL' $OUT/v2-test.log) pass=$(grep -c -- '--- PASS' $OUT/v2-test.log) checked=$(grep -c 'rel-L2' $OUT/v2-test.log)"
grep -E -- '^--- |^ok|^FAIL|panic' "$OUT/v2-test.log" | head -30
echo "#### 2. main's library against the ABI 5 one"
for v in main v2; do
  if [ $v = main ]; then lib=build/libexpertd_cuda.so; else lib=build/v2/libexpertd_cuda.so; fi
  echo "== $v"
  timeout 100 python3 bench/moe_bench.py --lib $lib --fast-accum --no-flashinfer --models qwen3-30b-a3b,qwen3-next-80b-a3b --tokens 1,1024,8192 --iters 50 > $OUT/gated-$v.log 2>&1
  grep -E '^\| (qwen3|nemotron)[^|]*\| [0-9]+ \| expertd \|' $OUT/gated-$v.log
done
echo "#### 3. sm90 token tiles for Qwen3-Next"
AB_CASES=qwen3-next AB_M=1024,4096,8192 BNS=64,128,256 timeout 80 build/gemm_sm90_ab ab > $OUT/ab-qwen3next.log 2>&1
echo "ab rc=$?"; grep '^SUM' $OUT/ab-qwen3next.log
