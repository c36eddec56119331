#!/usr/bin/env bash
# cutlass-install.sh installs CUTLASS's C++ headers (CuTe included) from the
# pinned PyPI wheel nvidia-cutlass into .tools/cutlass (gitignored), so the
# CUTLASS-based tools build with no CUTLASS checkout. It is idempotent: a
# complete install is left alone.
#
# The wheel ships the headers under cutlass_library/source/include and the
# host utilities under cutlass_library/source/tools/util/include; we keep
# those two trees as include/ and util/include/.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${CUTLASS_TOOLS:-$root/.tools/cutlass}"
version=4.2.0.0
stamp="$dest/.installed-$version"

if [[ -f "$stamp" && -f "$dest/include/cutlass/cutlass.h" ]]; then
  echo "cutlass-install: $dest already has CUTLASS $version"
  exit 0
fi

source "$root/scripts/wheels.sh"
install_wheels "$dest" "nvidia-cutlass==$version"
site="$dest/.site"

src="$site/cutlass_library/source"
[[ -f "$src/include/cutlass/cutlass.h" ]] || { echo "cutlass-install: no headers in the wheel" >&2; exit 1; }
mkdir -p "$dest/util"
cp -a "$src/include" "$dest/include"
cp -a "$src/tools/util/include" "$dest/util/include"
rm -rf "$site"

touch "$stamp"
echo "cutlass-install: installed CUTLASS $version headers into $dest"
