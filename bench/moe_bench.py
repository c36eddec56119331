"""FusedMoE kernel benchmark on one GPU: expertd against the PyTorch and FlashInfer peers.

For each model and token count M it builds a random FP8 layer (randn weights
quantized per expert, randn/10 hidden states at a static per-tensor scale,
randn logits), checks expertd and the peer against the float64 reference on
small M, then times with CUDA events, median of --iters replays after warm-up,
rotating --sets input sets (the weights, 1.28 GB for Nemotron, exceed the 60 MB
L2 by themselves; rotation keeps M=1's few experts from staying cached):

  expertd       the full op through expertd_moe_device, CUDA-graph replay
  expertd-gemm  skipped: the ABI has no GEMM-only entry point
  peer          bench/peer.py's TorchPeer, the full op, CUDA-graph replay
  peer-gemm     the peer's two torch._scaled_grouped_mm calls on pre-permuted data
  flashinfer    the peers' routing, then FlashInfer's cutlass_fused_moe (bench/
                flashinfer_peer.py; autotuned for the timed M once per model),
                CUDA-graph replay
  flashinfer-moe  cutlass_fused_moe alone on precomputed top-k ids and weights

FlashInfer runs where it imports (bench/run.sh installs the carried copy) and
its layer is per-tensor FP8; the log says when it is absent. Its output is
checked against the float64 reference first (the error is printed) and it is
timed only within FLASHINFER_TIME_BAR. The quoted vLLM GEMMs-only table is the
card's (H200 or H100, by the device's name; "n/a" on other cards).

DeepSeek-V3 (--model deepseek-v3; not in the default run, see DEFAULT_MODELS)
is block-scaled: 128x128 weight blocks, FP8 hidden states in with per-token-group
(128) scales, the intermediate requantized per token group. Its peer is
bench/peer.py's BlockPeer, which calls torch._scaled_mm per expert and so syncs
with the host once per call: its full op is timed eagerly (the timing column says
so); its GEMMs alone are graph-captured. A v1 library (no block scales) runs the
peer alone for it and the tables say "unsupported".

gpt-oss-120b runs gpt-oss's clamped SwiGLU (SWIGLU_OAI) with per-expert biases
on both GEMMs, which expertd takes from ABI 5 on (expertd_set_params): an
older library runs the peers alone for it and the tables say "unsupported".

Before the models it measures the card's two ceilings (measure_ceilings: a
device-to-device copy and torch._scaled_mm's dense FP8 product, a few seconds):
every "% of" column, the targets set as shares of them, the header and the
picture use what it measured on this card. --ceilings COPY_TBPS,FP8_TFLOPS gives
them instead; without CUDA they are MOE_SPEC section 3's H200 figures, and the
header says which. The summary's target column holds each model's targets at
that M (TARGETS) and whether expertd's full op meets each.

Without build/libexpertd_cuda.so it runs the peer alone and says so.
Results are printed as tables (the last one is the summary) and written to
$OUT/moe_bench.json and $OUT/moe_bench.md when OUT is set, with the picture
$OUT/moe_bench.png (bench/plot.py) where matplotlib imports.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import expertd_ctypes  # noqa: E402
import flashinfer_peer  # noqa: E402
import peer  # noqa: E402
import plot  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """The card's two ceilings every rate is a share of, and where they come from."""
    copy_tbps: float   # device-to-device copy, bytes read + written
    fp8_tflops: float  # dense FP8 matrix product, torch._scaled_mm at 8192^3
    source: str


# MOE_SPEC.md section 3's H200 figures: the fallback where nothing can be measured.
SPEC_CEILINGS = Ceilings(4.28, 1471.0, "MOE_SPEC.md section 3 (H200), not measured: no CUDA device")
# A buffer far beyond L2 (50-60 MB on Hopper), so the copy streams HBM.
CEILING_COPY_BYTES = 1 << 30
# MOE_SPEC section 3's matrix product: large enough that cuBLASLt's FP8 kernel
# runs at its peak, small enough to take under a millisecond.
CEILING_MM_N = 8192
CEILING_ITERS = 20
CEILING_WARMUP = 5
# vLLM 0.34's Triton fused-MoE kernels (fp8_w8a8 per-tensor), GEMM1 + GEMM2
# kernels alone (CUDA events, L2 flushed, CUDA graphs, median of 100), quoted per
# card from the runs docs/perf-notes.md records, not measured here: on the H200
# with its tuned H200 config for Nemotron's E=128,N=1856 and its default config
# for Qwen3, on the H100 with default configs (vLLM ships no tuned H100 file for
# these shapes). vLLM's full
# op adds routing, alignment, activation, quantization and combine launches, so
# these are a lower bound of its layer time. The card's name picks the table.
VLLM_GEMMS = {
    "H200": ("vLLM 0.34 Triton GEMMs only (lower bound of its full op), H200 2026-12-03", {
        ("nemotron-3-nano", 1): 0.0345, ("nemotron-3-nano", 16): 0.2054,
        ("nemotron-3-nano", 64): 0.3220, ("nemotron-3-nano", 256): 0.3546,
        ("nemotron-3-nano", 1024): 0.3743, ("nemotron-3-nano", 4096): 0.6984,
        ("nemotron-3-nano", 8192): 1.1702,
        ("qwen3-30b-a3b", 1): 0.0265, ("qwen3-30b-a3b", 16): 0.1287,
        ("qwen3-30b-a3b", 64): 0.1699, ("qwen3-30b-a3b", 256): 0.1831,
        ("qwen3-30b-a3b", 1024): 0.2191, ("qwen3-30b-a3b", 4096): 0.4319,
        ("qwen3-30b-a3b", 8192): 0.7767,
    }),
    "H100": ("vLLM 0.34 Triton GEMMs only (lower bound of its full op), H100 80GB HBM3, issue 33", {
        ("nemotron-3-nano", 1): 0.0431, ("nemotron-3-nano", 16): 0.2912,
        ("nemotron-3-nano", 64): 0.4715, ("nemotron-3-nano", 256): 0.5004,
        ("nemotron-3-nano", 1024): 0.5425, ("nemotron-3-nano", 4096): 0.7537,
        ("nemotron-3-nano", 8192): 1.2172,
        ("qwen3-30b-a3b", 1): 0.0318, ("qwen3-30b-a3b", 16): 0.1746,
        ("qwen3-30b-a3b", 64): 0.2310, ("qwen3-30b-a3b", 256): 0.2457,
        ("qwen3-30b-a3b", 1024): 0.2757, ("qwen3-30b-a3b", 4096): 0.4671,
        ("qwen3-30b-a3b", 8192): 0.7835,
    }),
}


