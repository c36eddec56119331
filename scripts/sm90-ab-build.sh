#!/usr/bin/env bash
# sm90-ab-build.sh builds build/gemm_sm90_ab: gemm_sm90_check linked with
# the tree's Hopper GEMM and with a baseline copy of it (default: the
# commit named by $1, else main), so `gemm_sm90_ab ab` times both in one
# process (kernels/cuda/csrc/tools/gemm_sm90_check.cu says how).
#
# Only sm_90a code; needs no GPU. NVCC as in cuda-build.sh.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
base="${1:-main}"
out="${EXPERTD_BUILD:-$root/build}"
obj="${EXPERTD_OBJ:-$root/.tools/obj}/sm90-ab"
src="$root/kernels/cuda/csrc"
source "$root/scripts/nvcc-env.sh"
mkdir -p "$obj/base" "$out"

rev="$(git -C "$root" rev-parse --short "$base")"
# gemm_sm90.cu and every header beside it at the baseline, so a header the
# GEMM starts including needs no change here.
rm -f "$obj/base/"*
for f in gemm_sm90.cu $(git -C "$root" ls-tree --name-only "$rev" kernels/cuda/csrc/ | grep -E '\.(h|cuh)$' | xargs -n1 basename); do
  git -C "$root" show "$rev:kernels/cuda/csrc/$f" > "$obj/base/$f"
done

flags=(-O3 -std=c++17 -DEXPERTD_HAVE_SM90 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a)
"$nvcc" "${flags[@]}" -Xptxas -v -I"$src" -c "$src/gemm_sm90.cu" -o "$obj/new.o" 2> "$obj/new.log" &
p1=$!
"$nvcc" "${flags[@]}" -I"$obj/base" -c "$src/tools/gemm_sm90_base.cu" -o "$obj/base.o" 2> "$obj/base.log" &
p2=$!
"$nvcc" "${flags[@]}" -I"$src" -c "$src/tools/gemm_sm90_check.cu" -o "$obj/check.o"
wait $p1 || { cat "$obj/new.log" >&2; exit 1; }
wait $p2 || { cat "$obj/base.log" >&2; exit 1; }
grep -v '^ptxas info\|bytes stack frame\|^ptxas\s*$' "$obj/new.log" | grep -i 'warning\|error' >&2 || true
if grep -E '[1-9][0-9]* bytes spill' "$obj/new.log" >/dev/null; then
  echo "sm90-ab-build: warning: some kernels spill registers (see $obj/new.log)" >&2
fi
g++ -o "$out/gemm_sm90_ab" "$obj/check.o" "$obj/new.o" "$obj/base.o" "$cudart" \
  -static-libstdc++ -static-libgcc -lpthread -ldl -lrt
echo "sm90-ab-build: $out/gemm_sm90_ab ($(du -h "$out/gemm_sm90_ab" | cut -f1)), baseline $rev"
