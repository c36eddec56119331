# nvcc-env.sh, sourced by the scripts that build CUDA code (the library and
# the standalone tools) with $root set: sets nvcc (NVCC, else
# .tools/cuda/bin/nvcc from cuda-install.sh, else nvcc on PATH), cuda_home
# and cudart (its static CUDA runtime).
nvcc="${NVCC:-}"
if [[ -z "$nvcc" ]]; then
  if [[ -x "$root/.tools/cuda/bin/nvcc" ]]; then nvcc="$root/.tools/cuda/bin/nvcc"; else nvcc="$(command -v nvcc)"; fi
fi
cuda_home="$(cd "$(dirname "$nvcc")/.." && pwd)"
cudart="$cuda_home/lib64/libcudart_static.a"
[[ -f "$cudart" ]] || cudart="$cuda_home/lib/libcudart_static.a"
