#!/usr/bin/env bash
# device-ncu.sh runs ON the device machine: Nsight Compute on the sm90 grouped
# GEMMs (build/gemm_sm90_check's PROFILE_M mode: one layer at one M, uniform
# routing, random data) and the full op's kernel split (bench/moe_profile.py),
# for what bounds each size. Here first: scripts/cuda-build.sh (the library and
# build/gemm_sm90_check). Carry ["build/gemm_sm90_check", "build/libexpertd_cuda.so"].
#   CASES="qwen3 nemotron" MS="8192 1024 64 1" bash scripts/device-ncu.sh
# Writes $OUT/ncu-<case>-<m>.txt (GEMM1 then GEMM2, details page) and
# $OUT/split.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-build/device-out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
ncu --version | tail -1
# --clock-control none leaves the card's clocks alone (the device notes ask
# for it); the skipped launches are the tool's warm-up; GEMM1 and GEMM2
# alternate, so two profiled launches are one of each.
for c in ${CASES:-qwen3 nemotron}; do
  for m in ${MS:-8192 1024 64 1}; do
    PROFILE_CASE=$c PROFILE_M=$m timeout 150 ncu --clock-control none --kernel-name regex:moe_gemm \
      --launch-skip 6 --launch-count 2 \
      --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
      --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
      build/gemm_sm90_check > "$OUT/ncu-$c-$m.txt" 2>&1
    echo "== $c M=$m rc=$?"
    grep -E "moe_gemm|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Registers Per|Achieved Occupancy" \
      "$OUT/ncu-$c-$m.txt" | sed -E 's/ +/ /g' | cut -c1-160
  done
done
if [[ -n ${SPLIT:-1} ]]; then
  echo "#### full-op split (first library)"
  timeout 200 python3 bench/moe_profile.py --lib build/libexpertd_cuda.so --tokens ${SPLIT_M:-1,64,1024,4096,8192} \
    --rounds 2 --iters 50 > "$OUT/split.txt" 2>&1
  echo "split rc=$?"
  grep -vE '^\s*$' "$OUT/split.txt" | tail -40
fi
