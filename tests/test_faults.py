"""The loop survives faults: signals, non-finite steps, crashes mid-save; keep-last K.

Each test plants its fault by monkeypatching the loop's own functions, so no fault
injection knob reaches the user-facing config.
"""

import errno
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import mt_train.checkpoint as checkpoint_module
import mt_train.train as train_module
from mt_parallel.testing import spawn
from mt_train.checkpoint import checkpoint_root, list_checkpoints
from mt_train.overrides import resolve_config
from mt_train.recipes import get_recipe
from mt_train.train import NonFiniteError, pretrain, setup

# On top of the tiny recipe: no warm-up, so the cosine decay starts at step 1 (step 1 runs
# just below training.lr); the LR is not flat (that takes training.min_lr_ratio=1.0).
TINY = ["training.warmup_steps=0"]


def _cfg(run_dir, *overrides):
    return resolve_config(get_recipe("tiny"), overrides=[*TINY, f"run_dir={run_dir}", *overrides])


def _steps(run_dir):
    return [c.step for c in list_checkpoints(checkpoint_root(run_dir))]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_saves_at_the_next_step_boundary_and_a_rerun_resumes_there(
    tmp_path, monkeypatch, signum
):
    real_train_step = train_module.train_step

    def train_step_then_signal(state, microbatches, *args):
        out = real_train_step(state, microbatches, *args)
        if state.step == 3:
            os.kill(os.getpid(), signum)  # arrives mid-run, as from a scheduler
        return out

    monkeypatch.setattr(train_module, "train_step", train_step_then_signal)
    stopped = pretrain(_cfg(tmp_path, "training.max_steps=50", "checkpoint.interval=0"))
    assert stopped.step == 3 and stopped.stop_requested
    assert _steps(tmp_path) == [3]
    assert signal.getsignal(signum) is not train_step_then_signal  # handlers restored
    monkeypatch.setattr(train_module, "train_step", real_train_step)
    resumed = pretrain(_cfg(tmp_path, "training.max_steps=5"))
    assert resumed.step == 5 and len(resumed.losses) == 2


def test_a_signal_after_a_boundarys_agreement_stops_at_the_next_agreed_boundary(
    tmp_path, monkeypatch
):
    # Between agree_to_stop and the next step the ranks are not in lockstep: a rank that
    # left the loop on its own flag there would skip the step its peers run (a hang).
    real_finish = train_module._finish_written_save

    def finish_then_signal(state, writer):
        real_finish(state, writer)
        if state.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # after step 3's agreement

    monkeypatch.setattr(train_module, "_finish_written_save", finish_then_signal)
    stopped = pretrain(_cfg(tmp_path, "training.max_steps=50", "checkpoint.interval=0"))
    assert stopped.step == 4 and stopped.stop_requested
    assert _steps(tmp_path) == [4]


