#!/usr/bin/env bash
# sass-diff.sh BASE_REF [NEW_REF] proves a CUDA refactor changes no machine
# code: it builds the library (cuda-build.sh) from kernels/cuda/csrc at
# BASE_REF and at NEW_REF (default: the working tree), then compares every
# kernel's SASS (cuobjdump -sass of the .so, per architecture and kernel,
# instruction addresses, encodings and branch labels normalised) and every
# function's ptxas -v report (registers, spills, stack, shared memory).
# It prints one line per kernel that differs or exists on one side only,
# and exits 1 if any does.
#
# Needs no GPU. NVCC as in cuda-build.sh; cuobjdump from CUOBJDUMP, else
# beside nvcc, else on PATH, else the copy Triton ships in the e2e tools'
# venv (EXPERTD_E2E_TOOLS, default .tools/e2e). SASS_DIFF_DIR (default
# /tmp/sass-diff-$USER) keeps the builds; a ref's build is reused while
# its sources are unchanged, so a second run against the same base builds
# one library.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
base="${1:?usage: sass-diff.sh BASE_REF [NEW_REF]}"
new="${2:-}"
dir="${SASS_DIFF_DIR:-/tmp/sass-diff-${USER:-$(id -u)}}"
mkdir -p "$dir"
source "$root/scripts/nvcc-env.sh"

cuobjdump="${CUOBJDUMP:-}"
if [[ -z "$cuobjdump" ]]; then
  for c in "$cuda_home/bin/cuobjdump" "$(command -v cuobjdump || true)" \
    "${EXPERTD_E2E_TOOLS:-$root/.tools/e2e}"/venv/lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump; do
    if [[ -n "$c" && -x "$c" ]]; then cuobjdump="$c"; break; fi
  done
fi
[[ -n "$cuobjdump" ]] || { echo "sass-diff: no cuobjdump (set CUOBJDUMP)" >&2; exit 2; }

# build NAME REF: the library of REF's sources (the working tree's where
# REF is empty) in $dir/NAME, unless the sources match the last build's.
build() {
  local name="$1" ref="$2" d="$dir/$1"
  rm -rf "$d/src.new"
  mkdir -p "$d/src.new"
  if [[ -n "$ref" ]]; then
    git -C "$root" archive "$ref" kernels/cuda/csrc | tar -x -C "$d/src.new" --strip-components=3
  else
    (cd "$root/kernels/cuda/csrc" && git ls-files --cached --others --exclude-standard -z | xargs -0 cp --parents -t "$d/src.new")
  fi
  if [[ -f "$d/build/libexpertd_cuda.so" && -d "$d/src" ]] && diff -r -q "$d/src" "$d/src.new" >/dev/null; then
    rm -rf "$d/src.new"
    echo "sass-diff: $name (${ref:-working tree}): sources unchanged, reusing its build"
    return
  fi
  rm -rf "$d/src" "$d/build"
  mv "$d/src.new" "$d/src"
  echo "sass-diff: building $name (${ref:-working tree})"
  EXPERTD_CSRC="$d/src" EXPERTD_BUILD="$d/build" EXPERTD_OBJ="$d/obj" NVCC="$nvcc" \
    bash "$root/scripts/cuda-build.sh" >"$d/build.log" 2>&1 || { cat "$d/build.log" >&2; exit 1; }
}
build base "$base"
build new "$new"

"$cuobjdump" -sass "$dir/base/build/libexpertd_cuda.so" >"$dir/base.sass"
"$cuobjdump" -sass "$dir/new/build/libexpertd_cuda.so" >"$dir/new.sass"

python3 - "$dir" <<'EOF'
import re, sys
d = sys.argv[1]

def anon(s):
    """Anonymous namespaces' names carry a hash of the build; keep the file name."""
    return re.sub(r'_GLOBAL__N__[0-9a-f]+_\d+_(\w+?)_cu_[0-9a-f]{8}', r'_GLOBAL__N__\1', s)

def sass(path):
    """Per (arch, kernel): its instructions, addresses, encodings and labels normalised."""
    out, arch, fn, labels = {}, None, None, {}
    for line in open(path):
        line = anon(line)
        m = re.match(r'\s*arch = (\S+)', line)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r'\s*Function : (\S+)', line)
        if m:
            fn, labels = (arch, m.group(1)), {}
            out[fn] = []
            continue
        if line.startswith('Fatbin'):
            fn = None
        if fn is None or not re.match(r'\s*/\*[0-9a-f]{4,}\*/', line):
            continue
        ins = re.sub(r'/\*[0-9a-f]{4,}\*/', '', line)        # instruction address
        ins = re.sub(r'/\* 0x[0-9a-f]{16} \*/', '', ins)     # encoding
        ins = ins.strip()
        def label(m):
            return labels.setdefault(m.group(0), '.L%d' % len(labels))
        ins = re.sub(r'\.L_x_\d+', label, ins)
        out[fn].append(ins)
    return out

def ptxas(path):
    """Per (arch, function): its ptxas -v lines (registers, spills, stack, smem)."""
    out, key = {}, None
    for line in open(path):
        line = anon(line)
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([^' ]+)'?(?: for '(\S+)')?", line)
        if m and 'Compiling' in line:
            key = (m.group(2), m.group(1))
            out.setdefault(key, [])
            continue
        if m:
            key = (key[0] if key else None, m.group(1))
            out.setdefault(key, [])
            continue
        if key and re.search(r'Used \d+ registers|bytes stack frame|spill', line):
            out[key].append(re.sub(r'^ptxas info\s*:\s*', '', line.strip()))
    return out

def shape(lines):
    """A kernel's instructions as a multiset, registers and branch targets left out."""
    out = []
    for ins in lines:
        ins = re.sub(r'\bU?[RPB]\d+\b', 'R', ins).replace('.reuse', '')
        if re.match(r'(@!?U?P\w* )?(BRA|BSSY|CALL|JMP|BRX)\b', ins):
            ins = re.sub(r'0x[0-9a-f]+', 'ADDR', ins)
        out.append(ins)
    return sorted(out)

bad = 0
for what, fn in (('sass', sass), ('ptxas', ptxas)):
    src = {'sass': '%s.sass', 'ptxas': '%s/build/ptxas.txt'}[what]
    a, b = fn(d + '/' + src % 'base'), fn(d + '/' + src % 'new')
    same = 0
    for k in sorted(set(a) | set(b), key=str):
        if k not in a or k not in b:
            print('%s: %s %s: only in %s' % (what, k[0], k[1], 'new' if k in b else 'base'))
            bad += 1
        elif a[k] != b[k]:
            n = sum(1 for x, y in zip(a[k], b[k]) if x != y) + abs(len(a[k]) - len(b[k]))
            note = ''
            if what == 'sass':
                note = '; same instructions, other order or registers' if shape(a[k]) == shape(b[k]) else \
                    '; %d and %d instructions' % (len(a[k]), len(b[k]))
            print('%s: %s %s: %d of %d lines differ%s' % (what, k[0], k[1], n, max(len(a[k]), len(b[k])), note))
            bad += 1
        else:
            same += 1
    print('sass-diff: %s: %d functions identical, %d in all' % (what, same, len(set(a) | set(b))))
sys.exit(1 if bad else 0)
EOF
