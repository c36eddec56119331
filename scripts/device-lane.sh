#!/usr/bin/env bash
# device-lane.sh runs ON the device machine, with build/ carried (make cuda
# cuda-test-bin here first: build/expertd cross-built and
# build/libexpertd_cuda.so): the GPU-ordered lane (docs/gpu-ordered.md)
# against the library in-process, on the Nemotron layer, without MPS and
# then under MPS when the machine has nvidia-cuda-mps-control.
#   run: bash scripts/device-lane.sh      (carry: ["build"])
# First, when build/cuda.test is there (make cuda-test-bin), the Go tests of
# the library's lane (TestLaneOnDevice) and of the backend's other paths
# with a lane waiting (TestLaneWaitingBlocksNothing: a hang names its step). Then each phase starts a daemon (-backend cuda -shared-memory), then one Python
# process (torch, and the expertd package from clients/python; PY_WHEELS as
# in device-latency.sh where grpcio or protobuf are missing) that:
#   - uploads the layer to the daemon and creates the same layer in-process
#     through bench/expertd_ctypes.py (the library of build/);
#   - opens a lane (M = 1) and leaves it waiting, then, each step under a
#     60 s limit that names the step that hung ("FAIL: HUNG: ..."): cuda_ipc
#     calls of new shapes (M = 8, then 256: the workspace grows) and the
#     CUDA IPC regions' unregistration, host-memory calls of the same
#     shapes (the pinned staging grows), a POSIX region registered and
#     unregistered, a second set loaded and unloaded, a second lane opened,
#     rung and closed; then rings the waiting lane and checks its output
#     against the cuda_ipc path's bytes;
#   - checks a lane call's output against the cuda_ipc path's (FusedMoE on
#     CUDA IPC regions) bytes for bytes, at M = 1, 16 and 64, three inputs
#     each, and reports whether the in-process call's bytes agree too;
#   - times one call (p50 of CUDA events on the caller's stream) in-process
#     and over the lane, and a 48-layer dependent chain (each output the
#     next input) in-process and over the lane, from a stream and from a
#     captured CUDA graph, printing p50 per layer and the ratio.
# Expected: under MPS the chain within ~1.10x; without MPS ~9x (a context
# switch per call). Wall time about 3 minutes. Logs land under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
build="${EXPERTD_BUILD:-build}"
out="${OUT:-$build/device-out}"
lib="$PWD/$build/libexpertd_cuda.so"
mkdir -p "$out"
S="$out/lane.txt"
: > "$S"
say() { echo "$*" | tee -a "$S"; }
admin=9293
listen=127.0.0.1:50163
daemon=""
py="${PYTHON:-python3}"
# shellcheck source=scripts/device-daemon.sh
source scripts/device-daemon.sh
pypath=$(python_path "$PWD/bench")

cat > "$out/lane_bench.py" << 'EOF'
import ctypes
import dataclasses
import os
import statistics
import sys
import threading
import time

import numpy as np
import torch

import expertd
import expertd_ctypes as xc
import peer
from expertd import lane as el

addr, lib_path = sys.argv[1], sys.argv[2]
LAYERS, WARM, REPS, CALLS = 48, 3, 20, 200
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
if not hasattr(ctypes.CDLL(lib_path), "expertd_lane_open"):
    sys.exit("this library has no lanes (expertd_lane_open): build main's kernels/cuda/csrc")
shape = peer.NEMOTRON
gen = torch.Generator(device=dev).manual_seed(1)
w = peer.make_weights(shape, dev, gen)
zero = torch.tensor(0.0, device=dev)
# Dynamic activation scales, as the daemon's upload below has.
w = dataclasses.replace(w, a13_scale=zero, a2_scale=zero.clone())
c = expertd.Client(addr)
t0 = time.time()
c.load_experts("lane", w.w13.cpu(), w.w2.cpu(), w.w13_scale.cpu().numpy(), w.w2_scale.cpu().numpy(),
               activation="relu2", overwrite=True)
print(f"uploaded {shape.name} in {time.time() - t0:.1f} s")
routing = expertd.routing(top_k=shape.top_k, renormalize=shape.renormalize, scoring=shape.scoring,
                          correction_bias=w.correction_bias.cpu().numpy(),
                          routed_scaling_factor=shape.scaling_factor)
