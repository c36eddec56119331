# device-daemon.sh is sourced by the device scripts that run a daemon and a
# Python caller on the device machine (device-latency.sh, device-lane.sh).
# The sourcing script sets build, out, lib, admin and say (its log line)
# first.

# daemon_start LISTEN LOG [daemon flags...] starts build/expertd on the cuda
# backend with the library of build/, logging to $out/LOG, and waits (up to
# 30 s) for it to be ready; $daemon is its pid.
daemon_start() {
	local listen=$1 log=$2
	shift 2
	"$build/expertd" -listen "$listen" -admin-addr "127.0.0.1:$admin" -backend cuda -library-path "$lib" \
		"$@" > "$out/$log" 2>&1 &
	daemon=$!
	for _ in $(seq 300); do
		curl -sf "http://127.0.0.1:$admin/readyz" > /dev/null && return 0
		sleep 0.1
	done
	say "daemon not ready after 30 s: $(tail -3 "$out/$log")"
	return 1
}

# daemon_stop ends the daemon without waiting on anything else the shell
# started.
daemon_stop() {
	kill "$daemon" 2> /dev/null
	for _ in $(seq 100); do
		kill -0 "$daemon" 2> /dev/null || return 0
		sleep 0.1
	done
	say "daemon did not stop in 10 s"
	kill -9 "$daemon" 2> /dev/null
}

# python_path prints the PYTHONPATH for the expertd package of
# clients/python and the folders given. PY_WHEELS: a folder of wheels
# (grpcio, protobuf, googleapis-common-protos at the versions
# clients/python's stubs are generated for) installed into a scratch
# directory first on the path, for a machine whose own protobuf cannot read
# the committed stubs. PYTHON names the interpreter (default python3).
python_path() {
	local p="$PWD/clients/python" d site
	for d in "$@"; do p="$p:$d"; done
	if [[ -n ${PY_WHEELS:-} ]]; then
		site=$(mktemp -d)
		"${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
			"$PY_WHEELS"/*.whl >&2 && p="$site:$p"
	fi
	echo "$p"
}
