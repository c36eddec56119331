#!/usr/bin/env bash
# Runs every Go fuzz target for a bounded time, one after another (go test
# fuzzes one target per invocation). The seed corpora committed under
# <package>/testdata/fuzz/<Target>/ run first, as in every plain `go test`;
# a failure writes the crashing input there, to commit as a regression seed.
#
#   scripts/fuzz.sh                  # each target for $FUZZTIME (default 10s)
#   FUZZTIME=2m scripts/fuzz.sh      # longer, e.g. nightly
#   FUZZTIME=1000x scripts/fuzz.sh   # a fixed number of executions
#   scripts/fuzz.sh FuzzCheckRequest # only the named targets
#
# FUZZPARALLEL sets the fuzzing workers (go test -parallel; default: all
# cores).
set -euo pipefail
cd "$(dirname "$0")/.."

fuzztime=${FUZZTIME:-10s}
parallel=()
if [[ -n ${FUZZPARALLEL:-} ]]; then
	parallel=(-parallel "$FUZZPARALLEL")
fi

# Every package with fuzz targets, among the tracked test files.
targets=$(git ls-files '*_test.go' | xargs grep -l '^func Fuzz' | xargs -n1 dirname | sort -u | sed 's#^#./#')
failed=0
for dir in $targets; do
	for name in $(grep -h -o '^func Fuzz[A-Za-z0-9_]*' "$dir"/*_test.go | sed 's/^func //' | sort); do
		if [[ $# -gt 0 && ! " $* " == *" $name "* ]]; then
			continue
		fi
		echo "== $dir $name ($fuzztime)"
		if ! go test -run '^$' -fuzz "^${name}\$" -fuzztime "$fuzztime" "${parallel[@]}" "$dir"; then
			echo "FAIL: $dir $name" >&2
			failed=1
		fi
	done
done
exit $failed
