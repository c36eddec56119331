#!/usr/bin/env bash
# device-service.sh runs ON the device machine, after device-check.sh, with
# build/ carried (make cuda cuda-test-bin here first: it cross-builds
# expertd and expertbench). It starts the real daemon on the GPU and
# measures the service path on the Nemotron layer with expertbench: one
# caller at M = 1, 16, 256, 1024 with tensors inline and through POSIX
# shared memory (end-to-end p50 against the server's kernel time, and the
# per-stage breakdown), then dynamic batching (64 callers x 4 tokens
# against one caller x 256) via scripts/batching-bench.sh.
# DURATION (default 5s) is per measurement; TOKENS (default "1 16 256
# 1024"; set to "" to skip this part) and MODES (default "inline inline-fp8 shm cuda-ipc ring-shm
# ring-cuda-ipc": BF16 or FP8 hidden states inline, or BF16 through POSIX
# shared memory or through GPU memory shared with CUDA IPC, by RPC or, for
# ring-*, through a call ring, docs/ring.md) pick the calls. Between those and the
# batching run (BATCHING=0 skips it), 4 callers at M=256 with batching off
# and 1, then 2 streams per set measure the overlap of concurrent calls
# (OVERLAP=0 skips it). LATENCY=1 (the default; 0 skips it) then runs
# scripts/device-latency.sh: issue 16's single-caller table (M = 1 and
# 256 over every transport, the ring included) and its throughput rows.
# Logs land under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
build="${EXPERTD_BUILD:-build}"
out="${OUT:-$build/device-out}"
dur="${DURATION:-5s}"
mkdir -p "$out"
lib="$PWD/$build/libexpertd_cuda.so"
port=50161 admin=9291
"$build/expertd" -listen "127.0.0.1:$port" -admin-addr "127.0.0.1:$admin" -backend cuda -library-path "$lib" \
	-shared-memory -ring -max-queued 256 -log-level info > "$out/daemon.log" 2>&1 &
daemon=$!
trap 'kill "$daemon" 2>/dev/null || true' EXIT
for _ in $(seq 300); do
	curl -sf "http://127.0.0.1:$admin/healthz" >/dev/null && break
	sleep 0.1
done
grep -m3 -iE 'backend|cuda|gpu' "$out/daemon.log"
bench() { "$build/expertbench" -addr "127.0.0.1:$port" -model nemotron -progress 0 "$@"; }
bench -load -keep -m 1 -c 1 -calls 1 > "$out/load.txt" 2>&1 || { echo "load failed"; cat "$out/load.txt"; exit 1; }
for m in ${TOKENS-1 16 256 1024}; do
	for mode in ${MODES:-inline inline-fp8 shm cuda-ipc ring-shm ring-cuda-ipc}; do
		case $mode in
		inline) flag="" ;;
		inline-fp8) flag="-hidden fp8" ;;
		shm) flag=-shm ;;
		cuda-ipc) flag="-cuda-ipc -cuda-lib $lib" ;;
		ring-shm) flag="-ring -shm" ;;
		ring-cuda-ipc) flag="-ring -cuda-ipc -cuda-lib $lib" ;;
		*) echo "unknown mode $mode"; exit 2 ;;
		esac
		echo "== nemotron M=$m c=1 $mode"
		# shellcheck disable=SC2086
		bench -m "$m" -c 1 -duration "$dur" $flag 2>&1 | tee "$out/svc-$m-$mode.txt" | tail -25
	done
done
# What Prometheus would see of those calls: the sub-millisecond buckets of
# the RPC, kernel and queue histograms, and the build.
curl -sf "http://127.0.0.1:$admin/metrics" > "$out/metrics.txt" || echo "scraping /metrics failed"
grep -E '^expertd_build_info|^(rpc_server_call_duration_seconds|expertd_(kernel|queue)_duration_seconds)_bucket.*le="(5e-05|0\.0001|0\.0002|0\.0005|0\.001)"' "$out/metrics.txt" |
	grep -E 'FusedMoE"|expert_set|build_info' | sed -E 's/otel_scope_[a-z_]+="[^"]*",?//g'
echo "per-call log lines at -log-level info: $(grep -c 'finished call' "$out/daemon.log")"
kill "$daemon"; wait "$daemon" 2>/dev/null

# Overlap across concurrent calls: 4 callers x M=256 with batching off (so
# the calls stay separate), the library running 1 or 2 calls per set at
# once (EXPERTD_CUDA_STREAMS); OVERLAP=0 skips it.
if [[ ${OVERLAP:-1} != 0 ]]; then
	for streams in 1 2; do
		EXPERTD_CUDA_STREAMS=$streams "$build/expertd" -listen "127.0.0.1:$port" -admin-addr "127.0.0.1:$admin" -backend cuda \
			-library-path "$lib" -shared-memory -batch-window 0 -max-queued 256 -log-level warn > "$out/daemon-streams$streams.log" 2>&1 &
		daemon=$!
		for _ in $(seq 300); do
			curl -sf "http://127.0.0.1:$admin/healthz" >/dev/null && break
			sleep 0.1
		done
		bench -load -keep -m 1 -c 1 -calls 1 > /dev/null 2>&1 || { echo "load failed"; exit 1; }
		for mode in ${OVERLAP_MODES:-inline shm}; do
			flag=""
			[[ $mode == shm ]] && flag=-shm
			echo "== overlap: streams=$streams nemotron M=256 c=4 $mode"
			# shellcheck disable=SC2086
			bench -m 256 -c 4 -duration "$dur" $flag 2>&1 | tee "$out/overlap-$streams-$mode.txt" | grep -E "tokens/s|latency|server "
		done
		kill "$daemon"; wait "$daemon" 2>/dev/null
	done
fi
# Issue 16's single-caller latency table and its throughput rows.
if [[ ${LATENCY:-1} != 0 ]]; then
	EXPERTD_BUILD="$build" OUT="$out" DURATION="$dur" scripts/device-latency.sh
fi
[[ ${BATCHING:-1} == 0 ]] && exit 0
echo "== dynamic batching (64 x 4 tokens against 1 x 256)"
BIN="$build" BACKEND=cuda LIBRARY="$lib" WINDOWS="${WINDOWS:-0 0.2ms 0.5ms}" DURATION="$dur" \
	scripts/batching-bench.sh 2>&1 | tee "$out/batching.txt"
