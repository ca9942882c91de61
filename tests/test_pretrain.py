"""`mt-train pretrain` end to end on CPU: loss falls, metrics are written, runs resume."""

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from mt_data import default_corpus_dir
from mt_train.checkpoint import checkpoint_root, list_checkpoints
from mt_train.overrides import resolve_config
from mt_train.recipes import get_recipe
from mt_train.train import pretrain, setup


def _cfg(run_dir, *overrides):
    return resolve_config(get_recipe("tiny"), overrides=[f"run_dir={run_dir}", *overrides])


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_pretrain_loss_falls_and_metrics_are_written(tmp_path):
    # The validation corpus here is the training corpus: this checks the mechanism only.
    validation = [f"validation.path={default_corpus_dir()}", "validation.interval=20"]
    state = pretrain(_cfg(tmp_path, "training.max_steps=40", "training.warmup_steps=5",
                          *validation))
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 41))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "aux_loss",
                "load_balancing_loss", "router_z_loss"):
        assert all(isinstance(r[key], (int, float)) for r in rows), key
    coef = state.cfg.model.router_aux_loss_coef  # the debug model has no z-loss weight
    assert all(r["aux_loss"] == pytest.approx(coef * r["load_balancing_loss"]) for r in rows)
    first, last = sum(state.losses[:5]) / 5, sum(state.losses[-5:]) / 5
    assert last < first - 1.0, (first, last)
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert sorted(val) == [20, 40] and val[40] < val[20], val
    checkpoints = list_checkpoints(checkpoint_root(tmp_path))
    assert [c.step for c in checkpoints] == [40]
    assert (tmp_path / "config.json").is_file()
    _check_generate(checkpoints[-1].path)
    _check_export(checkpoints[-1].path, state.model, tmp_path / "hf")


