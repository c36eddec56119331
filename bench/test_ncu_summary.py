"""bench/ncu_summary.py off the GPU, on a made-up raw-page CSV of two calls.
  python -m pytest -q bench/test_ncu_summary.py"""

import importlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ns = importlib.import_module("ncu_summary")
kn = importlib.import_module("kernel_names")

FILL = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char *, 1>>(int, T2, T3)"
GEMM = "void unnamed>::moe_gemm_kernel<128, 2, 5, 0, 0, 0, 0, 0, 0, 1>(CUtensorMap_st, CUtensorMap_st, unnamed>::Params)"
CUT1 = "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<Relu2Scale>>(T1::Params)"
CUT2 = "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<Plain>>(T1::Params)"
ROUTE = "void expertd::route_kernel<4>(expertd::RouteArgs)"

HEAD = ["ID", "Kernel Name", "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
        "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"]
UNITS = ["", "", "nsecond", "byte", "byte", "%", "%", "%", "ratio", "ratio", "ratio", "ratio"]


def row(i, name, ns_, rd, wr=0, tensor=""):
    return [str(i), name, str(ns_), str(rd), str(wr), "50", "60", str(tensor), "0.5", "2.5", "1.5", "0.1"]


def csv_text(rows):
    return "\n".join(",".join(f'"{c}"' for c in r) for r in [HEAD, UNITS] + rows) + "\n"


LOG = "lib ...\n== nemotron-3-nano M=1\n== nemotron-3-nano M=8192\n"
ROWS = [row(0, FILL, 2000, 0), row(1, ROUTE, 5000, 1000), row(2, GEMM, 20000, 40_000_000, tensor=3.5),
        row(3, GEMM, 10000, 20_000_000), row(4, FILL, 2000, 0), row(5, ROUTE, 10000, 1000),
        row(6, CUT1, 600000, 100_000_000, 50_000_000, tensor=70.25), row(7, CUT2, 500000, 80_000_000, tensor=65)]


def test_splits_calls_at_markers_and_labels_gemms_by_order():
    calls = ns.calls_of(LOG, ns.read_csv(csv_text(ROWS)))
    assert [(c.model, c.M) for c in calls] == [("nemotron-3-nano", 1), ("nemotron-3-nano", 8192)]
    assert [k.label for k in calls[0].kernels] == ["route_kernel", "gemm1", "gemm2"]
    assert [k.label for k in calls[1].kernels] == ["route_kernel", "gemm1 (cutlass)", "gemm2 (cutlass)"]


def test_table_rates_and_stalls():
    out = ns.table(ns.calls_of(LOG, ns.read_csv(csv_text(ROWS))))
    # 20 µs reading 40 MB: 2.00 TB/s; stalls sorted, largest first.
    assert "| nemotron-3-nano | 1 | gemm1 | 20.0 | 60.0 | 3.5 | 50.0 | 40.0 | 2.00 | long_scoreboard 2.50, gmma 1.50, barrier 0.50 |" in out
    # Reads and writes both count: 150 MB in 600 µs.
    assert "| nemotron-3-nano | 8192 | gemm1 (cutlass) | 600.0 | 60.0 | 70.2 | 50.0 | 150.0 | 0.25 |" in out


def test_more_ranges_than_names_is_an_error():
    with pytest.raises(ValueError, match="more profiler ranges"):
        ns.calls_of("== nemotron-3-nano M=1\n", ns.read_csv(csv_text(ROWS)))


def test_missing_metric_prints_a_dash():
    head = HEAD[:3]
    text = "\n".join(",".join(f'"{c}"' for c in r) for r in [head, UNITS[:3], [str(0), FILL, "1"], ["1", ROUTE, "3000"]])
    out = ns.table(ns.calls_of("== qwen3-30b-a3b M=16\n", ns.read_csv(text)))
    assert "| qwen3-30b-a3b | 16 | route_kernel | 3.0 | — | — | — | — | — |  |" in out


def test_kernel_label_names():
    assert kn.kernel_label(ROUTE) == "route_kernel"
    assert kn.kernel_label("void expertd::(anonymous namespace)::combine_kernel<8>(Args)") == "combine_kernel"
    assert kn.kernel_label("expertd::<unnamed>::cutlass_prep_kernel(expertd::<unnamed>::PrepParams)") == "cutlass_prep_kernel"
    assert kn.kernel_label("moe_gemm_kernel<64, (expertd::GemmEpilogue)2>") == "gemm2"
    assert kn.kernel_label("moe_gemm_kernel<64, (expertd::GemmEpilogue)3>") == "gemm1"
    assert kn.call_labels([GEMM, GEMM, GEMM]) == ["gemm1", "gemm2", "gemm2"]
