#!/usr/bin/env bash
# Runs the FusedMoE GPU benchmark: expertd (build/libexpertd_cuda.so) against
# the PyTorch peer and FlashInfer's cutlass_fused_moe, Nemotron, Qwen3, Qwen3-Next and
# gpt-oss-120b at M = 1..8192 (--model deepseek-v3 for DeepSeek-V3, --models all for all five).
# Without the library it runs the peers alone and says so. Extra arguments go to
# bench/moe_bench.py.
# FlashInfer: where $EXPERTD_FLASHINFER (default .carry/flashinfer, a copy of
# shared/flashinfer) holds setup.sh, that installs the carried wheels and the
# prebuilt FP8 module and this script takes the environment it prints; else the
# bench uses a flashinfer that imports as it is, or says it is absent.
# With OUT set (the device tool sets it) the log, JSON, markdown and PNG land there.
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
# Never FlashInfer's stock JIT build of its MoE module (hours): a missing
# ahead-of-time module is an error the bench reports.
export FLASHINFER_DISABLE_JIT=1
fi_dir="${EXPERTD_FLASHINFER:-.carry/flashinfer}"
if [ -f "$fi_dir/setup.sh" ]; then
	# setup.sh installs into $FI_SITE and ends on "=== [N s] ready: export
	# PYTHONPATH=$FI_SITE:... LD_LIBRARY_PATH=<what its module needs>". Building
	# the module instead of the prebuilt one does not fit one call: short budget.
	export FI_SITE="${FI_SITE:-/tmp/site}"
	ldp=$(FI_BUDGET_S="${FI_BUDGET_S:-60}" bash "$fi_dir/setup.sh" | tee /dev/stderr |
		sed -n 's/^=== \[[0-9]* s\] ready: .* LD_LIBRARY_PATH=//p') || true
	if [ -n "$ldp" ]; then
		export PYTHONPATH="$FI_SITE${PYTHONPATH:+:$PYTHONPATH}" LD_LIBRARY_PATH="$ldp"
	else
		echo "run.sh: $fi_dir/setup.sh did not finish (log above): FlashInfer only if the image has it" >&2
	fi
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv || true
python3 bench/moe_bench.py --lib "$lib" --fast-accum "$@"
