"""Turning a plain mt-models model into a (dp, cp, ep)-parallel one, and slicing batches.

Order (ARCHITECTURE.md §3, §5): build on meta → give each EP rank its experts and an
expert-parallel dispatcher → swap in the context-parallel attention core → FSDP2 (on
meta) → materialize the shards → `init_weights(seed)` (a function of the seed and the
canonical names alone, drawn whole and cut to each rank's shard, so every layout starts
from the one-process weights and no rank holds the unsharded model).

Batches: a step's global batch is split into micro-batches of `micro_batch` sequences
counted over all dp·ep batch ranks; batch rank b takes rows [b·m, (b+1)·m) of each
micro-batch (m = micro_batch / (dp·ep)), and each CP rank its zigzag columns. So a
micro-batch holds the same sequences whatever the layout, and so does each
load-balancing loss computed over it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from mt_models.layers.experts import GroupedExperts
from mt_parallel.context_parallel import ContextParallelAttention, split_sample, zigzag_ranges
from mt_parallel.dims import ParallelDims, check_cp_divides_seq_len, check_ep_divides_experts
from mt_parallel.expert_parallel import apply_expert_parallel
from mt_parallel.fsdp import apply_fsdp
from mt_parallel.mesh import ParallelMesh, build_mesh
from mt_parallel.stats import router_stats_reducer


def apply_context_parallel(model: nn.Module, group) -> int:
    """Swaps every attention module's core for the context-parallel one.

    Returns:
        The number of attention cores swapped.
    """
    swapped = 0
    core = ContextParallelAttention(group)  # shared: it checks each micro-batch's positions once
    for module in model.modules():
        if hasattr(module, "attention_core"):
            module.attention_core = core
            swapped += 1
    if not swapped:
        raise ValueError(
            f"{type(model).__name__} has no attention_core to swap; context parallelism "
            "needs mt-models attention modules"
        )
    return swapped


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    device: str | torch.device,
    *,
    seed: int,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    ep_async: bool = True,
) -> ParallelMesh:
    """Applies expert, context and FSDP2 parallelism to a meta-device model, in place.

    Needs an initialized default process group of `dims.world_size` ranks.

    Args:
        model: an mt-models causal LM built under `torch.device("meta")`.
        dims: the layout (pp must be 1 here).
        device: where parameters live ("cpu", "cuda" or a cuda device).
        seed: the run's seed for `init_weights`.
        param_dtype: compute dtype of gathered parameters (FSDP mixed precision).
        reduce_dtype: dtype of gradient reductions.
        reshard_after_forward: FSDP2's reshard policy for decoder layers and experts.
        ep_async: asynchronous expert-parallel all-to-alls (a side CUDA stream on GPU);
            False keeps the synchronous dispatch.

    Returns:
        The mesh, whose groups the caller uses for reductions and data slicing.
    """
    if dims.pp != 1:
        raise ValueError(f"parallel.pp ({dims.pp}) > 1 needs the pipeline schedule; use pp=1")
    # Materializing with to_empty and init_weights below overwrites whatever a parameter
    # holds: a loaded model would lose its weights without a word.
    for name, param in model.named_parameters():
        if param.device.type != "meta":
            raise ValueError(
                f"parallelize needs a model built under torch.device('meta'), but {name} is "
                f"on {param.device}: its values would be overwritten by init_weights({seed}); "
                "build the model on meta, parallelize it, then load weights into it "
                "(mt_models.load_hf_into, or a checkpoint)"
            )
    # Checked here, where the world is known, so the sizes named fit it too (the check of
    # apply_expert_parallel names every divisor of the experts, ep=2 on 3 ranks included).
    for num_experts in {m.num_experts for m in model.modules() if isinstance(m, GroupedExperts)}:
        check_ep_divides_experts(dims.ep, num_experts, dims.batch_ranks)  # dp * ep
    device = torch.device(device)
    mesh = build_mesh(dims, device.type)
    if dims.ep > 1:
        apply_expert_parallel(model, mesh.group("ep"), async_comm=ep_async)
    if dims.cp > 1:
        apply_context_parallel(model, mesh.group("cp"))
    if hasattr(model, "router_stats_reducer"):
        model.router_stats_reducer = router_stats_reducer(mesh)
    apply_fsdp(
        model,
        mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward,
    )
    # Sharded while still on the meta device, then materialized and initialized shard by
    # shard: no rank ever holds the unsharded model.
    model.to_empty(device=device)
    model.init_weights(seed)
    return mesh


def _micro_batch_sizes_that_fit(global_batch: int, ranks: int) -> str:
    fits = [m for m in range(ranks, global_batch + 1, ranks) if global_batch % m == 0]
    if fits:
        return f"use one of {fits[:6]}"
    return f"no micro-batch size fits: make training.global_batch_size a multiple of {ranks}"


def check_batch_split(global_batch: int, micro_batch: int, dims: ParallelDims) -> None:
    """Raises ValueError unless the batch splits into micro-batches and batch ranks."""
    if global_batch < 1 or micro_batch < 1:
        raise ValueError(
            f"training.global_batch_size ({global_batch}) and training.micro_batch_size "
            f"({micro_batch}) must be >= 1"
        )
    ranks = dims.batch_ranks
    if global_batch % micro_batch:
        raise ValueError(
            f"training.micro_batch_size ({micro_batch}) must divide "
            f"training.global_batch_size ({global_batch}); "
            + _micro_batch_sizes_that_fit(global_batch, ranks)
        )
    if micro_batch % ranks:
        hint = _micro_batch_sizes_that_fit(global_batch, ranks)
        raise ValueError(
            f"training.micro_batch_size ({micro_batch}) counts sequences over all dp*ep "
            f"({dims.dp}*{dims.ep}={ranks}) batch ranks and must be a multiple of it "
            f"that divides training.global_batch_size ({global_batch}); {hint}"
        )


def rank_batch_slices(
    tokens: Tensor, micro_batch: int, dims: ParallelDims, batch_rank: int, cp_rank: int
) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor | None]]:
    """Yields this rank's part of each micro-batch of a global batch.

    Args:
        tokens: the global batch, int64 [G, S+1].
        micro_batch: sequences per micro-batch over all batch ranks.
        dims: the layout.
        batch_rank: index among the dp·ep batch ranks.
        cp_rank: index in the CP group.

    Yields:
        `(rows [m, S+1], inputs [m, L], labels [m, L], positions [L] or None)` with
        m = micro_batch / (dp·ep) and L = S / cp; positions are None without CP.
    """
    check_batch_split(tokens.shape[0], micro_batch, dims)
    if not 0 <= batch_rank < dims.batch_ranks:
        raise ValueError(
            f"batch_rank ({batch_rank}) must be in [0, dp*ep={dims.batch_ranks}); pass "
            "ParallelMesh.batch_rank, not the global rank"
        )
    per_rank = micro_batch // dims.batch_ranks
    seq_len = tokens.shape[1] - 1
    if dims.cp > 1:  # here, where the world is known, so the cp sizes named fit it too
        check_cp_divides_seq_len(dims.cp, seq_len, dims.dp * dims.cp)
    for start in range(0, tokens.shape[0], micro_batch):
        rows = tokens[start + batch_rank * per_rank : start + (batch_rank + 1) * per_rank]
        if dims.cp > 1:
            inputs, labels, positions = split_sample(rows, zigzag_ranges(seq_len, dims.cp, cp_rank))
            yield rows, inputs, labels, positions
        else:
            yield rows, rows[:, :-1], rows[:, 1:], None
