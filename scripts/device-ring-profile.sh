#!/usr/bin/env bash
# device-ring-profile.sh runs ON the device machine, with build/ carried (make
# cuda cuda-test-bin here first; build/client.test from
# `CGO_ENABLED=0 go test -c -o build/client.test ./client` for the first
# step): where a same-host ring call's time goes outside the kernel.
#   run: bash scripts/device-ring-profile.sh      (carry: ["build"])
# 1. BenchmarkRingPath (client/ring_bench_test.go): the ring and the service's
#    Go side on a backend that computes nothing, on this host's CPUs.
# 2. The daemon on the CUDA backend (-pprof, -ring, log level warn) with one
#    caller on the ring for each ROWS entry (default: CUDA IPC at M=1, POSIX
#    shm at M=256): while the caller runs, the daemon's CPU profile (two
#    seconds) and a Go execution trace (one).
#    Read them here with `go tool pprof -top build/expertd cpu-*.prof` and
#    `go tool trace trace-*.out`.
# Logs and profiles land under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
build="${EXPERTD_BUILD:-build}"
out="${OUT:-$build/device-out}"
lib="$PWD/$build/libexpertd_cuda.so"
mkdir -p "$out"
S="$out/ring-profile.txt"
: > "$S"
say() { echo "$*" | tee -a "$S"; }
admin=9293
A=127.0.0.1:50171

say "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1) $(nproc) CPUs"
if [[ -x $build/client.test ]]; then
	say "== BenchmarkRingPath (null backend)"
	(cd client && timeout 120 "../$build/client.test" -test.run '^$' -test.bench RingPath -test.benchmem -test.benchtime 20000x 2>&1) |
		grep -E "^(Benchmark|ok|FAIL|---)" | tee -a "$S"
fi

"$build/expertd" -listen "$A" -admin-addr "127.0.0.1:$admin" -backend cuda -library-path "$lib" \
	-shared-memory -ring -pprof -log-level warn > "$out/daemon-profile.log" 2>&1 &
daemon=$!
for _ in $(seq 300); do
	curl -sf "http://127.0.0.1:$admin/readyz" > /dev/null && break
	sleep 0.1
done
timeout 60 "$build/expertbench" -addr "$A" -model nemotron -progress 0 -load -keep -m 1 -c 1 -calls 1 -no-rtt \
	> "$out/load-profile.txt" 2>&1 || say "load failed: $(tail -3 "$out/load-profile.txt")"

for row in ${ROWS:-ipc:1 shm:256}; do
	place=${row%%:*} m=${row##*:}
	flags="-shm"
	[[ $place == ipc ]] && flags="-cuda-ipc -cuda-lib $lib"
	say "== ring $place M=$m"
	# shellcheck disable=SC2086
	timeout 40 "$build/expertbench" -addr "$A" -model nemotron -progress 0 -no-rtt -c 1 -m "$m" -ring $flags \
		-duration 6s > "$out/bench-$place-$m.txt" 2>&1 &
	bench=$!
	sleep 2
	curl -sf -o "$out/cpu-$place-$m.prof" "http://127.0.0.1:$admin/debug/pprof/profile?seconds=2" || say "no CPU profile"
	curl -sf -o "$out/trace-$place-$m.out" "http://127.0.0.1:$admin/debug/pprof/trace?seconds=1" || say "no trace"
	wait "$bench"
	grep -E "^(mode|latency|server|tokens/s|  overhead|expertbench:)" "$out/bench-$place-$m.txt" | tee -a "$S"
done
kill "$daemon" 2> /dev/null
wait "$daemon" 2> /dev/null
say "done"
