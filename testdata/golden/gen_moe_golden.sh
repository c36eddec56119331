#!/usr/bin/env bash
# Regenerates moe_golden.json with pinned numpy and ml_dtypes in the repo's
# shared virtual environment (.venv/ at the repo root, git-ignored).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
	python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet numpy==2.4.6 ml-dtypes==0.6.0
"$venv/bin/python" "$root/testdata/golden/gen_moe_golden.py" "$root/testdata/golden/moe_golden.json"
