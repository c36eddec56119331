"""The benchmark's picture: time, TFLOP/s and weight TB/s against M, per model.

Reads what bench/moe_bench.py writes ($OUT/moe_bench.json) and draws one row per
model: time per call (log-log, with the floor the ceilings set: the larger of
weight bytes over the copy bandwidth and FLOPs over the FP8 rate), TFLOP/s and
weight TB/s (each with its ceiling as a horizontal line). Every implementation
the run timed is drawn beside expertd: the PyTorch peer (and its fast-accum
variant), FlashInfer's cutlass_fused_moe with routing (and the call alone), and
the quoted vLLM GEMMs-only figures of the run's card.

moe_bench.py calls write() when matplotlib imports; elsewhere run
`bash bench/plot.sh moe_bench.json [out.png]`, which brings matplotlib into a
virtual environment. Needs no torch.
"""

from __future__ import annotations

import json
import sys

# (label, record key, line style): every series the picture can hold, expertd first.
SERIES = [
    ("expertd", "expertd_ms", "-"),
    ("FlashInfer cutlass_fused_moe + routing", "flashinfer_ms", "-"),
    ("FlashInfer cutlass_fused_moe alone", "flashinfer_moe_ms", "--"),
    ("PyTorch peer", "peer_ms", "-"),
    ("PyTorch peer, fast accum", "peer_fast_ms", "--"),
    ("vLLM Triton GEMMs only (quoted)", "vllm_gemms_ms", ":"),
]


def tflops(rec: dict, ms: float) -> float:
    """TFLOP/s of record rec's layer at ms per call."""
    return rec["flops"] / (ms * 1e-3) / 1e12


def weight_tbps(rec: dict, ms: float) -> float:
    """TB/s of the weights its routing touched, at ms per call."""
    return rec["weight_bytes"] / (ms * 1e-3) / 1e12


def floor_ms(rec: dict, ceilings: dict) -> float:
    """The least time the ceilings allow: weight bytes at the copy rate or
    FLOPs at the FP8 rate, whichever is longer."""
    return max(rec["weight_bytes"] / (ceilings["copy_tbps"] * 1e12),
               rec["flops"] / (ceilings["fp8_tflops"] * 1e12)) * 1e3


def write(doc: dict, path: str) -> None:
    """Draw doc (moe_bench.json's content) into the PNG at path. Raises
    ImportError when matplotlib is absent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, results = doc["meta"], doc["results"]
    ceil = meta["ceilings"]
    models = list(dict.fromkeys(r["model"] for r in results))
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 4.2 * len(models)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, model in zip(axes, models):
        recs = sorted((r for r in results if r["model"] == model), key=lambda r: r["M"])
        Ms = [r["M"] for r in recs]
        for (label, key, style), color in zip(SERIES, colors):
            pts = [(r, r[key]) for r in recs if r.get(key)]
            if not pts:
                continue
            m = [r["M"] for r, _ in pts]
            kw = dict(label=label, linestyle=style, color=color, marker="o", markersize=3,
                      linewidth=2.2 if key == "expertd_ms" else 1.3)
            row[0].plot(m, [ms for _, ms in pts], **kw)
            row[1].plot(m, [tflops(r, ms) for r, ms in pts], **kw)
            row[2].plot(m, [weight_tbps(r, ms) for r, ms in pts], **kw)
        row[0].plot(Ms, [floor_ms(r, ceil) for r in recs], color="black", linestyle="-.",
                    linewidth=1, label="floor set by the ceilings")
        row[1].axhline(ceil["fp8_tflops"], color="black", linestyle="-.", linewidth=1,
                       label=f"FP8 dense {ceil['fp8_tflops']:.0f} TFLOP/s")
        row[2].axhline(ceil["copy_tbps"], color="black", linestyle="-.", linewidth=1,
                       label=f"copy {ceil['copy_tbps']:.2f} TB/s")
        for ax, what in zip(row, ("time per call (ms)", "TFLOP/s", "weight TB/s")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(Ms, [str(m) for m in Ms])
            if ax is row[0]:
                ax.set_yscale("log")
            ax.set_xlabel("tokens M")
            ax.set_ylabel(what)
            ax.set_title(f"{model}: {what}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
        row[0].legend(fontsize=7)
        row[1].legend(fontsize=7)
        row[2].legend(fontsize=7)
    fig.suptitle(f"{meta['device']}, commit {meta['commit']}, {meta['time_utc']}; "
                 f"ceilings: {ceil['source']}; vLLM: {meta.get('vllm_label', 'n/a')}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """plot.py moe_bench.json [out.png]"""
    if not 1 <= len(argv) <= 2:
        print("usage: plot.py moe_bench.json [out.png]", file=sys.stderr)
        return 2
    src = argv[0]
    dst = argv[1] if len(argv) > 1 else src.removesuffix(".json") + ".png"
    with open(src) as f:
        doc = json.load(f)
    write(doc, dst)
    print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
