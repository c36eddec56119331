#!/usr/bin/env bash
# cutlass-bench-build.sh builds build/cutlass_grouped_bench: CUTLASS's SM90
# ptr-array grouped FP8 GEMMs on the MoE layers' shapes
# (kernels/cuda/csrc/tools/cutlass_grouped_bench.cu says what it times).
#
# Only sm_90a code; needs no GPU. Headers from scripts/cutlass-install.sh;
# NVCC as in cuda-build.sh; JOBS (default 2) units compile at once, one per
# kernel configuration plus the driver. The CUDA runtime, libstdc++ and
# libgcc are linked statically, so the binary needs only libc and the driver.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
out="${EXPERTD_BUILD:-$root/build}"
obj="${EXPERTD_OBJ:-$root/.tools/obj}/cutlass-bench"
src="$root/kernels/cuda/csrc/tools/cutlass_grouped_bench.cu"
jobs="${JOBS:-2}"
source "$root/scripts/nvcc-env.sh"
"$root/scripts/cutlass-install.sh" >/dev/null
cutlass="${CUTLASS_TOOLS:-$root/.tools/cutlass}"
mkdir -p "$obj" "$out"

# NDEBUG: a device assert is a function call, and a call inside the
# mainloop makes ptxas serialize the wgmma pipeline (warning C7510).
flags=(-O3 -DNDEBUG -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a
       -I"$cutlass/include" -I"$cutlass/util/include")
configs="$(grep -oE '^ +X\(([0-9]+),' "$src" | grep -oE '[0-9]+' | tr '\n' ' ')"
units=(main $configs)
start=$SECONDS
printf '%s\n' "${units[@]}" | xargs -P "$jobs" -I{} sh -c '
  u={}
  if [ "$u" = main ]; then def=""; else def="-DCB_CONFIG=$u"; fi
  "$@" $def -c "'"$src"'" -o "'"$obj"'/$u.o" 2> "'"$obj"'/$u.log" || { cat "'"$obj"'/$u.log" >&2; exit 255; }
  if grep -q C7510 "'"$obj"'/$u.log"; then echo "cutlass-bench-build: unit $u: wgmma serialized (C7510)" >&2; fi
' sh "$nvcc" "${flags[@]}"
objs=()
for u in "${units[@]}"; do objs+=("$obj/$u.o"); done
g++ -o "$out/cutlass_grouped_bench" "${objs[@]}" "$cudart" -static-libstdc++ -static-libgcc -lpthread -ldl -lrt
echo "cutlass-bench-build: $out/cutlass_grouped_bench ($(du -h "$out/cutlass_grouped_bench" | cut -f1)), configurations: $configs; $(( (SECONDS - start) / 60 ))m$(( (SECONDS - start) % 60 ))s"
