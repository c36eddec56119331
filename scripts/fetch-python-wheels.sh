#!/usr/bin/env bash
# Fills .whl/ (gitignored) with the wheels scripts/device-python.sh installs
# on the GPU machine, which has no network and no Go. Its image (Python
# 3.12, torch 2.11, transformers 5.17, huggingface_hub 1.33, safetensors,
# tokenizers, numpy, pytest) lacks googleapis-common-protos, and its grpcio
# and protobuf are not known to be the ones the package's stubs need, so
# the set is those, transformers at the version the tests were checked
# against here, regex (transformers checks for >= 2025.10.22 at import and
# the image's version is not known; its other requirements are met there)
# and the expertd
# package itself as a wheel (building it there would need setuptools from
# an index). Every wheel is installed with --no-deps, so nothing else is
# pulled in. It prints the sizes: the carried paths (.whl/ and the two
# build/ files) and the tracked tree together must stay under 64 MiB.
# PYVER (default 3.12) must match the target's python.
# Usage: scripts/fetch-python-wheels.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.whl"
pyver="${PYVER:-3.12}"
# One version of each: a stale wheel beside a new one breaks the install.
rm -rf "$dest"
mkdir -p "$dest"
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$pyver" --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" \
  transformers==5.23.0 regex==2026.11.19 grpcio==1.85.1 protobuf==7.36.2 googleapis-common-protos==1.76.0
# The package is pure Python: one wheel serves every python.
python3 -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$dest" "$root/clients/python"
rm -rf "$root/clients/python/build" "$root"/clients/python/*.egg-info
ls -l "$dest"
whl=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
tree=$(cd "$root" && git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
bins=0
for f in build/expertd build/libexpertd_cuda.so; do
  [[ -f "$root/$f" ]] && bins=$((bins + $(stat -c %s "$root/$f")))
done
total=$((whl + tree + bins))
echo "fetch-python-wheels: .whl $((whl >> 20)) MiB + build/expertd and build/libexpertd_cuda.so $((bins >> 20)) MiB + tracked tree $((tree >> 20)) MiB = $((total >> 20)) MiB of 64"
if ((total > 64 << 20)); then
  echo "fetch-python-wheels: over the 64 MiB the device call carries" >&2
  exit 1
fi
