#!/usr/bin/env bash
# cuda-host-path.sh times the host side of expertd_moe on the device
# machine (docs/perf-notes.md, "Library host path (issue 16)"):
#   here:   make cuda            # build/libexpertd_cuda.so and build/host_path
#           optional "before": git worktree add /tmp/before e86c906 &&
#             EXPERTD_CSRC=/tmp/before/kernels/cuda/csrc EXPERTD_BUILD=build/before scripts/cuda-build.sh
#   device: bash scripts/cuda-host-path.sh [LIB...]   (carry: ["build"])
# For each library (default build/libexpertd_cuda.so, then build/before/
# libexpertd_cuda.so if it is there) it runs build/host_path twice: once
# plain (wall, kernel and host p50/p90 per memory kind and M), once with
# the library's host trace on, whose per-call stage lines it reduces to the
# median of each stage per (memory kind, M). HOST_PATH_SPIN_US=n also runs
# the current library with a completion spin of n µs; ITERS sets the calls
# per row (default 300).
set -uo pipefail
cd "$(dirname "$0")/.."
build="${EXPERTD_BUILD:-build}"
tool="$build/host_path"
[[ -x "$tool" ]] || { echo "$tool is missing: run make cuda first" >&2; exit 2; }
libs=("$@")
if (( ${#libs[@]} == 0 )); then
  libs=("$build/libexpertd_cuda.so")
  [[ -f "$build/before/libexpertd_cuda.so" ]] && libs+=("$build/before/libexpertd_cuda.so")
fi
out="${OUT:-$build/device-out}"
mkdir -p "$out"
iters="${ITERS:-300}"

# stages reads trace lines on stdin and prints, per (mode, m), the median
# of every stage the library reported.
stages() {
  awk '
    /^== host_path / { split($3, a, "="); mode = a[2]; next }
    /^expertd_moe host / {
      split($3, mm, "="); key = mode " m=" mm[2]
      if (!(key in seen)) { seen[key] = 1; keys[++nk] = key }
      for (i = 4; i <= NF; i++) {
        split($i, kv, "="); v = kv[2]; sub(/us$/, "", v)
        st = key SUBSEP kv[1]
        if (!(st in cnt)) { names[key] = names[key] " " kv[1] }
        vals[st, ++cnt[st]] = v + 0
      }
    }
    END {
      for (k = 1; k <= nk; k++) {
        key = keys[k]; line = sprintf("%-16s", key)
        n = split(names[key], nm, " ")
        for (j = 1; j <= n; j++) {
          st = key SUBSEP nm[j]; c = cnt[st]
          delete arr; for (i = 1; i <= c; i++) arr[i] = vals[st, i]
          # insertion sort: a few hundred values
          for (i = 2; i <= c; i++) { x = arr[i]; for (q = i - 1; q >= 1 && arr[q] > x; q--) arr[q + 1] = arr[q]; arr[q + 1] = x }
          line = line sprintf(" %s=%.1f", nm[j], arr[int((c + 1) / 2)])
        }
        print line " (us, medians)"
      }
    }'
}

for lib in "${libs[@]}"; do
  tag="$(basename "$(dirname "$lib")")"
  echo "== $lib"
  env -u HOST_PATH_SPIN_US "$tool" "$lib" "$iters" 2>/dev/null | tee "$out/host_path.$tag.txt"
  echo "-- stages (host trace on)"
  env -u HOST_PATH_SPIN_US EXPERTD_CUDA_HOST_TRACE=1 "$tool" "$lib" "$iters" 2>&1 >/dev/null | stages | tee "$out/host_path.$tag.stages.txt"
  if [[ -n "${HOST_PATH_SPIN_US:-}" && "$lib" == "${libs[0]}" ]]; then
    echo "-- completion spin ${HOST_PATH_SPIN_US} us"
    "$tool" "$lib" "$iters" 2>/dev/null | tee "$out/host_path.$tag.spin.txt"
  fi
done