lib = xc.Library(lib_path)
lib.init(0)
es = xc.ExpertSet(lib, 0, w)
print(f"library: {lib.device_info(0)}; caller MPS client: {el.mps_enabled(0)}")
K, E = shape.K, shape.E


def inproc(x, logits, out):
    """The layer in-process on torch's current stream (BF16 in and out)."""
    call = xc.Call.from_buffer_copy(es.params(x.shape[0]))
    call.n_hidden_scale = 0
    call.hidden = xc.Buf(x.data_ptr(), xc.DTYPE_BFLOAT16, xc.MEM_DEVICE)
    call.logits = xc.Buf(logits.data_ptr(), xc.DTYPE_FLOAT32, xc.MEM_DEVICE)
    call.correction_bias = xc.Buf(es.bias.data_ptr(), xc.DTYPE_FLOAT32, xc.MEM_DEVICE)
    call.out = xc.Buf(out.data_ptr(), xc.DTYPE_BFLOAT16, xc.MEM_DEVICE)
    call.stream = torch.cuda.current_stream().cuda_stream
    lib.check("expertd_moe_device", lib.lib.expertd_moe_device(es.handle, ctypes.byref(call)))


def buffers(name, m):
    """A registered CUDA IPC region holding hidden [m, K] BF16, logits
    [m, E] FP32 and out [m, K] BF16, and the request naming them."""
    hb, lb = m * K * 2, m * E * 4
    lo = (hb + 255) // 256 * 256
    oo = lo + (lb + 255) // 256 * 256
    arena = torch.zeros(oo + hb, dtype=torch.uint8, device=dev)
    region = c.register_cuda_tensor(name, arena)
    h = arena[:hb].view(torch.bfloat16).view(m, K)
    lg = arena[lo:lo + lb].view(torch.float32).view(m, E)
    out = arena[oo:oo + hb].view(torch.bfloat16).view(m, K)
    req = expertd.fused_moe_request(region.tensor(h), expert_set="lane", router_logits=region.tensor(lg),
                                    routing_message=routing, output_shm=region.ref(out))
    return arena, h, lg, out, req


def p50_us(f, reps):
    s = torch.cuda.current_stream()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for r in range(WARM + reps):
        e0.record(s)
        f()
        e1.record(s)
        e1.synchronize()
        if r >= WARM:
            ts.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(ts)


def step(name, fn, timeout=60):
    """Runs fn with the hold lane open and waiting; a step that does not
    return within timeout names itself and ends the process (a thread
    stuck in a CUDA call cannot be stopped)."""
    got = {}

    def run():
        try:
            got["v"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            got["e"] = e

    t0 = time.time()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout)
    if th.is_alive():
        print(f"FAIL: HUNG: {name} did not return in {timeout} s with a lane open and waiting", flush=True)
        os._exit(3)
    if "e" in got:
        print(f"FAIL: {name}: {got['e']!r}", flush=True)
        os._exit(4)
    print(f"with a lane waiting: {name}: ok in {time.time() - t0:.2f} s", flush=True)
    return got.get("v")


# With a lane open and waiting (its stream holds stream memory waits on a
# doorbell nobody rings yet), every other path of the daemon completes: a
# synchronizing CUDA call in the daemon would wait for that lane forever.
hold = buffers("hold", 1)
hold_lane = el.open_lane(c, hold[4], 0, depth=2)
hold[1].copy_((torch.randn(1, K, generator=gen, device=dev) / 10).bfloat16())
hold[2].copy_(torch.randn(1, E, generator=gen, device=dev))
torch.cuda.synchronize()
for m in (8, 256):  # new shapes, the second growing the workspace (a free)
    kept = step(f"register the M={m} CUDA IPC region (cudaIpcOpenMemHandle)", lambda: buffers(f"grow{m}", m))
    kept[1].copy_((torch.randn(m, K, generator=gen, device=dev) / 10).bfloat16())
    kept[2].copy_(torch.randn(m, E, generator=gen, device=dev))
    torch.cuda.synchronize()
    step(f"cuda_ipc FusedMoE at new M={m}", lambda: c.stub.FusedMoE(kept[4], timeout=120))
    step(f"unregister the M={m} CUDA IPC region (cudaIpcCloseMemHandle)", lambda: c.unregister_shared_memory(f"grow{m}"))
