#!/usr/bin/env bash
# Regenerates fp8_golden.json with pinned numpy and ml_dtypes in the repo's
# shared virtual environment (.venv/ at the repo root, git-ignored). The same
# pins as testdata/golden/gen_moe_golden.sh, so both share one .venv.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
	python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet numpy==2.4.6 ml-dtypes==0.6.0
"$venv/bin/python" "$root/scaling/testdata/gen_golden.py" "$root/scaling/testdata/fp8_golden.json"
