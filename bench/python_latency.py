#!/usr/bin/env python3
"""Client latency of FusedMoE from Python with grpcio, one call at a time.

Runs unary FusedMoE calls with BF16 hidden states sent inline on an expert
set already loaded (e.g. by `expertbench -load -keep`, whose set is named
"expertbench"), for each token count given, and prints the client's
p50/p90/p99 beside the server's kernel and total time (p50), and the round
trip of the daemon's health service from this client (the same channel),
so the Python client's overhead can be read against the Go numbers:

    bench/python_latency.py --addr 127.0.0.1:50051 --set expertbench --m 1 256

With --ring it also posts the same calls through a call ring (the daemon
runs with -shared-memory -ring) from the expertd package's Ring, with the
hidden states, logits and output in the ring's shared-memory region, as a
same-host engine would: the Python fast path's latency.

It needs grpcio and numpy (scripts/e2e-setup.sh puts them in .tools/e2e/venv),
and the expertd package's stubs (clients/python on PYTHONPATH, or the
package installed), else grpcio-tools to generate stubs from proto/ into a
temporary directory. --ring needs the package.
"""

import argparse
import os
import sys
import tempfile
import time

import numpy as np


def load_stubs(proto_root):
    try:
        # The expertd package's committed stubs, when it is installed or on
        # PYTHONPATH (clients/python) and this protobuf runtime reads them.
        from expertd.v1 import expert_pb2, expert_pb2_grpc  # noqa: E402

        return expert_pb2, expert_pb2_grpc
    except ImportError:
        pass
    import grpc_tools
    from grpc_tools import protoc

    out = tempfile.mkdtemp(prefix="expertd-stubs-")
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = ["protoc", f"-I{proto_root}", f"-I{well_known}", f"--python_out={out}", f"--grpc_python_out={out}",
            os.path.join(proto_root, "expertd", "v1", "expert.proto")]
    if protoc.main(args) != 0:
        sys.exit("python_latency: protoc failed: " + " ".join(args))
    sys.path.insert(0, out)
    from expertd.v1 import expert_pb2, expert_pb2_grpc  # noqa: E402

    return expert_pb2, expert_pb2_grpc


def pct(sorted_values, p):
    if not sorted_values:
        return 0.0
    i = max(0, min(len(sorted_values) - 1, int(np.ceil(p * len(sorted_values))) - 1))
    return sorted_values[i]


