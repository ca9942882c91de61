"""Checks of the DualPipeV executor against one process (used by tests; `spawn` targets).

:func:`compare_dualpipev` builds the same model twice, runs ``run_microbatches`` on the
whole of one and the executor on this rank's stages of the other over the same global
batch, and asserts the step's loss sums and every gradient of the rank's parameters (with
``dp`` > 1: of the FSDP2-sharded stages of dp pipelines, each on its rows of the batch).
:func:`zero_tags` makes every point-to-point operation use tag 0, as NCCL (which has no
tags) does, so that on gloo too only the order of the operations can match them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from mt_models import build_model
from mt_parallel.context_parallel import zigzag_ranges
from mt_parallel.dims import ParallelDims
from mt_parallel.expert_parallel import apply_expert_parallel
from mt_parallel.fsdp import apply_fsdp_to_stages
from mt_parallel.mesh import build_mesh
from mt_parallel.parallelize import apply_context_parallel
from mt_parallel.pipeline import DualPipeVExecutor
from mt_parallel.pipeline_stages import rank_parameters, split_for_dualpipev
from mt_parallel.schedule import MicroBatch, run_microbatches
from mt_parallel.stats import router_stats_reducer
from mt_parallel.testing import rel_err


def _build(model_config: Any, seed: int, device: str | torch.device = "cpu") -> torch.nn.Module:
    with torch.device("meta"):
        model = build_model(model_config)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


@contextlib.contextmanager
def zero_tags() -> Iterator[list[int]]:
    """Within the block, ``dist.send``/``recv``/``isend``/``irecv`` (and so
    ``batch_isend_irecv``) run with tag 0 whatever tag they are given; yields the tags they
    were given, one per operation. Restores the functions on exit."""
    from torch.distributed import distributed_c10d as c10d

    given: list[int] = []
    originals = {name: getattr(c10d, name) for name in ("send", "recv", "isend", "irecv")}

    def untagged(original):
        def run(*args, tag: int = 0, **kwargs):
            given.append(tag)
            return original(*args, tag=0, **kwargs)

        return run

    # batch_isend_irecv and P2POp look isend/irecv up in distributed_c10d: patch them there
    # and in torch.distributed, where callers find them.
    patched = {name: untagged(fn) for name, fn in originals.items()}
    for module in (c10d, dist):
        for name, fn in patched.items():
            setattr(module, name, fn)
    try:
        yield given
    finally:
        for module in (c10d, dist):
            for name, fn in originals.items():
                setattr(module, name, fn)


def _micro_batches(
    vocab_size: int, num: int, rows: int, seq_len: int, seed: int, packed: bool = False
) -> list[MicroBatch]:
    """`num` micro-batches of `rows` random sequences; a few labels of each are ignored.
    `packed`: each row holds two documents (positions restart halfway)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (num * rows, seq_len + 1), generator=gen)
    half = seq_len // 2
    positions = torch.cat([torch.arange(half), torch.arange(seq_len - half)]).expand(rows, -1)
    out = []
    for i, chunk in enumerate(tokens.split(rows)):
        labels = chunk[:, 1:].clone()
        labels[0, : i % 3] = -100  # valid-token counts differ between micro-batches
        out.append(MicroBatch(chunk[:, :-1].clone(), labels, positions if packed else None))
    return out


def _to(mb: MicroBatch, device: str) -> MicroBatch:
    positions = None if mb.positions is None else mb.positions.to(device)
    return MicroBatch(mb.input_ids.to(device), mb.labels.to(device), positions)


def _rows(mb: MicroBatch, index: int, parts: int) -> MicroBatch:
    """Part `index` of `parts` of a micro-batch's rows (a dp replica's)."""
    n = mb.input_ids.shape[0] // parts
    rows = slice(index * n, (index + 1) * n)
    positions = None if mb.positions is None else mb.positions[rows]
    return MicroBatch(mb.input_ids[rows], mb.labels[rows], positions)


def _zigzag(mb: MicroBatch, cp: int, cp_rank: int) -> MicroBatch:
    """CP rank `cp_rank`'s zigzag columns of a micro-batch, with their global positions."""
    ranges = zigzag_ranges(mb.input_ids.shape[1], cp, cp_rank)
    cols = torch.cat([torch.arange(start, end - 1) for start, end in ranges])
    cols = cols.to(mb.input_ids.device)
    return MicroBatch(mb.input_ids[:, cols], mb.labels[:, cols], cols)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A gradient as one tensor on the CPU (an FSDP2 shard gathered: a collective)."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).cpu()


