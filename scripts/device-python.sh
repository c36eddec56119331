#!/usr/bin/env bash
# Runs the Python package's tests on the GPU machine (no network, no Go):
# the daemon on the cuda backend (build/expertd and build/libexpertd_cuda.so
# from `make cuda cuda-test-bin`), the wheels of scripts/fetch-python-wheels.sh
# installed from .whl/ into a target directory put first on PYTHONPATH
# (the machine's torch stays), then pytest with CUDA IPC and the
# transformers comparisons required (EXPERTD_REQUIRE_TORCH=1: a missing
# torch or transformers fails instead of skipping). The daemon's log and
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
build/expertd -backend cuda -library-path build/libexpertd_cuda.so -listen "127.0.0.1:$port" -admin-addr "" \
  -shared-memory -weights-dir "$weights" >"$out/expertd-python.log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -rf "$weights" "$site"' EXIT
up=
for _ in $(seq 100); do
  if "$py" -c "import expertd; expertd.Client('127.0.0.1:$port').server_info(timeout=1)" 2>/dev/null; then
    up=1
    break
  fi
  sleep 0.2
done
[[ -n "$up" ]] || { echo "device-python: the daemon did not answer; its log:"; cat "$out/expertd-python.log"; exit 1; }
cd "$weights"  # outside the source tree: the installed package is tested
EXPERTD_ADDR="127.0.0.1:$port" EXPERTD_SHM=1 EXPERTD_CUDA=1 EXPERTD_WEIGHTS_DIR="$weights" EXPERTD_REQUIRE_TORCH=1 \
  "$py" -m pytest -q -rs -p no:cacheprovider "$OLDPWD/clients/python/tests" "$@" 2>&1 | tee "$out/pytest-python.txt"
exit "${PIPESTATUS[0]}"