def vllm_table(device_name: str) -> tuple[str | None, str, dict]:
    """(card, label, {(model, M): ms}) of the quoted vLLM table for this card,
    or (None, "n/a", {}) when the card is neither an H200 nor an H100."""
    for card, (label, table) in VLLM_GEMMS.items():
        if card in device_name:
            return card, label, table
    return None, "n/a", {}


TOKENS = [1, 16, 64, 256, 1024, 4096, 8192]
CHECK_M = [1, 64, 256]
# Per-model token counts and checked M where they differ from the above: the
# float64 reference of a DeepSeek-V3 layer (256 experts of 44 MB) is slow past M=64.
MODEL_TOKENS = {"deepseek-v3": [1, 64, 256, 4096, 8192]}
MODEL_CHECK_M = {"deepseek-v3": [1, 64]}
# The default run; DeepSeek-V3 adds ~2 min and 23 GB of weights (expertd's and
# the peer's copies): run it alone with --model deepseek-v3, or with --models all.
DEFAULT_MODELS = ["nemotron-3-nano", "qwen3-30b-a3b", "qwen3-next-80b-a3b", "gpt-oss-120b"]


@dataclasses.dataclass(frozen=True)
class Goal:
    """One target of expertd's full op at min_m <= M <= max_m. kind says what
    value bounds: "vllm" and "flashinfer" the ratio to a peer's time (at most;
    PEER_GOALS), "tflops" TFLOP/s (at least), "copy" and "fp8" the share of the
    card's copy or FP8 ceiling reached by the touched weights' TB/s or the
    TFLOP/s (at least)."""
    kind: str
    value: float
    min_m: int = 1
    max_m: int = sys.maxsize


# A peer goal's (record key of the peer's ms, its name, why a record may lack it).
PEER_GOALS = {"vllm": ("vllm_gemms_ms", "vLLM", "no table for this card"),
              "flashinfer": ("flashinfer_ms", "FlashInfer", "not timed")}


def _vllm_goals(prefill_tflops: float) -> tuple[Goal, ...]:
    """Nemotron's and Qwen3's targets: decode widens its lead over vLLM's GEMMs
    (M <= 16 the most); prefill beats them by a fifth, is no slower than
    FlashInfer's fused MoE and reaches prefill_tflops at M = 8192."""
    return (Goal("vllm", 0.85, max_m=16), Goal("vllm", 0.90, min_m=17, max_m=256),
            Goal("vllm", 0.80, min_m=1024), Goal("flashinfer", 1.0, min_m=1024),
            Goal("tflops", prefill_tflops, min_m=8192, max_m=8192))


# Decode streams the touched weights near the copy ceiling; prefill at M = 8192
# runs near dense FP8: bounds set by the card itself, where no peer's table exists.
_STREAM_GOALS = (Goal("copy", 0.85, max_m=256), Goal("fp8", 0.70, min_m=8192, max_m=8192))
# Each model's targets for expertd's full op; docs/perf-notes.md records every run against them.
TARGETS = {"nemotron-3-nano": _vllm_goals(1000.0),
           "qwen3-30b-a3b": _vllm_goals(900.0),
           "deepseek-v3": (Goal("copy", 0.85, max_m=1), Goal("tflops", 900.0, min_m=8192, max_m=8192)),
           "qwen3-next-80b-a3b": _STREAM_GOALS,
           "gpt-oss-120b": _STREAM_GOALS}
CHECK_BAR = 2e-2
# FlashInfer is timed only when every checked M is within this rel-L2 of the
# reference: its rounding differs from the other peers' (BF16 GEMM1 output, fused
# combine), and a layout or scale mistake puts it near 1e-1 or beyond.
FLASHINFER_TIME_BAR = 5e-2


