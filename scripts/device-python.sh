#!/usr/bin/env bash
# Runs the Python package's tests on a GPU machine without network: the
# daemon on the cuda backend (build/expertd, build/libexpertd_cuda.so from
# `make cuda cuda-test-bin`), the package and transformers installed from
# .whl/ (scripts/fetch-python-wheels.sh, PYVER matching the machine's
# python), then pytest with CUDA IPC and the transformers comparisons on.
# Usage: scripts/device-python.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
"$py" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print("torch", torch.__version__)'
"$py" -m pip install --quiet --no-index --find-links .whl transformers pytest ./clients/python
weights="$(mktemp -d)"
port="${EXPERTD_PORT:-50561}"
build/expertd -backend cuda -library-path build/libexpertd_cuda.so -listen "127.0.0.1:$port" -admin-addr "" \
  -shared-memory -weights-dir "$weights" >"${OUT:-/tmp}/expertd-python.log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -rf "$weights"' EXIT
for _ in $(seq 100); do
  "$py" -c "import expertd,sys; expertd.Client('127.0.0.1:$port').server_info(timeout=1)" 2>/dev/null && break
  sleep 0.2
done
cd "$weights"  # outside the source tree: the installed package is tested
EXPERTD_ADDR="127.0.0.1:$port" EXPERTD_SHM=1 EXPERTD_CUDA=1 EXPERTD_WEIGHTS_DIR="$weights" \
  "$py" -m pytest -q -rs -p no:cacheprovider "$OLDPWD/clients/python/tests" "$@"
