"""tools/launch/torchrun.sh: a SIGTERM mid-run saves, stops cleanly, and reports success.

Two gloo processes train under the wrapper; once steps are being logged the wrapper gets
SIGTERM (as SLURM or Kubernetes would send it). It forwards the signal to torchrun,
torchrun to the workers; they agree at the next step boundary, save, and exit 0, and the
wrapper exits 0 although torchrun itself exits non-zero after a signal. Checkpoints are
written asynchronously (every 3 steps and at the stop). A rerun in one process resumes
from the saved step.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
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


def _full_pipe() -> tuple[int, int]:
    """A pipe whose buffer is full: the next write to its write end blocks until the read
    end is read, which holds a process writing there at that write."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(write_end, b"x" * 4096)
    os.set_blocking(write_end, True)
    return read_end, write_end


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


# A stand-in for torchrun: it notes each SIGTERM it gets and, after the first, lets its
# "workers" finish (they write the exit file, as rank 0 does after a clean stop) and exits
# 1, as torchrun does after forwarding a signal.
FAKE_TORCHRUN = r"""#!/usr/bin/env bash
log="$FAKE_LOG"
trap 'echo TERM >>"$log"; stopping=1' TERM
echo ready >>"$log"
stopping=0
while [[ "$stopping" == 0 ]]; do sleep 0.05; done
sleep 1  # the workers save
echo '{"step": 7, "reason": "signal"}' >"$MT_TRAIN_EXIT_FILE"
exit 1
"""


def test_the_wrapper_forwards_one_sigterm_and_a_sigusr1_to_every_process_spares_torchrun(
    tmp_path,
):
    # Under SLURM a signal reaches every process of the job step (`--signal=USR1@120`,
    # `scancel --signal`), torchrun included, and the scheduler may repeat SIGTERM.
    # torchrun does not handle SIGUSR1 (its default action kills it, orphaning the
    # workers) and gives up its 30 s grace period at a third SIGTERM, so the wrapper must
    # keep torchrun alive through both and forward only the first signal.
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_TORCHRUN)
    fake.chmod(0o755)
    log = tmp_path / "fake.log"
    env = {**os.environ, "PYTHON": str(fake), "FAKE_LOG": str(log), "NPROC_PER_NODE": "1"}
    proc = subprocess.Popen(
        ["bash", str(ROOT / "tools/launch/torchrun.sh"), "-m", "x"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (log.exists() and "ready" in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGUSR1)  # the wrapper and the fake torchrun
        time.sleep(0.3)
        for _ in range(3):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr
    assert log.read_text().split() == ["ready", "TERM"], stderr
    assert "stopped cleanly after a signal" in stderr


def test_a_signal_that_comes_before_torchrun_starts_stops_the_wrapper_there(tmp_path):
    # The wrapper sets its traps before it starts torchrun; a signal in between must not
    # be lost (torchrun trained on, and later signals were not forwarded). The wrapper is
    # held between the two by a full stderr pipe (its first write).
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_TORCHRUN)
    fake.chmod(0o755)
    log = tmp_path / "fake.log"
    env = {**os.environ, "PYTHON": str(fake), "FAKE_LOG": str(log), "NPROC_PER_NODE": "1"}
    read_end, write_end = _full_pipe()
    proc = subprocess.Popen(
        ["bash", str(ROOT / "tools/launch/torchrun.sh"), "-m", "x"],
        env=env,
        stderr=write_end,
        start_new_session=True,
    )
    os.close(write_end)
    chunks = []
    try:
        deadline = time.monotonic() + 30
        while not Path(f"/proc/{proc.pid}/wchan").read_text().endswith("pipe_write"):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        read_all = lambda: chunks.extend(iter(lambda: os.read(read_end, 65536), b""))  # noqa: E731
        threading.Thread(target=read_all, daemon=True).start()
        proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = b"".join(chunks).lstrip(b"x").decode()
    assert proc.returncode == 0, output
    assert "stopped by a signal before torchrun started" in output
    assert not log.exists(), "torchrun was started"


FAKE_SRUN = r"""#!/usr/bin/env bash
# Stands in for srun: runs until the test lets it finish, then exits 0.
trap '' USR1 TERM
echo running >"$FAKE_DIR/srun.log"
while [[ ! -e "$FAKE_DIR/finish" ]]; do sleep 0.05; done
exit 0
"""


def test_sbatch_example_exits_with_the_runs_status_when_the_signal_meets_its_end(tmp_path):
    # SLURM's early SIGUSR1 interrupts the batch shell's `wait` (status 138); when srun
    # ended meanwhile (the run finished just then) that 138 was the job's exit status, a
    # failed job in SLURM's accounting and for afterok dependencies, instead of srun's 0.
    # The batch shell is held in its trap by a full stdout pipe while srun ends.
    (tmp_path / "srun").write_text(FAKE_SRUN)
    (tmp_path / "srun").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path)}
    read_end, write_end = _full_pipe()
    proc = subprocess.Popen(
        ["bash", str(ROOT / "tools/launch/sbatch_example.sh"), "tiny"],
        env=env,
        stdout=write_end,
        start_new_session=True,
    )
    os.close(write_end)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "srun.log").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.2)  # the batch shell sets its traps and waits
        proc.send_signal(signal.SIGUSR1)
        while not Path(f"/proc/{proc.pid}/wchan").read_text().endswith("pipe_write"):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        (tmp_path / "finish").touch()  # srun ends while the trap is held
        time.sleep(0.5)
        read_all = lambda: list(iter(lambda: os.read(read_end, 65536), b""))  # noqa: E731
        threading.Thread(target=read_all, daemon=True).start()
        proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0
