"""bench/host_trace.py off the GPU: its arguments, how it splits a profiler
trace into calls and what it reports of them, on made-up traces. The split and
the report need no torch; the last test (the device part's refusal of a
missing library) does, and skips without it unless EXPERTD_REQUIRE_TORCH=1.
  python -m pytest -q bench/test_host_trace.py"""

import importlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ht = importlib.import_module("host_trace")
Ev = ht.Ev

MARK = "at::cuda::(anonymous namespace)::spin_kernel(long)"


def test_defaults():
    a = ht.parse_args([])
    assert a.tokens == [1, 16]
    assert a.hidden == ["fp8", "bf16"]
    assert a.scales == ["static", "dynamic"]
    assert a.paths == ["graph", "host-device", "host-pinned"]
    assert a.models == ["nemotron-3-nano", "qwen3-30b-a3b"]
    assert a.routing == "none"


def test_lists_parse():
    a = ht.parse_args(["--tokens", "1,16,64", "--hidden", "bf16", "--paths", "host-device,graph",
                       "--models", "qwen3-30b-a3b", "--routing", "host"])
    assert a.tokens == [1, 16, 64]
    assert a.hidden == ["bf16"]
    assert a.paths == ["host-device", "graph"]
    assert a.models == ["qwen3-30b-a3b"]
    assert a.routing == "host"


@pytest.mark.parametrize("argv", [
    ["--hidden", "fp16"],
    ["--scales", "static,per-channel"],
    ["--paths", "host"],
    ["--tokens", "0"],
    ["--tokens", "1,x"],
    ["--iters", "0"],
    ["--warmup", "2"],
    ["--models", ","],
    ["--routing", "device"],
])
def test_bad_arguments_exit(argv, capsys):
    with pytest.raises(SystemExit) as e:
        ht.parse_args(argv)
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err


def trace(calls, prep=("Memcpy DtoD (Device -> Device)",)):
    """A GPU trace of calls (each a list of (name, start, dur) from t), each
    preceded by an input copy and bracketed by markers, 1000 µs apart."""
    gpu = []
    for i, ops in enumerate(calls):
        t = 1000.0 * i
        for name in prep:
            gpu.append(Ev(t, t + 1, name))
        gpu.append(Ev(t + 10, t + 11, MARK))
        for name, start, dur in ops:
            gpu.append(Ev(t + 100 + start, t + 100 + start + dur, name))
        gpu.append(Ev(t + 900, t + 901, MARK))
    return gpu


HOST_CALL = [("Memcpy HtoD (Pinned -> Device)", 0.0, 1.5), ("gemm", 5.0, 20.0), ("requant", 26.0, 2.0),
             ("combine", 30.0, 3.0)]


def test_split_calls_drops_markers_and_input_copies():
    calls = ht.split_calls(sorted(trace([HOST_CALL, HOST_CALL])), 2)
    assert [[e.name for e in c] for c in calls] == [[n for n, _, _ in HOST_CALL]] * 2
    assert calls[1][0].start == 1100.0


def test_split_calls_refuses_a_marker_count_off():
    gpu = sorted(trace([HOST_CALL, HOST_CALL]))
    assert ht.split_calls(gpu, 3) is None
    assert ht.split_calls([e for e in gpu if e.start != 900.0], 2) is None


def test_rows_start_at_the_first_kernel():
    rows = ht.op_rows([Ev(100 + s, 100 + s + d, n) for n, s, d in HOST_CALL], str)
    got = [(r["label"], r["kind"], r["start"], r["dur"], r["gap"]) for r in rows]
    assert got == [("Memcpy HtoD (Pinned -> Device)", "copy", -5.0, 1.5, None),
                   ("gemm", "kernel", 0.0, 20.0, 3.5),
                   ("requant", "kernel", 21.0, 2.0, 1.0),
                   ("combine", "kernel", 25.0, 3.0, 2.0)]


def test_gap_follows_the_latest_end():
    # A kernel that overlaps its predecessor (programmatic dependent launch)
    # has a negative gap; the next one's gap counts from the later end.
    rows = ht.op_rows([Ev(0, 10, "a"), Ev(8, 9, "b"), Ev(12, 13, "c")], str)
    assert [r["gap"] for r in rows] == [None, -2, 2]


