#!/usr/bin/env bash
# Downloads, into .whl/ (gitignored), the wheels the Python tests need on a
# machine without network that already has torch (the H200 has torch
# 2.11): transformers and its dependencies, the expertd package's
# dependencies and pytest, but not torch or its CUDA packages. There:
#   python -m pip install --no-index --find-links .whl transformers pytest ./clients/python
# PYVER (default: this python's, e.g. 3.12) must match the target's python.
# Usage: scripts/fetch-python-wheels.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.whl"
pyver="${PYVER:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
mkdir -p "$dest"
common=(--dest "$dest" --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux_2_28_x86_64 --platform any --python-version "$pyver" --quiet --disable-pip-version-check)
# transformers' own requirements, without torch (the target has it).
python3 -m pip download "${common[@]}" --no-deps transformers==5.23.0
python3 -m pip download "${common[@]}" \
  'huggingface-hub>=1.0' 'tokenizers>=0.22' 'safetensors>=0.4' regex pyyaml packaging filelock tqdm requests \
  numpy==2.3.5 grpcio==1.85.1 protobuf==7.36.2 googleapis-common-protos==1.76.0 pytest==9.2.0 \
  'setuptools>=68' wheel typer-slim typer click shellingham rich hf-xet fsspec httpx anyio certifi idna h11 httpcore sniffio typing-extensions
ls "$dest"