def log(msg: str) -> None:
    """Progress to stderr, so stdout ends with the tables."""
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- timing


def capture(fn, mode: str):
    """A CUDA graph of fn (after two eager warm-up calls on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode=mode):
        fn()
    return g


def time_replays(fns, iters: int, warmup: int, graph: bool = True,
                 mode: str = "thread_local", lone: bool = False) -> tuple[float, str, list[float]]:
    """Median ms of one call, rotating through fns (one per input set).

    Each fn is captured in its own graph and replayed; if capture fails the fns
    run eagerly and the returned mode says so. With lone (--lone) the
    host waits for each replay before timing the next, as a service's single
    call runs: the launch is then inside the timed span instead of queued
    behind the previous replay.
    """
    runs, how = fns, "eager"
    if graph:
        try:
            runs = [capture(fn, mode).replay for fn in fns]
            how = "graph"
        except Exception as e:  # capture refused: say so and time eagerly
            log(f"  graph capture failed ({type(e).__name__}: {str(e)[:200]}); timing eagerly")
            torch.cuda.synchronize()
            runs, how = fns, "eager (capture failed)"
    n = len(runs)
    for i in range(warmup):
        runs[i % n]()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        runs[i % n]()
        ends[i].record()
        if lone:
            ends[i].synchronize()
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return statistics.median(ms), how, ms


def measure_ceilings(device, copy_bytes: int = CEILING_COPY_BYTES, mm_n: int = CEILING_MM_N) -> Ceilings:
    """The card's ceilings, measured as MOE_SPEC section 3 did: a device-to-device
    copy of copy_bytes (rated by the bytes read plus those written) and the
    dense FP8 product torch._scaled_mm at mm_n^3 with per-tensor scales, each the
    median of CEILING_ITERS calls after CEILING_WARMUP."""
    src = torch.ones(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms, _, _ = time_replays([lambda: dst.copy_(src)], CEILING_ITERS, CEILING_WARMUP, graph=False)
    a = torch.randn(mm_n, mm_n, device=device).to(torch.float8_e4m3fn)
    # _scaled_mm takes its second operand column-major.
    b = torch.randn(mm_n, mm_n, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), dtype=torch.float32, device=device)
    mm_ms, _, _ = time_replays([lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)],
                               CEILING_ITERS, CEILING_WARMUP, graph=False)
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else str(device)
    return Ceilings(copy_tbps=2 * copy_bytes / (copy_ms * 1e-3) / 1e12,
                    fp8_tflops=2 * mm_n ** 3 / (mm_ms * 1e-3) / 1e12,
                    source=f"measured on this {name}: {copy_bytes >> 20} MiB device copy, "
                           f"torch._scaled_mm {mm_n}^3 per-tensor FP8, median of {CEILING_ITERS}")


def parse_ceilings(text: str) -> Ceilings:
    """--ceilings COPY_TBPS,FP8_TFLOPS: two positive numbers."""
    parts = text.split(",")
    try:
        copy, fp8 = (float(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want COPY_TBPS,FP8_TFLOPS (two numbers), got {text[:40]!r}")
    if not (0 < copy < math.inf and 0 < fp8 < math.inf):
        raise argparse.ArgumentTypeError(f"ceilings must be positive and finite, got {text[:40]!r}")
    return Ceilings(copy, fp8, "given by --ceilings, not measured")


def resolve_ceilings(given: Ceilings | None, device) -> Ceilings:
    """The ceilings the report uses: --ceilings when given, else measured on the
    CUDA device, else (no CUDA) MOE_SPEC section 3's H200 figures."""
    if given is not None:
        return given
    if not torch.cuda.is_available():
        return SPEC_CEILINGS
    c = measure_ceilings(device)
    # The copy's buffers are a gigabyte or more the layers' weights can use.
    torch.cuda.empty_cache()
    return c


# ---------------------------------------------------------------- checks


def check_outputs(w, xset, lib_set, peer_gmm, block=None, fi_peer=None) -> list[dict]:
    """expertd, the peer and FlashInfer (fi_peer, when given) against the float64
    reference on the given inputs.

    expertd's and FlashInfer's outputs are poisoned with NaN first, so an
    unwritten element fails.
    """
    rows = []
    for inp in xset:
        x, logits = inp[:2]
        M = x.shape[0]
        ref = peer.reference_moe(w, *inp)
        got_peer = peer.make_peer(w, M, peer_gmm, block)(*inp)
        row = {"M": M, "peer_vs_ref": peer.rel_l2(got_peer, ref)}
        if peer_gmm is peer.grouped_mm_torch:
            try:
                fast = peer.TorchPeer(w, M, peer.grouped_mm_torch_fast)(x, logits)
                row["peer_fastacc_vs_ref"] = peer.rel_l2(fast, ref)
            except (RuntimeError, ValueError) as e:  # a build may refuse use_fast_accum
                log(f"  use_fast_accum=True refused: {str(e)[:200]}")
        if fi_peer is not None:
            fo = torch.full((M, w.shape.K), float("nan"), dtype=torch.bfloat16, device=x.device)
            try:
                fi_peer(x, logits, fo)
                torch.cuda.synchronize()
                row["flashinfer_vs_ref"] = peer.rel_l2(fo, ref)
            except Exception as e:  # FlashInfer's errors have no common type: report, keep going
                log(f"  flashinfer failed its check at M={M}: {type(e).__name__}: {str(e)[:300]}")
                row["flashinfer_vs_ref"] = math.inf
        if lib_set is not None:
            out = torch.full((M, w.shape.K), float("nan"), dtype=torch.bfloat16, device=x.device)
            run_expertd(lib_set, inp, out)
            torch.cuda.synchronize()
            row["expertd_vs_ref"] = peer.rel_l2(out, ref)
            row["expertd_vs_peer"] = peer.rel_l2(out, got_peer.double())
            row["expertd_unwritten"] = int((~torch.isfinite(out.float())).sum())
        # ok judges expertd (the peer when the library is absent): the peer
        # is a comparison, and at M = 1 its error sits near the bar (six
        # routed pairs average little), so it must not fail expertd's run.
        if "expertd_vs_ref" in row:
            row["ok"] = row["expertd_vs_ref"] <= CHECK_BAR and row["expertd_unwritten"] == 0
        else:
            row["ok"] = row["peer_vs_ref"] <= CHECK_BAR
        rows.append(row)
    return rows