def test_a_repeated_signal_during_the_final_save_is_ignored_and_the_save_completes(
    tmp_path, monkeypatch
):
    # A worker often gets SIGTERM twice (the scheduler's, then torchrun's forward). The
    # stop's save runs after the loop; the second signal arriving there must meet the
    # loop's handler (which ignores repeats), not the one from before the run (by default
    # SIGTERM kills the process, leaving the save half-written).
    real_train_step, real_save = train_module.train_step, train_module._save
    outside = []

    def train_step_then_signal(state, microbatches, *args):
        out = real_train_step(state, microbatches, *args)
        if state.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    def save_after_a_second_signal(state, writer):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_save(state, writer)

    monkeypatch.setattr(train_module, "train_step", train_step_then_signal)
    monkeypatch.setattr(train_module, "_save", save_after_a_second_signal)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: outside.append(signum))
    try:
        stopped = pretrain(_cfg(tmp_path, "training.max_steps=50", "checkpoint.interval=0"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert outside == [], "the second SIGTERM reached the handler from before the run"
    assert stopped.step == 3 and _steps(tmp_path) == [3]


def _plant_nan_at(monkeypatch, bad_step):
    real_clip = train_module.clip_grad_norm
    calls = {"n": 0}

    def clip_with_a_nan_gradient(params, max_norm, group):
        params = list(params)
        calls["n"] += 1
        if calls["n"] == bad_step:
            params[0].grad.view(-1)[0] = float("nan")
        return real_clip(params, max_norm, group)

    monkeypatch.setattr(train_module, "clip_grad_norm", clip_with_a_nan_gradient)


def test_pretrain_runs_in_a_worker_thread_where_no_signal_handler_can_be_set(tmp_path):
    results = []
    worker = threading.Thread(
        target=lambda: results.append(pretrain(_cfg(tmp_path, "training.max_steps=1")).step)
    )
    worker.start()
    worker.join()
    assert results == [1] and _steps(tmp_path) == [1]


def test_a_nan_gradient_is_skipped_and_counted_and_the_weights_stay_finite(tmp_path, monkeypatch):
    _plant_nan_at(monkeypatch, bad_step=2)
    state = pretrain(_cfg(tmp_path, "training.max_steps=4", "training.on_nonfinite=skip"))
    assert state.skipped_steps == 1
    # Had the NaN reached AdamW, every later loss and weight would be NaN.
    assert all(math.isfinite(loss) for loss in state.losses)
    assert all(torch.isfinite(p).all() for p in state.model.parameters())


def test_a_nan_gradient_with_stop_ends_the_run_keeping_the_last_good_checkpoint(
    tmp_path, monkeypatch
):
    _plant_nan_at(monkeypatch, bad_step=3)
    cfg = _cfg(
        tmp_path, "training.max_steps=6", "training.on_nonfinite=stop", "checkpoint.interval=2"
    )
    with pytest.raises(NonFiniteError, match=r"step 3: .*not finite.*step_00000002"):
        pretrain(cfg)
    assert _steps(tmp_path) == [2]
    monkeypatch.undo()
    resumed = pretrain(cfg)
    assert resumed.step == 6 and len(resumed.losses) == 4


def test_a_crash_in_the_middle_of_a_save_leaves_the_previous_checkpoint_resumable(
    tmp_path, monkeypatch
):
    real_save = checkpoint_module.dcp.save
    saves = {"n": 0}

    def save_then_crash(state_dict, *, checkpoint_id):
        saves["n"] += 1
        real_save(state_dict, checkpoint_id=checkpoint_id)  # the tensor files are written
        if saves["n"] == 2:
            raise OSError("disk vanished in the middle of the save")

    monkeypatch.setattr(checkpoint_module.dcp, "save", save_then_crash)
    cfg = _cfg(tmp_path, "training.max_steps=4", "checkpoint.interval=2")
    with pytest.raises(OSError, match="disk vanished") as raised:
        pretrain(cfg)
    root = checkpoint_root(tmp_path)
    (note,) = raised.value.__notes__  # which save failed, and the disk space left
    assert str(root / ".tmp-step_00000004") in note and "GB free there" in note
    assert _steps(tmp_path) == [2]
    assert (root / ".tmp-step_00000004" / ".metadata").is_file()  # the torn save is there
    monkeypatch.undo()
    resumed = pretrain(cfg)
    assert resumed.step == 4 and len(resumed.losses) == 2
    assert _steps(tmp_path) == [2, 4]
    assert not list(root.glob(".tmp-*")), "a later save removes torn leftovers"


def _crash_at_file_operation(monkeypatch, n):
    """Makes the `n`-th rename or tree delete of a directory in a checkpoints directory
    (1-based) a crash, as a kill at that point; returns the list of those operations made
    (the crashed one too). DCP's own renames, of files inside a checkpoint, run as usual."""
    done = []
    for module, name in ((checkpoint_module.os, "rename"), (checkpoint_module.shutil, "rmtree")):
        real = getattr(module, name)

        def operation(*args, _real=real, _name=name, **kwargs):
            if Path(args[0]).parent.name != "checkpoints":
                return _real(*args, **kwargs)
            done.append((_name, *(Path(a).name for a in args)))
            if len(done) == n:
                raise KeyboardInterrupt
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, operation)
    return done


def test_a_crash_anywhere_in_saving_a_step_again_leaves_that_step_resumable(tmp_path, monkeypatch):
    # Saving a step that already has a checkpoint (the only one, keep_last=1) must never
    # leave the run without it: a crash at each rename and delete of that save is tried,
    # and the rerun continues from step 2 as an uninterrupted run does.
    def cfg(run, max_steps):
        return _cfg(run, f"training.max_steps={max_steps}", "checkpoint.interval=2",
                    "checkpoint.keep_last=1", "training.min_lr_ratio=1.0")  # fmt: skip

    whole = pretrain(cfg(tmp_path / "whole", 3))
    state = pretrain(cfg(tmp_path / "first", 2))
    clean = tmp_path / "clean"
    shutil.copytree(tmp_path / "first", clean)
    state.cfg = cfg(clean, 2)
    operations = _crash_at_file_operation(monkeypatch, n=0)
    train_module._save(state, None)  # a save of step 2 again, without a crash
    monkeypatch.undo()
    assert [p.name for p in checkpoint_root(clean).iterdir()] == ["step_00000002"]
    assert len(operations) >= 2, operations
    for n in range(1, len(operations) + 1):
        run = tmp_path / f"crash_{n}"
        shutil.copytree(tmp_path / "first", run)
        state.cfg = cfg(run, 2)
        _crash_at_file_operation(monkeypatch, n)
        with pytest.raises(KeyboardInterrupt):
            train_module._save(state, None)
        monkeypatch.undo()
        assert _steps(run) == [2], (operations[n - 1], sorted(checkpoint_root(run).iterdir()))
        resumed = pretrain(cfg(run, 3))
        assert resumed.losses == whole.losses[2:], operations[n - 1]
        assert [p.name for p in checkpoint_root(run).iterdir()] == ["step_00000003"]


def test_a_write_that_fails_inside_dcp_names_the_checkpoint_and_the_free_space(
    tmp_path, monkeypatch
):
    # A real write failure (a full disk) reaches the loop wrapped in DCP's
    # CheckpointException, a BaseException, not as the OSError the writer raised.
    def full_disk(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", full_disk)
    with pytest.raises(dcp.CheckpointException) as raised:
        pretrain(_cfg(tmp_path, "training.max_steps=1"))
    (note,) = raised.value.__notes__
    assert str(checkpoint_root(tmp_path) / ".tmp-step_00000001") in note
    assert "GB free there" in note


def test_only_the_last_k_checkpoints_are_kept(tmp_path):
    pretrain(
        _cfg(tmp_path, "training.max_steps=4", "checkpoint.interval=1", "checkpoint.keep_last=2")
    )
    assert _steps(tmp_path) == [3, 4]


def _undeletable_old_checkpoints(monkeypatch):
    """Makes the delete of every ``.old-step_*`` fail as read-only files do."""
    real_rmtree = checkpoint_module.shutil.rmtree

    def rmtree(path, ignore_errors=False, **kwargs):
        if not Path(path).name.startswith(".old-step_"):
            real_rmtree(path, ignore_errors=ignore_errors, **kwargs)
        elif not ignore_errors:  # (with ignore_errors, nothing is deleted, silently)
            raise PermissionError(13, "Permission denied", str(Path(path) / "__0_0.distcp"))

    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", rmtree)


def test_an_old_checkpoint_that_cannot_be_deleted_is_warned_and_the_run_goes_on(
    tmp_path, monkeypatch, caplog
):
    # Checkpoints copied read-only, or written by another user of a shared directory: the
    # new checkpoint was complete, yet its pruning's PermissionError ended the run there.
    _undeletable_old_checkpoints(monkeypatch)
    state = pretrain(_cfg(tmp_path, "training.max_steps=3", "checkpoint.interval=1",
                          "checkpoint.keep_last=1"))  # fmt: skip
    assert state.step == 3 and _steps(tmp_path) == [3]
    root = checkpoint_root(tmp_path)
    for step in (1, 2):
        old = root / f".old-step_{step:08d}"
        assert old.is_dir()
        assert (
            f"checkpoint.keep_last=1: the old checkpoint {root / f'step_{step:08d}'} could not "
            f"be deleted ([Errno 13] Permission denied: '{old / '__0_0.distcp'}'); what is left "
            f"of it is {old}, delete that by hand" in caplog.text
        )


def _saving_every_2_steps(tmp_path, max_steps):
    """A run to `max_steps` that saves every 2 steps and keeps the last checkpoint only."""
    return _cfg(tmp_path, f"training.max_steps={max_steps}", "checkpoint.interval=2",
                "checkpoint.keep_last=1")  # fmt: skip


def test_the_earlier_checkpoint_of_a_step_saved_again_that_cannot_be_deleted_is_warned(
    tmp_path, monkeypatch, caplog
):
    # A resumed run that redoes a step saves it again; the new checkpoint was complete and
    # in place, yet deleting the one it replaced raised and ended the run.
    state = pretrain(_saving_every_2_steps(tmp_path, 2))
    root = checkpoint_root(tmp_path)
    _undeletable_old_checkpoints(monkeypatch)
    state.skipped_steps = 7  # marks the new save's train_state.json
    train_module._save(state, None)
    monkeypatch.undo()
    saved = json.loads((root / "step_00000002" / "train_state.json").read_text())
    assert saved["skipped_steps"] == 7, "the new checkpoint took the step's name"
    assert _steps(tmp_path) == [2]
    old = root / ".old-step_00000002"
    assert old.is_dir()
    assert (
        f"step 2 was saved again: its earlier checkpoint {root / '.replaced-step_00000002'} "
        f"could not be deleted ([Errno 13] Permission denied: '{old / '__0_0.distcp'}'); what "
        f"is left of it is {old}, delete that by hand" in caplog.text
    )
    assert pretrain(_saving_every_2_steps(tmp_path, 3)).step == 3


def test_old_checkpoints_of_one_step_that_cannot_be_deleted_never_block_a_later_delete(
    tmp_path, monkeypatch, caplog
):
    # Every delete renamed the checkpoint to the one name .old-step_N first: with an
    # undeletable .old-step_N already there the rename failed (directory not empty), the
    # warning named .old-step_N as what was left although .replaced-step_N was, and the
    # next start failed clearing that .replaced-step_N.
    state = pretrain(_saving_every_2_steps(tmp_path, 2))
    root = checkpoint_root(tmp_path)
    _undeletable_old_checkpoints(monkeypatch)
    for _ in range(2):  # step 2 saved again twice
        train_module._save(state, None)
    assert sorted(p.name for p in root.iterdir()) == [
        ".old-step_00000002", ".old-step_00000002.1", "step_00000002",
    ]  # fmt: skip
    for left in (".old-step_00000002", ".old-step_00000002.1"):
        assert f"what is left of it is {root / left}, delete that by hand" in caplog.text
    monkeypatch.undo()
    assert pretrain(_saving_every_2_steps(tmp_path, 3)).step == 3
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003"]


def test_an_async_checkpoint_holds_its_own_step_while_training_goes_on(tmp_path):
    constant_lr = ["training.min_lr_ratio=1.0"]
    whole = pretrain(_cfg(tmp_path / "whole", "training.max_steps=6", *constant_lr))
    run = tmp_path / "async"
    pretrain(
        _cfg(
            run,
            "training.max_steps=5",
            "checkpoint.interval=2",
            "checkpoint.keep_last=3",
            "checkpoint.async_save=true",
            *constant_lr,
        )
    )
    assert _steps(run) == [2, 4, 5]
    # Step 4's files were written while step 5 changed the weights; resume from step 4.
    shutil.rmtree(checkpoint_root(run) / "step_00000005")
    resumed = pretrain(_cfg(run, "training.max_steps=6", *constant_lr))
    assert resumed.losses == whole.losses[4:]


def test_a_rank_that_never_answers_ends_the_run_with_a_clear_error(tmp_path):
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Rank 0 of a world of 2 whose rank 1 never starts.
    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mt_train",
            "pretrain",
            "tiny",
            "parallel.timeout_s=2",
            "training.device=cpu",
            f"run_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "timed out" in result.stderr and "parallel.timeout_s" in result.stderr
    assert "Traceback" not in result.stderr


def _worker_of_rank(launcher_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker process with RANK=rank, if it has started."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if parent == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(entry)
    return None


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's workers in /proc")
def test_a_rank_that_hangs_mid_run_ends_the_run_with_a_clear_error(tmp_path):
    import time

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "mt_train",
        "pretrain",
        "tiny",
        "training.max_steps=100000",
        "training.device=cpu",
        "parallel.timeout_s=15",
        "checkpoint.interval=0",
        f"run_dir={tmp_path}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "launcher.log", "w+")  # noqa: SIM115 - read back at the end
    launcher = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True
    )
    stopped = None
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 2"
            time.sleep(0.2)
        stopped = _worker_of_rank(launcher.pid, 1)
        assert stopped is not None, "rank 1's worker was not found"
        os.kill(stopped, signal.SIGSTOP)  # rank 1 hangs mid-run; rank 0 waits on it
        rank0 = _worker_of_rank(launcher.pid, 0)
        deadline = time.monotonic() + 90
        while rank0 is not None and os.path.exists(f"/proc/{rank0}"):
            with open(f"/proc/{rank0}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            assert time.monotonic() < deadline, "rank 0 did not give up on the hung rank"
            time.sleep(0.2)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGKILL)
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a failed check above: take everything down
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        log.seek(0)
        output = log.read()
        log.close()
    assert launcher.returncode != 0
    assert "timed out" in output and "parallel.timeout_s" in output, output[-3000:]


def test_a_second_run_on_a_run_dir_in_use_is_refused_and_touches_nothing(tmp_path):
    import fcntl

    cfg = _cfg(tmp_path, "training.max_steps=2", "checkpoint.interval=1")
    pretrain(cfg)  # ends, so the run_dir is free again
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"}
    with open(tmp_path / ".lock", "a+") as other:  # another process's run holds the run_dir
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        other.seek(0)
        other.truncate()
        other.write("pid 4242 on node7\n")
        other.flush()
        again = _cfg(tmp_path, "training.max_steps=4", "checkpoint.interval=1")
        with pytest.raises(ValueError, match=rf"run_dir {re.escape(str(tmp_path))} is in use by "
                           r"another mt-train run \(pid 4242 on node7\); wait for it to end "
                           r"or choose another run_dir"):  # fmt: skip
            pretrain(again)
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before, "the refused run wrote to the run_dir"
    assert pretrain(again).step == 4  # free once the other run ends


def test_a_fresh_run_into_a_run_dir_with_checkpoints_is_refused(tmp_path):
    pretrain(_cfg(tmp_path, "training.max_steps=2", "checkpoint.interval=2"))
    with pytest.raises(ValueError, match="checkpoint.resume=false but .* holds checkpoints"):
        pretrain(_cfg(tmp_path, "training.max_steps=2", "checkpoint.resume=false"))
    assert _steps(tmp_path) == [2]


def test_a_checkpoint_or_checkpoints_directory_given_as_run_dir_is_refused_naming_the_run(
    tmp_path, monkeypatch
):
    # A user who means "resume from step 2" gives its directory: that started a new run from
    # step 0 in it (its config.json, metrics and checkpoints among the checkpoint's files).
    run = tmp_path / "run"
    pretrain(_cfg(run, "training.max_steps=2", "checkpoint.interval=1"))
    step = checkpoint_root(run) / "step_00000002"
    before = sorted(p for p in run.rglob("*") if p.name != ".lock")
    monkeypatch.chdir(tmp_path)  # a relative run_dir, as typed
    for given in (step, checkpoint_root(run), Path("run/checkpoints/step_00000002")):
        with pytest.raises(ValueError) as err:
            pretrain(_cfg(given, "training.max_steps=3"))
        message = str(err.value)
        assert message.startswith(f"run_dir ({str(given)!r}) is ")
        assert f"to resume that run, give run_dir={run}" in message
    with pytest.raises(ValueError, match="to start a new run from its weights, give "
                       f"init_from={step} and a new run_dir"):  # fmt: skip
        pretrain(_cfg(step, "training.max_steps=3"))
    assert sorted(p for p in run.rglob("*") if p.name != ".lock") == before, "nothing written"
    moved = tmp_path / "moved"  # a checkpoint out of its run (or a model-only one)
    shutil.copytree(step, moved)
    with pytest.raises(ValueError, match=f"run_dir .*moved.* is a checkpoint, not a run "
                       f"directory; to start a new run from its weights, give init_from={moved}"):
        pretrain(_cfg(moved, "training.max_steps=3"))
    assert pretrain(_cfg(run, "training.max_steps=3")).losses  # the run itself resumes


def test_a_run_dir_whose_config_json_is_not_a_runs_is_refused_and_left_untouched(tmp_path):
    # A Hugging Face model directory given as run_dir (meant: start from it), or any
    # directory with a config.json of its own: a new run overwrote it with the run's.
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (hf / "model.safetensors").write_bytes(b"")
    other = tmp_path / "project"
    other.mkdir()
    (other / "config.json").write_text('{"name": "something else"}')
    for run_dir, fix in ((hf, f"give init_from={hf} and a new run_dir"),
                         (other, "choose another run_dir")):  # fmt: skip
        before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
        with pytest.raises(ValueError, match=f"run_dir .*{run_dir.name}.* holds a config.json "
                           f"mt-train did not write.*{re.escape(fix)}"):  # fmt: skip
            pretrain(_cfg(run_dir, "training.max_steps=1"))
        assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    # A run that stopped before its first checkpoint left its own config.json: a rerun is
    # a fresh run there, as before.
    run = tmp_path / "run"
    pretrain(_cfg(run, "training.max_steps=1", "checkpoint.interval=0"))
    shutil.rmtree(checkpoint_root(run))
    assert pretrain(_cfg(run, "training.max_steps=1")).step == 1
    # A run's directory (its checkpoints/) resumes whatever its config.json holds.
    (run / "config.json").write_text("{}")
    assert pretrain(_cfg(run, "training.max_steps=2")).step == 2


def _crash_in_step(monkeypatch, step, message):
    """Makes training step `step` raise RuntimeError(message) before it runs."""
    real_step = train_module.train_step

    def crashing(state, microbatches, *args):
        if state.step == step - 1:
            raise RuntimeError(message)
        return real_step(state, microbatches, *args)

    monkeypatch.setattr(train_module, "train_step", crashing)


def test_an_async_checkpoint_completes_once_written_not_at_the_next_save(tmp_path, monkeypatch):
    # Files written by the end of the next step (deterministic here), then a crash before
    # any later save: the checkpoint must already be complete.
    def written_by_now(writer):
        if writer.pending:
            writer._pending[0].result()  # the background write finishes
        return writer.pending

    monkeypatch.setattr(checkpoint_module.AsyncCheckpointer, "written", written_by_now)
    _crash_in_step(monkeypatch, 4, "node lost")
    cfg = _cfg(tmp_path, "training.max_steps=6", "checkpoint.interval=2",
               "checkpoint.async_save=true")  # fmt: skip
    with pytest.raises(RuntimeError, match="node lost"):
        pretrain(cfg)
    assert _steps(tmp_path) == [2]


def test_a_crash_in_one_process_completes_the_background_save_it_had_staged(
    tmp_path, monkeypatch
):
    # The save of step 2 is staged (tensors copied) but, its files not yet reported
    # written, not completed when step 3 crashes: in one process nothing else waits on
    # the completion, so the crash completes it rather than losing the step.
    monkeypatch.setattr(checkpoint_module.AsyncCheckpointer, "written", lambda writer: False)
    _crash_in_step(monkeypatch, 3, "CUDA error: an illegal memory access was encountered")
    cfg = _cfg(tmp_path, "training.max_steps=6", "checkpoint.interval=2",
               "checkpoint.async_save=true")  # fmt: skip
    with pytest.raises(RuntimeError, match="illegal memory access"):
        pretrain(cfg)
    assert _steps(tmp_path) == [2]
    monkeypatch.undo()
    resumed = pretrain(cfg)
    assert resumed.step == 6 and len(resumed.losses) == 4  # from step 2


def test_resuming_or_initializing_a_different_model_names_the_mismatch(tmp_path):
    source = tmp_path / "source"
    pretrain(_cfg(source, "training.max_steps=1"))
    step = checkpoint_root(source) / "step_00000001"
    fewer_layers = "model.num_hidden_layers=1"
    with pytest.raises(ValueError, match=r"holds \d+ model tensor\(s\) this model lacks"):
        pretrain(_cfg(tmp_path / "init", "training.max_steps=1", fewer_layers,
                      f"init_from={step}"))  # fmt: skip
    with pytest.raises(ValueError, match="holds .* model tensor.* this model lacks"):
        pretrain(_cfg(source, "training.max_steps=2", fewer_layers))
    with pytest.raises(ValueError, match="has shape .* but the model gives .*override "
                       "model.moe_intermediate_size=32, or use a new run_dir"):  # fmt: skip
        pretrain(_cfg(source, "training.max_steps=2", "model.moe_intermediate_size=16"))


def test_resuming_a_different_model_names_the_config_keys_that_change_its_tensors(tmp_path):
    pretrain(_cfg(tmp_path, "training.max_steps=1"))
    # rope_theta changes no tensor and may change on resume; vocab_size and num_experts
    # change tensors: the error names those two with the checkpoint's values, not rope_theta.
    with pytest.raises(ValueError) as err:
        pretrain(_cfg(tmp_path, "training.max_steps=2", "model.vocab_size=5000",
                      "model.num_experts=16", "model.rope_theta=500.0"))  # fmt: skip
    message = str(err.value)
    assert "num_experts (8 there, 16 here), vocab_size (4096 there, 5000 here)" in message
    assert "override model.num_experts=8 model.vocab_size=4096" in message
    assert "rope_theta" not in message


def test_resuming_with_a_recipe_of_another_model_family_names_the_family_and_its_recipes(
    tmp_path, monkeypatch
):
    pretrain(_cfg(tmp_path, "training.max_steps=1"))
    loads = []
    monkeypatch.setattr(train_module, "load_checkpoint", lambda *a: loads.append(a))
    other = resolve_config(get_recipe("debug-gpt-oss"), overrides=[
        f"run_dir={tmp_path}", "training.max_steps=2", "data.seq_len=64",
    ])  # fmt: skip
    # model.* overrides cannot turn one family into another: the recipe has to change.
    with pytest.raises(ValueError, match=r"checkpoint .*step_00000001 holds a qwen3_moe model "
                       r"but this run builds a gpt_oss one; resume with a qwen3_moe recipe "
                       r"\(debug, tiny, qwen3-30b-a3b\) or use a new run_dir"):  # fmt: skip
        pretrain(other)
    assert loads == [], "the tensors were not read"


def test_resuming_with_another_seq_len_names_the_checkpoint_and_fails_before_loading_it(
    tmp_path, monkeypatch
):
    pretrain(_cfg(tmp_path, "training.max_steps=1"))
    loads = []
    monkeypatch.setattr(train_module, "load_checkpoint", lambda *a: loads.append(a))
    # The fix names the override as it is given (data.seq_len=64), not mt-data's argument.
    with pytest.raises(ValueError, match=r"cannot resume from .*step_00000001: it was trained "
                       r"with data\.seq_len=64, this run has data\.seq_len=32; resume with "
                       r"data\.seq_len=64 or use a new run_dir"):  # fmt: skip
        pretrain(_cfg(tmp_path, "training.max_steps=2", "data.seq_len=32"))
    assert loads == [], "the tensors were not read"


def _small_corpus(tmp_path):
    """A corpus of a few dozen samples of the tiny recipe, and a global batch size that
    does not divide them (the last batch is partial)."""
    from mt_data import TokenDataset, build_corpus
    from mt_data.default_corpus import default_tokenizer_path

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"x = {i} * {i}\n" * 9}) + "\n" for i in range(40)))
    corpus = tmp_path / "corpus"
    build_corpus([docs], default_tokenizer_path(), corpus, workers=0, progress=False)
    samples = TokenDataset(corpus, 64).num_samples
    return corpus, samples, next(b for b in range(2, samples) if samples % b)


