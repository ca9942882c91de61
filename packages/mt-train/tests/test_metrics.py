"""Peak FLOP/s for MFU by device name; the metrics.jsonl format."""

import io
import json
import math

import pytest

from mt_train.metrics import MetricsLogger, peak_flops


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H200", (794e12, 989e12)),
        ("NVIDIA H100 80GB HBM3", (794e12, 989e12)),
        ("NVIDIA H100 PCIe", (None, 756e12)),  # not the SXM part's 989
        ("NVIDIA H100 NVL", (None, 835e12)),
        ("NVIDIA H200 NVL", (None, 835e12)),
        ("NVIDIA A100-SXM4-80GB", (None, None)),
    ],
)
def test_peak_flops_tell_the_pcie_and_nvl_parts_from_the_sxm_ones(name, expected):
    assert peak_flops(name) == expected


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def test_a_skipped_steps_non_finite_numbers_are_written_as_strict_json_nulls(tmp_path):
    logger = MetricsLogger(tmp_path, max_steps=2, stream=io.StringIO())
    row = {"loss": 2.5, "aux_loss": 0.01, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0}
    logger.log({"step": 1, **row})
    logger.log({"step": 2, **row, "loss": math.nan, "grad_norm": math.inf, "aux_loss": -math.inf})
    logger.close()
    # A strict parser (jq, JSON.parse) refuses NaN and Infinity.
    lines = [
        json.loads(line, parse_constant=_reject_constant)
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert lines[0] == {"step": 1, **row}
    assert lines[1] == {**row, "step": 2, "loss": None, "grad_norm": None, "aux_loss": None}


def test_a_step_that_validated_prints_its_line_whatever_log_every(tmp_path):
    stream = io.StringIO()
    logger = MetricsLogger(tmp_path, max_steps=30, log_every=10, stream=stream)
    row = {"loss": 2.5, "aux_loss": 0.01, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0}
    for step in range(1, 31):
        logger.log({"step": step, **row, **({"val_loss": 2.0} if step in (5, 25) else {})})
    logger.close()
    lines = stream.getvalue().splitlines()
    step_of = {line: line.split("/")[0].split()[-1] for line in lines}  # "step  5/30 [..."
    assert [step_of[line] for line in lines] == ["5", "10", "20", "25", "30"]
    assert [step_of[line] for line in lines if "| val 2.0000 |" in line] == ["5", "25"]


class _FakeWandbRun:
    """Stands in for a resumed W&B run whose history already reaches a step."""

    def __init__(self, starting_step):
        self.starting_step = starting_step  # W&B's next step: lower ones are dropped
        self.logged = []

    def log(self, data, step=None):
        self.logged.append(step)

    def finish(self):
        pass


def test_wandb_is_not_sent_again_the_steps_it_holds_after_a_resume_and_warns_once(
    tmp_path, monkeypatch, caplog
):
    import sys
    import types

    from mt_train.metrics import build_sinks

    run = _FakeWandbRun(starting_step=6)  # the interrupted run logged steps 1..5
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    (sink,) = build_sinks(tmp_path, False, "proj", {}, start_step=3)  # resumed at step 3
    row = {"loss": 2.5, "aux_loss": 0.01, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0}
    with caplog.at_level("WARNING", logger="mt_train"):
        for step in range(4, 9):
            sink.log({"step": step, **row})
    sink.close()
    assert run.logged == [6, 7, 8]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "steps 4 to 5" in warning and "metrics.jsonl" in warning, warning


def test_metrics_jsonl_cut_back_on_resume_is_on_disk_before_it_replaces_the_old_one(
    tmp_path, monkeypatch
):
    import os

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)))
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    MetricsLogger(tmp_path, max_steps=9, start_step=3, stream=io.StringIO()).close()
    # Without the fsync a power loss after the rename can leave an empty file: the whole
    # history lost, not just the redone steps.
    assert events[:2] == [("fsync", "metrics.jsonl.tmp"), ("replace", "metrics.jsonl.tmp")]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_a_wandb_run_that_cannot_start_is_a_value_error_naming_the_key_and_ways_out(
    tmp_path, monkeypatch
):
    import sys
    import types

    from mt_train.metrics import build_sinks

    class Error(Exception):  # wandb.errors.Error, the base of UsageError, CommError, ...
        pass

    def init(**kwargs):
        raise Error("No API key configured. Use `wandb login` to log in.")

    fake = types.ModuleType("wandb")
    fake.init = init
    fake.errors = types.SimpleNamespace(Error=Error)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with pytest.raises(ValueError, match=r"metrics.wandb_project='proj': W&B could not start a "
                       r"run \(No API key configured.*\); log in with `wandb login`, set "
                       r"WANDB_MODE=offline, or set metrics.wandb_project=''"):  # fmt: skip
        build_sinks(tmp_path, False, "proj", {})


def test_sinks_already_open_are_closed_when_a_later_one_cannot_start(tmp_path, monkeypatch):
    import sys
    import types

    from mt_train.metrics import build_sinks

    closed = []

    class FakeWriter:  # stands in for torch.utils.tensorboard.SummaryWriter
        def __init__(self, log_dir, purge_step=None):
            pass

        def close(self):
            closed.append("tensorboard")

    tensorboard = types.ModuleType("torch.utils.tensorboard")
    tensorboard.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tensorboard)
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: import fails
    with pytest.raises(ValueError, match="needs the wandb package"):
        build_sinks(tmp_path, True, "proj", {})
    assert closed == ["tensorboard"]


def test_a_metrics_file_that_cannot_be_written_is_a_value_error_and_closes_the_sinks(tmp_path):
    class Sink:
        closed = False

        def close(self):
            self.closed = True

    (tmp_path / "metrics.jsonl").mkdir()  # say, left there by a mistaken copy
    sink = Sink()
    with pytest.raises(ValueError, match=r"metrics\.jsonl.*choose another run_dir"):
        MetricsLogger(tmp_path, max_steps=4, sinks=[sink])
    assert sink.closed  # its event file complete, its W&B run finished


def test_a_tensorboard_directory_that_cannot_be_created_is_a_value_error_naming_it(
    tmp_path, monkeypatch
):
    import os
    import sys
    import types

    from mt_train.metrics import TensorBoardSink

    class FakeWriter:  # creates its directory as torch.utils.tensorboard.SummaryWriter does
        def __init__(self, log_dir, purge_step=None):
            os.makedirs(log_dir, exist_ok=True)

    tensorboard = types.ModuleType("torch.utils.tensorboard")
    tensorboard.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tensorboard)

    (tmp_path / "tensorboard").write_text("a file where the event files would go")
    with pytest.raises(ValueError, match=r"tensorboard.*metrics\.tensorboard=false"):
        TensorBoardSink(tmp_path)
