"""`mt-train pretrain` with parallel.pp = 2 (two gloo ranks, DualPipeV) trains as one process
does, and its checkpoints continue under the other layout.

A tiny 4-layer model (one layer per stage), 4 micro-batches of one sequence (2·pp, the
schedule's least), an LR that changes every step, gradients clipped at every step (norm ~2,
grad_clip 1). References, in one process: 4 steps at pp = 1, and 2 steps at pp = 1 saved.
Two ranks then train 4 steps at pp = 2 (saving in the background), resume the pp = 1 run
to step 4 at pp = 2, and train a third run 2 steps at pp = 2, which one process resumes to
step 4; and a new run from the reference's step-2 weights (init_from) at pp = 2 and at
pp = 1. Every run's per-step losses and step-4 checkpoint (every parameter and AdamW
moment, canonical keys) must match the uninterrupted pp = 1 run (the init_from runs' loss
each other's).

Tolerances: the stages run the same kernels on the same micro-batch shapes as one process,
so the forward agrees closely; the weight gradients are summed over micro-batches in
another order (DualPipeV's) and, for the deferred linears, by another kernel, ~1e-7
relative in fp32. Adam's normalization magnifies that to ~1e-5 in small tensors after 4
steps (as in tests/test_checkpoint_layouts.py); a tensor on the wrong rank, loaded into
the wrong place or not updated is off by O(1), and a gradient norm summed on one rank
only clips another way (2e-4 off by step 4). Measured here (CPU, torch 2.11): equal.

Also: 3 steps in FP8 (emulated) at pp = 2 give the one-process FP8 losses; validation at
pp = 2 (and pp = 2, dp = 2) gives the one-process held-out losses; and pp = 2 with
dp = 2 (four ranks, FSDP2 over each stage's two replicas) trains, saves and resumes to and
from pp = 1 as one process does, and so do pp = 2 with ep = 2 (each pipeline holding half
of every layer's experts) and with cp = 2 (zigzag chunks of every sequence), every rank
having materialized its own stages only.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mt_data import default_corpus_dir
from mt_models import base
from mt_parallel import ParallelDims
from mt_parallel.testing import rel_err, spawn
from mt_train.checkpoint import checkpoint_root, latest_checkpoint
from mt_train.overrides import resolve_config
from mt_train.recipes import get_recipe
from mt_train.train import TrainState, check_pipeline_sharding, pretrain

RUN = [
    "model.num_hidden_layers=4", "data.seq_len=32", "training.global_batch_size=4",
    "training.micro_batch_size=1", "training.max_steps=4", "training.warmup_steps=2",
    "training.num_threads=1", "checkpoint.interval=2", "checkpoint.keep_last=4",
]  # fmt: skip
PP2 = ["parallel.pp=2"]
FP8 = ["precision.fp8=true", "training.max_steps=3"]  # (emulated on the CPU)
# Validation on the training corpus (the mechanism only), after each of 2 steps.
VAL = [f"validation.path={default_corpus_dir()}", "validation.interval=1",
       "validation.steps=2", "training.max_steps=2"]  # fmt: skip
LOSS_TOLERANCE = 1e-5
TENSOR_TOLERANCE = 1e-4


def _cfg(run_dir: Path, *overrides: str):
    return resolve_config(get_recipe("tiny"), overrides=[*RUN, f"run_dir={run_dir}", *overrides])


def _initializing_own_stages_only(run_dir: Path, *overrides: str) -> TrainState:
    """pretrain, asserting that this rank materialized and initialized its stages'
    parameters and no other (the rest of the model stays on the meta device)."""
    initialized = []
    original = base.copy_whole_into

    def recording(target, whole):
        initialized.append(target)
        original(target, whole)

    base.copy_whole_into = recording
    try:
        state = pretrain(_cfg(run_dir, *overrides))
    finally:
        base.copy_whole_into = original
    mine = {id(p) for p in state.model.parameters()}
    assert {id(p) for p in initialized} == mine and len(initialized) == len(mine)
    # The rank keeps only its stages' weights.
    assert {id(p) for p in state.model.whole.parameters()} == mine
    return state


def _on_two_ranks(root: str) -> None:
    root = Path(root)
    state = _initializing_own_stages_only(root / "pp2", *PP2, "checkpoint.async_save=true")
    assert len(state.losses) == 4
    assert state.pipeline is not None and state.pipeline.pp == 2
    state = pretrain(_cfg(root / "pp1_then_pp2", *PP2))
    assert len(state.losses) == 2, "the resumed run must start at step 3"
    pretrain(_cfg(root / "fp8_pp2", *PP2, *FP8))
    pretrain(_cfg(root / "val_pp2", *PP2, *VAL))
    pretrain(_cfg(root / "pp2_then_pp1", *PP2, "training.max_steps=2"))
    pretrain(_cfg(root / "init_pp2", *PP2, *_init_from(root)))


def _init_from(root: Path) -> list[str]:
    """A new 1-step run from the reference's step-2 weights."""
    step_2 = checkpoint_root(root / "reference") / "step_00000002"
    return [f"init_from={step_2}", "training.max_steps=1"]