# ---------------------------------------------------------------- one model


def run_expertd(lib_set, inp, out, params=None):
    """expertd_moe_device on one input set: (x, logits) or (x, logits, x_scale)."""
    return lib_set.moe_device(inp[0], inp[1], out, params,
                              hidden_scale=inp[2] if len(inp) > 2 else None)


def distinct_experts(w, sets) -> float:
    """Mean count of distinct experts the routing hits, over the input sets."""
    hits = [torch.unique(peer.route(inp[1], w.shape, w.correction_bias)[0]).numel() for inp in sets]
    return sum(hits) / len(hits)


def make_flashinfer(fi, w, buckets, dev, gen):
    """FlashInfer's peer for w's layer, autotuned over buckets: (peer, None),
    or (None, why not)."""
    why = flashinfer_peer.supports(w.shape)
    if why is not None:
        return None, why
    t0 = time.time()
    try:
        p = flashinfer_peer.FlashInferPeer(fi, w, buckets)
        p.tune(*peer.make_inputs(w.shape, w, p.max_m, dev, gen))
    except Exception as e:  # module load, tactic or launch failure: report, keep the other peers
        log(f"  flashinfer unavailable for {w.shape.name}: {type(e).__name__}: {str(e)[:400]}")
        return None, f"failed: {type(e).__name__}: {str(e)[:160]}"
    log(f"  flashinfer: cutlass_fused_moe ({getattr(p.act, 'name', p.act)}), "
        f"autotuned for M = {list(p.buckets)} ({time.time() - t0:.1f} s)")
    return p, None


def time_flashinfer(fi_peer, sets, M, K, args) -> dict:
    """FlashInfer's full op (routing + cutlass_fused_moe) and its call alone on
    precomputed routing, as record fields."""
    dev = sets[0][0].device
    fo = [torch.empty(M, K, dtype=torch.bfloat16, device=dev) for _ in sets]
    routed = [fi_peer.route(inp[1]) for inp in sets]
    rec = {}
    try:
        rec["flashinfer_ms"], rec["flashinfer_mode"], _ = time_replays(
            [lambda i=i: fi_peer(sets[i][0], sets[i][1], fo[i]) for i in range(len(sets))],
            args.iters, args.warmup, lone=args.lone)
        rec["flashinfer_moe_ms"], rec["flashinfer_moe_mode"], _ = time_replays(
            [lambda i=i: fi_peer.moe_only(sets[i][0], *routed[i], fo[i]) for i in range(len(sets))],
            args.iters, args.warmup, lone=args.lone)
    except Exception as e:  # FlashInfer's errors have no common type: report, keep going
        log(f"  flashinfer failed at M={M}: {type(e).__name__}: {str(e)[:300]}")
        rec = {"flashinfer_note": f"failed at M={M}: {type(e).__name__}"}
    return rec


