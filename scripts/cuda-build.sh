#!/usr/bin/env bash
# cuda-build.sh builds build/libexpertd_cuda.so from kernels/cuda/csrc.
#
# Targets: sm_90a machine code (Hopper wgmma/TMA kernels and the portable
# ones), sm_80 machine code and compute_80 PTX (the portable kernels for
# every other card from Ampere on). The CUDA runtime is linked statically,
# and libstdc++/libgcc too, so the library needs only libc and the driver on
# the device machine. The ptxas resource report goes to build/ptxas.txt.
#
# gemm_cutlass.cu (GEMM2 on CUTLASS's grouped GEMM) is sm_90a code only,
# compiled with NDEBUG and CUTLASS's headers (scripts/cutlass-install.sh
# installs the pinned ones into .tools/cutlass, or CUTLASS_TOOLS, when
# absent); EXPERTD_CUTLASS=0 leaves it out, and the library then runs GEMM2
# on its own kernels everywhere.
#
# Needs no GPU. NVCC (default: .tools/cuda/bin/nvcc from cuda-install.sh,
# then nvcc on PATH) and JOBS can be overridden.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
src="${EXPERTD_CSRC:-$root/kernels/cuda/csrc}"  # override: build another copy of the sources
out="${EXPERTD_BUILD:-$root/build}"  # override: a private output folder
obj="${EXPERTD_OBJ:-$root/.tools/obj}"  # objects stay out of build/, which travels to the device
mkdir -p "$obj" "$out"

# With no nvcc anywhere, install the pinned one first; nvcc-env.sh then
# picks it (NVCC, else .tools/cuda, else PATH) and its static runtime.
if [[ -z "${NVCC:-}" && ! -x "$root/.tools/cuda/bin/nvcc" ]] && ! command -v nvcc >/dev/null; then
  "$root/scripts/cuda-install.sh"
fi
source "$root/scripts/nvcc-env.sh"

gencode=(-gencode arch=compute_90a,code=sm_90a -gencode arch=compute_80,code=sm_80
         -gencode arch=compute_80,code=compute_80)
flags=(-O3 -std=c++17 -Xcompiler -fPIC -Xcompiler -fvisibility=hidden -Xptxas -v
       --expt-relaxed-constexpr -I"$src")

# Every .cu in the source folder is part of the library; gemm_sm90.cu's
# presence turns on the Hopper path in the others, gemm_cutlass.cu's the
# CUTLASS GEMM2.
srcs=()
for f in "$src"/*.cu; do
  [[ "$(basename "$f")" == gemm_cutlass.cu && "${EXPERTD_CUTLASS:-1}" == 0 ]] && continue
  srcs+=("$(basename "$f")")
done
if [[ -f "$src/gemm_sm90.cu" ]]; then
  flags+=(-DEXPERTD_HAVE_SM90)
fi
cutlass_flags=()
if [[ " ${srcs[*]} " == *" gemm_cutlass.cu "* ]]; then
  flags+=(-DEXPERTD_HAVE_CUTLASS)
  "$root/scripts/cutlass-install.sh" >/dev/null
  cutlass="${CUTLASS_TOOLS:-$root/.tools/cutlass}"
  # NDEBUG: a device assert is a call, and a call inside the mainloop makes
  # ptxas serialize the wgmma pipeline (warning C7510, checked below).
  # Hidden inline functions: CUTLASS's host code pulls in libstdc++'s
  # inline members, which would otherwise be exported from the library.
  cutlass_flags=(-DNDEBUG -Xcompiler -fvisibility-inlines-hidden -I"$cutlass/include" -I"$cutlass/util/include")
fi
# unit_args prints the gencode and extra flags of one source file.
unit_args() {
  if [[ "$1" == gemm_cutlass.cu ]]; then
    printf '%s\n' -gencode arch=compute_90a,code=sm_90a "${cutlass_flags[@]}"
  else
    printf '%s\n' "${gencode[@]}"
  fi
}

: > "$out/ptxas.txt"
pids=()
for f in "${srcs[@]}"; do
  (
    mapfile -t unit < <(unit_args "$f")
    "$nvcc" "${flags[@]}" "${unit[@]}" -c "$src/$f" -o "$obj/${f%.cu}.o" 2> "$obj/${f%.cu}.log" \
      || { cat "$obj/${f%.cu}.log" >&2; exit 1; }
  ) &
  pids+=($!)
  if (( ${#pids[@]} >= ${JOBS:-2} )); then
    wait "${pids[0]}"
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p"; done
if [[ -f "$obj/gemm_cutlass.log" && " ${srcs[*]} " == *" gemm_cutlass.cu "* ]] && grep -q C7510 "$obj/gemm_cutlass.log"; then
  grep C7510 "$obj/gemm_cutlass.log" >&2
  echo "cuda-build: gemm_cutlass.cu: ptxas serialized the wgmma pipeline (C7510)" >&2
  exit 1
fi
for f in "${srcs[@]}"; do
  log="$obj/${f%.cu}.log"
  grep -v '^ptxas info\|bytes stack frame\|^ptxas\s*$' "$log" | grep -i 'warning\|error' >&2 || true
  { echo "== $f"; cat "$log"; } >> "$out/ptxas.txt"
done

objs=()
for f in "${srcs[@]}"; do objs+=("$obj/${f%.cu}.o"); done
g++ -shared -o "$out/libexpertd_cuda.so" "${objs[@]}" "$cudart" \
  -static-libstdc++ -static-libgcc -Wl,--exclude-libs,ALL -Wl,-z,defs -lpthread -ldl -lrt
echo "cuda-build: $out/libexpertd_cuda.so ($(du -h "$out/libexpertd_cuda.so" | cut -f1)), $(grep -c 'spill' "$out/ptxas.txt" || true) ptxas reports in build/ptxas.txt"
if grep -E '[1-9][0-9]* bytes spill' "$out/ptxas.txt" >/dev/null; then
  echo "cuda-build: warning: some kernels spill registers (see build/ptxas.txt)" >&2
fi

# The host-path timer (kernels/cuda/csrc/tools/host_path.cc): plain C++
# that loads the library with dlopen, so it times libraries of either ABI.
if [[ -f "$src/tools/host_path.cc" ]]; then
  g++ -O2 -std=c++17 -Wall -Wextra -I"$src" -o "$out/host_path" "$src/tools/host_path.cc" -ldl
  echo "cuda-build: $out/host_path"
fi

# The Hopper GEMM's own check-and-time tool (kernels/cuda/csrc/tools), linked
# against the same object, so CI compiles it on every submission too.
if [[ -f "$obj/gemm_sm90.o" ]]; then
  "$nvcc" -O3 -std=c++17 -DEXPERTD_HAVE_SM90 -I"$src" -gencode arch=compute_90a,code=sm_90a -c "$src/tools/gemm_sm90_check.cu" \
    -o "$obj/gemm_sm90_check.o"
  g++ -o "$out/gemm_sm90_check" "$obj/gemm_sm90_check.o" "$obj/gemm_sm90.o" "$cudart" \
    -static-libstdc++ -static-libgcc -lpthread -ldl -lrt
  echo "cuda-build: $out/gemm_sm90_check"
fi