def _losses(run_dir: Path, key: str = "loss") -> list[float]:
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(row)[key] for row in rows if key in json.loads(row)]


def _assert_same_validation(run_dir: Path, reference: Path) -> None:
    """The run's held-out losses (forward only, through the stages) are the reference's."""
    got, want = _losses(run_dir, "val_loss"), _losses(reference, "val_loss")
    assert len(got) == len(want) == 2, (got, want)
    assert got[0] != got[1], "the weights changed between the evaluations"
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= LOSS_TOLERANCE * abs(w), f"{run_dir.name}: val_loss {got} {want}"


def _final(run_dir: Path) -> tuple[dict[str, torch.Tensor], dict, list[float]]:
    checkpoint = latest_checkpoint(checkpoint_root(run_dir))
    assert checkpoint is not None and checkpoint.step == 4
    dcp_to_torch_save(checkpoint.path, run_dir / "step_4.pt")
    tensors = torch.load(run_dir / "step_4.pt")
    data = checkpoint.train_state(needed=("data",))["data"]
    return tensors, data, _losses(run_dir)


@pytest.mark.slow
def test_pp2_trains_saves_and_resumes_as_one_process_does(tmp_path, monkeypatch):
    pretrain(_cfg(tmp_path / "reference"))
    pretrain(_cfg(tmp_path / "pp1_then_pp2", "training.max_steps=2"))
    pretrain(_cfg(tmp_path / "fp8_pp1", *FP8))
    pretrain(_cfg(tmp_path / "val_pp1", *VAL))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    spawn(_on_two_ranks, 2, str(tmp_path))
    # FP8 linears under the pipeline defer their weight gradients too: the same losses.
    fp8, fp8_pp2 = _losses(tmp_path / "fp8_pp1"), _losses(tmp_path / "fp8_pp2")
    assert len(fp8_pp2) == 3 and fp8 != _losses(tmp_path / "reference")[:3]
    for step, (got, want) in enumerate(zip(fp8_pp2, fp8, strict=True), start=1):
        assert abs(got - want) <= LOSS_TOLERANCE * abs(want), f"fp8: step {step} {got} {want}"
    _assert_same_validation(tmp_path / "val_pp2", tmp_path / "val_pp1")
    state = pretrain(_cfg(tmp_path / "pp2_then_pp1"))
    assert len(state.losses) == 2 and state.pipeline is None
    # init_from: every pipeline rank loads the whole model before keeping its stages.
    pretrain(_cfg(tmp_path / "init_pp1", *_init_from(tmp_path)))
    (want,), (got,) = _losses(tmp_path / "init_pp1"), _losses(tmp_path / "init_pp2")
    assert abs(got - want) <= LOSS_TOLERANCE * abs(want), f"init_from: {got} {want}"
    assert abs(want - _losses(tmp_path / "reference")[0]) > 1e-3, "init_from loaded nothing"
    assert len(state.losses) == 2 and state.pipeline is None
    compared = _assert_like_the_reference(tmp_path, ("pp2", "pp1_then_pp2", "pp2_then_pp1"))
    assert any(k.endswith("embed_tokens.weight") for k in compared)
    assert any(".layers.3." in k and k.endswith("exp_avg_sq") for k in compared)


def _assert_like_the_reference(root: Path, runs: tuple[str, ...]) -> set[str]:
    """Each run's per-step losses, data position and step-4 checkpoint (every parameter and
    AdamW moment) match the uninterrupted one-process run's in ``root / "reference"``;
    returns the compared checkpoint keys."""
    ref_tensors, ref_data, ref_losses = _final(root / "reference")
    compared = {k for k in ref_tensors if k.startswith(("model/", "optim/"))}
    for run in runs:
        tensors, data, losses = _final(root / run)
        assert data == ref_data, run
        assert len(losses) == len(ref_losses) == 4, run
        for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True), start=1):
            assert abs(got - want) <= LOSS_TOLERANCE * abs(want), f"{run}: step {step} {got} {want}"
        assert compared == {k for k in tensors if k.startswith(("model/", "optim/"))}, run
        assert int(tensors["optim/step"]) == 4, run
        for key in sorted(compared - {"optim/step"}):
            error = rel_err(tensors[key], ref_tensors[key])
            assert error <= TENSOR_TOLERANCE, f"{run}: {key} differs by {error:.2e} (relative)"
    return compared


