#!/usr/bin/env bash
# e2e-setup.sh installs the outside tools the end-to-end tests (./e2e) drive
# the daemon with, into .tools/e2e (gitignored):
#   bin/grpcurl   grpcurl, built from the Go module proxy at a pinned version
#   venv/         a Python venv with pinned grpcio, numpy and pytest, torch
#                 and transformers (for the tests that compare the daemon
#                 with transformers' MoE blocks; EXPERTD_E2E_TORCH=0 leaves
#                 them out), and the expertd package installed from
#                 clients/python (reinstalled whenever its files change)
# It is idempotent: a complete install is left alone. The tests find the
# tools there (or through $EXPERTD_GRPCURL and $EXPERTD_PYTHON) and skip
# loudly without them, unless EXPERTD_E2E_REQUIRE=1, as in CI, makes a
# missing tool a failure.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${EXPERTD_E2E_TOOLS:-$root/.tools/e2e}"

py_pkgs=(grpcio==1.85.1 protobuf==7.36.2 googleapis-common-protos==1.76.0 numpy==2.3.5 pytest==9.2.0)
# PyPI's Linux torch is the CUDA build: it brings the CUDA runtime wheels
# (~5 GB installed) and runs on the CPU without a GPU. transformers pins
# the huggingface_hub and safetensors the checkpoint tests write with.
if [[ "${EXPERTD_E2E_TORCH:-1}" != 0 ]]; then
  py_pkgs+=(torch==2.15.0 transformers==5.23.0)
fi

"$root/scripts/grpcurl-install.sh" "$dest/bin"

venv="$dest/venv"
want="${py_pkgs[*]}"
pystamp="$venv/.installed"
if [[ -x "$venv/bin/python" && -f "$pystamp" && "$(cat "$pystamp")" == "$want" ]]; then
  echo "e2e-setup: python venv already has $want"
else
  echo "e2e-setup: creating python venv with $want"
  rm -rf "$venv"
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${py_pkgs[@]}"
  echo "$want" >"$pystamp"
fi
# The package, as a user installs it (not editable): the tests run against
# what pip put in site-packages, not the source tree.
pkg="$root/clients/python"
pkgsum="$(cd "$pkg" && find . -name __pycache__ -prune -o -type f -print | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)"
if [[ "$(cat "$venv/.expertd" 2>/dev/null)" != "$pkgsum" ]]; then
  echo "e2e-setup: installing the expertd package from clients/python"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$pkg"
  echo "$pkgsum" >"$venv/.expertd"
fi
"$venv/bin/python" -c 'import grpc, numpy, expertd; print("e2e-setup: grpcio", grpc.__version__, "numpy", numpy.__version__, "expertd", expertd.__version__)'
if [[ "${EXPERTD_E2E_TORCH:-1}" != 0 ]]; then
  "$venv/bin/python" -c 'import torch, transformers; print("e2e-setup: torch", torch.__version__, "transformers", transformers.__version__)'
fi
