#!/usr/bin/env bash
# Runs the Python package's tests on the GPU machine (no network, no Go):
# the daemon on the cuda backend (build/expertd and build/libexpertd_cuda.so
# from `make cuda cuda-test-bin`), the wheels of scripts/fetch-python-wheels.sh
# installed from .whl/ into a target directory put first on PYTHONPATH
# (the machine's torch stays), then pytest with CUDA IPC and the
# transformers comparisons required (EXPERTD_REQUIRE_TORCH=1: a missing
# torch or transformers fails instead of skipping). The daemons' logs and
# pytest's output go to $OUT (or /tmp).
# Carry: .whl build/expertd build/libexpertd_cuda.so
# Usage: scripts/device-python.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
out="${OUT:-/tmp}"
site="$(mktemp -d)"
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c '
import torch, transformers, grpc, google.protobuf, expertd
assert torch.cuda.is_available(), "no CUDA device"
print("torch", torch.__version__, "transformers", transformers.__version__, "grpcio", grpc.__version__,
      "protobuf", google.protobuf.__version__, "expertd", expertd.__version__, "from", expertd.__file__)'
weights="$(mktemp -d)"
port="${EXPERTD_PORT:-50561}"
# Three daemons on the cuda backend, as TestPythonPackage runs three on
# the cpu one: the suite's (-shared-memory), the ring one RemoteMoE's path
# tests use (-ring, and -lanes for its "gpu" path) and one serving no
# shared memory.
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null; rm -rf "$weights" "$site"' EXIT
start() { # start PORT LOG FLAGS...
  local p=$1 log=$2
  shift 2
  build/expertd -backend cuda -library-path build/libexpertd_cuda.so -listen "127.0.0.1:$p" -admin-addr "" "$@" \
    >"$out/$log" 2>&1 &
  pids+=($!)
}
start "$port" expertd-python.log -shared-memory -weights-dir "$weights"
start "$((port + 1))" expertd-python-ring.log -shared-memory -ring -lanes
start "$((port + 2))" expertd-python-plain.log
for p in "$port" "$((port + 1))" "$((port + 2))"; do
  up=
  for _ in $(seq 100); do
    if "$py" -c "import expertd; expertd.Client('127.0.0.1:$p').server_info(timeout=1)" 2>/dev/null; then
      up=1
      break
    fi
    sleep 0.2
  done
  [[ -n "$up" ]] || { echo "device-python: the daemon on port $p did not answer; the logs:"; cat "$out"/expertd-python*.log; exit 1; }
done
cd "$weights"  # outside the source tree: the installed package is tested
EXPERTD_ADDR="127.0.0.1:$port" EXPERTD_RING_ADDR="127.0.0.1:$((port + 1))" EXPERTD_PLAIN_ADDR="127.0.0.1:$((port + 2))" \
  EXPERTD_SHM=1 EXPERTD_CUDA=1 EXPERTD_WEIGHTS_DIR="$weights" EXPERTD_REQUIRE_TORCH=1 \
  "$py" -m pytest -q -rs -p no:cacheprovider "$OLDPWD/clients/python/tests" "$@" 2>&1 | tee "$out/pytest-python.txt"
exit "${PIPESTATUS[0]}"
