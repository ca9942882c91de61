"""tools/bench/trace_summary.py: busy time counts overlapping kernels once, gaps and the
per-kernel table come out of a hand-made trace."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "bench" / "trace_summary.py"


def _module():
    spec = importlib.util.spec_from_file_location("trace_summary", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["trace_summary"] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def _kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


TRACE = {
    "traceEvents": [
        _kernel("gemm", 0, 100),
        _kernel("copy", 50, 100),  # overlaps gemm on another stream: 50 us counted once
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999},  # not GPU
        _kernel("gemm", 450, 100),  # after a 300 us idle gap
        _kernel("memset", 560, 10, cat="gpu_memset"),
    ]
}


def test_busy_time_window_gaps_and_kernel_table():
    summary = _module().summarize(TRACE)
    assert summary.window_us == 570 and summary.busy_us == 260 and summary.num_events == 4
    assert summary.by_name == [("gemm", 200, 2), ("copy", 100, 1), ("memset", 10, 1)]
    assert summary.gaps == [(300, "gemm")]


def test_a_trace_without_gpu_kernels_is_an_error():
    with pytest.raises(ValueError, match="no GPU kernels"):
        _module().summarize({"traceEvents": [TRACE["traceEvents"][2]]})


def test_the_command_prints_the_summary(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(path), "--top", "2"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "window 0.6 ms, GPU busy 0.3 ms (46%), 4 GPU events" in out
    assert "gemm" in out and "memset" not in out.split("idle gaps")[0]
    assert "0.30 ms before gemm" in out


def test_the_command_refuses_a_cpu_trace_or_a_missing_file_in_one_line_without_a_traceback(
    tmp_path,
):
    # A trace recorded on CPU (profile.trace_steps on a CPU run) has host ops only.
    cpu_trace = tmp_path / "trace_rank0_steps2-3.json"
    cpu_trace.write_text(json.dumps({"traceEvents": [TRACE["traceEvents"][2]]}))
    for path, reason in ((cpu_trace, "no GPU kernels"), (tmp_path / "none.json", "none.json")):
        result = subprocess.run(
            [sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True
        )
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and reason in result.stderr
        assert str(path) in result.stderr and result.stdout == ""


def test_with_no_gap_threshold_only_real_idle_stretches_are_gaps():
    # Not the first kernel (nothing idles before it) nor back-to-back or overlapping ones.
    summary = _module().summarize(TRACE, gap_threshold_us=0)
    assert summary.gaps == [(300, "gemm"), (10, "memset")]


def test_the_command_refuses_a_negative_gap_threshold_or_kernel_count(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    for option in (["--gap-us", "-10"], ["--top", "-1"]):
        result = subprocess.run(
            [sys.executable, str(SCRIPT), str(path), *option], capture_output=True, text=True
        )
        assert result.returncode == 2 and option[0] in result.stderr, result.stderr


def test_per_call_averages_each_call_of_repeated_steps_in_launch_order():
    steps = [("quant", 10, 20), ("gemm", 40, 100), ("quant", 150, 30)]  # one step, offsets
    trace = {
        "traceEvents": [
            _kernel(name, 1000 * i + ts, dur + i)  # step i runs each kernel i us longer
            for i in range(3)
            for name, ts, dur in steps
        ]
        + [_kernel("memset", 5, 1, cat="gpu_memset")]  # not a kernel
    }
    calls = _module().per_call(trace, 3)
    assert calls == [("quant", 21.0), ("gemm", 101.0), ("quant", 31.0)]
    broken = {"traceEvents": trace["traceEvents"][:-2]}  # the last step lost a kernel
    with pytest.raises(ValueError, match="do not split into 3 runs"):
        _module().per_call(broken, 3)
    swapped = {"traceEvents": [dict(e) for e in trace["traceEvents"]]}
    swapped["traceEvents"][3]["name"] = "other"  # step 1 launched another kernel first
    with pytest.raises(ValueError, match="one step's sequence"):
        _module().per_call(swapped, 3)