# pp = 2 with dp = 2 (four gloo ranks, FSDP2 over each stage's two replicas): micro-batches
# of 2 sequences (1 per replica), 4 of them (2·pp).
DP2 = ["training.global_batch_size=8", "training.micro_batch_size=2"]
PP2_DP2 = [*PP2, "parallel.dp=2", *DP2]


def _on_four_ranks(root: str) -> None:
    root = Path(root)
    state = _initializing_own_stages_only(root / "pp2_dp2", *PP2_DP2, "checkpoint.async_save=true")
    assert len(state.losses) == 4
    assert state.pipeline is not None and (state.dims.pp, state.dims.dp) == (2, 2)
    state = pretrain(_cfg(root / "pp1_then_pp2_dp2", *PP2_DP2))
    assert len(state.losses) == 2, "the resumed run must start at step 3"
    pretrain(_cfg(root / "pp2_dp2_then_pp1", *PP2_DP2, "training.max_steps=2"))
    pretrain(_cfg(root / "val_pp2_dp2", *PP2_DP2, *VAL))
    # Expert parallelism: each pipeline of the two ep ranks holds half of every layer's
    # experts (and reads other rows of the batch).
    state = _initializing_own_stages_only(root / "pp2_ep2", *PP2, "parallel.ep=2", *DP2)
    assert (state.dims.pp, state.dims.dp, state.dims.ep) == (2, 1, 2)
    # Context parallelism: each pipeline of the two cp ranks holds zigzag chunks of every
    # sequence, its attention exchanging keys and values with the other's.
    state = pretrain(_cfg(root / "pp2_cp2", *PP2, "parallel.cp=2", *DP2))
    assert (state.dims.pp, state.dims.dp, state.dims.cp) == (2, 1, 2)


@pytest.mark.slow
def test_pp2_with_dp2_cp2_or_ep2_trains_saves_and_resumes_as_one_process_does(
    tmp_path, monkeypatch
):
    pretrain(_cfg(tmp_path / "reference", *DP2))
    pretrain(_cfg(tmp_path / "pp1_then_pp2_dp2", *DP2, "training.max_steps=2"))
    pretrain(_cfg(tmp_path / "val_dp2_pp1", *DP2, *VAL))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    spawn(_on_four_ranks, 4, str(tmp_path))
    state = pretrain(_cfg(tmp_path / "pp2_dp2_then_pp1", *DP2))
    assert len(state.losses) == 2 and state.pipeline is None
    _assert_same_validation(tmp_path / "val_pp2_dp2", tmp_path / "val_dp2_pp1")
    runs = ("pp2_dp2", "pp1_then_pp2_dp2", "pp2_dp2_then_pp1", "pp2_ep2", "pp2_cp2")
    compared = _assert_like_the_reference(tmp_path, runs)
    assert any(".experts." in k and k.endswith("exp_avg_sq") for k in compared)


# bf16 mixed precision on the CPU (FSDP2 gathers bf16 parameters, reduces in fp32), 6 layers
# and 6 micro-batches of 2 sequences, 3 steps.
BF16 = ["training.dtype=bfloat16", "training.device=cpu", "model.num_hidden_layers=6",
        "training.global_batch_size=12", "training.micro_batch_size=2",
        "training.max_steps=3"]  # fmt: skip


def _bf16_run(run_dir: str, *layout: str) -> None:
    pretrain(_cfg(Path(run_dir), *BF16, *layout))


@pytest.mark.slow
def test_pp3_dp2_in_bf16_mixed_precision_gives_the_dp2_losses_bit_for_bit(tmp_path, monkeypatch):
    # At pp = 3 DualPipeV flushes weight gradients back to back, with no backward between
    # them: each flush must reach FSDP2's fp32 accumulator, or they add up in bf16 first
    # (the losses then differ from step 2 on).
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    spawn(_bf16_run, 2, str(tmp_path / "dp2"), "parallel.dp=2")
    spawn(_bf16_run, 6, str(tmp_path / "pp3_dp2"), "parallel.pp=3", "parallel.dp=2")
    want = _losses(tmp_path / "dp2")
    assert len(want) == 3 and _losses(tmp_path / "pp3_dp2") == want


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_tied_model_is_refused_when_fsdp2_would_shard_its_pipeline(world_size):
    tied = SimpleNamespace(tie_word_embeddings=True)
    dims = ParallelDims(world_size=world_size, pp=2)  # dp = -1 fills the world
    if world_size == 2:  # the pipeline alone: nothing sharded
        check_pipeline_sharding(dims, tied)
        return
    rule = (r"tie_word_embeddings=true with parallel.pp=2 and dp\*cp\*ep = 2\*1\*1 = 2: "
            r".* set model.tie_word_embeddings=false")
    with pytest.raises(ValueError, match=rule):
        check_pipeline_sharding(dims, tied)
    check_pipeline_sharding(dims, SimpleNamespace(tie_word_embeddings=False))
