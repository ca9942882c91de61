"""StepProfiler: which steps a trace holds and how its file is named."""

import errno
import json
import logging

import pytest
import torch

from mt_train.profiling import StepProfiler


def _run_steps(profiler, steps):
    for step in steps:
        with profiler.step(step):
            pass
    profiler.close()


def test_a_run_resumed_inside_the_trace_range_traces_the_rest_of_it(tmp_path):
    _run_steps(StepProfiler(tmp_path, 0, (2, 4), False, False), range(3, 7))
    traces = [p.name for p in (tmp_path / "profile").iterdir()]
    assert traces == ["trace_rank0_steps3-4.json"]
    assert "traceEvents" in json.loads((tmp_path / "profile" / traces[0]).read_text())


def test_a_trace_cut_short_by_the_end_of_the_run_names_the_steps_it_holds(tmp_path):
    _run_steps(StepProfiler(tmp_path, 1, (2, 9), False, False), range(1, 4))
    assert [p.name for p in (tmp_path / "profile").iterdir()] == ["trace_rank1_steps2-3.json"]


def test_nvtx_without_cuda_warns_that_it_needs_a_gpu_as_memory_snapshot_does(tmp_path, caplog):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only message")
    with caplog.at_level(logging.WARNING, logger="mt_train"):
        _run_steps(StepProfiler(tmp_path, 0, None, False, True), range(1, 3))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "profile.nvtx" in messages[0] and "CUDA" in messages[0]


def test_a_trace_that_cannot_be_written_leaves_no_torn_file_and_the_run_goes_on(
    tmp_path, monkeypatch, caplog
):
    def export_half_then_fill_the_disk(self, path):
        with open(path, "w") as f:
            f.write('{"traceEvents": [')  # torn: the disk filled up midway
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(
        torch.profiler.profile, "export_chrome_trace", export_half_then_fill_the_disk
    )
    ran = []
    profiler = StepProfiler(tmp_path, 0, (1, 1), False, False)
    with caplog.at_level(logging.WARNING, logger="mt_train"):
        for step in range(1, 4):
            with profiler.step(step):
                ran.append(step)
        profiler.close()
    assert ran == [1, 2, 3]
    assert list((tmp_path / "profile").iterdir()) == []  # neither a torn trace nor a temporary
    [message] = [r.getMessage() for r in caplog.records]
    assert "trace_rank0_steps1-1.json" in message and "No space left" in message


def test_a_memory_snapshot_that_cannot_be_written_leaves_no_torn_file_and_stops_recording(
    tmp_path, monkeypatch, caplog
):
    recording = []

    def dump_half_then_fill_the_disk(path):
        with open(path, "wb") as f:
            f.write(b"\x80\x04")  # torn pickle: the disk filled up midway
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump_half_then_fill_the_disk)
    monkeypatch.setattr(
        torch.cuda.memory, "_record_memory_history", lambda *a, **k: recording.append(k)
    )
    profiler = StepProfiler(tmp_path, 0, None, False, False)
    profiler.memory = True  # as on a CUDA machine with profile.memory_snapshot=true
    with caplog.at_level(logging.WARNING, logger="mt_train"):
        _run_steps(profiler, range(1, 3))
    assert list((tmp_path / "profile").iterdir()) == []
    assert recording == [{"enabled": None}]  # the recorder is stopped all the same
    [message] = [r.getMessage() for r in caplog.records]
    assert "memory_rank0.pickle" in message and "No space left" in message


def test_a_trace_ended_by_a_failing_step_is_named_after_the_steps_it_holds(tmp_path):
    profiler = StepProfiler(tmp_path, 0, (2, 5), False, False)
    with pytest.raises(RuntimeError, match="non-finite"):
        for step in range(1, 6):
            with profiler.step(step):
                if step == 2:
                    raise RuntimeError("non-finite loss")  # the run ends here
    profiler.close()  # as pretrain's `finally` does
    assert [p.name for p in (tmp_path / "profile").iterdir()] == ["trace_rank0_steps2-2.json"]


def test_a_profile_path_taken_by_a_file_warns_and_the_run_goes_on(tmp_path, caplog):
    (tmp_path / "profile").write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="mt_train"):
        _run_steps(StepProfiler(tmp_path, 0, (1, 1), False, False), range(1, 3))
    [message] = [r.getMessage() for r in caplog.records]
    assert "trace_rank0_steps1-1.json" in message
    assert (tmp_path / "profile").read_text() == "not a directory"
