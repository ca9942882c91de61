"""FSDP2 applied from outside the model, with the reductions that keep gradients exact.

Experts are sharded over the (dp, cp) mesh, everything else over (dp, cp, ep). Every
gradient reduction *sums* (FSDP2's divide factor set to 1): each rank's loss is already
its share of the global-batch mean (the summed token losses divided by the number of
labelled tokens in the whole step), so the sum over ranks is the single-device gradient
of that mean, for expert and non-expert parameters alike (ARCHITECTURE.md §5).

Under DualPipeV (:func:`apply_fsdp_to_stages`) each of a rank's two stages is a root of
its own. A pipeline step runs many backward passes, and the weight gradients of the
deferrable linears arrive after them (zero bubble), so the reduction is held for the
whole step (:func:`hold_gradient_reduction`: gradients accumulate unsharded, in FSDP2's
accumulator, and the parameters stay gathered after each backward) and run once at its end
(:func:`reduce_held_gradients`), as ``torch.distributed.pipelining`` does for its
zero-bubble schedules: FSDP2 has no public call for "reduce now", so both reach into the
same state that pipelining's stage does. After each flush of deferred weight gradients,
:func:`fold_held_gradients` moves them into FSDP2's accumulator (fp32 under mixed
precision), as a backward pass would.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from mt_models.layers.experts import GroupedExperts
from mt_parallel.mesh import ParallelMesh


def apply_fsdp(
    model: nn.Module,
    mesh: ParallelMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
) -> None:
    """Shards a model with FSDP2 (on the meta device or materialized): experts, then each
    layer, then the root.

    Args:
        model: an mt-models causal LM (after expert parallelism, if any).
        mesh: the run's mesh.
        param_dtype: dtype the gathered parameters are computed in (None: as stored,
            e.g. bf16 on GPU with fp32 master weights).
        reduce_dtype: dtype of gradient reduction.
        reshard_after_forward: free gathered layer parameters after forward (ZeRO-3);
            False keeps them until backward (ZeRO-2-like, more memory, less traffic).
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for module in list(model.modules()):
        if isinstance(module, GroupedExperts):
            _shard_experts(module, mesh, policy, reshard_after_forward)
    for layer in _decoder_layers(model):
        fully_shard(
            layer, mesh=mesh.dense, mp_policy=policy, reshard_after_forward=reshard_after_forward
        )
    fully_shard(model, mesh=mesh.dense, mp_policy=policy, reshard_after_forward=False)
    _sum_reductions(model)


def _shard_experts(
    module: GroupedExperts, mesh: ParallelMesh, policy: MixedPrecisionPolicy,
    reshard_after_forward: bool,
) -> None:  # fmt: skip
    fully_shard(
        module, mesh=mesh.expert, mp_policy=policy, reshard_after_forward=reshard_after_forward
    )
    if hasattr(module, "forward_tokens"):  # the local dispatcher's fused entry
        register_fsdp_forward_method(module, "forward_tokens")


def _sum_reductions(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def apply_fsdp_to_stages(
    stages: tuple[nn.Module, nn.Module],
    mesh: ParallelMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
) -> None:
    """Shards a pipeline rank's two DualPipeV stages (``split_for_dualpipev``, which made
    their linears deferrable: FSDP2 records the modules that own each parameter, so none
    may be swapped afterwards): experts, then each decoder layer, then each stage as a
    root of its own (its embedding, final norm and head).

    Args:
        stages: the rank's (chunk 0, chunk 1), on the meta device (materialized and
            initialized afterwards, as ``parallelize`` does) or materialized.
        mesh: the run's mesh (its pp axis separates the pipelines; the others shard).
        param_dtype, reduce_dtype, reshard_after_forward: as for :func:`apply_fsdp`.
    """
    shared = {id(p) for p in stages[0].parameters()} & {id(p) for p in stages[1].parameters()}
    if shared:
        names = [n for n, p in stages[1].named_parameters() if id(p) in shared]
        raise ValueError(
            f"both stages of this rank hold {names} (tied input and output embeddings, "
            "which put stage 0 and the last stage on pipeline rank 0): FSDP2 cannot shard "
            "one parameter under two roots; use an untied model (tie_word_embeddings=False), "
            "or leave the pipeline's stages unsharded (dp = cp = ep = 1)"
        )
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for stage in stages:
        for module in list(stage.modules()):
            if isinstance(module, GroupedExperts):
                _shard_experts(module, mesh, policy, reshard_after_forward)
        for layer in stage.model.layers.values():
            fully_shard(
                layer, mesh=mesh.dense, mp_policy=policy,
                reshard_after_forward=reshard_after_forward,
            )
        fully_shard(stage, mesh=mesh.dense, mp_policy=policy, reshard_after_forward=False)
        _sum_reductions(stage)


def fsdp_param_dtype(module: nn.Module) -> torch.dtype | None:
    """The ``param_dtype`` of `module`'s FSDP2 mixed precision (None: not an FSDP2 root, or
    computing in the stored dtype)."""
    if not isinstance(module, FSDPModule):
        return None
    return fully_shard.state(module)._mp_policy.param_dtype


def hold_gradient_reduction(root: FSDPModule) -> None:
    """Until :func:`reduce_held_gradients`, the backward passes through `root` (an FSDP2
    root and everything sharded under it) accumulate unsharded gradients and leave the
    parameters gathered (a later forward may still reshard a layer that reshards after
    forward), reducing nothing."""
    root.set_is_last_backward(False)
    root.set_reshard_after_backward(False)
    root.set_requires_gradient_sync(False)


def fold_held_gradients(root: FSDPModule) -> None:
    """Moves the gradients written into `root`'s gathered parameters' ``.grad`` since the
    last backward pass (by deferred weight-gradient GEMMs) into FSDP2's accumulator, in the
    reduce dtype, as a backward pass under :func:`hold_gradient_reduction` does. Without it,
    consecutive flushes with no backward between them (DualPipeV at pp >= 3) would add up
    in the parameters' dtype, bf16 under mixed precision, before the fp32 accumulator."""
    for state in fully_shard.state(root)._state_ctx.all_states:
        if state._fsdp_param_group:
            for fsdp_param in state._fsdp_param_group.fsdp_params:
                fsdp_param.accumulate_unsharded_grad_if_needed()
                fsdp_param.to_accumulated_grad_if_needed()


def reduce_held_gradients(root: FSDPModule) -> None:
    """Reduce-scatters every gradient accumulated under `root` since
    :func:`hold_gradient_reduction` (those the backward passes left and those written
    later, by deferred weight-gradient GEMMs, into the gathered parameters' ``.grad``) into
    the sharded parameters' ``.grad``, and reshards the parameters. A collective over the
    root's mesh: every rank holding a shard of it must call it, in the same order."""
    root.set_is_last_backward(True)
    root.set_reshard_after_backward(True)
    root.set_requires_gradient_sync(True)
    state = fully_shard.state(root)
    for each in state._state_ctx.all_states:
        if each._fsdp_param_group:
            each._fsdp_param_group.post_backward()
    state._root_post_backward_final_callback()


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no model.layers; apply_fsdp expects an mt-models "
            "causal LM"
        )
    return list(layers)
