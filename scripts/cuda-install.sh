#!/usr/bin/env bash
# cuda-install.sh installs a pinned CUDA 13.0 compiler from NVIDIA's PyPI
# wheels into .tools/cuda (gitignored), so the library builds on machines
# with no CUDA toolkit, GPU-less CI included. It is idempotent: a complete
# install is left alone.
#
# The wheels spread the toolkit over several packages under nvidia/cu13/:
# nvcc (bin/nvcc, ptxas), nvvm (cicc, libdevice), crt (host headers nvcc
# includes), cccl (cuda/std, cub, thrust) and the runtime (cudart headers,
# libcudart_static.a). We merge them into one CUDA_HOME-shaped tree.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${CUDA_TOOLS:-$root/.tools/cuda}"
stamp="$dest/.installed-13.0"

pkgs=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88
)

if [[ -f "$stamp" && -x "$dest/bin/nvcc" ]]; then
  echo "cuda-install: $dest already has CUDA 13.0"
  exit 0
fi

source "$root/scripts/wheels.sh"
install_wheels "$dest" "${pkgs[@]}"
site="$dest/.site"

# Merge every wheel's CUDA tree into one prefix.
cu="$site/nvidia/cu13"
[[ -d "$cu" ]] || cu="$(dirname "$(find "$site/nvidia" -path '*/bin/nvcc' | head -1)")/.."
mkdir -p "$dest/bin" "$dest/include" "$dest/lib64" "$dest/nvvm"
cp -a "$cu/bin/." "$dest/bin/"
cp -a "$cu/include/." "$dest/include/"
for d in lib lib64; do
  [[ -d "$cu/$d" ]] && cp -a "$cu/$d/." "$dest/lib64/"
done
[[ -d "$cu/nvvm" ]] && cp -a "$cu/nvvm/." "$dest/nvvm/"
# nvcc finds cicc and libdevice at $CUDA_HOME/nvvm, ptxas and fatbinary next
# to itself, and reads nvcc.profile beside it for include and library paths.
ln -sfn lib64 "$dest/lib"
chmod +x "$dest"/bin/* "$dest"/nvvm/bin/* 2>/dev/null || true
rm -rf "$site"

"$dest/bin/nvcc" --version | tail -2
touch "$stamp"
echo "cuda-install: installed into $dest"
