"""What bounds each kernel of the profiled calls: a table from Nsight Compute's raw CSV.

scripts/device-bounds.sh runs bench/ncu_call.py under ncu (one call per model
and M, each in its own profiler range, each begun by a marker fill kernel) and
exports the report's raw page as CSV; this splits the rows into calls at the
markers, names each call by the "== <model> M=<M>" lines ncu_call.py printed,
and prints per kernel: time, the SM's and DRAM's throughput as a share of
peak, the tensor pipe's active cycles, DRAM bytes and rate, and the three
largest stall reasons (warps stalled per issued instruction). No torch needed.

  python3 bench/ncu_summary.py --log ncu-nemotron.log --csv ncu-nemotron.csv
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from dataclasses import dataclass, field

from kernel_names import call_labels

MARKER = "FillFunctor"
_STALL = re.compile(r"^smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)_per_issue_active\.ratio$")
_CALL = re.compile(r"^== (\S+) M=(\d+)\s*$")


@dataclass
class Kernel:
    name: str
    metrics: dict[str, str]
    label: str = ""


@dataclass
class Call:
    model: str
    M: int
    kernels: list[Kernel] = field(default_factory=list)


def read_csv(text: str) -> list[Kernel]:
    """The raw page's kernel rows: after the header, those whose ID is a
    number (the units row's is empty)."""
    rows = list(csv.reader(line for line in text.splitlines() if line.startswith('"')))
    if not rows:
        return []
    head = rows[0]
    kernels = (dict(zip(head, r)) for r in rows[1:] if r and r[0].strip().isdigit())
    return [Kernel(m.get("Kernel Name", "?"), m) for m in kernels]


def calls_of(log_text: str, kernels: list[Kernel]) -> list[Call]:
    """Splits the kernels at each marker into the calls the log names, in order."""
    names = [(m.group(1), int(m.group(2))) for m in map(_CALL.match, log_text.splitlines()) if m]
    calls: list[Call] = []
    for k in kernels:
        if MARKER in k.name:
            if len(calls) == len(names):
                raise ValueError(f"more profiler ranges than '== model M=' lines ({len(names)})")
            calls.append(Call(*names[len(calls)]))
        elif calls:
            calls[-1].kernels.append(k)
    for c in calls:
        for k, lab in zip(c.kernels, call_labels([k.name for k in c.kernels])):
            k.label = lab
    return calls


def num(m: dict[str, str], key: str) -> float | None:
    v = m.get(key, "").replace(",", "")
    try:
        return float(v)
    except ValueError:
        return None


def first(m: dict[str, str], *keys: str) -> float | None:
    for k in keys:
        v = num(m, k)
        if v is not None:
            return v
    return None


def stalls(m: dict[str, str], top: int = 3) -> str:
    found = [(s.group(1), num(m, k)) for k, s in ((k, _STALL.match(k)) for k in m) if s]
    found = sorted(((n, v) for n, v in found if v), key=lambda nv: -nv[1])
    return ", ".join(f"{n} {v:.2f}" for n, v in found[:top])


def duration_us(m: dict[str, str]) -> float | None:
    """gpu__time_duration in µs whatever unit the export chose (ns by default)."""
    v = num(m, "gpu__time_duration.sum")
    return None if v is None else v / 1e3


def table(calls: list[Call]) -> str:
    lines = ["| model | M | kernel | µs | SM % | tensor pipe % | DRAM % | DRAM MB | DRAM TB/s | top stalls (warps per issue) |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt):
        return "—" if v is None else format(v, fmt)

    for c in calls:
        for k in c.kernels:
            m = k.metrics
            us = duration_us(m)
            rd, wr = num(m, "dram__bytes_read.sum"), num(m, "dram__bytes_write.sum")
            mb = None if rd is None else (rd + (wr or 0)) / 1e6
            tbs = None if mb is None or not us else mb / us  # MB per µs = TB/s
            tensor = first(m, "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
                           "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed")
            lines.append(f"| {c.model} | {c.M} | {k.label} | {f(us, '.1f')} | "
                         f"{f(num(m, 'sm__throughput.avg.pct_of_peak_sustained_elapsed'), '.1f')} | {f(tensor, '.1f')} | "
                         f"{f(num(m, 'dram__throughput.avg.pct_of_peak_sustained_elapsed'), '.1f')} | {f(mb, '.1f')} | "
                         f"{f(tbs, '.2f')} | {stalls(m)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", required=True, help="ncu_call.py's output (its '== model M=' lines)")
    ap.add_argument("--csv", required=True, help="ncu --import REPORT --page raw --csv")
    args = ap.parse_args(argv)
    with open(args.log) as f:
        log_text = f.read()
    with open(args.csv) as f:
        kernels = read_csv(f.read())
    try:
        calls = calls_of(log_text, kernels)
    except ValueError as e:
        print(f"ncu_summary: {e}", file=sys.stderr)
        return 1
    if not calls:
        print(f"ncu_summary: no profiled call in {args.csv}", file=sys.stderr)
        return 1
    print(table(calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