def test_summarize_takes_medians_of_the_common_sequence():
    slow = [("gemm", 0.0, 30.0), ("combine", 31.0, 3.0)]
    fast = [("gemm", 0.0, 20.0), ("combine", 21.0, 3.0)]
    odd = [("gemm", 0.0, 20.0), ("requant", 21.0, 2.0), ("combine", 24.0, 3.0)]
    per_call = [ht.op_rows([Ev(s, s + d, n) for n, s, d in c], str) for c in (fast, fast, slow, odd)]
    s = ht.summarize(per_call)
    assert (s["calls"], s["matching"]) == (4, 3)
    assert [o["label"] for o in s["ops"]] == ["gemm", "combine"]
    assert s["ops"][0]["dur"] == 20.0
    assert s["ops"][1]["gap"] == 1.0
    assert s["span_us"] == 24.0
    assert s["kernel_span_us"] == 24.0
    assert s["others"] == [{"labels": ["gemm", "requant", "combine"], "calls": 1}]


def test_kernel_span_leaves_out_copies():
    s = ht.summarize([ht.op_rows([Ev(100 + s, 100 + s + d, n) for n, s, d in HOST_CALL], str)])
    assert s["span_us"] == 33.0
    assert s["kernel_span_us"] == 28.0


def test_analyze_splits_by_markers_and_times_api_calls():
    gpu = trace([HOST_CALL, HOST_CALL, HOST_CALL])
    ranges = [Ev(1000.0 * i + 95, 1000.0 * i + 140, ht.CALL_RANGE) for i in range(3)]
    api = []
    for r in ranges:
        api += [Ev(r.start + 1, r.start + 3, "cudaMemcpyAsync"), Ev(r.start + 4, r.start + 7, "cudaGraphLaunch"),
                Ev(r.start + 8, r.end - 1, "cudaEventSynchronize"), Ev(r.start + 2, r.start + 2.5, "aten::empty")]
    # Outside any call: the input copy's and the markers' API calls.
    api += [Ev(1000.0 * i + 1, 1000.0 * i + 2, "cudaMemcpyAsync") for i in range(3)]
    # The range's GPU-side annotation is no operation of the call.
    gpu.append(Ev(100, 133, ht.CALL_RANGE))
    rec = ht.analyze(gpu, ranges + api, 3, str.upper)
    assert rec["split"] == "markers"
    g = rec["gpu"]
    assert (g["calls"], g["matching"]) == (3, 3)
    assert [o["label"] for o in g["ops"]] == [n.upper() for n, _, _ in HOST_CALL]
    assert rec["first_op_after_entry_us"] == 5.0
    assert rec["first_kernel_after_entry_us"] == 10.0
    a = rec["api"]
    assert [(o["label"], o["start"], o["dur"]) for o in a["ops"]] == [
        ("cudaMemcpyAsync", 1.0, 2.0), ("cudaGraphLaunch", 4.0, 3.0), ("cudaEventSynchronize", 8.0, 36.0)]


def test_analyze_falls_back_to_host_ranges():
    gpu = [e for e in trace([HOST_CALL, HOST_CALL]) if ht.MARKER not in e.name]
    ranges = [Ev(1000.0 * i + 95, 1000.0 * i + 140, ht.CALL_RANGE) for i in range(2)]
    rec = ht.analyze(gpu, ranges, 2, str)
    assert rec["split"] == "host ranges"
    assert rec["gpu"]["matching"] == 2
    assert [o["label"] for o in rec["gpu"]["ops"]] == [n for n, _, _ in HOST_CALL]


def test_format_case_names_every_door_and_op():
    rec = ht.analyze(trace([HOST_CALL]), [Ev(95, 140, ht.CALL_RANGE)], 1, str)
    case = {"model": "nemotron-3-nano", "M": 1, "hidden": "fp8", "scales": "dynamic", "routing": "none",
            "doors": [{"door": "graph", "wall_p50": 60.0, "wall_p90": 61.0, "device_p50": 36.2, "device_p90": 37.0},
                      {"door": "host-device", "wall_p50": 70.0, "wall_p90": 71.0, "device_p50": 41.3,
                       "device_p90": 42.0, "same_bytes": True, "profile": rec}]}
    text = ht.format_case(case)
    assert "nemotron-3-nano M=1 hidden=fp8 scales=dynamic" in text
    assert "graph" in text and "host-device" in text and "41.3" in text and "True" in text
    for name, _, _ in HOST_CALL:
        assert name in text


def test_run_refuses_a_missing_library(capsys):
    if os.environ.get("EXPERTD_REQUIRE_TORCH") != "1":
        pytest.importorskip("torch", reason="torch is not installed (scripts/e2e-setup.sh installs it)")
    assert ht.main(["--lib", "/nonexistent/libexpertd_cuda.so"]) == 2
    assert "no library at /nonexistent" in capsys.readouterr().err
    assert ht.main(["--lib", "/nonexistent/libexpertd_cuda.so", "--models", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