def bench_model(shape, Ms, lib, args, gen, fi=None, vllm=None) -> tuple[list[dict], list[dict]]:
    """Checks and timings of one model at every M (FlashInfer's too, with fi;
    vllm: the card's quoted {(model, M): ms})."""
    dev = torch.device("cuda")
    t0 = time.time()
    w = peer.make_weights(shape, dev, gen)
    peer.calibrate_a2_scale(w, 256, dev, gen)
    a2 = "dynamic per token group" if shape.block else f"{w.a2_scale.item():.3e}"
    log(f"{shape.name}: weights built ({time.time() - t0:.1f} s), a2_scale={a2}")
    peer.check_routing(shape, dev, gen)
    gmm, block = None, None
    if shape.block is None:
        gmm = peer.default_grouped_mm(dev)
        peer_name = ("torch._scaled_grouped_mm (rowwise FP8, CUTLASS)" if gmm is peer.grouped_mm_torch
                     else "float32 emulation")
    else:
        block = peer.block_mode(dev)
        peer_name = peer.BLOCK_MODE_NAMES[block]
    log(f"  peer: {peer_name}")
    lib_set, lib_note = None, None
    if lib is not None:
        try:
            t1 = time.time()
            lib_set = expertd_ctypes.ExpertSet(lib, args.device, w)
            log(f"  expertd set created ({time.time() - t1:.1f} s)")
        except expertd_ctypes.ExpertdError as e:
            unsupported = e.code == expertd_ctypes.ERR_UNSUPPORTED
            lib_note = f"unsupported: {e}" if unsupported else f"set_create failed: {e}"
            log(f"  expertd {'does not support' if unsupported else 'set_create failed for'} "
                f"{shape.name}, peer only: {e}")
    check_m = args.check_m if args.check_m is not None else MODEL_CHECK_M.get(shape.name, CHECK_M)
    fi_peer, fi_note = None, "absent" if fi is None else None
    if fi is not None:
        fi_peer, fi_note = make_flashinfer(fi, w, list(Ms) + list(check_m), dev, gen)
    inputs = [peer.make_inputs(shape, w, m, dev, gen) for m in check_m]
    try:
        checks = check_outputs(w, inputs, lib_set, gmm, block, fi_peer)
    except expertd_ctypes.ExpertdError as e:
        log(f"  expertd failed its check run, peer only for {shape.name}: {e}")
        try:
            lib_set.free()
        except expertd_ctypes.ExpertdError as e2:
            log(f"  expertd set_free failed too: {e2}")
        lib_set, lib_note = None, f"check run failed: {e}"
        checks = check_outputs(w, inputs, None, gmm, block, fi_peer)
    del inputs
    fi_err = max((c["flashinfer_vs_ref"] for c in checks if "flashinfer_vs_ref" in c), default=None)
    if fi_err is not None and not fi_err <= FLASHINFER_TIME_BAR:
        fi_note = f"not timed: rel-L2 {fi_err:.2e} vs reference > {FLASHINFER_TIME_BAR:g}"
        log(f"  flashinfer {fi_note}")
        fi_peer = None
    for c in checks:
        log(f"  check M={c['M']}: " + ", ".join(
            f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items() if k != "M"))
    results = []
    for M in Ms:
        sets = [peer.make_inputs(shape, w, M, dev, gen) for _ in range(args.sets)]
        hit = distinct_experts(w, sets)
        rec = {"model": shape.name, "M": M, "distinct_experts": hit,
               "flops": shape.flops(M), "weight_bytes": hit * shape.expert_bytes(),
               "vllm_gemms_ms": (vllm or {}).get((shape.name, M)), "peer_impl": peer_name}
        if lib_note is not None:
            rec["expertd_note"] = lib_note
        if fi_peer is not None:
            rec.update(time_flashinfer(fi_peer, sets, M, shape.K, args))
        else:
            rec["flashinfer_note"] = fi_note

        p = peer.make_peer(w, M, gmm, block)
        outs = [None] * len(sets)

        def peer_fn(i):
            def f():
                outs[i] = p(*sets[i])
            return f
        # BlockPeer's per-expert calls sync with the host: no graph, and the
        # mode column says "eager (host sync per call)".
        rec["peer_ms"], rec["peer_mode"], _ = time_replays(
            [peer_fn(i) for i in range(len(sets))], args.iters, args.warmup, graph=p.capturable, lone=args.lone)
        if not p.capturable:
            rec["peer_mode"] = "eager (host sync per call)"

        # GEMM-only inputs: permuted FP8 rows and the requantized intermediate.
        pre = [p.gemm_args(*inp) for inp in sets]
        rec["peer_gemm_ms"], rec["peer_gemm_mode"], _ = time_replays(
            [lambda a=a: p.gemm_only(*a) for a in pre], args.iters, args.warmup, lone=args.lone)

        if args.fast_accum and gmm is peer.grouped_mm_torch:
            pf = peer.TorchPeer(w, M, peer.grouped_mm_torch_fast)
            try:
                pf.gemm_only(*pre[0])
                rec["peer_fast_ms"], rec["peer_fast_mode"], _ = time_replays(
                    [lambda i=i: pf(*sets[i]) for i in range(len(sets))], args.iters, args.warmup, lone=args.lone)
                rec["peer_fast_gemm_ms"], rec["peer_fast_gemm_mode"], _ = time_replays(
                    [lambda a=a: pf.gemm_only(*a) for a in pre], args.iters, args.warmup, lone=args.lone)
            except (RuntimeError, ValueError) as e:
                log(f"  peer with use_fast_accum=True not timed: {str(e)[:200]}")
                rec.pop("peer_fast_ms", None)
            del pf
        del pre

        if lib_set is not None:
            params = lib_set.params(M)
            xo = [torch.empty(M, shape.K, dtype=torch.bfloat16, device=dev) for _ in sets]
            try:
                rec["expertd_ms"], rec["expertd_mode"], _ = time_replays(
                    [lambda i=i: run_expertd(lib_set, sets[i], xo[i], params) for i in range(len(sets))],
                    args.iters, args.warmup, lone=args.lone)
            except expertd_ctypes.ExpertdError as e:
                log(f"  expertd failed at M={M}: {e}")
                rec["expertd_ms"], rec["expertd_mode"] = None, f"failed: {e}"[:120]
            del xo
        rec["expertd_gemm_ms"] = None
        rec["expertd_gemm_note"] = "no GEMM-only entry point in the ABI"
        results.append(rec)
        log(f"  M={M:5d} experts={hit:6.1f} peer {rec['peer_ms']:.4f} ms ({rec['peer_mode']}), "
            f"peer-gemm {rec['peer_gemm_ms']:.4f} ms"
            + (f", fastacc {rec['peer_fast_ms']:.4f} / gemm {rec['peer_fast_gemm_ms']:.4f} ms"
               if "peer_fast_ms" in rec else "")
            + (f", flashinfer {rec['flashinfer_ms']:.4f} / moe only {rec['flashinfer_moe_ms']:.4f} ms "
               f"({rec['flashinfer_mode']})" if "flashinfer_ms" in rec else "")
            + (f", expertd {rec['expertd_ms']:.4f} ms ({rec['expertd_mode']})"
               if "expertd_ms" in rec else ""))
        del p, outs, sets
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if lib_set is not None:
        lib_set.free()
    del w, fi_peer
    torch.cuda.empty_cache()
    return results, [dict(c, model=shape.name) for c in checks]