def test_data_that_runs_out_mid_batch_leaves_that_batch_unread(tmp_path):
    corpus, samples, batch = _small_corpus(tmp_path)
    run = tmp_path / "run"
    state = pretrain(_cfg(run, f"data.path={corpus}", "data.on_exhausted=stop",
                          f"training.global_batch_size={batch}", "training.micro_batch_size=1",
                          "training.max_steps=1000"))  # fmt: skip
    assert state.step == samples // batch
    saved = json.loads((list_checkpoints(checkpoint_root(run))[-1].path
                        / "train_state.json").read_text())  # fmt: skip
    assert saved["data"]["consumed_samples"] == state.step * batch


def test_a_run_that_runs_out_of_data_validates_its_last_step_and_reads_on_unchanged(tmp_path):
    corpus, samples, batch = _small_corpus(tmp_path)
    run = tmp_path / "run"
    # Validation every 1000 steps: only the end of the run is due, which the data decides.
    state = pretrain(_cfg(run, f"data.path={corpus}", "data.on_exhausted=stop",
                          f"training.global_batch_size={batch}", "training.micro_batch_size=1",
                          "training.max_steps=1000", f"validation.path={corpus}",
                          "validation.interval=1000"))  # fmt: skip
    # Every step looked whether a next batch exists, without consuming it.
    assert state.step == samples // batch
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [state.step]
    saved = json.loads((list_checkpoints(checkpoint_root(run))[-1].path
                        / "train_state.json").read_text())  # fmt: skip
    assert saved["data"]["consumed_samples"] == state.step * batch


