"""Writes fp8_golden.json: float32 inputs and their FP8 E4M3FN, FP8 E5M2,
bfloat16 and float16 encodings as numpy + ml_dtypes compute them, plus the
decoded value of every FP8 code and of sampled 16-bit codes. scaling's Go
tests check that expertd's codecs agree.

ml_dtypes' float32 -> float8_e4m3fn cast does not saturate: values that
round past 448 (and +-Inf) become NaN. expertd saturates to +-448, as
torch's scaled-quantization clamp and Hopper's cvt.rn.satfinite do, so the
"e4m3fn" column is the cast of the input clipped to [-448, 448] and
"e4m3fn_cast" is the plain cast, kept so the test can show that the two
differ only there.

Run it through gen_golden.sh, which pins the versions.
"""

import json
import sys

import ml_dtypes
import numpy as np

SEED = 20261202
F32 = np.float32


def code_values(dtype, nbits):
    """All codes of a 1-byte or 2-byte dtype, decoded to float32."""
    codes = np.arange(1 << nbits, dtype=np.uint8 if nbits == 8 else np.uint16)
    return codes, codes.view(dtype).astype(F32)


def boundaries(values):
    """Every positive finite code value, the midpoint of each adjacent pair
    and its float32 neighbours, with both signs."""
    v = np.unique(values[np.isfinite(values) & (values >= 0)]).astype(np.float64)
    mid = ((v[:-1] + v[1:]) / 2).astype(F32)
    assert np.all(mid.astype(np.float64) == (v[:-1] + v[1:]) / 2), "midpoint not a float32"
    pos = np.concatenate([
        v.astype(F32),
        mid,
        np.nextafter(mid, F32(0)),
        np.nextafter(mid, F32(np.inf)),
    ])
    return np.concatenate([pos, -pos])


def sampled(arr, n, rng):
    return arr[np.sort(rng.choice(len(arr), size=n, replace=False))]


def main(out):
    rng = np.random.default_rng(SEED)
    e4_codes, e4_vals = code_values(ml_dtypes.float8_e4m3fn, 8)
    e5_codes, e5_vals = code_values(ml_dtypes.float8_e5m2, 8)
    bf_codes, bf_vals = code_values(ml_dtypes.bfloat16, 16)
    h_codes, h_vals = code_values(np.float16, 16)

    specials = np.array([
        0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan,
        np.finfo(F32).max, -np.finfo(F32).max, np.finfo(F32).smallest_subnormal,
        448, 464, 480, 512, 1e6, 57344, 61440, 65504, 65520, 2.0**-9, 2.0**-10, 2.0**-16, 2.0**-17,
    ], dtype=F32)
    inputs = np.concatenate([
        specials,
        boundaries(e4_vals),
        boundaries(e5_vals),
        sampled(boundaries(bf_vals), 800, rng),
        sampled(boundaries(h_vals), 800, rng),
        (rng.standard_normal(600) * 1e-3).astype(F32),
        rng.standard_normal(600).astype(F32),
        (rng.standard_normal(600) * 300).astype(F32),
        rng.integers(0, 1 << 32, size=1200, dtype=np.uint64).astype(np.uint32).view(F32),
    ])

    with np.errstate(invalid="ignore", over="ignore"):
        e4m3 = np.clip(inputs, F32(-448), F32(448)).astype(ml_dtypes.float8_e4m3fn)
        e4m3_cast = inputs.astype(ml_dtypes.float8_e4m3fn)
        e5m2 = inputs.astype(ml_dtypes.float8_e5m2)
        bf16 = inputs.astype(ml_dtypes.bfloat16)
        fp16 = inputs.astype(np.float16)

    bf_sample = sampled(bf_codes, 1024, rng)
    h_sample = sampled(h_codes, 1024, rng)
    doc = {
        "about": "numpy + ml_dtypes encodings of float32 inputs (as uint32 bits); regenerate with gen_golden.sh",
        "numpy": np.__version__,
        "ml_dtypes": ml_dtypes.__version__,
        "seed": SEED,
        "inputs": inputs.view(np.uint32).tolist(),
        "e4m3fn": e4m3.view(np.uint8).tolist(),
        "e4m3fn_cast": e4m3_cast.view(np.uint8).tolist(),
        "e5m2": e5m2.view(np.uint8).tolist(),
        "bfloat16": bf16.view(np.uint16).tolist(),
        "float16": fp16.view(np.uint16).tolist(),
        "decode_e4m3fn": e4_vals.view(np.uint32).tolist(),
        "decode_e5m2": e5_vals.view(np.uint32).tolist(),
        "bfloat16_codes": bf_sample.tolist(),
        "decode_bfloat16": bf_vals[bf_sample].view(np.uint32).tolist(),
        "float16_codes": h_sample.tolist(),
        "decode_float16": h_vals[h_sample].view(np.uint32).tolist(),
    }
    with open(out, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {out}: {len(inputs)} inputs")


if __name__ == "__main__":
    main(sys.argv[1])