# ---------------------------------------------------------------- report


def rates(rec: dict, ms: float | None, ceil: Ceilings) -> dict:
    """TFLOP/s, weight GB/s and their shares of the card's ceilings."""
    if ms is None or ms <= 0:
        return {"tflops": None, "gbps": None, "pct_bw": None, "pct_fp8": None}
    tflops = plot.tflops(rec, ms)
    gbps = plot.weight_tbps(rec, ms) * 1e3
    return {"tflops": tflops, "gbps": gbps, "pct_bw": 100 * gbps / (ceil.copy_tbps * 1e3),
            "pct_fp8": 100 * tflops / ceil.fp8_tflops}


def fmt(v, spec=".3f", none="—") -> str:
    """A number for a table cell, or a dash."""
    return none if v is None else format(v, spec)


def _goal_cell(g: Goal, rec: dict, ms: float | None, ceil: Ceilings) -> str:
    """One goal's bound, and whether expertd's full op at ms meets it when timed."""
    if g.kind in PEER_GOALS:
        key, name, absent = PEER_GOALS[g.kind]
        v = rec.get(key)
        if v is None:
            return f"≤ {g.value:g}x {name}: {absent}"
        want, got, bound = f"≤ {g.value:g}x {name} = {g.value * v:.4f} ms", ms, g.value * v
        meets = got is not None and got <= bound
    else:
        q = rates(rec, ms, ceil)
        tbps = None if q["gbps"] is None else q["gbps"] / 1e3
        copy, fp8 = g.value * ceil.copy_tbps, g.value * ceil.fp8_tflops
        want, got, bound = {
            "tflops": (f"≥ {g.value:g} TFLOP/s", q["tflops"], g.value),
            "copy": (f"≥ {copy:.2f} TB/s ({g.value:.0%} of copy)", tbps, copy),
            "fp8": (f"≥ {fp8:.0f} TFLOP/s ({g.value:.0%} of FP8)", q["tflops"], fp8),
        }[g.kind]
        meets = got is not None and got >= bound
    return want if got is None else f"{want}: {'met' if meets else 'missed'}"


def target(rec: dict, ms: float | None, ceil: Ceilings) -> str:
    """The issue's targets for this model and M against the card's ceilings and
    vLLM table, and whether expertd's full op at ms meets each."""
    goals = [g for g in TARGETS.get(rec["model"], ()) if g.min_m <= rec["M"] <= g.max_m]
    return "; ".join(_goal_cell(g, rec, ms, ceil) for g in goals) or "—"


def impls(r: dict, have_lib: bool) -> list[tuple[str, str, str]]:
    """(name, ms key, timing-mode key) of every implementation timed in record r."""
    out = [("peer", "peer_ms", "peer_mode"), ("peer-gemm", "peer_gemm_ms", "peer_gemm_mode")]
    if "peer_fast_ms" in r:
        out += [("peer-fastacc", "peer_fast_ms", "peer_fast_mode"),
                ("peer-fastacc-gemm", "peer_fast_gemm_ms", "peer_fast_gemm_mode")]
    if "flashinfer_ms" in r:
        out += [("flashinfer", "flashinfer_ms", "flashinfer_mode"),
                ("flashinfer-moe", "flashinfer_moe_ms", "flashinfer_moe_mode")]
    if have_lib:
        out.insert(0, ("expertd", "expertd_ms", "expertd_note" if "expertd_note" in r else "expertd_mode"))
    return out


