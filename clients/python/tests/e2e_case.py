"""Drives a running expertd with the installed expertd package for the e2e
test (e2e/python_test.go).

Usage: e2e_case.py --addr HOST:PORT --case DIR

DIR/case.json names raw little-endian arrays in DIR (dtype, shape) and the
routing. The script loads the set in small chunks, runs FusedMoE on the
named set and with the same weights inline, asks for an unknown set,
unloads, writes the outputs as raw float32 files (out_named.f32,
out_inline.f32) into DIR and prints a JSON summary. The Go test checks the
numbers against its float64 reference.
"""

import argparse
import json
import os

import numpy as np

import expertd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", required=True)
    ap.add_argument("--case", required=True)
    args = ap.parse_args()

    with open(os.path.join(args.case, "case.json")) as f:
        case = json.load(f)
    arrays = {}
    for name, spec in case["arrays"].items():
        raw = np.fromfile(os.path.join(args.case, spec["file"]), dtype=np.dtype(spec["dtype"]).newbyteorder("<"))
        arrays[name] = raw.reshape(spec["shape"])

    c = expertd.Client(args.addr)
    summary = {"version": c.server_info().version, "module": expertd.__file__}
    chunks = []
    weights = (arrays["w13"], arrays["w2"], arrays["w13_scale"], arrays["w2_scale"])
    info = c.load_experts("py-layer", *weights, activation=case["activation"], chunk_bytes=case["chunk_bytes"],
                          progress=lambda sent, total: chunks.append(sent))
    summary.update(fingerprint=info.fingerprint, bytes=info.bytes, chunks=len(chunks),
                   sets=[s.name for s in c.list_experts()])

    kwargs = dict(router_logits=arrays["router_logits"], top_k=case["top_k"],
                  renormalize=case["renormalize"], output_dtype="float32")
    named = c.fused_moe(arrays["hidden"], expert_set="py-layer", return_routing=True, **kwargs)
    inline = c.fused_moe(arrays["hidden"], weights=expertd.expert_weights(*weights, activation=case["activation"]),
                         **kwargs)
    named.output.astype("<f4").tofile(os.path.join(args.case, "out_named.f32"))
    inline.output.astype("<f4").tofile(os.path.join(args.case, "out_inline.f32"))
    summary.update(output_shape=list(named.output.shape), backend=named.backend,
                   topk_ids=named.topk_ids.reshape(-1).tolist())

    try:
        c.fused_moe(arrays["hidden"], expert_set="no-such-set", **kwargs)
        summary["unknown_set"] = "OK"
    except expertd.ExpertdError as e:
        summary["unknown_set"] = e.code.name
    summary["freed"] = c.unload_experts("py-layer")
    c.close()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
