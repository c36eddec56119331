#!/usr/bin/env bash
# Dynamic batching on the local daemon: for each batching window, start
# expertd, load one layer, time one caller sending M=BIG tokens per call,
# then CALLERS concurrent callers sending SMALL tokens each, and print
# tokens/s, tokens per CPU-second of the daemon (process_cpu_seconds_total:
# the figure that does not depend on how much of a shared machine the
# daemon got) and the mean batch size it recorded (expertd_batch_calls);
# last, one caller sending SMALL tokens, whose latency shows what the
# window costs a caller with nobody to batch with.
# docs/perf-notes.md ("Dynamic batching") has a run.
#
#   scripts/batching-bench.sh                       # nemotron, windows 0 (off) 0.5ms 2ms 5ms
#   WINDOWS="0 2ms" DURATION=30s scripts/batching-bench.sh
#   MODEL=qwen3 SIZES="-k 1024 -n 384" scripts/batching-bench.sh
#
# BACKEND (default cpu) is the daemon's -backend; on a GPU machine add
# LIBRARY=path/to/libexpertd_cuda.so. Window 0 turns batching off. The daemon runs with -max-queued so that
# unbatched callers queue instead of being refused.
set -euo pipefail
cd "$(dirname "$0")/.."

model=${MODEL:-nemotron}
sizes=${SIZES:-}
windows=${WINDOWS:-0 0.5ms 2ms 5ms}
duration=${DURATION:-20s}
callers=${CALLERS:-64}
small=${SMALL:-4}
big=${BIG:-256}
port=${PORT:-50151}
admin=${ADMIN_PORT:-9191}

daemon=""
# BIN=dir uses prebuilt expertd and expertbench (the device machine has no
# Go: make cuda-test-bin cross-builds both into build/).
if [[ -n "${BIN:-}" ]]; then
	bin=$BIN
	trap 'kill "$daemon" 2>/dev/null || true' EXIT
else
	bin=$(mktemp -d)
	trap 'kill "$daemon" 2>/dev/null || true; rm -rf "$bin"' EXIT
	go build -o "$bin/expertd" ./cmd/expertd
	go build -o "$bin/expertbench" ./cmd/expertbench
fi

# tokens_per_s prints the tokens/s of an expertbench -json summary.
tokens_per_s() { sed -n 's/.*"tokens_per_s": \([0-9.]*\).*/\1/p'; }
p50_ms() { sed -n 's/.*"p50_ns": \([0-9]*\).*/\1/p' | awk '{printf "%.1f", $1/1e6}'; }
calls() { sed -n 's/.*"calls": \([0-9]*\).*/\1/p'; }
cpu_s() { curl -s "http://127.0.0.1:$admin/metrics" | awk '/^process_cpu_seconds_total/ {print $2}'; }
mean_batch() {
	curl -s "http://127.0.0.1:$admin/metrics" |
		awk '/^expertd_batch_calls_sum/ {s+=$2} /^expertd_batch_calls_count/ {c+=$2} END {if (c) printf "%.1f", s/c; else printf "-"}'
}

printf '%-7s %9s %9s %8s | %9s %9s %8s | %9s %9s | %6s | %8s\n' window "big tok/s" "tok/cpu-s" "p50 ms" "small t/s" "tok/cpu-s" "p50 ms" "% tok/s" "% cpu-s" batch "lone p50"
for w in $windows; do
	"$bin/expertd" -listen "127.0.0.1:$port" -admin-addr "127.0.0.1:$admin" -backend "${BACKEND:-cpu}" ${LIBRARY:+-library-path "$LIBRARY"} \
		-max-queued 256 -batch-window "$w" -log-level warn &
	daemon=$!
	for _ in $(seq 100); do
		curl -sf "http://127.0.0.1:$admin/healthz" >/dev/null && break
		sleep 0.1
	done
	# shellcheck disable=SC2086 # $sizes is a list of flags
	"$bin/expertbench" -addr "127.0.0.1:$port" -model "$model" $sizes -load -keep -m "$big" -c 1 -calls 1 -progress 0 >/dev/null
	# shellcheck disable=SC2086
	c0=$(cpu_s)
	one=$("$bin/expertbench" -addr "127.0.0.1:$port" -model "$model" $sizes -m "$big" -c 1 -duration "$duration" -progress 0 -json)
	c1=$(cpu_s)
	# shellcheck disable=SC2086
	many=$("$bin/expertbench" -addr "127.0.0.1:$port" -model "$model" $sizes -m "$small" -c "$callers" -duration "$duration" -progress 0 -json)
	c2=$(cpu_s)
	batch=$(mean_batch)
	# shellcheck disable=SC2086
	lone=$("$bin/expertbench" -addr "127.0.0.1:$port" -model "$model" $sizes -m "$small" -c 1 -duration "$duration" -progress 0 -json)
	t1=$(tokens_per_s <<<"$one")
	t2=$(tokens_per_s <<<"$many")
	e1=$(awk -v n="$(calls <<<"$one")" -v m="$big" -v a="$c0" -v b="$c1" 'BEGIN {print n*m/(b-a)}')
	e2=$(awk -v n="$(calls <<<"$many")" -v m="$small" -v a="$c1" -v b="$c2" 'BEGIN {print n*m/(b-a)}')
	printf '%-7s %9.0f %9.1f %8s | %9.0f %9.1f %8s | %8.0f%% %8.0f%% | %6s | %8s\n' "$w" "$t1" "$e1" "$(p50_ms <<<"$one")" \
		"$t2" "$e2" "$(p50_ms <<<"$many")" "$(awk -v a="$t2" -v b="$t1" 'BEGIN {print 100*a/b}')" \
		"$(awk -v a="$e2" -v b="$e1" 'BEGIN {print 100*a/b}')" "$batch" "$(p50_ms <<<"$lone")"
	kill "$daemon"
	wait "$daemon" 2>/dev/null || true
done
