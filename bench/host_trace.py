"""Where a small call's time goes on each of the library's doors, kernel by kernel.

For each model, token count M, hidden-state dtype and scale mode it runs one
layer through three doors, each call alone (the host waits for it before the
next starts, as a service's single call runs):

  graph        expertd_moe_device captured in a torch CUDA graph and replayed,
               as `moe_bench.py --lone` times it (CUDA events around the replay)
  host-device  expertd_moe, the synchronous host API, as the daemon calls it for
               a CUDA IPC request (kernels/cuda/backend.go, packCall): hidden
               states, logits and output in device memory; the hidden-state
               scales, the correction bias and any routing results in pageable
               host memory (Go slices); a graph per call shape (use_graph) and
               kernel_ms asked for
  host-pinned  the same with hidden states, logits and output in page-locked host
               memory (a registered POSIX shared-memory region), their memory
               kind left UNKNOWN so the library asks the driver, as the daemon does

It prints per door the call's wall time (host entry to return) and device time
(the library's kernel_ms; the graph door's events, as moe_bench) over --iters
calls, the doors interleaved so they share the card's state, then from
--profile-calls calls under the PyTorch profiler (CUPTI sees the kernels and
copies the library launches from C too) every GPU operation of one call in
order: label, start relative to the call's first kernel, duration and the gap
before it, medians over the calls; and the CUDA API calls the call made, from
its entry. The profiler slows the host side (CUPTI wraps each API call), so the
gaps a host launch leaves are longer there than in the timed calls; the
durations and the gaps inside a graph are not.

Scale modes: "static" is moe_bench's layer (a static a13 and a calibrated static
a2 scale; FP8 hidden states quantized at a13 with that one scale); "dynamic" is
the same weights loaded with a13 = a2 = 0 (dynamic, as expertbench's layer and
build/host_path's are), FP8 hidden states quantized per token (M scales, as
expertbench sends them). Block-scaled layers take per-group scales in both. The
doors of one case share the set, the input sets and their rotation, so their
outputs must be the same bytes, which it checks.

Inputs rotate over --sets sets (as moe_bench's do, so M = 1's few experts do not
stay in L2); each is copied into a door's own fixed buffers before its call, out
of the timed span, so the host doors' graph keys (device addresses) stay fixed
as a ring slot's do. Markers (a tiny torch kernel) bracket each profiled call,
which is how the trace is split into calls.

  device (carry build):  python3 bench/host_trace.py
  options:  --models nemotron-3-nano,qwen3-30b-a3b --tokens 1,16 --hidden fp8,bf16
            --scales static,dynamic --paths graph,host-device,host-pinned
            --routing none|host   (host: routing results into pageable memory,
            as a request with return_routing; the graph door never asks)

With OUT set it writes $OUT/host_trace.json, and with --chrome-traces each
door's profiler trace ($OUT/host_trace.<case>.<door>.json, for Perfetto).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

PATHS = ("graph", "host-device", "host-pinned")
HIDDEN = ("fp8", "bf16")
SCALES = ("static", "dynamic")
ROUTING = ("none", "host")
# The record_function range around each profiled call, and the kernel of the
# markers that bracket it on the GPU (torch.cuda._sleep's).
CALL_RANGE = "host_trace call"
MARKER = "spin_kernel"
MARKER_CYCLES = 1000

# One profiler event: start and end in µs on the profiler's clock.
Ev = collections.namedtuple("Ev", "start end name")


# ---------------------------------------------------------------- arguments


def _list_of(flag: str, allowed: tuple[str, ...]):
    """An argparse type: a comma list of values from allowed."""
    def parse(text: str) -> list[str]:
        got = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in got if v not in allowed]
        if not got or bad:
            raise argparse.ArgumentTypeError(
                f"{flag} {text[:40]!r}: want a comma list of {', '.join(allowed)}")
        return got
    return parse


def _tokens(text: str) -> list[int]:
    """An argparse type: a comma list of token counts >= 1."""
    try:
        got = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        got = []
    if not got or min(got) < 1:
        raise argparse.ArgumentTypeError(f"--tokens {text[:40]!r}: want a comma list of integers >= 1")
    return got


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: want an integer >= 1")
    return v


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", default=None, help="libexpertd_cuda.so (default build/libexpertd_cuda.so)")
    ap.add_argument("--models", "--model", default="nemotron-3-nano,qwen3-30b-a3b",
                    help="comma list of bench/peer.py MODELS")
    ap.add_argument("--tokens", type=_tokens, default=[1, 16], help="comma list of M")
    ap.add_argument("--hidden", type=_list_of("--hidden", HIDDEN), default=list(HIDDEN),
                    help="hidden-state dtypes: fp8, bf16")
    ap.add_argument("--scales", type=_list_of("--scales", SCALES), default=list(SCALES),
                    help="static (moe_bench's layer), dynamic (expertbench's and host_path's)")
    ap.add_argument("--paths", type=_list_of("--paths", PATHS), default=list(PATHS), help="doors to run")
    ap.add_argument("--routing", choices=ROUTING, default="none",
                    help="host doors: none (no return_routing, the default request) or host (pageable)")
    ap.add_argument("--iters", type=_positive, default=200, help="timed calls per door")
    ap.add_argument("--warmup", type=_positive, default=20,
                    help="untimed calls per door first (>= 3: the host doors capture their graph on the second)")
    ap.add_argument("--sets", type=_positive, default=8, help="input sets rotated")
    ap.add_argument("--profile-calls", type=_positive, default=30, help="calls per door under the profiler")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--chrome-traces", action="store_true", help="write each door's profiler trace to $OUT")
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.models:
        ap.error("--models: empty")
    if args.warmup < 3:
        ap.error(f"--warmup {args.warmup}: want >= 3, or the host doors' graph capture lands in the timed calls")
    return args


# ---------------------------------------------------------------- the trace


def is_copy(name: str) -> bool:
    """Whether a GPU operation is a copy or a memset rather than a kernel."""
    return name.lower().startswith(("memcpy", "memset"))


def split_calls(gpu: list[Ev], n: int) -> list[list[Ev]] | None:
    """Each call's GPU operations, from a trace sorted by start in which every
    call is bracketed by two marker kernels (inputs copied in between the
    brackets); None when the markers do not number 2n."""
    marks = [i for i, e in enumerate(gpu) if MARKER in e.name]
    if len(marks) != 2 * n:
        return None
    return [gpu[marks[2 * k] + 1:marks[2 * k + 1]] for k in range(n)]


def split_by_ranges(gpu: list[Ev], ranges: list[Ev]) -> list[list[Ev]]:
    """Each call's GPU operations as those starting inside its host range
    (the fallback: the GPU clock is mapped onto the host's, not shared)."""
    return [[e for e in gpu if r.start <= e.start <= r.end and MARKER not in e.name] for r in ranges]


def op_rows(ops: list[Ev], label, origin: float | None = None) -> list[dict]:
    """One call's operations as rows: label, name, kind, start relative to
    origin (default: the call's first kernel, else its first operation),
    duration and the gap after the latest end before it (None for the first)."""
    if origin is None:
        kernels = [e for e in ops if not is_copy(e.name)]
        origin = (kernels or ops)[0].start if ops else 0.0
    rows, last_end = [], None
    for e in ops:
        rows.append({"label": label(e.name), "name": e.name, "kind": "copy" if is_copy(e.name) else "kernel",
                     "start": e.start - origin, "dur": e.end - e.start,
                     "gap": None if last_end is None else e.start - last_end})
        last_end = e.end if last_end is None else max(last_end, e.end)
    return rows


def _span(rows: list[dict]) -> float | None:
    if not rows:
        return None
    return max(r["start"] + r["dur"] for r in rows) - min(r["start"] for r in rows)


def summarize(per_call: list[list[dict]]) -> dict:
    """Medians over calls of each position of the commonest sequence of
    labels (calls with another sequence are counted, not merged), and of the
    call's span (first start to last end) and its kernels' span."""
    if not per_call:
        return {"calls": 0, "matching": 0, "ops": [], "span_us": None, "kernel_span_us": None, "others": []}
    seqs = [tuple(r["label"] for r in rows) for rows in per_call]
    counts = collections.Counter(seqs)
    modal, count = counts.most_common(1)[0]
    same = [rows for rows, s in zip(per_call, seqs) if s == modal]
    ops = []
    for j, label in enumerate(modal):
        col = [rows[j] for rows in same]
        gaps = [c["gap"] for c in col if c["gap"] is not None]
        ops.append({"label": label, "name": col[0]["name"], "kind": col[0]["kind"],
                    "start": statistics.median(c["start"] for c in col),
                    "dur": statistics.median(c["dur"] for c in col),
                    "gap": statistics.median(gaps) if gaps else None})
    spans = [_span(rows) for rows in same]
    kspans = [s for s in (_span([r for r in rows if r["kind"] == "kernel"]) for rows in same) if s is not None]
    return {"calls": len(per_call), "matching": count, "ops": ops,
            "span_us": statistics.median(s for s in spans if s is not None) if modal else None,
            "kernel_span_us": statistics.median(kspans) if kspans else None,
            "others": [{"labels": list(s), "calls": c} for s, c in counts.most_common()[1:]]}


def api_calls(cpu: list[Ev], ranges: list[Ev]) -> list[list[Ev]]:
    """Each call's CUDA runtime and driver API calls (names cuda*, cu*)
    inside its host range, sorted by start."""
    return [sorted(e for e in cpu if r.start <= e.start and e.end <= r.end and e.name.startswith("cu"))
            for r in ranges]


def after_entry(calls: list[list[Ev]], ranges: list[Ev], kernels_only: bool) -> float | None:
    """Median µs from a call's host entry to its first GPU operation (or first
    kernel): launch latency as the profiler's mapped clocks see it."""
    got = []
    for ops, r in zip(calls, ranges):
        ops = [e for e in ops if not (kernels_only and is_copy(e.name))]
        if ops:
            got.append(ops[0].start - r.start)
    return statistics.median(got) if got else None


def analyze(gpu: list[Ev], cpu: list[Ev], n: int, label) -> dict:
    """The profiled calls of one door: GPU operations and API calls per call,
    summarized; gpu and cpu are the profiler's events on each side."""
    ranges = sorted({e for e in cpu if e.name == CALL_RANGE})
    gpu = sorted(e for e in gpu if e.name != CALL_RANGE)
    calls, split = split_calls(gpu, n), "markers"
    if calls is None:
        calls, split = split_by_ranges(gpu, ranges), "host ranges"
    rec = {"split": split, "gpu": summarize([op_rows(c, label) for c in calls])}
    if len(ranges) == len(calls):
        rec["first_op_after_entry_us"] = after_entry(calls, ranges, False)
        rec["first_kernel_after_entry_us"] = after_entry(calls, ranges, True)
        rec["api"] = summarize([op_rows(c, str, r.start) for c, r in zip(api_calls(cpu, ranges), ranges)])
    return rec


# ---------------------------------------------------------------- the report


def _us(v, width: int = 7) -> str:
    return f"{v:{width}.1f}" if isinstance(v, (int, float)) else " " * (width - 1) + "-"


def format_ops(title: str, s: dict, name_width: int = 70) -> str:
    """A summary's operations as a table under title."""
    lines = [f"-- {title} (medians of {s['matching']} of {s['calls']} calls with this sequence)",
             f"  {'#':>2}  {'op':<28} {'start':>7} {'dur':>7} {'gap':>7}  name"]
    for i, o in enumerate(s["ops"]):
        lines.append(f"  {i:>2}  {o['label'][:28]:<28} {_us(o['start'])} {_us(o['dur'])} {_us(o['gap'])}  "
                     f"{o['name'][:name_width]}")
    for other in s.get("others", []):
        lines.append(f"  ({other['calls']} calls ran another sequence: {', '.join(other['labels'])})")
    return "\n".join(lines)


def format_case(case: dict) -> str:
    """One case's doors: the timing table, then each door's trace."""
    lines = [f"== {case['model']} M={case['M']} hidden={case['hidden']} scales={case['scales']} "
             f"routing={case['routing']}",
             f"  {'door':<12} {'wall p50':>9} {'wall p90':>9} {'device p50':>10} {'device p90':>10} "
             f"{'span':>7} {'kernels':>7} {'1st op':>7} {'1st krn':>7}  same bytes"]
    for d in case["doors"]:
        p = d.get("profile", {})
        g = p.get("gpu", {})
        lines.append(f"  {d['door']:<12} {_us(d['wall_p50'], 9)} {_us(d['wall_p90'], 9)} {_us(d['device_p50'], 10)} "
                     f"{_us(d['device_p90'], 10)} {_us(g.get('span_us'))} {_us(g.get('kernel_span_us'))} "
                     f"{_us(p.get('first_op_after_entry_us'))} {_us(p.get('first_kernel_after_entry_us'))}  "
                     f"{d.get('same_bytes', '-')}")
    lines.append("  (µs; wall and device from the timed calls; span = first GPU op to last end, kernels = first "
                 "kernel to last kernel end, 1st op / 1st krn = from host entry, all from the profiled calls)")
    for d in case["doors"]:
        p = d.get("profile")
        if not p:
            continue
        lines.append(format_ops(f"{d['door']}: GPU operations from the first kernel (split by {p['split']})",
                                p["gpu"]))
        if "api" in p:
            lines.append(format_ops(f"{d['door']}: CUDA API calls from the call's entry", p["api"]))
    return "\n".join(lines)


def percentile(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[int(q * (len(s) - 1))]


# ---------------------------------------------------------------- the device


def run(args) -> int:
    """Every case on the GPU; prints the report, writes $OUT/host_trace.json."""
    import ctypes
    import dataclasses

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import expertd_ctypes as xc
    import peer
    from moe_bench import capture, log
    from kernel_names import kernel_label

    unknown = [m for m in args.models if m not in peer.MODELS]
    if unknown:
        print(f"host_trace: unknown model {unknown[0][:60]!r}; known: {', '.join(peer.MODELS)}", file=sys.stderr)
        return 2
    lib = xc.load(args.lib or xc.DEFAULT_LIB)
    if lib is None:
        print(f"host_trace: no library at {args.lib or xc.DEFAULT_LIB} (make cuda; carry build)", file=sys.stderr)
        return 2
    if lib.abi < 4:
        print(f"host_trace: library ABI {lib.abi} has no expertd_call (needs 4)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    # torch makes the context before expertd_init, as in moe_bench: the
    # library's eager module loading (expertd_init) would otherwise load every
    # torch kernel too.
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed)
    lib.init(0)
    log(f"lib {lib.path}: {lib.device_info(0)}; torch {torch.__version__}")
    out_dir = os.environ.get("OUT")

    def label(name: str) -> str:
        return name if is_copy(name) else kernel_label(name)

    class Door:
        """One way into the library with its own fixed buffers."""

        name = ""

        def __init__(self, sets, pinned_inputs: bool):
            self.sets = sets
            h, s, lg = sets[0]["dev"]
            where = {"pin_memory": True} if pinned_inputs else {"device": dev}
            self.hidden = torch.empty(h.shape, dtype=h.dtype, **where)
            self.logits = torch.empty(lg.shape, dtype=lg.dtype, **where)
            self.pinned_inputs = pinned_inputs

        def prepare(self, i: int) -> None:
            """Set i's inputs into this door's buffers; the GPU idle after."""
            src = self.sets[i % len(self.sets)]["cpu" if self.pinned_inputs else "dev"]
            self.hidden.copy_(src[0])
            self.logits.copy_(src[2])
            self.copy_scale(i)
            torch.cuda.synchronize()

        def copy_scale(self, i: int) -> None:
            raise NotImplementedError

        def run(self) -> tuple[float, float]:
            """One call alone: (wall µs, device µs)."""
            raise NotImplementedError

        def output(self):
            return self.out.cpu().view(torch.int16)

    class GraphDoor(Door):
        """(c): moe_bench --lone's replay of expertd_moe_device."""

        name = "graph"

        def __init__(self, es, template, sets, bias, M, K):
            super().__init__(sets, False)
            s0 = sets[0]["dev"][1]
            self.scale = None if s0 is None else torch.empty_like(s0)
            self.out = torch.empty(M, K, dtype=torch.bfloat16, device=dev)
            c = xc.Call.from_buffer_copy(template)
            c.hidden, c.logits, c.out = xc.buf(self.hidden), xc.buf(self.logits), xc.buf(self.out)
            if self.scale is not None:
                c.hidden_scale = xc.buf(self.scale)
            if bias is not None:
                c.correction_bias = xc.buf(bias)
            self.call = c
            self.prepare(0)
            self.graph = capture(lambda: es.launch(c), "thread_local")
            self.ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

        def copy_scale(self, i):
            if self.scale is not None:
                self.scale.copy_(self.sets[i % len(self.sets)]["dev"][1])

        def run(self):
            a, b = self.ev
            t0 = time.perf_counter()
            a.record()
            self.graph.replay()
            b.record()
            b.synchronize()
            return (time.perf_counter() - t0) * 1e6, a.elapsed_time(b) * 1e3

    class HostDoor(Door):
        """(a) and (b): expertd_moe as the daemon fills expertd_call."""

        def __init__(self, name, es, template, sets, bias_cpu, M, K, top_k, pinned, routing):
            super().__init__(sets, pinned)
            self.name, self.es = name, es
            s0 = sets[0]["cpu"][1]
            # Go slices: pageable, and said to be.
            self.scale = None if s0 is None else torch.empty_like(s0)
            if pinned:
                self.out = torch.empty(M, K, dtype=torch.bfloat16, pin_memory=True)
                mem = xc.MEM_UNKNOWN  # the daemon's tensorBuf: host bytes, the driver tells
            else:
                self.out = torch.empty(M, K, dtype=torch.bfloat16, device=dev)
                mem = xc.MEM_DEVICE
            c = xc.Call.from_buffer_copy(template)
            c.hidden, c.logits, c.out = xc.buf(self.hidden, mem), xc.buf(self.logits, mem), xc.buf(self.out, mem)
            if self.scale is not None:
                c.hidden_scale = xc.buf(self.scale, xc.MEM_PAGEABLE)
            if bias_cpu is not None:
                c.correction_bias = xc.buf(bias_cpu, xc.MEM_PAGEABLE)
            self.routing = None
            if routing == "host":
                self.routing = (torch.empty(M * top_k, dtype=torch.int32), torch.empty(M * top_k))
                c.topk_ids_out = xc.buf(self.routing[0], xc.MEM_PAGEABLE)
                c.topk_weights_out = xc.buf(self.routing[1], xc.MEM_PAGEABLE)
            c.use_graph = 1
            self.ms = ctypes.c_float(0)
            c.kernel_ms = ctypes.pointer(self.ms)
            self.call = c

        def copy_scale(self, i):
            if self.scale is not None:
                self.scale.copy_(self.sets[i % len(self.sets)]["cpu"][1])

        def run(self):
            t0 = time.perf_counter()
            self.es.moe_host(self.call)
            return (time.perf_counter() - t0) * 1e6, self.ms.value * 1e3

    def inputs(shape, w, M, hidden, scales):
        """One input set: the hidden states (and their scales, or None) and
        logits, on the device and in pageable host memory."""
        x = torch.randn(M, shape.K, generator=gen, device=dev) / 10
        logits = torch.randn(M, shape.E, generator=gen, device=dev)
        if hidden == "bf16":
            h, s = x.bfloat16(), None
        elif shape.block is not None:
            h, s = peer.quantize_groups(x, shape.block[1])
        elif scales == "static":
            h, s = peer.quantize_static(x, w.a13_scale), w.a13_scale.float().reshape(1)
        else:
            h, s = peer.quantize_groups(x, shape.K)
        if s is not None:
            s = s.reshape(-1).contiguous()
        d = (h.contiguous(), s, logits)
        return {"dev": d, "cpu": tuple(None if t is None else t.cpu() for t in d)}

    def time_doors(doors) -> dict:
        """Warm-up, then --iters calls of every door interleaved, each call on
        the set after the one the call before it ran (whichever door)."""
        nd = len(doors)
        got = {d.name: ([], []) for d in doors}
        for phase, n in (("warmup", args.warmup), ("timed", args.iters)):
            for i in range(n):
                for k, d in enumerate(doors):
                    d.prepare(i * nd + k)
                    wall, devt = d.run()
                    if phase == "timed":
                        got[d.name][0].append(wall)
                        got[d.name][1].append(devt)
        return got

    def profile(d, tag: str) -> dict:
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        n = args.profile_calls
        walls = []
        with torch.profiler.profile(activities=acts) as prof:
            for i in range(n):
                d.prepare(i)
                torch.cuda._sleep(MARKER_CYCLES)
                torch.cuda.synchronize()
                with torch.profiler.record_function(CALL_RANGE):
                    walls.append(d.run())
                torch.cuda._sleep(MARKER_CYCLES)
                torch.cuda.synchronize()
        gpu, cpu = [], []
        for e in prof.events():
            ev = Ev(float(e.time_range.start), float(e.time_range.end), e.name)
            (gpu if e.device_type == torch.autograd.DeviceType.CUDA else cpu).append(ev)
        rec = analyze(gpu, cpu, n, label)
        rec["wall_p50_profiled"] = statistics.median(w for w, _ in walls)
        rec["device_p50_profiled"] = statistics.median(t for _, t in walls)
        if args.chrome_traces and out_dir:
            os.makedirs(out_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(out_dir, f"host_trace.{tag}.{d.name}.json"))
        return rec

    cases = []
    for model in args.models:
        shape = peer.MODELS[model]
        w = peer.make_weights(shape, dev, gen)
        peer.calibrate_a2_scale(w, 256, dev, gen)
        zero = torch.tensor(0.0, dtype=torch.float32, device=dev)
        sets_by_scales = {}
        for scales in args.scales:
            ws = w if scales == "static" else dataclasses.replace(w, a13_scale=zero, a2_scale=zero.clone())
            sets_by_scales[scales] = xc.ExpertSet(lib, 0, ws)
        bias_cpu = None if w.correction_bias is None else w.correction_bias.float().cpu().contiguous()
        log(f"{model}: a13 {float(w.a13_scale):.3e}, a2 {float(w.a2_scale):.3e} (static); sets "
            + ", ".join(sets_by_scales))
        for M in args.tokens:
            for hidden in args.hidden:
                for scales in args.scales:
                    es = sets_by_scales[scales]
                    sets = [inputs(shape, w, M, hidden, scales) for _ in range(args.sets)]
                    template = es.params(M)
                    s0 = sets[0]["dev"][1]
                    template.n_hidden_scale = 0 if s0 is None else s0.numel()
                    doors = []
                    for p in args.paths:
                        if p == "graph":
                            doors.append(GraphDoor(es, template, sets, es.bias, M, shape.K))
                        else:
                            doors.append(HostDoor(p, es, template, sets, bias_cpu, M, shape.K, shape.top_k,
                                                  p == "host-pinned", args.routing))
                    tag = f"{model}.m{M}.{hidden}.{scales}"
                    log(f"{tag}: timing {', '.join(d.name for d in doors)}")
                    timed = time_doors(doors)
                    # Same input, every door: the same kernels on the same
                    # bytes must give the same bytes.
                    outs = {}
                    for d in doors:
                        d.prepare(0)
                        d.run()
                        outs[d.name] = d.output()
                    ref = outs[doors[0].name]
                    recs = []
                    for d in doors:
                        walls, devs = timed[d.name]
                        r = {"door": d.name, "wall_p50": percentile(walls, 0.5), "wall_p90": percentile(walls, 0.9),
                             "device_p50": percentile(devs, 0.5), "device_p90": percentile(devs, 0.9)}
                        if d is not doors[0]:
                            r["same_bytes"] = bool(torch.equal(outs[d.name], ref))
                        try:
                            r["profile"] = profile(d, tag)
                        except Exception as e:  # the timings stand without the trace
                            log(f"{tag} {d.name}: profiling failed: {type(e).__name__}: {str(e)[:200]}")
                        recs.append(r)
                    case = {"model": model, "M": M, "hidden": hidden, "scales": scales, "routing": args.routing,
                            "doors": recs}
                    cases.append(case)
                    print(format_case(case), flush=True)
                    del doors, sets
                    torch.cuda.synchronize()
        for es in sets_by_scales.values():
            es.free()
        del w
        torch.cuda.empty_cache()
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "host_trace.json"), "w") as f:
            json.dump({"lib": lib.path, "device": torch.cuda.get_device_name(0),
                       "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "args": {k: v for k, v in vars(args).items()}, "cases": cases}, f, indent=1)
    return 0


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