def bf16_bytes(x):
    """Rounds float32 values to bfloat16 (nearest even) and returns the bytes."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r.tobytes()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--addr", default="127.0.0.1:50051", help="gRPC target (host:port or unix:///path)")
    ap.add_argument("--set", default="expertbench", help="loaded expert set to call")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 256], help="tokens per call")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per token count")
    ap.add_argument("--ring", action="store_true", help="also time calls through a call ring (needs the expertd package)")
    ap.add_argument("--proto-root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "proto"))
    a = ap.parse_args()

    import grpc

    pb, pb_grpc = load_stubs(a.proto_root)
    opts = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]
    ch = grpc.insecure_channel(a.addr, options=opts)
    stub = pb_grpc.ExpertServiceStub(ch)
    sets = {s.name: s for s in stub.ListExperts(pb.ListExpertsRequest()).expert_sets}
    if a.set not in sets:
        sys.exit(f"python_latency: no expert set {a.set!r} on {a.addr} (loaded: {sorted(sets)})")
    info = sets[a.set]
    e, k, topk = info.num_experts, info.hidden_size, max(1, info.top_k_hint or 2)

    # The health service's round trip from this client, without the
    # grpcio-health-checking package: an empty HealthCheckRequest is b"".
    check = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda x: x, response_deserializer=lambda x: x)
    for _ in range(200):
        check(b"")
    rtt = []
    for _ in range(2000):
        t0 = time.perf_counter()
        check(b"")
        rtt.append(time.perf_counter() - t0)
    rtt.sort()
    print(f"set {a.set}: E={e} K={k} top_k={topk} on {info.backend}; target {a.addr}")
    print(f"rtt          daemon health from Python p50 {pct(rtt, .5)*1e3:.3f} ms (p90 {pct(rtt, .9)*1e3:.3f}, p99 {pct(rtt, .99)*1e3:.3f})")

    rng = np.random.default_rng(1)
    for m in a.m:
        reqs = []
        for _ in range(4):
            reqs.append(pb.FusedMoERequest(
                expert_set=a.set,
                hidden_states=pb.Tensor(dtype=pb.DATA_TYPE_BFLOAT16, shape=[m, k],
                                        data=bf16_bytes(rng.standard_normal((m, k)) * 0.1)),
                router_logits=pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[m, e],
                                        data=rng.standard_normal((m, e)).astype(np.float32).tobytes()),
                routing=pb.Routing(top_k=topk, renormalize=True),
                output_dtype=pb.DATA_TYPE_BFLOAT16))
        for r in reqs * 5:  # warm-up
            stub.FusedMoE(r)
        lat, kernel, total = [], [], []
        end = time.perf_counter() + a.duration
        i = 0
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            resp = stub.FusedMoE(reqs[i % len(reqs)])
            lat.append(time.perf_counter() - t0)
            kernel.append(resp.timings.kernel_nanos / 1e9)
            total.append(resp.timings.total_nanos / 1e9)
            i += 1
        lat.sort()
        kernel.sort()
        total.sort()
        report(f"M={m:<5d} unary inline BF16", lat, kernel, total)
        if a.ring:
            ring_row(a, m, reqs)


def report(what, lat, kernel, total):
    lat.sort()
    kernel.sort()
    total.sort()
    print(f"{what}  {len(lat)} calls  latency p50 {pct(lat, .5)*1e3:.3f} ms  p90 {pct(lat, .9)*1e3:.3f}  "
          f"p99 {pct(lat, .99)*1e3:.3f}  server kernel p50 {pct(kernel, .5)*1e3:.3f}  total p50 {pct(total, .5)*1e3:.3f}")


def ring_row(a, m, reqs):
    """Times reqs' calls through a one-slot ring with their tensors and
    output in its region."""
    import expertd
    from expertd import ring as ringmod
    from expertd.v1 import expert_pb2 as pb

    page = 4096
    up = lambda n: (n + page - 1) // page * page  # noqa: E731
    r0 = reqs[0]
    hid, lg = len(r0.hidden_states.data), len(r0.router_logits.data)
    out = hid  # BF16 out, [M, K] like the hidden states
    ring_bytes = up(ringmod.size(1, 64 << 10))
    size = ring_bytes + len(reqs) * (up(hid) + up(lg)) + up(out)
    name = f"python-latency-ring-{m}"
    shm = expertd.SharedMemory.create(size)
    client = expertd.Client(a.addr)
    try:
        client.register_shared_memory(name, shm)
        shm.unlink()
        r = ringmod.Ring(shm._buf, 0, slots=1, slot_size=64 << 10)
        attached = ringmod.attach(client.stub, name, r)
        buf = shm.buf
        ref = lambda off, n: pb.SharedMemoryRef(region_name=name, offset=off, byte_size=n)  # noqa: E731
        off, posted = ring_bytes, []
        out_ref = ref(size - up(out), out)
        for q in reqs:
            buf[off:off + hid] = q.hidden_states.data
            h = pb.Tensor(dtype=q.hidden_states.dtype, shape=q.hidden_states.shape, shm=ref(off, hid))
            off += up(hid)
            buf[off:off + lg] = q.router_logits.data
            lt = pb.Tensor(dtype=q.router_logits.dtype, shape=q.router_logits.shape, shm=ref(off, lg))
            off += up(lg)
            posted.append(pb.FusedMoERequest(expert_set=q.expert_set, hidden_states=h, router_logits=lt,
                                             routing=q.routing, output_dtype=q.output_dtype, output_shm=out_ref))
        del buf
        for q in posted * 5:  # warm-up
            r.fused_moe(q, timeout_s=10)
        lat, kernel, total = [], [], []
        end = time.perf_counter() + a.duration
        i = 0
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            resp = r.fused_moe(posted[i % len(posted)], timeout_s=10)
            lat.append(time.perf_counter() - t0)
            kernel.append(resp.timings.kernel_nanos / 1e9)
            total.append(resp.timings.total_nanos / 1e9)
            i += 1
        report(f"M={m:<5d} ring, POSIX shm ", lat, kernel, total)
        attached.cancel()
        r.drop_memory()
        # grpcio may share one connection among channels to a target, and
        # regions belong to the connection: unregister rather than rely on
        # closing the channel.
        client.unregister_shared_memory(name)
    finally:
        client.close()
        shm.close()


if __name__ == "__main__":
    main()
