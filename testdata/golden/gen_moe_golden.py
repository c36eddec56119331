"""Golden vectors for the FusedMoE op of MOE_SPEC.md section 1.

An implementation independent of the Go code: numpy for the arithmetic,
ml_dtypes for the FP8 E4M3FN and bfloat16 roundings. Writes two small cases
(one SILU_GATED with sigmoid + bias + groups routing and per-channel weight
scales, one RELU2 with softmax routing and [16, 16] block scales) with
their inputs and the expected output, before output rounding, to JSON.

Usage: gen_moe_golden.sh (pins numpy and ml_dtypes), or
    python gen_moe_golden.py OUT.json
"""

import json
import sys

import ml_dtypes
import numpy as np

FP8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
FP8_MAX = 448.0
MIN_SCALE = np.float32(1e-10)


def to_fp8(x):
    """Round float32 values to FP8 E4M3FN (nearest even), saturating at 448."""
    x = np.clip(np.asarray(x, np.float32), -FP8_MAX, FP8_MAX)
    return x.astype(FP8)


def codes(q):
    return q.view(np.uint8).astype(int).ravel().tolist()


def quant_weights(w, block):
    """Per-channel (block None) or block scales over the last two dims of w [E, R, C]."""
    e, r, c = w.shape
    if block is None:
        s = np.maximum(np.abs(w).max(axis=2) / np.float32(FP8_MAX), MIN_SCALE).astype(np.float32)
        return to_fp8(w / s[:, :, None]), s
    bn, bk = block
    nr, nc = -(-r // bn), -(-c // bk)
    s = np.zeros((e, nr, nc), np.float32)
    full = np.zeros_like(w)
    for i in range(nr):
        for j in range(nc):
            tile = w[:, i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s[:, i, j] = np.maximum(np.abs(tile).max(axis=(1, 2)) / np.float32(FP8_MAX), MIN_SCALE)
            full[:, i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = s[:, i, j][:, None, None]
    return to_fp8(w / full), s


def weight_scale_full(s, shape, block):
    """Expand a scale array to one value per weight element, as float64."""
    e, r, c = shape
    if block is None:
        return np.repeat(s[:, :, None], c, axis=2).astype(np.float64)
    bn, bk = block
    return np.repeat(np.repeat(s, bn, axis=1), bk, axis=2)[:, :r, :c].astype(np.float64)


def quant_act(x, group):
    """Dynamic FP8 quantization of each row of x [rows, cols] per group of
    columns (group = cols for per token): scale = max(amax/448, 1e-10).
    Returns the dequantized values as float64."""
    rows, cols = x.shape
    out = np.zeros((rows, cols), np.float64)
    for g0 in range(0, cols, group):
        part = x[:, g0:g0 + group].astype(np.float32)
        s = np.maximum(np.abs(part).max(axis=1) / np.float32(FP8_MAX), MIN_SCALE).astype(np.float32)
        q = to_fp8(part / s[:, None])
        out[:, g0:g0 + group] = q.astype(np.float64) * s[:, None].astype(np.float64)
    return out


def route(logits, c):
    """Top-k ids and weights, ties to the lower id (stable sorts)."""
    x = logits.astype(np.float64)
    if c["scoring"] == "sigmoid":
        score = 1 / (1 + np.exp(-x))
    else:
        z = np.exp(x - x.max(axis=1, keepdims=True))
        score = z / z.sum(axis=1, keepdims=True)
    sel = score + (np.asarray(c["bias"], np.float32).astype(np.float64) if c["bias"] else 0)
    m, e = x.shape
    k = c["top_k"]
    ids = np.zeros((m, k), int)
    w = np.zeros((m, k))
    for t in range(m):
        allowed = np.ones(e, bool)
        g = c["num_groups"]
        if g > 1:
            size = e // g
            gs = np.array([np.sort(sel[t, i * size:(i + 1) * size])[::-1][:2].sum() for i in range(g)])
            keep = np.argsort(-gs, kind="stable")[:c["topk_groups"]]
            allowed[:] = False
            for i in keep:
                allowed[i * size:(i + 1) * size] = True
        cand = np.where(allowed, sel[t], -np.inf)
        ids[t] = np.argsort(-cand, kind="stable")[:k]
        w[t] = score[t, ids[t]]
        if c["renormalize"]:
            w[t] /= w[t].sum()
        w[t] *= c["scaling_factor"]
    return ids, w


def moe(c, hidden, logits, w13q, w13s, w2q, w2s):
    e, k, n, m = c["E"], c["K"], c["N"], c["M"]
    block = c["block"] or None
    group_k = block[1] if block else k
    group_n = block[1] if block else n
    r1 = 2 * n if c["activation"] == "silu_gated" else n
    w13 = w13q.astype(np.float64) * weight_scale_full(w13s, (e, r1, k), block)
    w2 = w2q.astype(np.float64) * weight_scale_full(w2s, (e, k, n), block)
    a = quant_act(hidden, group_k)
    ids, w = route(logits, c)
    out = np.zeros((m, k))
    for t in range(m):
        for j in range(c["top_k"]):
            ex = ids[t, j]
            h = w13[ex] @ a[t]
            if c["activation"] == "silu_gated":
                g, u = h[:n], h[n:]
                x = g / (1 + np.exp(-g)) * u
            else:
                x = np.maximum(h, 0) ** 2
            xq = quant_act(x[None, :].astype(np.float32), group_n)[0]
            out[t] += w[t, j] * (w2[ex] @ xq)
    return out, ids, w


def make_case(rng, c):
    e, k, n, m = c["E"], c["K"], c["N"], c["M"]
    block = c["block"] or None
    r1 = 2 * n if c["activation"] == "silu_gated" else n
    hidden = (rng.standard_normal((m, k)) / 10).astype(np.float32)
    if c["hidden_dtype"] == "bfloat16":
        hidden = hidden.astype(BF16).astype(np.float32)
    logits = rng.standard_normal((m, e)).astype(np.float32)
    # JSON null when the router has no correction bias.
    c["bias"] = (rng.standard_normal(e) / 10).astype(np.float32).tolist() if c["bias"] else None
    w13q, w13s = quant_weights(rng.standard_normal((e, r1, k)).astype(np.float32), block)
    w2q, w2s = quant_weights(rng.standard_normal((e, k, n)).astype(np.float32), block)
    out, ids, w = moe(c, hidden, logits, w13q, w13s, w2q, w2s)
    c.update(
        hidden=hidden.ravel().tolist(),
        logits=logits.ravel().tolist(),
        w13=codes(w13q), w13_scale=w13s.ravel().tolist(), w13_scale_shape=list(w13s.shape),
        w2=codes(w2q), w2_scale=w2s.ravel().tolist(), w2_scale_shape=list(w2s.shape),
        want_out=out.ravel().tolist(),
        want_ids=ids.ravel().tolist(),
        want_weights=w.ravel().tolist(),
    )
    return c


def main(path):
    rng = np.random.default_rng(20260101)
    cases = [
        make_case(rng, dict(
            name="silu_gated/sigmoid-bias-groups/per-channel/bf16", activation="silu_gated",
            E=4, top_k=2, K=40, N=24, M=5, scoring="sigmoid", renormalize=True, bias=True,
            num_groups=2, topk_groups=1, scaling_factor=2.5, block=[],
            hidden_dtype="bfloat16", out_dtype="bfloat16")),
        make_case(rng, dict(
            name="relu2/softmax/block16/fp32", activation="relu2",
            E=4, top_k=2, K=40, N=24, M=5, scoring="softmax", renormalize=True, bias=False,
            num_groups=0, topk_groups=0, scaling_factor=1.0, block=[16, 16],
            hidden_dtype="float32", out_dtype="float32")),
    ]
    with open(path, "w") as f:
        json.dump({"generator": "testdata/golden/gen_moe_golden.py",
                   "numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__,
                   "cases": cases}, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
