#!/usr/bin/env bash
# device-doorbell.sh runs the GPU-ordered call probe (build/doorbell, from
# kernels/cuda/csrc/tools/doorbell.cu) on the device machine: two processes on
# one GPU, first as they are (time-sliced contexts), then under MPS when the
# machine has nvidia-cuda-mps-control. Carry build/doorbell. With OUT set the
# log lands there.
set -uo pipefail
cd "$(dirname "$0")/.."
[[ -n "${OUT:-}" ]] && exec > >(tee "$OUT/doorbell.log") 2>&1
bin=build/doorbell
nvidia-smi --query-gpu=name,compute_mode --format=csv
# A stalled chain is killed with its forked daemon, so the next run starts clean.
run() {
	timeout -s KILL 40 "$bin" "$@"; echo "exit $?"
	pkill -9 -x doorbell 2>/dev/null || true
}
probe() {
	for w in 30 5; do
		run 48 "$w" 20 "$1"
	done
	run 1 30 200 "$1"
}
echo "== without MPS"
probe memop
if command -v nvidia-cuda-mps-control >/dev/null; then
	export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
	mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
	if nvidia-cuda-mps-control -d; then
		echo "== under MPS"
		probe memop
		run 48 30 20 spin
		echo quit | nvidia-cuda-mps-control
		cat "$CUDA_MPS_LOG_DIRECTORY"/control.log 2>/dev/null | tail -n 5
	else
		echo "MPS control daemon did not start"
	fi
else
	echo "no nvidia-cuda-mps-control on this machine"
fi