def tables(results: list[dict], checks: list[dict], have_lib: bool, vllm_label: str, ceil: Ceilings) -> str:
    """Markdown tables: checks, every implementation's rates, then the summary."""
    pct = f"% of copy {ceil.copy_tbps:.2f} TB/s | % of FP8 {ceil.fp8_tflops:.0f} TFLOP/s"
    lines = ["### Correctness (rel-L2 vs float64 reference; bar 2e-2)", "",
             "ok: expertd within the bar with every element written (the peer when expertd is absent). "
             f"FlashInfer is timed only within {FLASHINFER_TIME_BAR:g} at every checked M.", "",
             "| model | M | peer vs ref | peer fastacc vs ref | flashinfer vs ref | expertd vs ref | "
             "expertd vs peer | unwritten | ok |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c['model']} | {c['M']} | {fmt(c['peer_vs_ref'], '.2e')} | "
                     f"{fmt(c.get('peer_fastacc_vs_ref'), '.2e')} | {fmt(c.get('flashinfer_vs_ref'), '.2e')} | "
                     f"{fmt(c.get('expertd_vs_ref'), '.2e')} | {fmt(c.get('expertd_vs_peer'), '.2e')} | "
                     f"{fmt(c.get('expertd_unwritten'), 'd')} | {'yes' if c['ok'] else 'NO'} |")
    lines += ["", "### Per implementation", "",
              f"| model | M | impl | timing | ms | TFLOP/s | weight GB/s | {pct} |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for name, key, mode in impls(r, have_lib):
            ms = r.get(key)
            q = rates(r, ms, ceil)
            lines.append(f"| {r['model']} | {r['M']} | {name} | {r.get(mode, '—')} | {fmt(ms, '.4f')} | "
                         f"{fmt(q['tflops'], '.1f')} | {fmt(q['gbps'], '.0f')} | {fmt(q['pct_bw'], '.1f')} | "
                         f"{fmt(q['pct_fp8'], '.1f')} |")
    who = "expertd" if have_lib else "peer"
    lines += ["", f"### Summary (rates are {who}'s full op, the peer's where expertd has none; "
              f"vLLM column: {vllm_label}, quoted, not measured; FlashInfer: routing + cutlass_fused_moe, "
              "measured)",
              "", "| model | M | experts hit | expertd ms | peer ms | peer fastacc ms | peer GEMM ms | "
              "FlashInfer ms | expertd ÷ FlashInfer | "
              f"vLLM GEMMs ms | expertd ÷ vLLM GEMMs | speedup vs faster peer | TFLOP/s | weight GB/s | {pct} | "
              "issue target (expertd) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        e = r.get("expertd_ms")
        q = rates(r, e if have_lib and e is not None else r["peer_ms"], ceil)
        best = min(v for v in (r["peer_ms"], r.get("peer_fast_ms")) if v is not None)
        speed = best / e if e else None
        ecell = fmt(e, '.4f') if e is not None or "expertd_note" not in r else "unsupported"
        v = r.get("vllm_gemms_ms")
        ratio = e / v if e and v else None
        f = r.get("flashinfer_ms")
        fcell = fmt(f, ".4f") if f is not None else ("—" if r.get("flashinfer_note") in (None, "absent")
                                                     else "n/a")
        lines.append(f"| {r['model']} | {r['M']} | {r['distinct_experts']:.1f} | {ecell} | "
                     f"{r['peer_ms']:.4f} | {fmt(r.get('peer_fast_ms'), '.4f')} | {r['peer_gemm_ms']:.4f} | "
                     f"{fcell} | {fmt(e / f if e and f else None, '.2f')} | "
                     f"{fmt(v, '.4f', 'n/a' if vllm_label == 'n/a' else '—')} | {fmt(ratio, '.2f')} | "
                     f"{fmt(speed, '.2f')} | {fmt(q['tflops'], '.1f')} | {fmt(q['gbps'], '.0f')} | "
                     f"{fmt(q['pct_bw'], '.1f')} | {fmt(q['pct_fp8'], '.1f')} | {target(r, e, ceil)} |")
    peers = {}
    for r in results:
        peers.setdefault(r["peer_impl"], []).append(r["model"])
    lines += ["", "Peers: " + "; ".join(f"{', '.join(dict.fromkeys(m))}: {impl}"
                                       for impl, m in peers.items())]
    notes = {}
    for r in results:
        if r.get("flashinfer_note"):
            notes.setdefault(r["flashinfer_note"], []).append(r["model"])
    if notes:
        lines += ["", "FlashInfer: " + "; ".join(f"{', '.join(dict.fromkeys(m))}: {n}"
                                                 for n, m in notes.items())]
    return "\n".join(lines)


def header(meta: dict) -> str:
    """The report's first line: the card and its ceilings, the builds, the run's settings."""
    c = meta["ceilings"]
    return (f"device {meta['device']} ({meta['sms']} SMs); ceilings: copy {c['copy_tbps']:.2f} TB/s, "
            f"FP8 dense {c['fp8_tflops']:.0f} TFLOP/s ({c['source']}); torch {meta['torch']} "
            f"(CUDA {meta['cuda']}), commit {meta['commit']}, seed {meta['seed']}, median of {meta['iters']} "
            f"replays after {meta['warmup']} warm-up, {meta['sets']} input sets rotated"
            + (f"; expertd {meta['expertd']}, built from {meta['expertd_lib_commit']}"
               if meta["expertd"] else "; expertd library absent: peer only")
            + f"; {meta['flashinfer']}; vLLM table: {meta['vllm_table'] or 'n/a'}")


def main(argv=None) -> int:
    """Parse flags, check and time every model and M, print and write the tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", "--model", default=",".join(DEFAULT_MODELS),
                    help=f"comma-separated model names, or all ({', '.join(peer.MODELS)})")
    ap.add_argument("--tokens", default=None,
                    help=f"comma-separated M values (default {TOKENS}; {MODEL_TOKENS})")
    ap.add_argument("--check-m", default=None,
                    help=f"M values checked against the reference (default {CHECK_M}; {MODEL_CHECK_M})")
    ap.add_argument("--iters", type=int, default=100, help="timed replays per measurement (>= 50)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed replays first")
    ap.add_argument("--lone", action="store_true",
                    help="time each replay alone, the host waiting for the one before (a service's single call)")
    ap.add_argument("--sets", type=int, default=8, help="input sets rotated (>= 4)")
    ap.add_argument("--lib", default=expertd_ctypes.DEFAULT_LIB, help="path to libexpertd_cuda.so")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None, help="default: fresh each run")
    ap.add_argument("--fast-accum", action="store_true",
                    help="also time the peer with use_fast_accum=True")
    ap.add_argument("--no-flashinfer", action="store_true",
                    help="skip FlashInfer's cutlass_fused_moe even where it imports")
    ap.add_argument("--ceilings", type=parse_ceilings, default=None, metavar="COPY_TBPS,FP8_TFLOPS",
                    help="the card's copy TB/s and dense FP8 TFLOP/s instead of measuring them first")
    args = ap.parse_args(argv)
    if args.check_m is not None:
        args.check_m = [int(m) for m in args.check_m.split(",") if m]
    names = list(peer.MODELS) if args.models == "all" else [m for m in args.models.split(",") if m]
    for name in names:
        if name not in peer.MODELS:
            ap.error(f"unknown model {name!r}: want one of {', '.join(peer.MODELS)} or all")
    if args.iters < 50 or args.sets < 4:
        ap.error("need --iters >= 50 and --sets >= 4")
    if torch.cuda.is_available():
        torch.cuda.set_device(args.device)
    ceil = resolve_ceilings(args.ceilings, args.device)
    log(f"ceilings: copy {ceil.copy_tbps:.2f} TB/s, FP8 dense {ceil.fp8_tflops:.0f} TFLOP/s ({ceil.source})")
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to benchmark")
        return 2
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)

    lib = None
    try:
        lib = expertd_ctypes.load(args.lib)
    except (OSError, expertd_ctypes.ExpertdError) as e:
        log(f"WARNING: {args.lib} would not load ({e}); running the peer only")
    if lib is None and not os.path.exists(args.lib):
        log(f"NOTE: {args.lib} is absent; running the peer only")
    lib_info = None
    if lib is not None:
        lib.init(args.device)
        with open(lib.path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
        lib_info = f"{lib.device_info(args.device)}, sha256 {digest}"
        log(f"expertd: {lib_info}")

    fi, fi_info = None, "skipped (--no-flashinfer)"
    if not args.no_flashinfer:
        fi, fi_info = flashinfer_peer.load()
    log(f"flashinfer: {fi_info}" if fi is not None else f"NOTE: FlashInfer absent: {fi_info}")

    props = torch.cuda.get_device_properties(args.device)
    card, vllm_label, vllm = vllm_table(props.name)
    log(f"vLLM GEMMs-only table: {card + ' (' + vllm_label + ')' if card else 'n/a (no table for ' + props.name + ')'}")
    meta = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "commit": os.environ.get("EXPERTD_COMMIT", "unknown"),
            "seed": seed, "iters": args.iters, "warmup": args.warmup, "sets": args.sets,
            "expertd": lib_info, "expertd_lib_commit": os.environ.get("EXPERTD_LIB_COMMIT", "unknown"),
            "flashinfer": fi_info if fi is not None else f"absent: {fi_info}",
            "vllm_table": card, "vllm_label": vllm_label, "ceilings": dataclasses.asdict(ceil),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    log(f"device {props.name}, torch {torch.__version__}, seed {seed}, commit {meta['commit']}")

    results, checks = [], []
    for name in names:
        Ms = ([int(m) for m in args.tokens.split(",") if m] if args.tokens is not None
              else MODEL_TOKENS.get(name, TOKENS))
        r, c = bench_model(peer.MODELS[name], Ms, lib, args, gen, fi, vllm)
        results += r
        checks += c

    md = tables(results, checks, lib is not None, vllm_label, ceil)
    head = header(meta)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        doc = {"meta": meta, "checks": checks, "results": results}
        with open(os.path.join(out, "moe_bench.json"), "w") as f:
            json.dump(doc, f, indent=1,
                      default=lambda v: None if isinstance(v, float) and math.isnan(v) else str(v))
        png = os.path.join(out, "moe_bench.png")
        try:
            plot.write(doc, png)
            log(f"picture: {png}")
        except ImportError as e:
            log(f"NOTE: no picture here ({e}): `bash bench/plot.sh {out}/moe_bench.json` draws it")
        except Exception as e:  # the tables matter more than the picture: report, go on
            log(f"NOTE: the picture failed ({type(e).__name__}: {str(e)[:200]}); "
                f"`bash bench/plot.sh {out}/moe_bench.json` draws it")
        with open(os.path.join(out, "moe_bench.md"), "w") as f:
            f.write(head + "\n\n" + md + "\n")
    print(head)
    print()
    print(md)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
