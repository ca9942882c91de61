"""tools/launch/torchrun.sh: a SIGTERM mid-run saves, stops cleanly, and reports success.

Two gloo processes train under the wrapper; once steps are being logged the wrapper gets
SIGTERM (as SLURM or Kubernetes would send it). It forwards the signal to torchrun,
torchrun to the workers; they agree at the next step boundary, save, and exit 0, and the
wrapper exits 0 although torchrun itself exits non-zero after a signal. Checkpoints are
written asynchronously (every 3 steps and at the stop). A rerun in one process resumes
from the saved step.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mt_train.checkpoint import checkpoint_root, list_checkpoints

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
# On top of the tiny recipe: no warm-up, so the cosine decay starts at step 1 (step 1 runs
# just below training.lr); the LR is not flat (that takes training.min_lr_ratio=1.0).
TINY = ["training.warmup_steps=0"]


def _logged_steps(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_sigterm_to_the_torchrun_wrapper_saves_exits_zero_and_the_rerun_resumes(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NPROC_PER_NODE": "2",
           "PYTHON": sys.executable}
    cmd = ["bash", str(ROOT / "tools/launch/torchrun.sh"), "-m", "mt_train", "pretrain",
           "tiny", *TINY, "training.max_steps=10000", "parallel.ep=2", f"run_dir={run_dir}",
           "checkpoint.interval=3", "checkpoint.async_save=true"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(_logged_steps(run_dir)) < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no training steps within 120 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    assert "stopped cleanly after a signal" in stderr
    steps = _logged_steps(run_dir)
    saved = [c.step for c in list_checkpoints(checkpoint_root(run_dir))]
    assert saved[-1] == steps[-1] and 2 <= saved[-1] < 10000
    rerun = subprocess.run(
        [sys.executable, "-m", "mt_train", "pretrain", "tiny", *TINY,
         f"training.max_steps={saved[-1] + 1}", f"run_dir={run_dir}"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"(step {saved[-1]})" in rerun.stderr
    assert _logged_steps(run_dir) == list(range(1, saved[-1] + 2))
