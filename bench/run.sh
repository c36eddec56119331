#!/usr/bin/env bash
# Runs the FusedMoE GPU benchmark: expertd (build/libexpertd_cuda.so) against
# the PyTorch peer, Nemotron and Qwen3 at M = 1..8192 (--model deepseek-v3 for
# DeepSeek-V3, --models all for all three). Without the library it runs the
# peer alone and says so. Extra arguments go to bench/moe_bench.py.
# With OUT set (the device tool sets it) the log, JSON and markdown land there.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# The device copy of the tree may have no .git: pass EXPERTD_COMMIT from outside.
export EXPERTD_COMMIT="${EXPERTD_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
lib="${EXPERTD_LIB:-build/libexpertd_cuda.so}"
if [ ! -f "$lib" ]; then
	echo "run.sh: $lib is missing: benchmarking the PyTorch peer only" >&2
fi
if [ -n "${OUT:-}" ]; then
	exec > >(tee "$OUT/moe_bench.log") 2>&1
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv || true
python3 bench/moe_bench.py --lib "$lib" --fast-accum "$@"