def compare_dualpipev(
    model_config: Any, *, num_micro_batches: int, rows: int, seq_len: int, seed: int = 0,
    grad_tol: float, loss_tol: float, packed: bool = False, device: str = "cpu", dp: int = 1,
    ep: int = 1, cp: int = 1,
) -> dict[str, float]:  # fmt: skip
    """Asserts that one DualPipeV step reproduces ``run_microbatches`` on one process.

    Runs on each rank of the default group (pp = world size / dp), or in this process with
    pp = 1 when no group is initialized. With dp > 1 the stages are sharded by FSDP2 over
    the dp axis, each replica runs its rows of every micro-batch, and the loss sums are
    added over the replicas before they are compared. Asserts: ``ce_sum`` and
    ``num_tokens`` equal, the aux loss and its terms within `loss_tol` relative, every
    gradient of the rank's parameters within `grad_tol` relative (norm), no gradient on
    parameters of other ranks' stages, every parameter on exactly one rank of a pipeline,
    and each (chunk, micro-batch)'s weight gradients flushed exactly once, none empty. A
    second step from zeroed gradients must give the same gradients again (nothing carried
    over between steps).

    Args:
        model_config: an mt-models family config (built fp32 on the CPU).
        num_micro_batches: micro-batches of the step (>= 2·pp).
        rows: sequences per micro-batch.
        seq_len: tokens per sequence.
        seed: seeds weights and data.
        grad_tol: bound on each gradient's relative error (norm).
        loss_tol: bound on the relative error of ce_sum, aux_loss and its terms.
        packed: two documents per row (per-document positions [B, S]).
        device: "cpu", or "cuda" for this rank's current GPU (spawn sets it per rank);
            both models and the batch live there, comparisons are made on the CPU.
        dp: data-parallel replicas (rows must divide by dp·ep).
        ep: expert-parallel ranks: each (dp, ep) pipeline holds a slice of every layer's
            experts (sharded on the meta device, as mt-train's pretrain builds them) and
            reads its own rows; its expert gradients are compared with the reference's
            slice.
        cp: context-parallel ranks: each pipeline holds zigzag chunks of every sequence
            (context-parallel attention swapped in on the meta device); not with packed.

    Returns:
        The worst relative errors seen.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    pp = world // (dp * cp * ep)
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    group, dp_group, reducer, dp_rank, ep_rank, cp_rank = None, None, None, 0, 0, 0
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dp * cp * ep > 1:
        dims = ParallelDims(world_size=world, pp=pp, dp=dp, cp=cp, ep=ep)
        mesh = build_mesh(dims, torch.device(device).type)
        rank, dp_rank, ep_rank = mesh.rank("pp"), mesh.batch_rank, mesh.rank("ep")
        cp_rank = mesh.rank("cp")
        group, dp_group = mesh.group("pp"), mesh.group("dp_cp_ep")  # ranks of distinct tokens
        reducer = router_stats_reducer(mesh)
    mbs = _micro_batches(model_config.vocab_size, num_micro_batches, rows, seq_len, seed, packed)
    mbs = [_to(mb, device) for mb in mbs]
    num_tokens = sum(int((mb.labels != -100).sum()) for mb in mbs)
    reference = _build(model_config, seed, device)
    want = run_microbatches(reference, mbs, num_tokens)
    if ep * cp > 1:  # experts or sequences sliced on the meta device, stages materialized alone
        assert not (packed and cp > 1), "context parallelism masks by global position only"
        with torch.device("meta"):
            model = build_model(model_config)
        if ep > 1:
            apply_expert_parallel(model, mesh.group("ep"), async_comm=False)
        if cp > 1:
            apply_context_parallel(model, mesh.group("cp"))
        stages = split_for_dualpipev(model, rank, pp)
        apply_fsdp_to_stages(stages, mesh)
        for stage in stages:
            stage.to_empty(device=device)
        model.init_weights(seed, skip_meta=True)
    else:
        model = _build(model_config, seed, device)
        stages = split_for_dualpipev(model, rank, pp)
        if dp > 1:
            apply_fsdp_to_stages(stages, mesh)
    executor = DualPipeVExecutor(stages, rank, pp, group, stats_reducer=reducer)
    mine_mbs = [_rows(mb, dp_rank, dp * ep) for mb in mbs]
    if cp > 1:
        mine_mbs = [_zigzag(mb, cp, cp_rank) for mb in mine_mbs]
    where = f"rank {rank} of pp={pp}"
    if dp * cp * ep > 1:
        where += f", batch rank {dp_rank} of dp*ep={dp * ep}, cp rank {cp_rank} of {cp}"
    worst = {"loss": 0.0, "aux": 0.0, "grad": 0.0}
    ref_params = dict(reference.named_parameters())
    mine = dict(rank_parameters(stages))
    first: dict[str, torch.Tensor] = {}
    for step in range(2):
        got = executor.step(mine_mbs, num_tokens)
        if dp * cp * ep > 1:  # each pipeline's sums: added up
            sums = torch.stack([got.ce_sum.double(), got.num_tokens.double()])
            dist.all_reduce(sums, group=dp_group)
            got = dataclasses.replace(got, ce_sum=sums[0], num_tokens=sums[1].round().long())
        assert int(got.num_tokens) == int(want.num_tokens) == num_tokens, (where, got, want)
        worst["loss"] = max(worst["loss"], rel_err(got.ce_sum.cpu(), want.ce_sum.cpu()))
        assert worst["loss"] <= loss_tol, f"{where}: ce_sum {got.ce_sum} vs {want.ce_sum}"
        assert float(want.aux_loss) > 0, f"{where}: the reference's aux loss is 0"
        worst["aux"] = max(worst["aux"], rel_err(got.aux_loss.cpu(), want.aux_loss.cpu()))
        assert worst["aux"] <= loss_tol, f"{where}: aux_loss {got.aux_loss} vs {want.aux_loss}"
        assert got.losses.keys() == want.losses.keys(), (got.losses, want.losses)
        for name, value in got.losses.items():
            err = abs(value - want.losses[name]) / max(abs(want.losses[name]), 1e-30)
            assert err <= loss_tol, f"{where}: {name} {value} vs {want.losses[name]}"
        flushed = sorted((c, m) for c, m, _ in executor.weight_flushes)
        every = [(c, m) for c in (0, 1) for m in range(num_micro_batches)]
        assert flushed == every, f"{where}: W ran for {flushed}, expected each of {every} once"
        # Every linear the stage calls defers its dW: attention and dense-MLP projections
        # and the experts' grouped linears (the head's weight is read by the fused
        # cross-entropy, not called; router, norms and embedding get theirs at B).
        deferrable = [sum(hasattr(m, "wgrad_queue") and name != "lm_head"
                          for name, m in stage.named_modules()) for stage in stages]  # fmt: skip
        wrong = [(c, m, n) for c, m, n in executor.weight_flushes if n != deferrable[c]]
        assert not wrong, f"{where}: W flushed (chunk, mb, count) {wrong}, not {deferrable}"
        for name, param in sorted(mine.items()):  # (one order: gathering shards is collective)
            assert param.grad is not None, f"{where}: {name} has no gradient"
            grad = _whole(param.grad)
            want_grad = ref_params[name].grad.cpu()
            if grad.shape != want_grad.shape:  # this pipeline's slice of the experts
                local = grad.shape[0]
                want_grad = want_grad[ep_rank * local : (ep_rank + 1) * local]
            if step == 0:
                err = rel_err(grad, want_grad)
                worst["grad"] = max(worst["grad"], err)
                assert err <= grad_tol, f"{where}: gradient of {name} differs by {err:.2e}"
                first[name] = grad
            else:
                assert torch.equal(grad, first[name]), f"{where}: step 2 {name} differs"
            param.grad = None
    others = [n for n, p in model.named_parameters() if n not in mine and p.grad is not None]
    assert not others, f"{where}: parameters of other ranks' stages got gradients: {others}"
    names = [None] * pp
    if dist.is_initialized():
        dist.all_gather_object(names, sorted(mine), group=group)
    else:
        names = [sorted(mine)]
    held = [n for rank_names in names for n in rank_names]
    assert sorted(held) == sorted(ref_params), f"{where}: parameters held by the ranks {held}"
    return worst


def check_dualpipev_cases(
    cases: list[tuple[Any, dict[str, Any]]], *, untagged: bool = False
) -> None:
    """Runs :func:`compare_dualpipev` for each (model config, keyword arguments) in turn.

    Args:
        cases: (model config, keyword arguments of :func:`compare_dualpipev`).
        untagged: run every point-to-point operation with tag 0 (:func:`zero_tags`), and
            assert that the executor sent and received through them.
    """
    with zero_tags() if untagged else contextlib.nullcontext([]) as given:
        for model_config, kwargs in cases:
            worst = compare_dualpipev(model_config, **kwargs)
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"dualpipev worst errors {worst}, tags given {sorted(set(given))}")
    if untagged and dist.is_initialized() and dist.get_world_size() > 1:
        assert given, f"rank {dist.get_rank()}: no point-to-point operation ran"
