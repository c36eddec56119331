#!/usr/bin/env bash
# Draws bench/moe_bench.py's picture from its JSON where the GPU machine could
# not (no matplotlib there): brings matplotlib into a virtual environment under
# .venv/plot once, then runs bench/plot.py.
#   bash bench/plot.sh moe_bench.json [out.png]
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${EXPERTD_PLOT_VENV:-.venv/plot}"
pin="matplotlib==3.11.2"
if ! "$venv/bin/python" -c "import matplotlib" 2>/dev/null; then
	python3 -m venv "$venv"
	"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$pin"
fi
exec "$venv/bin/python" bench/plot.py "$@"
