"""FSDP2 applied from outside the model, with the reductions that keep gradients exact.

Experts are sharded over the (dp, cp) mesh, everything else over (dp, cp, ep). Every
gradient reduction *sums* (FSDP2's divide factor set to 1): each rank's loss is already
its share of the global-batch mean (the summed token losses divided by the number of
labelled tokens in the whole step), so the sum over ranks is the single-device gradient
of that mean, for expert and non-expert parameters alike (ARCHITECTURE.md §5).
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
            fully_shard(
                module, mesh=mesh.expert, mp_policy=policy,
                reshard_after_forward=reshard_after_forward,
            )
            if hasattr(module, "forward_tokens"):  # the local dispatcher's fused entry
                register_fsdp_forward_method(module, "forward_tokens")
    for layer in _decoder_layers(model):
        fully_shard(
            layer, mesh=mesh.dense, mp_policy=policy, reshard_after_forward=reshard_after_forward
        )
    fully_shard(model, mesh=mesh.dense, mp_policy=policy, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no model.layers; apply_fsdp expects an mt-models "
            "causal LM"
        )
    return list(layers)
