#!/usr/bin/env bash
# device-bounds.sh runs ON the device machine: Nsight Compute on every kernel of
# one full FusedMoE call per (model, M) (bench/ncu_call.py: the bench's layer,
# warmed up, one un-graphed call in a profiler range), for what bounds each row
# of bench/run.sh's table: the tensor pipe's and DRAM's share of their peaks,
# the SM's throughput, and the warps' stall reasons.
#   run: BOUNDS="nemotron-3-nano:1,256,1024,8192 qwen3-30b-a3b:1024,8192" bash scripts/device-bounds.sh
#   (carry build/libexpertd_cuda.so)
# Writes $OUT/ncu-<model>.txt (the details page: sections per kernel),
# $OUT/ncu-<model>.csv (the raw page: every metric collected) and .log (the
# driver's output), then prints bench/ncu_summary.py's table of each model.
# The device tool brings back only so many files from $OUT: with several
# models, pack them into one archive in the calling command.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out="${OUT:-build/device-out}"
lib="${EXPERTD_LIB:-build/libexpertd_cuda.so}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
ncu --version | tail -1
# Metric names differ between Nsight Compute versions (the tensor pipe's
# cycle counter is named per instruction family): ask this one which of the
# wanted bases it has and pass only those.
have=$(ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}')
want="gpu__time_duration.sum sm__throughput.avg.pct_of_peak_sustained_elapsed
dram__throughput.avg.pct_of_peak_sustained_elapsed dram__bytes_read.sum dram__bytes_write.sum
sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
sm__inst_executed_pipe_tensor_op_gmma.sum lts__t_bytes.sum"
metrics=""
for m in $want; do
  if grep -qx "${m%%.*}" <<<"$have"; then metrics+="${metrics:+,}$m"; else echo "this ncu has no ${m%%.*}"; fi
done
echo "metrics: $metrics"
for spec in ${BOUNDS:-nemotron-3-nano:1,16,256,1024,8192 qwen3-30b-a3b:1,256,1024,8192}; do
  model="${spec%%:*}" tokens="${spec#*:}"
  rep="$out/ncu-$model"
  # --clock-control none leaves the card's clocks as the bench ran them.
  timeout "${NCU_LIMIT_S:-240}" ncu --profile-from-start off --clock-control none -f -o "$rep" \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --section LaunchStats \
    ${metrics:+--metrics "$metrics"} \
    python3 bench/ncu_call.py --lib "$lib" --model "$model" --tokens "$tokens" > "$out/ncu-$model.log" 2>&1
  echo "== $model ($tokens) rc=$?"
  ncu -i "$rep.ncu-rep" --page details > "$out/ncu-$model.txt" 2>&1
  # Base units (ns, bytes) so the summary reads every row alike.
  ncu -i "$rep.ncu-rep" --page raw --csv --print-units base > "$out/ncu-$model.csv" 2>&1
  grep -E "^== " "$out/ncu-$model.log"
  python3 bench/ncu_summary.py --log "$out/ncu-$model.log" --csv "$out/ncu-$model.csv"
  rm -f "$rep.ncu-rep"
done
