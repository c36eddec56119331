"""A sharded Hugging Face checkpoint loaded by the daemon from its
-weights-dir (EXPERTD_WEIGHTS_DIR names the same directory here), run with
the routing its config.json gives."""

import json
import os
import struct

import numpy as np
import pytest

import expertd
import moeref
from moeref import rel_l2

pytestmark = pytest.mark.skipif(not os.environ.get("EXPERTD_WEIGHTS_DIR"),
                                reason="EXPERTD_WEIGHTS_DIR names the daemon's -weights-dir")


def write_safetensors(path, tensors):
    """tensors: name -> (dtype, numpy array of its bytes' carrier)."""
    header, blobs, at = {}, [], 0
    for name in sorted(tensors):
        dtype, a = tensors[name]
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    js = json.dumps(header).encode()
    js += b" " * (-len(js) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(js)) + js + b"".join(blobs))


def test_sharded_qwen3_checkpoint(client, rng):
    e, k, n, m, top_k = 8, 64, 32, 6, 2
    root = os.environ["EXPERTD_WEIGHTS_DIR"]
    name = f"qwen3-{os.getpid()}"
    d = os.path.join(root, name)
    os.makedirs(d)
    # compressed-tensors FP8: per-channel weight_scale [rows, 1] per projection.
    ts, s13, s2, w13, w2 = {}, [], [], [], []
    for x in range(e):
        rows = []
        for proj, shape in (("gate_proj", (n, k)), ("up_proj", (n, k)), ("down_proj", (k, n))):
            f = rng.standard_normal(shape)
            sc = (np.abs(f).max(1) / 448).astype(np.float32)
            codes = moeref.fp8_encode(f / sc[:, None])
            p = f"model.layers.3.mlp.experts.{x}.{proj}"
            ts[p + ".weight"] = ("F8_E4M3", codes)
            ts[p + ".weight_scale"] = ("F32", sc[:, None])
            rows.append((codes, sc))
        w13.append(np.concatenate([rows[0][0], rows[1][0]]))
        s13.append(np.concatenate([rows[0][1], rows[1][1]]))
        w2.append(rows[2][0])
        s2.append(rows[2][1])
    ts["model.layers.3.mlp.gate.weight"] = ("BF16", np.zeros((e, k), np.uint16))
    names = sorted(ts)
    weight_map = {}
    for i, shard in enumerate(("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                               "model-00003-of-00003.safetensors")):
        part = {t: ts[t] for t in names[i::3]}
        write_safetensors(os.path.join(d, shard), part)
        weight_map.update({t: shard for t in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "qwen3_moe", "num_experts": e, "num_experts_per_tok": top_k,
                   "norm_topk_prob": True, "hidden_act": "silu"}, f)

    info = client.load_safetensors(name, name, layer=3, preset="auto")
    try:
        assert (info.num_experts, info.hidden_size, info.intermediate_size) == (e, k, n)
        assert info.w13_scale_granularity and info.routing.top_k == top_k and info.routing.renormalize
        hidden = (rng.standard_normal((m, k)) / 10).astype(np.float32)
        logits = rng.standard_normal((m, e)).astype(np.float32)
        res = client.fused_moe(hidden, expert_set=name, router_logits=logits, routing_message=info.routing,
                               output_dtype="float32")
        ids, w = moeref.route(logits, top_k, True)
        ref = moeref.fused_moe(hidden, np.stack(w13), np.stack(w2), np.stack(s13), np.stack(s2), ids, w)
        assert rel_l2(res.output, ref) <= 2e-2, rel_l2(res.output, ref)
    finally:
        client.unload_experts(name)