def _check_export(checkpoint, model, out):
    import torch

    from mt_models import load_hf
    from mt_train.cli import main

    assert main(["convert", "mt-to-hf", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    assert (out / "tokenizer.json").is_file(), "the run's tokenizer travels with the export"
    exported = load_hf(out).canonical_parameters()
    trained = model.canonical_parameters()
    assert sorted(exported) == sorted(trained)
    for key, param in trained.items():
        assert exported[key].dtype == torch.float32 and torch.equal(exported[key], param), key


def _check_generate(checkpoint):
    from mt_train.generate import generate

    greedy = generate(checkpoint, "def main(", max_new_tokens=8)
    assert greedy.startswith("def main(") and len(greedy) > len("def main(")
    # top-p so small that only the likeliest token survives: sampling equals greedy.
    assert generate(checkpoint, "def main(", max_new_tokens=8, temperature=1.0,
                    top_p=1e-9, seed=3) == greedy
    assert generate(checkpoint, "def main(", max_new_tokens=0) == "def main("


def test_tensorboard_gets_every_numeric_metric_and_the_profiler_traces_the_steps(
    tmp_path, monkeypatch
):
    import types

    written, purge_steps = [], []

    class FakeWriter:  # stands in for torch.utils.tensorboard.SummaryWriter
        def __init__(self, log_dir, purge_step=None):
            self.log_dir = log_dir
            purge_steps.append(purge_step)

        def add_scalar(self, key, value, step):
            written.append((step, key, value))

        def close(self):
            written.append("closed")

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    pretrain(_cfg(tmp_path, "training.max_steps=3", "metrics.tensorboard=true",
                  "profile.trace_steps=2,3", "checkpoint.interval=2"))
    # Without the final checkpoint a rerun resumes at step 2 and redoes step 3: TensorBoard
    # purges the first run's events from step 3 on, as metrics.jsonl drops its lines.
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000003")
    pretrain(_cfg(tmp_path, "training.max_steps=3", "metrics.tensorboard=true"))
    assert purge_steps == [1, 3]
    rows = _metrics(tmp_path)
    assert written[-1] == "closed"
    for row in rows:
        assert (row["step"], "loss", row["loss"]) in written
        assert (row["step"], "grad_norm", row["grad_norm"]) in written
    # The same run asked for a profiler trace of steps 2..3.
    trace = json.loads((tmp_path / "profile" / "trace_rank0_steps2-3.json").read_text())
    assert any("aten::" in event.get("name", "") for event in trace["traceEvents"])


def test_resumed_run_continues_from_its_last_step_bit_exactly(tmp_path, caplog):
    constant_lr = ["training.warmup_steps=0", "training.min_lr_ratio=1.0"]
    whole = pretrain(_cfg(tmp_path / "whole", "training.max_steps=6", *constant_lr))
    pretrain(_cfg(tmp_path / "split", "training.max_steps=3", *constant_lr))
    with caplog.at_level(logging.WARNING, logger="mt_train"):
        resumed = pretrain(_cfg(tmp_path / "split", "training.max_steps=6", *constant_lr))
    assert len(resumed.losses) == 3, "the second run must start at step 4, not step 1"
    assert resumed.losses == whole.losses[3:]
    assert [r["step"] for r in _metrics(tmp_path / "split")] == [1, 2, 3, 4, 5, 6]
    assert "training.max_steps: 3 -> 6" in caplog.text


def test_changed_schedule_on_resume_warns_about_the_lr(tmp_path, caplog):
    pretrain(_cfg(tmp_path, "training.max_steps=4", "training.warmup_steps=1"))
    with caplog.at_level(logging.WARNING, logger="mt_train"):
        state = pretrain(_cfg(tmp_path, "training.max_steps=8", "training.warmup_steps=1"))
    assert state.step == 8 and len(state.losses) == 4
    assert "LR schedule is recomputed" in caplog.text


def test_a_changed_micro_batch_size_on_resume_warns_when_the_balancing_loss_depends_on_it(
    tmp_path, caplog
):
    # A run of 3 steps against one of 1 step resumed with micro-batches of 4 (the same
    # global batch of 4). tiny's "global" balancing loss is one loss per micro-batch, so
    # the regrouping changes the step-2 gradient and so the step-3 loss: a warning says so.
    # A per-sequence loss does not depend on the grouping: no warning, the same loss.
    constant_lr = ["training.warmup_steps=0", "training.min_lr_ratio=1.0"]
    for aux_loss_type in ("global", "sequence"):
        run = [f"model.aux_loss_type={aux_loss_type}", *constant_lr]
        whole = pretrain(_cfg(tmp_path / f"{aux_loss_type}-whole", "training.max_steps=3", *run))
        split = tmp_path / aux_loss_type
        pretrain(_cfg(split, "training.max_steps=1", *run))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mt_train"):
            resumed = pretrain(
                _cfg(split, "training.max_steps=3", "training.micro_batch_size=4", *run)
            )
        difference = abs(resumed.losses[1] - whole.losses[2]) / whole.losses[2]
        if aux_loss_type == "global":
            assert "training.micro_batch_size changed from 2 to 4" in caplog.text
            assert "keep training.micro_batch_size=2" in caplog.text
            assert difference > 1e-6
        else:
            assert "training.micro_batch_size changed" not in caplog.text
            assert difference <= 1e-6


def test_an_unfinished_checkpoint_is_never_resumed(tmp_path):
    pretrain(_cfg(tmp_path, "training.max_steps=2"))
    root = checkpoint_root(tmp_path)
    # A crash while writing step 3 leaves a temporary directory behind.
    shutil.copytree(root / "step_00000002", root / ".tmp-step_00000003")
    state = pretrain(_cfg(tmp_path, "training.max_steps=3"))
    assert state.losses and len(state.losses) == 1 and state.step == 3


def test_a_checkpoint_named_without_the_8_digit_step_is_not_resumed_but_warned_of(
    tmp_path, caplog
):
    pretrain(_cfg(tmp_path, "training.max_steps=2"))
    root = checkpoint_root(tmp_path)
    (root / "step_00000002").rename(root / "step_2")  # renamed by hand
    with caplog.at_level(logging.WARNING, logger="mt_train"):
        state = pretrain(_cfg(tmp_path, "training.max_steps=1"))
    assert state.step == 1 and len(state.losses) == 1, "a fresh run, not a resume"
    assert (
        f"{root / 'step_2'} is a checkpoint that is not resumed: checkpoints are found by "
        "their step in 8 digits; if it is this run's, rename it to step_00000002"
    ) in caplog.text
    assert caplog.text.count("step_2 ") == 1


@pytest.mark.slow
def test_mt_train_command_runs_and_resumes(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "mt_train", "pretrain", "tiny", f"run_dir={tmp_path}"]
    first = subprocess.run([*cmd, "training.max_steps=2"], capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr
    assert "step 2/2" in first.stdout
    again = subprocess.run([*cmd, "training.max_steps=3"], capture_output=True, text=True, env=env)
    assert again.returncode == 0, again.stderr
    assert "step 3/3" in again.stdout and "step 1/3" not in again.stdout
    assert "resumed from" in again.stderr


def test_the_command_leaves_the_process_group_after_a_run(tmp_path):
    # Under torchrun the process group outlived a finished run, and gloo's teardown in the
    # interpreter's exit then aborted a rank now and then (SIGABRT after a run that
    # finished: torchrun reported it failed). A one-rank group stands in for torchrun's.
    import torch.distributed as dist

    from mt_train.cli import main

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert main(["pretrain", "tiny", f"run_dir={tmp_path}", "training.max_steps=1"]) == 0
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))


def test_weights_and_biases_gets_every_step_in_an_offline_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from wandb.sdk.wandb_run import Run

    _offline_wandb(tmp_path, monkeypatch)
    logged = []
    real_log = Run.log

    def spy(self, data, step=None, **kwargs):
        logged.append((step, dict(data)))
        return real_log(self, data, step=step, **kwargs)

    monkeypatch.setattr(Run, "log", spy)
    pretrain(_cfg(tmp_path, "training.max_steps=3", "metrics.wandb_project=mt-test"))
    assert wandb.run is None, "the W&B run must be finished at the end"
    rows = _metrics(tmp_path)
    assert [step for step, _ in logged] == [row["step"] for row in rows]
    for (_, data), row in zip(logged, rows, strict=True):
        assert data["loss"] == row["loss"] and data["grad_norm"] == row["grad_norm"]
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert run_file.stat().st_size > 0


def test_a_resumed_run_logs_to_the_same_weights_and_biases_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from wandb.sdk.wandb_run import Run

    _offline_wandb(tmp_path, monkeypatch)
    logged = []
    real_log = Run.log

    def spy(self, data, step=None, **kwargs):
        logged.append((self.id, step))
        return real_log(self, data, step=step, **kwargs)

    monkeypatch.setattr(Run, "log", spy)
    pretrain(_cfg(tmp_path, "training.max_steps=2", "metrics.wandb_project=mt-test"))
    pretrain(_cfg(tmp_path, "training.max_steps=3", "metrics.wandb_project=mt-test"))
    assert [step for _, step in logged] == [1, 2, 3]
    assert len({run_id for run_id, _ in logged}) == 1, logged


def test_the_first_run_says_it_builds_the_default_corpus_and_where(tmp_path, monkeypatch, caplog):
    import mt_data.default_corpus
    from mt_train.train import setup

    documents = ["def f(x):\n    return x + 1\n" * 50] * 20  # enough for 64-token samples
    monkeypatch.setattr(mt_data.default_corpus, "iter_default_documents", lambda: iter(documents))
    monkeypatch.setenv("MT_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="mt_train"):
        setup(_cfg(tmp_path / "run"))
    corpus = default_corpus_dir()
    assert corpus.parent == tmp_path / "cache" / "corpus"
    assert f"building the default corpus (this Python's standard library sources) into {corpus}" \
        in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mt_train"):
        setup(_cfg(tmp_path / "run"))  # cached: nothing to say
    assert "building the default corpus" not in caplog.text


def test_a_warmup_as_long_as_the_run_warns_at_setup(tmp_path, caplog):
    from mt_train.train import setup

    with caplog.at_level(logging.WARNING, logger="mt_train"):
        setup(_cfg(tmp_path / "short", "training.max_steps=4"))  # the tiny recipe warms up 15
    assert "training.warmup_steps (15) >= training.max_steps (4): the whole run is warm-up, " \
        "the LR rises to 8.000e-04 (training.lr 3.000e-03) and never decays; for it to reach " \
        "training.lr and decay, set training.warmup_steps below 4 (say 0)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mt_train"):
        setup(_cfg(tmp_path / "long", "training.max_steps=16"))
    assert "warmup_steps" not in caplog.text


def test_a_seq_len_past_the_models_context_warns_at_setup_unless_rope_scaling_extends_it(
    tmp_path, caplog
):
    # max_position_embeddings is the trained context a Hub config.json states (inference
    # engines cut sequences to it); YaRN extends it to factor × original_max_position_embeddings.
    from mt_train.train import setup

    with caplog.at_level(logging.WARNING, logger="mt_train"):
        setup(_cfg(tmp_path / "plain", "model.max_position_embeddings=48"))  # seq_len 64
    assert "data.seq_len (64) is longer than the model's context, " \
        "model.max_position_embeddings (48): " in caplog.text
    assert "raise model.max_position_embeddings to 64 or lower data.seq_len to 48" in caplog.text
    assert caplog.text.count("data.seq_len (64)") == 1
    yarn = '{"rope_type": "yarn", "original_max_position_embeddings": 16, "factor": %s}'
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mt_train"):
        setup(_cfg(tmp_path / "short", "model.max_position_embeddings=32",
                   f"model.rope_scaling={yarn % 3.0}"))
    assert "data.seq_len (64) is longer than the model's context, 48 (model.rope_scaling " \
        "factor 3.0 × original_max_position_embeddings 16; model.max_position_embeddings " \
        "32): " in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mt_train"):
        setup(_cfg(tmp_path / "yarn", "model.max_position_embeddings=32",
                   f"model.rope_scaling={yarn % 4.0}"))
        setup(_cfg(tmp_path / "long", "model.max_position_embeddings=64"))
    assert "seq_len" not in caplog.text


@pytest.mark.parametrize(("key", "what"), [("vocab_size", "vocabulary size"), ("eos_id", "EOS id")])
def test_a_validation_corpus_of_another_tokenizer_is_refused_before_the_model_is_built(
    tmp_path, monkeypatch, key, what
):
    import mt_train.train as train_module

    heldout = tmp_path / "heldout"
    shutil.copytree(default_corpus_dir(), heldout)
    manifest = json.loads((heldout / "manifest.json").read_text())
    manifest[key] += 1
    (heldout / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(train_module, "build_model", None)  # must not be reached
    cfg = _cfg(tmp_path / "run", f"validation.path={heldout}", "validation.interval=5")
    with pytest.raises(ValueError, match=f"validation.path: .* has {what} {manifest[key]} but"):
        train_module.setup(cfg)


def test_data_loading_time_counts_in_the_step_time_and_is_reported(tmp_path, monkeypatch):
    import time

    import mt_train.train as train_module

    real_next = train_module.next_microbatches

    def slow_next(state, *args):
        time.sleep(0.3)  # a slow data loader
        return real_next(state, *args)

    monkeypatch.setattr(train_module, "next_microbatches", slow_next)
    cfg = _cfg(tmp_path, "training.max_steps=2")
    pretrain(cfg)
    tokens = cfg.training.global_batch_size * cfg.data.seq_len
    for row in _metrics(tmp_path):
        assert row["data_time_s"] >= 0.3 and row["step_time_s"] > row["data_time_s"]
        assert row["tokens_per_s"] == pytest.approx(tokens / row["step_time_s"], rel=1e-9)


def test_document_masking_trains_each_packed_document_as_if_it_were_alone(tmp_path):
    import torch

    from mt_train.train import next_microbatches, setup

    state = setup(_cfg(tmp_path, "data.document_masking=true"))
    eos = state.dataset.eos_id  # the builder ends each document with EOS
    model = state.model.eval()  # no dropout either way; eval only documents the intent
    checked = 0
    with torch.no_grad():
        # Stdlib files are long against the tiny recipe's samples: read batches until two
        # samples hold an EOS.
        batches = (mb for _ in range(100) for mb in next_microbatches(state))
        for mb in batches:
            if checked >= 2:
                break
            assert mb.positions is not None and mb.positions.shape == mb.input_ids.shape
            for row in range(mb.input_ids.shape[0]):
                ids, labels = mb.input_ids[row : row + 1], mb.labels[row : row + 1]
                starts = [0, *((ids[0, :-1] == eos).nonzero().flatten() + 1).tolist()]
                if len(starts) < 2:
                    continue
                assert (mb.positions[row, starts] == 0).all()
                packed = model.loss(ids, labels, position_ids=mb.positions[row : row + 1])
                alone = sum(
                    float(model.loss(ids[:, a:b], labels[:, a:b]).ce_sum)
                    for a, b in zip(starts, [*starts[1:], ids.shape[1]], strict=True)
                )
                assert float(packed.ce_sum) == pytest.approx(alone, rel=1e-5)
                # Attending across documents gives another loss (by far more than the
                # rounding that separates packed from alone).
                across = float(model.loss(ids, labels).ce_sum)
                assert abs(across - alone) > 20 * abs(float(packed.ce_sum) - alone)
                assert across != pytest.approx(alone, rel=1e-4)
                checked += 1
    assert checked >= 2, "the batch held no sample with two documents"


def test_a_run_with_document_masking_trains(tmp_path):
    import math

    pretrain(_cfg(tmp_path, "data.document_masking=true", "training.max_steps=3"))
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)


def test_a_run_resumed_with_another_seed_validates_on_the_batches_it_validated_on(tmp_path):
    # A resumed run continues the checkpoint's data order whatever `seed` says; the held-out
    # batches must stay those of the run too, or val_loss jumps at the resume.
    validation = [f"validation.path={default_corpus_dir()}", "validation.interval=1"]
    pretrain(_cfg(tmp_path / "whole", "training.max_steps=2", *validation))
    pretrain(_cfg(tmp_path / "split", "training.max_steps=1", *validation))
    pretrain(_cfg(tmp_path / "split", "training.max_steps=2", "seed=1", *validation))
    whole, split = _metrics(tmp_path / "whole"), _metrics(tmp_path / "split")
    assert [r["loss"] for r in split] == [r["loss"] for r in whole]
    assert [r["val_loss"] for r in split] == [r["val_loss"] for r in whole]


def _validate_then_save(root):
    """Body of the two-rank test below: each run validates its one step, then saves it."""
    from pathlib import Path

    import torch.distributed as dist

    validation = [f"validation.path={default_corpus_dir()}", "validation.interval=1"]
    # FSDP2 keeps the root's parameters gathered after a forward, and with
    # reshard_after_forward=false every layer's: no backward follows validation's.
    for name, layout in (("root", []), ("layers", ["parallel.reshard_after_forward=false"])):
        run_dir = Path(root) / name
        state = pretrain(_cfg(run_dir, "training.max_steps=1", *validation, *layout))
        assert state.step == 1
        if dist.get_rank() == 0:
            assert [c.step for c in list_checkpoints(checkpoint_root(run_dir))] == [1]
            assert [r["step"] for r in _metrics(run_dir) if "val_loss" in r] == [1]
    dist.barrier()  # both ranks tear down together (gloo can abort on a peer gone early)


def test_two_ranks_save_a_checkpoint_right_after_validating(tmp_path, monkeypatch):
    from pathlib import Path

    from mt_parallel.testing import spawn

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    spawn(_validate_then_save, 2, str(tmp_path))


def test_the_run_config_is_on_disk_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    from mt_train.train import setup

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
    setup(_cfg(tmp_path)).run_lock.close()
    # Without the fsync a power loss after the rename can leave config.json empty.
    ours = [e for e in events if e[1] == "config.json.tmp"]
    assert ours == [("fsync", "config.json.tmp"), ("replace", "config.json.tmp")]
    assert json.loads((tmp_path / "config.json").read_text())["run_dir"] == str(tmp_path)


def test_a_validation_asking_more_samples_than_the_held_out_corpus_has_is_warned(
    tmp_path, caplog
):
    # The held-out loader starts over when it runs out: samples were evaluated twice
    # without a word.
    validation = [f"validation.path={default_corpus_dir()}", "validation.interval=5"]
    with caplog.at_level(logging.WARNING, logger="mt_train"):
        state = setup(_cfg(tmp_path / "few", *validation, "validation.steps=1"))
    state.run_lock.close()
    assert "evaluated more than once" not in caplog.text
    held_out = state.val_dataset.num_samples
    steps = held_out // state.cfg.training.global_batch_size + 1
    with caplog.at_level(logging.WARNING, logger="mt_train"):
        state = setup(_cfg(tmp_path / "many", *validation, f"validation.steps={steps}"))
    state.run_lock.close()
    assert f"holds {held_out} of seq_len" in caplog.text
    assert "evaluated more than once" in caplog.text


@pytest.mark.parametrize(("world_size", "code"), [("2", 0), ("2", 1), (None, 0)])
def test_the_script_leaves_a_finished_rank_of_several_with_os_exit(monkeypatch, world_size,
                                                                   code):  # fmt: skip
    # gloo's teardown in the interpreter's exit aborted a rank of a finished torchrun run
    # now and then even with the group destroyed (SIGABRT; torchrun reported a failure).
    import mt_train.cli as cli

    exits = []

    def os_exit(status):
        exits.append(("os._exit", status))
        raise SystemExit(status)

    monkeypatch.setattr(cli, "main", lambda: code)
    monkeypatch.setattr(cli.os, "_exit", os_exit)
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    with pytest.raises(SystemExit) as raised:
        cli.entry()
    assert raised.value.code == code
    assert exits == ([("os._exit", 0)] if world_size and code == 0 else [])


def test_peak_memory_gb_is_in_gigabytes_of_ten_to_the_nine_bytes_as_its_name_and_label_say():
    import resource

    import torch

    from mt_train.train import _peak_memory_gb

    # On CPU the process's largest resident size, which ru_maxrss gives in KiB (Linux).
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gb = _peak_memory_gb(torch.device("cpu"))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert before / 1e9 <= gb <= after / 1e9, (before, gb, after)


def test_the_profilers_start_counts_neither_as_data_time_nor_in_the_step_time(
    tmp_path, monkeypatch
):
    import time

    import mt_train.profiling as profiling_module

    real_profile = profiling_module.torch.profiler.profile

    class SlowToStart(real_profile):
        def __enter__(self):
            time.sleep(0.5)  # CUPTI's start on a GPU can take this long
            return super().__enter__()

    monkeypatch.setattr(profiling_module.torch.profiler, "profile", SlowToStart)
    pretrain(_cfg(tmp_path, "training.max_steps=1", "profile.trace_steps=1,1"))
    [row] = _metrics(tmp_path)
    assert (tmp_path / "profile" / "trace_rank0_steps1-1.json").is_file()
    assert row["data_time_s"] < 0.5 and row["step_time_s"] < 0.5 + row["data_time_s"], row


def test_the_metric_sinks_are_closed_even_when_ending_the_profiler_fails(tmp_path, monkeypatch):
    import types

    import mt_train.profiling as profiling_module

    closed = []

    class FakeWriter:  # stands in for torch.utils.tensorboard.SummaryWriter
        def __init__(self, log_dir, purge_step=None):
            pass

        def add_scalar(self, key, value, step):
            pass

        def close(self):
            closed.append(True)  # flushes the last steps' events

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)

    def failing_close(self):
        raise RuntimeError("the profiler could not stop")

    monkeypatch.setattr(profiling_module.StepProfiler, "close", failing_close)
    with pytest.raises(RuntimeError, match="could not stop"):
        pretrain(_cfg(tmp_path, "training.max_steps=1", "metrics.tensorboard=true"))
    assert closed == [True]