cpu_gen = torch.Generator().manual_seed(2)
for m in (8, 256):  # host memory: the pinned staging grows too (cudaFreeHost)
    xh = (torch.randn(m, K, generator=cpu_gen) / 10).numpy()
    lh = torch.randn(m, E, generator=cpu_gen).numpy()
    step(f"host-memory FusedMoE at new M={m}",
         lambda: c.fused_moe(xh, expert_set="lane", router_logits=lh, routing_message=routing, timeout=120))
shm = expertd.SharedMemory.create(1 << 20)
step("register a POSIX region (cudaHostRegister)", lambda: c.register_shared_memory("posix", shm))
step("unregister it (cudaHostUnregister)", lambda: c.unregister_shared_memory("posix"))
shm.close()
tiny = 8, 256, 128  # E, K, N: a set of its own, loaded and unloaded
step("load a second set",
     lambda: c.load_experts("lane-tmp", np.zeros((tiny[0], tiny[2], tiny[1]), np.uint8),
                            np.zeros((tiny[0], tiny[1], tiny[2]), np.uint8), np.ones(tiny[0], np.float32),
                            np.ones(tiny[0], np.float32), activation="relu2", overwrite=True, timeout=120))
step("unload it (its weights freed)", lambda: c.unload_experts("lane-tmp", timeout=120))
second = step("register the second lane's CUDA IPC region", lambda: buffers("second", 4))
second[1].copy_((torch.randn(4, K, generator=gen, device=dev) / 10).bfloat16())
second[2].copy_(torch.randn(4, E, generator=gen, device=dev))
torch.cuda.synchronize()
lane2 = step("open a second lane (M=4)", lambda: el.open_lane(c, second[4], 0, depth=2))


