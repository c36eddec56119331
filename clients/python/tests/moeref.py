"""A float64 numpy reference of FusedMoE (MOE_SPEC.md section 1) for the
tests: FP8 E4M3FN codes, softmax or sigmoid routing, per-token dynamic
activation quantization, gated SiLU or ReLU^2, router weights after w2."""

import numpy as np


def _e4m3_table():
    v = np.zeros(256)
    for code in range(256):
        s, e, m = code >> 7, (code >> 3) & 0xF, code & 7
        if e == 0xF and m == 7:
            v[code] = np.nan
        elif e == 0:
            v[code] = m / 8 * 2.0 ** -6
        else:
            v[code] = (1 + m / 8) * 2.0 ** (e - 7)
        if s:
            v[code] = -v[code]
    return v


E4M3 = _e4m3_table()
_POS = np.array([c for c in range(127)])  # 0x00..0x7E, ascending values
_POSV = E4M3[_POS]


def fp8_encode(x):
    """Rounds float values to E4M3FN codes (nearest, ties to the even code
    as IEEE and the daemon round, saturating at 448). Ties are common, not
    a corner: a BF16 row whose absmax has the mantissa of 448 scales by a
    power of two, so its values keep 8 significant bits and one in 16 sits
    halfway between two FP8 codes."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), 448.0)
    i = np.clip(np.searchsorted(_POSV, a), 1, len(_POSV) - 1)
    lo, hi = _POSV[i - 1], _POSV[i]
    below, above = a - lo, hi - a
    # A code's lowest bit is its mantissa's, so the even one has it clear.
    pick = np.where((below < above) | ((below == above) & (_POS[i - 1] % 2 == 0)), i - 1, i)
    return (_POS[pick] | np.where(x < 0, 0x80, 0)).astype(np.uint8)


def fp8_decode(codes):
    return E4M3[np.asarray(codes, dtype=np.uint8)]


def quant_rows(x):
    """Per-row dynamic FP8 quantization: (dequantized values)."""
    s = np.maximum(np.abs(x).max(axis=-1, keepdims=True) / 448.0, 1e-10)
    return fp8_decode(fp8_encode(x / s)) * s


def random_layer(rng, e, k, n, gated=True):
    """FP8 codes of randn weights with one float32 scale per expert."""
    rows = 2 * n if gated else n
    w13f = rng.standard_normal((e, rows, k))
    w2f = rng.standard_normal((e, k, n))
    s13 = (np.abs(w13f).reshape(e, -1).max(1) / 448).astype(np.float32)
    s2 = (np.abs(w2f).reshape(e, -1).max(1) / 448).astype(np.float32)
    w13 = fp8_encode(w13f / s13[:, None, None])
    w2 = fp8_encode(w2f / s2[:, None, None])
    return w13, w2, s13, s2


def route(logits, top_k, renormalize, scoring="softmax"):
    logits = np.asarray(logits, dtype=np.float64)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p = p / p.sum(1, keepdims=True) if scoring == "softmax" else 1 / (1 + np.exp(-logits))
    ids = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, ids, 1)
    if renormalize:
        w = w / w.sum(1, keepdims=True)
    return ids, w


def _scale(s):
    """Per-expert [E] or per-channel [E, rows] scales, broadcast to weights."""
    s = np.asarray(s, dtype=np.float64)
    return s[:, None, None] if s.ndim == 1 else s[:, :, None]


def fused_moe(hidden, w13, w2, s13, s2, ids, weights, gated=True):
    w13d = fp8_decode(w13) * _scale(s13)
    w2d = fp8_decode(w2) * _scale(s2)
    a = quant_rows(np.asarray(hidden, dtype=np.float64))
    out = np.zeros(a.shape)
    n = w2.shape[2]
    for t in range(a.shape[0]):
        for j, e in enumerate(ids[t]):
            h = w13d[e] @ a[t]
            act = h[:n] / (1 + np.exp(-h[:n])) * h[n:] if gated else np.maximum(h, 0) ** 2
            out[t] += weights[t, j] * (w2d[e] @ quant_rows(act[None])[0])
    return out


def rel_l2(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))
