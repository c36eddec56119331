"""Where a FusedMoE call's time goes, and two builds of the library side by side.

For each model and M it times the full op of every --lib given (CUDA-graph
replay, median of --iters, --sets input sets rotated, as moe_bench.py does),
interleaving the libraries round by round so they share the card's state,
and splits each library's call into its kernels with the PyTorch profiler
(CUPTI), so an A/B names the kernel that moved: each kernel's exclusive time is its end minus the later of its start
and the previous kernel's end, so the time a programmatic-dependent-launch
kernel spends parked in griddepcontrol.wait behind its predecessor counts
for the predecessor, and the exclusive times add up to the call. With two
libraries it also says whether their outputs are the same bytes on every
input set.

  python3 bench/moe_profile.py --lib build/libexpertd_cuda.so --lib other.so \\
      --model qwen3-30b-a3b --tokens 1,256,8192

--lib-env sets environment variables while the --lib at the same position
initializes, for the library's environment switches (EXPERTD_SM90_CUTLASS):
give the two --lib two copies of one file, since a path loaded twice is one
library.

Prints one table per model; with OUT set also writes $OUT/moe_profile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import expertd_ctypes  # noqa: E402
import peer  # noqa: E402
from kernel_names import kernel_label  # noqa: E402
from moe_bench import capture, log, vllm_table  # noqa: E402


def exclusive_us(prof, calls: int) -> dict[str, float]:
    """Per-call exclusive device µs by kernel label (see the module doc)."""
    evs = []
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        if "memcpy" in e.name.lower() or "memset" in e.name.lower():
            label = "memcpy/memset"
        else:
            label = kernel_label(e.name)
        evs.append((e.time_range.start, e.time_range.end, label))
    evs.sort()
    out: dict[str, float] = {}
    prev_end = None
    for start, end, label in evs:
        begin = start if prev_end is None else max(start, prev_end)
        out[label] = out.get(label, 0.0) + max(0.0, end - begin)
        prev_end = end if prev_end is None else max(prev_end, end)
    return {k: v / calls for k, v in out.items()}


def kernel_columns(splits: list[dict[str, float]]) -> str:
    """Each kernel's exclusive µs in every library ("-" where one has no
    such kernel), slowest first by the first library's figure."""
    names = sorted({k for s in splits for k in s}, key=lambda k: -splits[0].get(k, 0.0))
    return ", ".join(f"{k} " + "/".join(f"{s[k]:.1f}" if k in s else "-" for s in splits) for k in names)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", action="append", required=True, help="a libexpertd_cuda.so (repeat for A/B)")
    ap.add_argument("--lib-env", action="append", default=[],
                    help="KEY=VALUE[,KEY=VALUE] in the environment while the --lib at the same position "
                         "initializes ('' for none)")
    ap.add_argument("--models", "--model", default="nemotron-3-nano,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,16,64,256,1024,4096,8192")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--sets", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per library")
    ap.add_argument("--profile-calls", type=int, default=40, help="calls under the profiler, per --lib")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed)
    libs = []
    for li, path in enumerate(args.lib):
        spec = args.lib_env[li] if li < len(args.lib_env) else ""
        env = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            lib = expertd_ctypes.load(path)
            lib.init(0)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        libs.append(lib)
        log(f"lib {path}{' ' + spec if spec else ''}: {lib.device_info(0)}")
    card, vllm_label, vllm_ms = vllm_table(torch.cuda.get_device_name(0))
    log(f"vLLM GEMMs-only table: {vllm_label if card else 'n/a'}")
    records = []
    for name in args.models.split(","):
        shape = peer.MODELS[name]
        w = peer.make_weights(shape, dev, gen)
        peer.calibrate_a2_scale(w, 256, dev, gen)
        sets_by_lib = [expertd_ctypes.ExpertSet(lib, 0, w) for lib in libs]
        for M in [int(m) for m in args.tokens.split(",")]:
            inputs = [peer.make_inputs(shape, w, M, dev, gen) for _ in range(args.sets)]
            outs = [[torch.empty(M, shape.K, dtype=torch.bfloat16, device=dev) for _ in inputs] for _ in libs]
            graphs = []
            for li, es in enumerate(sets_by_lib):
                params = es.params(M)
                fns = [lambda es=es, i=i, li=li: es.moe_device(inputs[i][0], inputs[i][1], outs[li][i], params,
                                                               hidden_scale=inputs[i][2] if len(inputs[i]) > 2
                                                               else None)
                       for i in range(len(inputs))]
                graphs.append([capture(fn, "thread_local") for fn in fns])
            for gs in graphs:
                for g in gs:
                    g.replay()
            torch.cuda.synchronize()

            def same_bytes():
                if len(libs) < 2:
                    return None
                return all(torch.equal(outs[0][i].view(torch.int16), outs[li][i].view(torch.int16))
                           for li in range(1, len(libs)) for i in range(len(inputs)))

            same = same_bytes()
            ms = [[] for _ in libs]
            for _ in range(args.rounds):
                for li, gs in enumerate(graphs):
                    for i in range(args.warmup):
                        gs[i % len(gs)].replay()
                    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(args.iters)]
                    for i, (a, b) in enumerate(ev):
                        a.record()
                        gs[i % len(gs)].replay()
                        b.record()
                    torch.cuda.synchronize()
                    ms[li] += [a.elapsed_time(b) for a, b in ev]
            med = [statistics.median(x) for x in ms]
            # Again after the timed replays: whatever device state a library
            # keeps between calls must not make later replays drift.
            if same is not None:
                same = same and same_bytes()
            splits = []
            for gs in graphs:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for i in range(args.profile_calls):
                        gs[i % len(gs)].replay()
                    torch.cuda.synchronize()
                splits.append(exclusive_us(prof, args.profile_calls))
            vllm = vllm_ms.get((name, M))
            # kernels_us: one split per --lib, in their order.
            rec = {"model": name, "M": M, "ms": med, "same_bytes": same, "kernels_us": splits,
                   "vllm_gemms_ms": vllm}
            records.append(rec)
            ratio = "  ".join(f"{m / vllm:.3f}x" for m in med) if vllm else ""
            log(f"{name} M={M}: " + " / ".join(f"{m:.4f}" for m in med) + f" ms  (vs vLLM GEMMs {ratio})"
                + (f"  same bytes: {same}" if same is not None else ""))
            for li, split in enumerate(splits):
                log(f"    lib{li}: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(split.items(), key=lambda kv: -kv[1]))
                    + f"  (sum {sum(split.values()):.1f} us)")
            del graphs, outs, inputs
            torch.cuda.synchronize()
        for es in sets_by_lib:
            es.free()
        del w
        torch.cuda.empty_cache()
    libs_label = " / ".join(f"lib{i}" for i in range(len(libs)))
    print("| model | M | " + " | ".join(f"lib{i} ms" for i in range(len(libs))) + f" | same bytes | kernels (µs, {libs_label}) |")
    print("|---|---|" + "---|" * len(libs) + "---|---|")
    for r in records:
        print(f"| {r['model']} | {r['M']} | " + " | ".join(f"{m:.4f}" for m in r["ms"]) + f" | {r['same_bytes']} | "
              + kernel_columns(r["kernels_us"]) + " |")
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "moe_profile.json"), "w") as f:
            json.dump({"libs": args.lib, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