def ring_and_wait(lane):
    lane.enqueue(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()


step("ring the second lane once", lambda: ring_and_wait(lane2))
step("close the second lane", lane2.close)
step("unregister the second lane's region", lambda: c.unregister_shared_memory("second"))
step("ring the waiting lane at last", lambda: ring_and_wait(hold_lane))
lane_out = hold[3].clone()
hold_req = hold[4]
step("the cuda_ipc call of the waiting lane's request", lambda: c.stub.FusedMoE(hold_req, timeout=120))
same = torch.equal(lane_out.view(torch.int16), hold[3].view(torch.int16))
print(f"the waiting lane's output == the cuda_ipc call's bytes: {same}")
if not same:
    sys.exit("FAIL: the waiting lane's output differs from the cuda_ipc path's")

lanes = {}
for m in (1, 16, 64):
    keep_ipc = buffers(f"ipc{m}", m)
    _, h, lg, out, req = keep_ipc
    keep_lane = buffers(f"lane{m}", m)
    _, h2, lg2, out2, lreq = keep_lane
    lane = el.open_lane(c, lreq, 0, depth=16)
    lanes[m] = (lane, keep_ipc, keep_lane)
    xi, yi = torch.empty(m, K, dtype=torch.bfloat16, device=dev), torch.empty(m, K, dtype=torch.bfloat16, device=dev)
    li = torch.empty(m, E, dtype=torch.float32, device=dev)
    for i in range(3):
        x = (torch.randn(m, K, generator=gen, device=dev) / 10).bfloat16()
        logits = torch.randn(m, E, generator=gen, device=dev)
        for dst, src in ((h, x), (lg, logits), (h2, x), (lg2, logits), (xi, x), (li, logits)):
            dst.copy_(src)
        # The cuda_ipc path reads inputs the caller has finished writing.
        torch.cuda.synchronize()
        c.stub.FusedMoE(req)
        lane.enqueue(torch.cuda.current_stream().cuda_stream)
        inproc(xi, li, yi)
        torch.cuda.synchronize()
        same = torch.equal(out2.view(torch.int16), out.view(torch.int16))
        lib_same = torch.equal(yi.view(torch.int16), out.view(torch.int16))
        print(f"M={m} input {i}: lane == cuda_ipc bytes: {same}; in-process == cuda_ipc bytes: {lib_same}")
        if not same:
            sys.exit(f"FAIL: the lane's output differs from the cuda_ipc path's at M={m}")
    print(f"M={m}: lane depth {lane.depth}, daemon MPS {lane.mps}, skips on close {lane.skips_on_close}")

for m in (1, 16, 64):
    lane, (_, h, lg, out, _), (_, h2, lg2, out2, _) = lanes[m]
    xi = torch.randn(m, K, device=dev).bfloat16() / 10
    li = torch.randn(m, E, device=dev)
    yi = torch.empty_like(xi)
    t_in = p50_us(lambda: inproc(xi, li, yi), CALLS)
    t_lane = p50_us(lambda: lane.enqueue(torch.cuda.current_stream().cuda_stream), CALLS)
    print(f"one call, M={m}: in-process p50 {t_in:.1f} us, lane p50 {t_lane:.1f} us, "
          f"lane - in-process {t_lane - t_in:+.1f} us, ratio {t_lane / t_in:.2f}x")

# The chain: 48 dependent layers at M = 1, each output the next input.
m = 1
lane, _, (_, h2, lg2, out2, _) = lanes[m]
x0 = torch.randn(m, K, device=dev).bfloat16() / 10
lg2.copy_(torch.randn(m, E, device=dev))
xi, yi, li = torch.empty_like(x0), torch.empty_like(x0), lg2.clone()


def chain_in():
    for layer in range(LAYERS):
        xi.copy_(yi if layer else x0)
        inproc(xi, li, yi)


def chain_lane():
    for layer in range(LAYERS):
        h2.copy_(out2 if layer else x0)
        lane.enqueue(torch.cuda.current_stream().cuda_stream)


rows = {}
rows["stream"] = (p50_us(chain_in, REPS), p50_us(chain_lane, REPS))
torch.cuda.synchronize()
print(f"chain ends equal (lane vs in-process): {torch.equal(out2.view(torch.int16), yi.view(torch.int16))}")
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    chain_in()
    chain_lane()
torch.cuda.synchronize()
g_in, g_lane = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
with torch.cuda.graph(g_in):
    chain_in()
with torch.cuda.graph(g_lane):
    chain_lane()
rows["CUDA graph"] = (p50_us(g_in.replay, REPS), p50_us(g_lane.replay, REPS))
torch.cuda.synchronize()
print(f"graph chain ends equal (lane vs in-process): {torch.equal(out2.view(torch.int16), yi.view(torch.int16))}")
for how, (t_in, t_lane) in rows.items():
    print(f"chain of {LAYERS}, M=1, from a {how}: in-process p50 {t_in / LAYERS:.1f} us/layer, "
          f"lane {t_lane / LAYERS:.1f} us/layer, ratio {t_lane / t_in:.3f}x")
for lane, _, _ in lanes.values():
    lane.close()
hold_lane.close()
es.free()
print("done")
EOF

phase() { # phase NAME
	say "== $1: $(nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader 2>&1)"
	daemon_start "$listen" "daemon-$1.log" -shared-memory -lanes -log-level info
	PYTHONPATH="$pypath" timeout 300 "$py" "$out/lane_bench.py" "$listen" "$lib" 2>&1 | tee -a "$S"
	say "python exit ${PIPESTATUS[0]}"
	curl -s "http://127.0.0.1:$admin/metrics" | grep -E '^expertd_lane' | tee -a "$S"
	daemon_stop
	grep -E 'lane (opened|closed)|closing a lane' "$out/daemon-$1.log" | tail -4 | tee -a "$S"
}

# The library's side alone: a lane rung from a second process with copies
# (kernels/cuda/lane_gpu_test.go), when the Go test binary was carried.
if [[ -x $build/cuda.test ]]; then
	say "== TestLaneOnDevice, TestLaneWaitingBlocksNothing"
	EXPERTD_LIBRARY_PATH="$lib" EXPERTD_CUDA_REQUIRE=1 timeout 240 "$build/cuda.test" \
		-test.run '^TestLane(OnDevice|WaitingBlocksNothing)$' -test.v 2>&1 | tail -20 | tee -a "$S"
fi
phase "without MPS"
if command -v nvidia-cuda-mps-control > /dev/null; then
	export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
	mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
	if nvidia-cuda-mps-control -d; then
		phase "under MPS"
		echo quit | nvidia-cuda-mps-control
		tail -n 5 "$CUDA_MPS_LOG_DIRECTORY"/control.log 2> /dev/null
	else
		say "MPS control daemon did not start"
	fi
else
	say "no nvidia-cuda-mps-control on this machine"
fi
say "done"
