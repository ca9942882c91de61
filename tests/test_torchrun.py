"""`mt_train pretrain` under torchrun (gloo, CPU) tracks the one-process run.

One run in one process is the reference. A two-process context-parallel run stops at
step 3; it is resumed under another layout (ep = 2, each rank holding half the experts of
the checkpoint) to step 5. Every step's loss must
equal the reference's within 1e-5 relative: the layouts compute the same global-batch
gradient, and the checkpoint is layout-free.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

# On top of the tiny recipe: a constant LR, so stopping at step 3 keeps the schedule.
TINY = ["training.warmup_steps=0", "training.min_lr_ratio=1.0", "training.max_steps=5"]


def _losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def _run(args, nproc=1):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        cmd = [sys.executable, "-m", "mt_train", "pretrain", "tiny", *TINY, *args]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "mt_train", "pretrain", "tiny", *TINY, *args,
        ]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_torchrun_layouts_and_a_layout_change_on_resume_track_one_process(tmp_path):
    _run([f"run_dir={tmp_path / 'one'}"])
    reference = _losses(tmp_path / "one")
    first = _run(
        [f"run_dir={tmp_path / 'par'}", "parallel.cp=2", "training.max_steps=3",
         "profile.memory_snapshot=true"],
        nproc=2,
    )  # fmt: skip
    resumed = _run([f"run_dir={tmp_path / 'par'}", "parallel.ep=2"], nproc=2)
    assert "resumed from" in resumed.stderr
    # A warning that every rank would give alike (the config's, the run's) comes once.
    if not torch.cuda.is_available():
        assert first.stderr.count("profile.memory_snapshot needs CUDA") == 1, first.stderr
    again = _run([f"run_dir={tmp_path / 'par'}"], nproc=2)
    assert again.stderr.count("is already at step 5") == 1, again.stderr
    losses = _losses(tmp_path / "par")
    assert len(losses) == len(reference) == 5
    for step, (a, b) in enumerate(zip(losses, reference, strict=True), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs one process {b}"
