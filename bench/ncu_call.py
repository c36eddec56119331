"""One FusedMoE call per (model, M) inside a CUDA profiler range, for Nsight Compute.

The library is called as moe_profile.py calls it (the bench's layer: random
weights, static scales calibrated as peer.py does, FP8 hidden states), warmed
up on other inputs first so every kernel, workspace and graph a call of that M
uses exists; then exactly one call runs between cudaProfilerStart and
cudaProfilerStop, not graphed, after a one-element fill that marks where
the range begins, so Nsight Compute started with --profile-from-start off sees
the marker and then each of that call's kernels once:

  ncu --profile-from-start off --section SpeedOfLight ... \\
      python3 bench/ncu_call.py --lib build/libexpertd_cuda.so --model nemotron-3-nano --tokens 1024,8192

Between the ranges it prints "== <model> M=<M>" so the report's kernels can be
told apart by order.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import expertd_ctypes  # noqa: E402
import peer  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True, help="a libexpertd_cuda.so")
    ap.add_argument("--models", "--model", default="nemotron-3-nano")
    ap.add_argument("--tokens", default="1,1024,8192")
    ap.add_argument("--warmup", type=int, default=5, help="calls before the profiled one")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed)
    lib = expertd_ctypes.load(args.lib)
    lib.init(0)
    # Each range begins with this fill, which ncu_summary.py splits calls at.
    marker = torch.empty(1, device=dev)
    for name in args.models.split(","):
        shape = peer.MODELS[name]
        w = peer.make_weights(shape, dev, gen)
        peer.calibrate_a2_scale(w, 256, dev, gen)
        es = expertd_ctypes.ExpertSet(lib, 0, w)
        for M in [int(m) for m in args.tokens.split(",")]:
            params = es.params(M)
            inputs = [peer.make_inputs(shape, w, M, dev, gen) for _ in range(2)]
            out = torch.empty(M, shape.K, dtype=torch.bfloat16, device=dev)

            def call(i):
                x = inputs[i]
                es.moe_device(x[0], x[1], out, params, hidden_scale=x[2] if len(x) > 2 else None)

            for _ in range(args.warmup):
                call(0)
            torch.cuda.synchronize()
            print(f"== {name} M={M}", flush=True)
            torch.cuda.profiler.start()
            marker.fill_(M)
            call(1)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            del inputs, out
        es.free()
        del w
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
