#!/usr/bin/env bash
# device-latency.sh runs ON the device machine, with build/ carried (make cuda
# cuda-test-bin here first: it cross-builds expertd and expertbench): issue
# 16's single-caller table and its throughput rows, on the Nemotron layer
# with static activation scales (set "static", loaded with expertbench
# -scales static: a per-tensor a13 and an a2 calibrated as bench/peer.py's,
# the layer bench/moe_bench.py times, so the server's kernel time compares
# with the bench's). Every row's label shows its flags.
#   run: bash scripts/device-latency.sh      (carry: ["build"])
# One daemon on TCP loopback (-shared-memory -ring, log level warn) serves
# M=1 and M=256 unary and stream calls with tensors inline (BF16, and FP8
# hidden states at M=256), through POSIX shared memory and CUDA IPC, and
# through the call ring (over CUDA IPC also with FP8 hidden states, that
# row again on the same weights with dynamic scales, set "expertbench", for
# comparison); then 4 callers over shm, ring and CUDA IPC, 8
# callers inline on one connection and on 8; then the Python client
# (bench/python_latency.py, when grpcio and numpy import); then the same
# daemon on a Unix socket; then the ring with the library's completion spin
# (-cuda-sync-spin). Every expertbench summary prints the client p50/p90/p99
# beside the server's kernel and total time; the first one prints the RTT
# (a bare grpc-go round trip in the bench's process and the daemon's health
# service). DURATION (default 3s) is per row. Logs land under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
build="${EXPERTD_BUILD:-build}"
out="${OUT:-$build/device-out}"
dur="${DURATION:-3s}"
lib="$PWD/$build/libexpertd_cuda.so"
mkdir -p "$out"
S="$out/latency.txt"
: > "$S"
say() { echo "$*" | tee -a "$S"; }
admin=9291
daemon=""

# shellcheck source=scripts/device-daemon.sh
source scripts/device-daemon.sh
# The static set's rows pass these flags; the dynamic row, dyn's. Both sets
# hold the same weights (one seed).
st=(-set static -scales static)
dyn=(-set expertbench -scales dynamic)
load() { # load LISTEN LOG FLAGS...: upload and keep a Nemotron layer
	local listen=$1 log=$2
	shift 2
	timeout 60 "$build/expertbench" -addr "$listen" -model nemotron -progress 0 -load -keep -seed 1 -m 1 -c 1 -calls 1 -no-rtt "$@" \
		> "$out/load-$log.txt" 2>&1 || say "load $* failed on $listen: $(tail -3 "$out/load-$log.txt")"
}
start() { # start LISTEN LOG [daemon flags...]
	local listen=$1 log=$2
	shift 2
	daemon_start "$listen" "$log" -shared-memory -ring -max-queued 256 -log-level warn "$@"
	load "$listen" "$log" "${st[@]}"
}
stop() { daemon_stop; }
row() { # row ADDR [expertbench flags...]
	local addr=$1
	shift
	say "== $*"
	timeout 30 "$build/expertbench" -addr "$addr" -model nemotron -progress 0 -duration "$dur" "$@" 2>&1 |
		grep -E "^(model|mode|latency|server|rtt|tokens/s|  overhead|expertbench:)" | tee -a "$S"
}
ipc="-cuda-ipc -cuda-lib $lib"

say "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader 2>&1)"
A=127.0.0.1:50161
start "$A" daemon-tcp.log
load "$A" daemon-tcp-dynamic.log "${dyn[@]}"
row "$A" "${st[@]}" -c 1 -m 1
for m in 1 256; do
	row "$A" "${st[@]}" -no-rtt -c 1 -m "$m" -stream
	[[ $m == 256 ]] && row "$A" "${st[@]}" -no-rtt -c 1 -m 256 && row "$A" "${st[@]}" -no-rtt -c 1 -m 256 -hidden fp8
	row "$A" "${st[@]}" -no-rtt -c 1 -m "$m" -shm
	# shellcheck disable=SC2086
	row "$A" "${st[@]}" -no-rtt -c 1 -m "$m" $ipc
	row "$A" "${st[@]}" -no-rtt -c 1 -m "$m" -ring -shm
	# shellcheck disable=SC2086
	row "$A" "${st[@]}" -no-rtt -c 1 -m "$m" -ring $ipc
	# The bench's input dtype and scales: one-token FP8 calls take GEMM1's
	# fused routing (DecodeRoute), BF16 ones the separate prologue kernel,
	# and dynamic scales add the prologue, the quantizing gather and the
	# requant.
	# shellcheck disable=SC2086
	row "$A" "${st[@]}" -no-rtt -c 1 -m "$m" -ring $ipc -hidden fp8
	# shellcheck disable=SC2086
	row "$A" "${dyn[@]}" -no-rtt -c 1 -m "$m" -ring $ipc -hidden fp8
done
row "$A" "${st[@]}" -no-rtt -c 4 -m 256 -shm
row "$A" "${st[@]}" -no-rtt -c 4 -m 256 -ring -shm
# shellcheck disable=SC2086
row "$A" "${st[@]}" -no-rtt -c 4 -m 256 -ring $ipc
row "$A" "${st[@]}" -no-rtt -c 8 -m 256
row "$A" "${st[@]}" -no-rtt -c 8 -m 256 -conns 8
py="${PYTHON:-python3}"
pypath=$(python_path)
if PYTHONPATH="$pypath" "$py" -c 'import grpc, numpy' 2> /dev/null; then
	say "== Python grpcio unary inline, set static"
	PYTHONPATH="$pypath" timeout 60 "$py" bench/python_latency.py --ring --addr "$A" --set static --m 1 256 --duration "${dur%s}" 2>&1 |
		tail -8 | tee -a "$S"
else
	say "== Python: grpcio or numpy missing"
fi
stop

U="unix:///tmp/expertd-latency-$$.sock"
start "$U" daemon-unix.log
for m in 1 256; do
	row "$U" "${st[@]}" -no-rtt -c 1 -m "$m"
	row "$U" "${st[@]}" -no-rtt -c 1 -m "$m" -stream
done
stop

start "$A" daemon-spin.log -cuda-sync-spin 100us
for m in 1 256; do
	# shellcheck disable=SC2086
	row "$A" "${st[@]}" -no-rtt -c 1 -m "$m" -ring $ipc
	row "$A" "${st[@]}" -no-rtt -c 1 -m "$m" -ring -shm
done
stop
say "done"
