#!/usr/bin/env bash
# Regenerates the Python stubs of proto/ into the expertd package
# (clients/python/expertd/v1: expert_pb2.py, expert_pb2.pyi,
# expert_pb2_grpc.py) with grpcio-tools pinned here, so the package needs no
# proto/ and no code generation at run time. The pinned generator lives in
# its own venv, .tools/protoc-python (gitignored), made on first use.
# Usage: scripts/gen-proto-python.sh (run by scripts/gen-proto.sh).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${EXPERTD_PROTOC_PYTHON:-$root/.tools/protoc-python}"
pin="grpcio-tools==1.85.1"

if [[ ! -x "$venv/bin/python" || "$(cat "$venv/.installed" 2>/dev/null)" != "$pin" ]]; then
  echo "gen-proto-python: creating $venv with $pin"
  rm -rf "$venv"
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$pin"
  echo "$pin" >"$venv/.installed"
fi

out="$root/clients/python"
rm -f "$out"/expertd/v1/expert_pb2*.py "$out"/expertd/v1/expert_pb2*.pyi
cd "$root/proto"
"$venv/bin/python" -m grpc_tools.protoc -I. \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  expertd/v1/expert.proto