def _tear_a_tensor_file(step):
    (data,) = step.glob("*.distcp")
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)


DAMAGES = {
    "tensor_file_missing": lambda step: next(step.glob("*.distcp")).unlink(),
    "tensor_file_torn": _tear_a_tensor_file,
    "metadata_empty": lambda step: (step / ".metadata").write_bytes(b""),
    "train_state_torn": lambda step: (step / "train_state.json").write_text('{"step": 2, "da'),
    "train_state_without_config": lambda step: (step / "train_state.json").write_text("{}"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_checkpoint_is_a_value_error_naming_it_and_the_way_out(tmp_path, damage):
    pretrain(_cfg(tmp_path, "training.max_steps=2", "checkpoint.interval=1"))
    step = checkpoint_root(tmp_path) / "step_00000002"
    DAMAGES[damage](step)
    with pytest.raises(ValueError, match=rf"checkpoint {re.escape(str(step))} cannot be read, "
                       r"it is damaged.*move step_00000002 out of .* resume from the checkpoint "
                       r"before it"):  # fmt: skip
        pretrain(_cfg(tmp_path, "training.max_steps=3"))
    shutil.move(step, tmp_path / "aside")  # the way out the message gives
    resumed = pretrain(_cfg(tmp_path, "training.max_steps=3"))
    assert resumed.step == 3 and len(resumed.losses) == 2


def test_a_crash_while_an_old_checkpoint_is_deleted_leaves_no_partial_step_dir(
    tmp_path, monkeypatch
):
    root = tmp_path / "checkpoints"
    old = root / "step_00000001"
    old.mkdir(parents=True)
    for name in ("train_state.json", ".metadata", "__0_0.distcp", "__1_0.distcp"):
        (old / name).write_text("x")
    assert [c.step for c in list_checkpoints(root)] == [1]
    real_rmtree = shutil.rmtree

    def crash_after_one_shard(path, ignore_errors=False):
        if not Path(path).exists():
            return real_rmtree(path, ignore_errors=ignore_errors)
        (Path(path) / "__0_0.distcp").unlink()  # the delete got this far
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", crash_after_one_shard)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_module._delete_checkpoint(old)
    # What is left is not a checkpoint: resuming never picks up a step with shards missing.
    assert list_checkpoints(root) == []
    assert [p.name for p in root.iterdir()] == [".old-step_00000001"]


def test_a_checkpoint_of_a_newer_or_unknown_format_version_is_refused_naming_it(tmp_path):
    step = tmp_path / "step_00000002"
    step.mkdir()
    checkpoint = checkpoint_module.Checkpoint(path=step, step=2)
    state = {"step": 2, "data": {}, "config": {}}
    current = checkpoint_module.FORMAT_VERSION
    for version in (current + 1, current + 7):
        (step / "train_state.json").write_text(json.dumps({**state, "format_version": version}))
        with pytest.raises(ValueError, match=rf"checkpoint {re.escape(str(step))} has format "
                           rf"version {version}, newer than .* \({current}\); read it with the "
                           r"moetrain version that wrote it, or upgrade moetrain"):  # fmt: skip
            checkpoint.train_state()
    for version in (None, "1", 1.0, True, 0):
        with_version = state if version is None else {**state, "format_version": version}
        (step / "train_state.json").write_text(json.dumps(with_version))
        shown = re.escape(repr(version))
        with pytest.raises(ValueError, match=rf"checkpoint {re.escape(str(step))} cannot be "
                           rf"read: its train_state.json has format_version {shown}, not a "
                           r"version .* move step_00000002 out of"):  # fmt: skip
            checkpoint.train_state()
    for version in range(1, current + 1):  # every version this code wrote still loads
        (step / "train_state.json").write_text(json.dumps({**state, "format_version": version}))
        assert checkpoint.train_state()["format_version"] == version


def _setup_failures_on_rank_0(tmp):
    """Body of the two-rank test below: each of rank 0's own setup steps fails in turn."""
    import time

    import torch.distributed as dist

    from mt_train.distributed import RankFailedError

    rank = dist.get_rank()
    cases = {  # run_dir: what rank 0's error says
        "locked": "is in use by another mt-train run (pid 4242 on node7)",
        "config_blocked": "config.json.tmp",
    }
    for name, error in cases.items():
        cfg = _cfg(Path(tmp) / name, "training.max_steps=1", "parallel.timeout_s=60")
        start = time.monotonic()
        with pytest.raises(Exception) as raised:  # noqa: PT011 - the type depends on the rank
            pretrain(cfg)
        elapsed = time.monotonic() - start
        if rank == 0:
            assert not isinstance(raised.value, RankFailedError), raised.value
        else:
            assert isinstance(raised.value, RankFailedError), raised.value
            assert "rank 0 failed while" in str(raised.value)
        assert error in str(raised.value), f"{name}: {raised.value}"
        assert elapsed < 30, f"{name}: rank {rank} took {elapsed:.0f} s to give up"
        dist.barrier()


def test_a_setup_failure_of_rank_0_alone_stops_every_rank_at_once_naming_it(tmp_path, monkeypatch):
    import fcntl


    # Spawned ranks take this process's sys.path and import tests.test_faults.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    (tmp_path / "locked").mkdir()
    # The temporary file of config.json, written by rank 0 alone at the end of setup, is
    # a directory: its write fails there.
    (tmp_path / "config_blocked" / "config.json.tmp").mkdir(parents=True)
    with open(tmp_path / "locked" / ".lock", "a+") as other:  # another run holds it
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        other.write("pid 4242 on node7\n")
        other.flush()
        spawn(_setup_failures_on_rank_0, 2, str(tmp_path))


def test_a_save_whose_files_did_not_all_land_in_its_directory_is_not_completed(
    tmp_path, monkeypatch
):
    # run_dir on node-local disks: each node's ranks write their files to their own disk, and
    # rank 0 renamed a directory without the others' into place, listed as complete; the
    # resume after a preemption failed on it. Here the second save's file vanishes.
    real_save = checkpoint_module.dcp.save
    saves = []

    def save_then_lose_the_file(tensors, checkpoint_id):
        real_save(tensors, checkpoint_id=checkpoint_id)
        saves.append(checkpoint_id)
        if len(saves) == 2:
            (Path(checkpoint_id) / "__0_0.distcp").unlink()

    monkeypatch.setattr(checkpoint_module.dcp, "save", save_then_lose_the_file)
    with pytest.raises(ValueError) as raised:
        pretrain(_cfg(tmp_path, "training.max_steps=2", "checkpoint.interval=1"))
    tmp = checkpoint_root(tmp_path) / ".tmp-step_00000002"
    assert str(raised.value).startswith(
        f"checkpoint {tmp} lacks 1 of the files its .metadata lists, or holds them cut short "
        "(e.g. ['__0_0.distcp']): every rank writes its own files there, so run_dir must be "
        "on a file system every node shares"
    )
    assert _steps(tmp_path) == [1]


def _ranks_seeing_different_checkpoints(tmp):
    """Body of the two-rank test below: rank 1 does not see the run's checkpoint."""
    import torch.distributed as dist

    pretrain(_cfg(tmp, "training.max_steps=1"))
    if dist.get_rank() == 1:  # its node's file system shows no checkpoint
        train_module.latest_checkpoint = lambda root: None
    with pytest.raises(ValueError) as raised:
        pretrain(_cfg(tmp, "training.max_steps=2"))
    assert str(raised.value) == (
        f"the ranks see different newest checkpoints in {checkpoint_root(tmp)} (step_00000001: "
        "rank 0; none: rank 1): run_dir must be on a file system that every node shares and "
        "sees alike"
    )


def test_ranks_that_see_different_newest_checkpoints_all_stop_naming_them(
    tmp_path, monkeypatch
):
    # A run_dir on node-local disks: rank 0 resumed while rank 1 started afresh, and their
    # collectives no longer matched (a hang until parallel.timeout_s, or worse).
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    spawn(_ranks_seeing_different_checkpoints, 2, str(tmp_path))


def _rng_after_resume(tmp):
    """Body of the two-rank test below: each rank's RNG state after a resume is its own."""
    import torch.distributed as dist

    rank = dist.get_rank()
    cfg = _cfg(tmp, "training.max_steps=2", "checkpoint.interval=2")
    torch.manual_seed(100 + rank)  # the ranks' generators differ, as after rank-wise draws
    pretrain(cfg)
    saved = torch.get_rng_state()
    torch.manual_seed(7)  # a fresh process would have another state
    state = setup(cfg)
    state.run_lock and state.run_lock.close()
    assert state.step == 2
    assert torch.equal(torch.get_rng_state(), saved), f"rank {rank} resumed another's RNG"
    states = [None, None]
    dist.all_gather_object(states, saved)
    assert not torch.equal(states[0], states[1]), "the ranks' saved states are equal"
    if rank == 0:
        torch.save(states, Path(tmp) / "rng_states.pt")
    dist.barrier()  # both ranks tear down together (gloo can abort on a peer gone early)


def test_each_rank_resumes_its_own_rng_state_and_other_rank_counts_resume_too(
    tmp_path, monkeypatch
):

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    spawn(_rng_after_resume, 2, str(tmp_path))
    rank_states = torch.load(tmp_path / "rng_states.pt")
    cfg = _cfg(tmp_path, "training.max_steps=2")
    # One process: rank 0's state.
    torch.manual_seed(7)
    state = setup(cfg)
    state.run_lock.close()
    assert torch.equal(torch.get_rng_state(), rank_states[0])
    # A rank the checkpoint has no state for (a resume on more ranks) gets a seed derived
    # from the step and its rank: the same each time, other than every saved rank's.
    monkeypatch.setattr(checkpoint_module, "_rank", lambda: 2)
    derived = []
    for seed in (7, 8):
        torch.manual_seed(seed)
        state = setup(cfg)
        state.run_lock.close()
        derived.append(torch.get_rng_state())
    assert torch.equal(derived[0], derived[1])
    assert not any(torch.equal(derived[0], s) for s in rank_states)


def _save_failing_on_rank_0(tmp):
    """Body of the two-rank test below: rank 0 fails to complete a checkpoint."""
    import time

    import torch.distributed as dist

    from mt_train.distributed import RankFailedError

    rank = dist.get_rank()
    if rank == 0:  # the steps of completing a save that rank 0 does alone

        def disk_gone(path):
            raise OSError(f"disk gone under {path}")

        checkpoint_module._fsync_dir = disk_gone
    cfg = _cfg(tmp, "training.max_steps=2", "checkpoint.interval=1", "parallel.timeout_s=60")
    start = time.monotonic()
    with pytest.raises(Exception) as raised:  # noqa: PT011 - the type depends on the rank
        pretrain(cfg)
    elapsed = time.monotonic() - start
    assert isinstance(raised.value, OSError if rank == 0 else RankFailedError), raised.value
    assert "disk gone under" in str(raised.value)
    assert elapsed < 30, f"rank {rank} took {elapsed:.0f} s to give up"
    dist.barrier()


def test_a_checkpoint_that_rank_0_fails_to_complete_stops_every_rank_at_once(tmp_path, monkeypatch):

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    spawn(_save_failing_on_rank_0, 2, str(tmp_path))
    assert _steps(tmp_path) == [], "no checkpoint was completed"


def _metrics_failing_on_rank_0(tmp):
    """Body of the two-rank test below: rank 0's metrics write fails at step 2."""
    import time

    import torch.distributed as dist

    from mt_train.distributed import RankFailedError
    from mt_train.metrics import MetricsLogger

    rank = dist.get_rank()
    if rank == 0:
        real_log = MetricsLogger.log

        def log_until_the_disk_fills(self, step_metrics):
            if step_metrics["step"] == 2:
                raise OSError(errno.ENOSPC, "No space left on device (simulated)")
            real_log(self, step_metrics)

        MetricsLogger.log = log_until_the_disk_fills
    cfg = _cfg(tmp, "training.max_steps=4", "checkpoint.interval=0", "parallel.timeout_s=20")
    start = time.monotonic()
    with pytest.raises(Exception) as raised:  # noqa: PT011 - the type depends on the rank
        pretrain(cfg)
    elapsed = time.monotonic() - start
    assert isinstance(raised.value, OSError if rank == 0 else RankFailedError), raised.value
    assert "No space left on device (simulated)" in str(raised.value)
    assert elapsed < 15, f"rank {rank} took {elapsed:.0f} s to give up"
    dist.barrier()


def test_a_metrics_write_that_fails_on_rank_0_mid_run_stops_every_rank_at_that_step(
    tmp_path, monkeypatch
):

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    spawn(_metrics_failing_on_rank_0, 2, str(tmp_path))


def test_a_checkpoint_with_the_shared_rng_key_of_older_versions_still_resumes_it(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    pretrain(_cfg(tmp_path, "training.max_steps=1"))
    (checkpoint,) = list_checkpoints(checkpoint_root(tmp_path))
    whole = tmp_path / "whole.pt"
    dcp_to_torch_save(checkpoint.path, whole)
    tensors = torch.load(whole)
    saved = tensors.pop("rng/cpu/rank_0")
    tensors["rng/cpu"] = saved  # the one key every rank wrote before per-rank states
    torch.save(tensors, whole)
    for stale in [*checkpoint.path.glob("*.distcp"), checkpoint.path / ".metadata"]:
        stale.unlink()
    torch_save_to_dcp(whole, checkpoint.path)
    state_file = checkpoint.path / "train_state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "format_version": 1}))
    torch.manual_seed(7)
    state = setup(_cfg(tmp_path, "training.max_steps=2"))
    state.run_lock.close()
    assert state.step == 1 and torch.equal(torch.get_rng_state(), saved)


def test_each_nodes_local_rank_0_writes_its_wrappers_exit_file(tmp_path, monkeypatch):
    # tools/launch/torchrun.sh runs once per node, each with its own $MT_TRAIN_EXIT_FILE
    # (mktemp), and exits 0 after a signal only when that file was written: on a node
    # without global rank 0 the wrapper reported a clean stop as a failure (and srun's
    # --kill-on-bad-exit then killed the other nodes' tasks).
    from types import SimpleNamespace

    from mt_train.distributed import Env
    from mt_train.faults import EXIT_FILE_ENV, write_exit_file

    for rank, local_rank in ((8, 0), (9, 1), (0, 0)):
        path = tmp_path / f"exit_{rank}"
        monkeypatch.setenv(EXIT_FILE_ENV, str(path))
        env = Env(rank=rank, world_size=16, local_rank=local_rank, device=torch.device("cpu"))
        write_exit_file(SimpleNamespace(env=env, step=7, stop_requested=True))
        written = json.loads(path.read_text()) if path.exists() else None
        expected = {"step": 7, "reason": "signal"} if local_rank == 0 else None
        assert written == expected, (rank, local_rank)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_during_setup_stops_before_the_first_step_keeping_the_last_checkpoint(
    tmp_path, monkeypatch, signum
):
    # A preemption while a run resumes (building the model, reading the checkpoint) used
    # to meet the default handler: the process died by the signal (exit 143, or 138 for
    # SLURM's SIGUSR1), and under torchrun.sh the stop counted as a failure.
    pretrain(_cfg(tmp_path, "training.max_steps=2", "checkpoint.interval=2"))
    real_resume = train_module._resume_or_start

    def resume_after_a_signal(state, run_dir):
        os.kill(os.getpid(), signum)  # arrives in the middle of setup
        return real_resume(state, run_dir)

    monkeypatch.setattr(train_module, "_resume_or_start", resume_after_a_signal)
    monkeypatch.setenv("MT_TRAIN_EXIT_FILE", str(tmp_path / "exit.json"))
    outside = []
    previous = signal.signal(signum, lambda signum, frame: outside.append(signum))
    try:
        stopped = pretrain(_cfg(tmp_path, "training.max_steps=4", "checkpoint.interval=2"))
    finally:
        signal.signal(signum, previous)
    assert outside == [], "the signal reached the handler from before the run"
    assert stopped.stop_requested and stopped.step == 2 and stopped.losses == []
    assert _steps(tmp_path) == [2]
    assert json.loads((tmp_path / "exit.json").read_text()) == {"step": 2, "reason": "signal"}


def test_a_run_dir_that_cannot_be_written_is_a_value_error_naming_it(tmp_path):
    # A read-only run_dir (a mount, another user's directory) failed with a traceback
    # from opening the lock file. Root ignores permissions, so a directory stands in for
    # the lock file that cannot be opened for writing.
    (tmp_path / ".lock").mkdir()
    with pytest.raises(ValueError, match=rf"run_dir {re.escape(str(tmp_path))} cannot be "
                       r"written \(.*\.lock.*\); make it writable or choose another "
                       r"run_dir"):  # fmt: skip
        pretrain(_cfg(tmp_path, "training.max_steps=1"))
    assert not checkpoint_root(tmp_path).exists()


def test_a_signal_during_a_periodic_save_stops_right_after_it_without_another_step(
    tmp_path, monkeypatch
):
    # torchrun SIGKILLs 30 s after forwarding a signal. One that came while a checkpoint
    # was being written made the run train another step and write a second checkpoint
    # in that time, when the one just written already held the stop's step.
    real_save = train_module._save

    def save_during_a_signal(state, writer):
        if state.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(state, writer)

    monkeypatch.setattr(train_module, "_save", save_during_a_signal)
    stopped = pretrain(_cfg(tmp_path, "training.max_steps=50", "checkpoint.interval=2"))
    assert stopped.stop_requested and stopped.step == 2 and len(stopped.losses) == 2
    assert _steps(tmp_path) == [2]


def test_a_run_already_at_max_steps_still_writes_the_launchers_exit_file(tmp_path, monkeypatch):
    # tools/launch/torchrun.sh exits 0 after a signal only if this file was written; a
    # run with nothing to do (a requeued job that had finished) returned without it.
    pretrain(_cfg(tmp_path, "training.max_steps=2"))
    monkeypatch.setenv("MT_TRAIN_EXIT_FILE", str(tmp_path / "exit.json"))
    assert pretrain(_cfg(tmp_path, "training.max_steps=2")).losses == []
    assert json.loads((tmp_path / "exit.json").read_text()) == {"step": 2, "reason": "finished"}


def test_a_resumed_run_clears_what_a_crashed_save_left_before_its_first_step(tmp_path):
    # A save killed midway (torchrun's SIGKILL after its grace period, a full disk) leaves
    # a torn .tmp-step_N as large as a checkpoint. It was removed only by the next save,
    # checkpoint.interval steps later: after a full disk the rerun failed in setup (no
    # space for config.json) with the torn save still holding the space.
    pretrain(_cfg(tmp_path, "training.max_steps=2", "checkpoint.interval=1"))
    root = checkpoint_root(tmp_path)
    shutil.copytree(root / "step_00000002", root / ".tmp-step_00000003")
    (root / ".tmp-step_00000003" / "train_state.json").unlink()
    shutil.copytree(root / "step_00000001", root / ".old-step_00000001")
    state = setup(_cfg(tmp_path, "training.max_steps=4", "checkpoint.interval=1"))
    state.run_lock.close()
    assert state.step == 2
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]


def test_the_command_reports_a_failed_checkpoint_write_in_two_lines_without_a_traceback(
    tmp_path, monkeypatch, capsys
):
    # DCP's CheckpointException is a BaseException: a full disk at a save ended
    # `mt-train pretrain` with a traceback of DCP's internals, the useful note at its end.
    from mt_train.cli import main

    def full_disk(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", full_disk)
    code = main(["pretrain", "tiny", f"run_dir={tmp_path}", "training.max_steps=1"])
    err = capsys.readouterr().err
    assert code == 1
    lines = [line for line in err.splitlines() if not line.startswith(("step ", "INFO", "WARN"))]
    assert lines[-2] == "mt-train: error: OSError: [Errno 28] No space left on device"
    assert lines[-1].startswith(f"writing checkpoint {checkpoint_root(tmp_path)}")
    assert "previous complete checkpoint is untouched" in lines[-1]
    assert "Traceback" not in err
