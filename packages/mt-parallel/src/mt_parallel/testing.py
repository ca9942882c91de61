"""Helpers for checking parallel runs against one process (used by tests and tools).

`spawn(fn, world_size, *args)` runs `fn(*args)` in `world_size` fresh processes joined
by a gloo process group, as torchrun would on CPU. `compare_layout` builds the same
model twice, once whole in this process and once under a (dp, cp, ep) layout, feeds both
the same global batch and asserts identical routing, loss and every gradient.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from mt_models import build_model
from mt_parallel.context_parallel import zigzag_positions
from mt_parallel.dims import ParallelDims
from mt_parallel.expert_parallel import apply_expert_parallel
from mt_parallel.grad_norm import clip_grad_norm
from mt_parallel.parallelize import parallelize, rank_batch_slices
from mt_parallel.schedule import MicroBatch, run_microbatches

NEAR_TIE_EXIT = 3  # exit status of an NCCL rank that stopped on a RoutingNearTie


class RoutingNearTie(AssertionError):
    """A layout routed some token to other experts than one process did: a router near-tie
    flipped under a different summation order, which invalidates the comparison of this
    data (not a parallelism bug unless it happens for every seed)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple, kwargs: dict
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(*args, **kwargs)
    except BaseException as err:
        if backend == "nccl":
            # A peer may be blocked in a collective this rank will never join; tearing
            # NCCL down would wait for it (until the 10-minute watchdog). Report and leave:
            # spawn then stops the other ranks.
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(NEAR_TIE_EXIT if isinstance(err, RoutingNearTie) else 1)
        dist.destroy_process_group()
        raise
    # Every rank is done with the store (rank 0 serves it) before any leaves, and then
    # leaves without the interpreter's teardown: there, with gloo, a C++ thread of the
    # destroyed groups sometimes aborted the process ("terminate called without an active
    # exception", SIGABRT, no Python frame; 1-2 runs in 10 of a spawned gloo test here,
    # after every check had passed). Nothing is left to run after a successful `fn`.
    try:
        dist.barrier()
    except Exception as err:
        if not dist.is_initialized():  # fn destroyed the group: not a peer's failure
            raise
        # A peer failed and left ('Connection closed by peer'): its own error is the one
        # spawn must report, and an error of this rank, which passed, could come first.
        print(f"rank {rank} passed; a peer left before the final barrier ({err})", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(
    fn: Callable, world_size: int, *args: Any, backend: str = "gloo",
    timeout_s: float | None = None, **kwargs: Any,
) -> None:  # fmt: skip
    """Runs `fn(*args, **kwargs)` on `world_size` spawned processes (gloo: CPU, nccl: GPUs).

    An exception on any rank fails the call with that rank's traceback. Under NCCL the
    failing rank prints it and exits (status `NEAR_TIE_EXIT` for a `RoutingNearTie`), and
    the call raises `torch.multiprocessing.ProcessExitedException`.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of processes.
        *args: picklable arguments.
        backend: "gloo" or "nccl" (rank i then runs on GPU i).
        timeout_s: seconds the ranks may run (None: no limit); past it they are killed and
            a TimeoutError is raised, so a hang (ranks waiting on messages that never
            come) fails the test instead of stalling it.
        **kwargs: picklable keyword arguments.
    """
    context = mp.spawn(
        _entry,
        args=(world_size, _free_port(), backend, fn, args, kwargs),
        nprocs=world_size,
        join=False,
    )
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not context.join(None if deadline is None else max(deadline - time.monotonic(), 0)):
        if deadline is not None and time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
            raise TimeoutError(
                f"spawn({getattr(fn, '__name__', fn)}, {world_size}) was still running after "
                f"timeout_s={timeout_s} s and was killed: a hang (a rank waiting on a message "
                "that never comes?) or too small a timeout_s"
            )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    denom = b.norm()
    return float((a - b).norm() / denom) if denom > 0 else float((a - b).norm())


@dataclass
class _Run:
    losses: list[float]
    grads: dict[str, torch.Tensor]  # canonical name -> first step's gradient
    topk: list[torch.Tensor]  # per (micro-batch, MoE layer): top-k ids of this rank's tokens
    reduce_scatters: list[tuple[int, int]]  # per step: (micro-batches, reduce-scatter calls)


def _record_topk(model: nn.Module, sink: list) -> list:
    handles = []
    for module in model.modules():
        if type(module).__name__.endswith("Router") and hasattr(module, "topk"):
            handles.append(
                module.register_forward_hook(lambda m, i, out: sink.append(out.topk_ids_TK))
            )
    return handles


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        grads[name] = grad.detach().clone() if grad is not None else torch.zeros_like(param)
    return model.to_canonical(grads)


def _train(
    model: nn.Module, batches: list[torch.Tensor], micro: int, dims: ParallelDims | None,
    group: dist.ProcessGroup | None, batch_rank: int, cp_rank: int,
    grad_reduce: str = "microbatch",
) -> _Run:
    """Runs len(batches) AdamW steps; records losses, step-1 grads, routing and the
    reduce-scatters of each step."""
    # eps 1e-4, not 1e-8: g / (√v + eps) on gradient entries near eps turns last-bit
    # differences of another summation order into weight differences up to lr, and within
    # a few steps into flipped router near-ties (assert_same_routing).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    topk: list[torch.Tensor] = []
    handles = _record_topk(model, topk)
    run = _Run([], {}, topk, [])
    for step, tokens in enumerate(batches):
        global_tokens = tokens.shape[0] * (tokens.shape[1] - 1)
        mbs = []
        for rows, inputs, labels, positions in rank_batch_slices(
            tokens, micro, dims or ParallelDims(world_size=1), batch_rank, cp_rank
        ):
            del rows
            mbs.append(MicroBatch(inputs, labels, positions))
        calls = [0]
        reduce_scatter = dist.reduce_scatter_tensor

        def counted(*args, _inner=reduce_scatter, _calls=calls, **kwargs):
            _calls[0] += 1
            return _inner(*args, **kwargs)

        dist.reduce_scatter_tensor = counted  # FSDP2 reduces gradients through it
        try:
            result = run_microbatches(model, mbs, global_tokens, grad_reduce=grad_reduce)
        finally:
            dist.reduce_scatter_tensor = reduce_scatter
        run.reduce_scatters.append((len(mbs), calls[0]))
        ce = result.ce_sum.to(tokens.device)
        if group is not None:
            dist.all_reduce(ce, group=group)
        run.losses.append(float(ce) / global_tokens)
        if step == 0:
            run.grads = _full_grads(model)
        clip_grad_norm(model.parameters(), 1.0, group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for h in handles:
        h.remove()
    return run


def compare_layout(
    model_config: Any, layout: dict[str, int], *, seq_len: int, global_batch: int,
    micro_batch: int, steps: int = 5, seed: int = 0, tol: float = 1e-5,
    device: str = "cpu", force_expert_parallel: bool = False, ep_async: bool = True,
) -> dict[str, float]:
    """Asserts that a (dp, cp, ep) layout reproduces one process, on every rank.

    Args:
        model_config: an mt-models family config (fp32 CPU run).
        layout: {"dp": .., "cp": .., "ep": ..}; their product is the world size. An
            optional "grad_reduce" entry ("step") runs `run_microbatches` with it and
            also asserts one reduce-scatter per FSDP unit per step (a second step in the
            default mode must issue micro-batches times as many).
        seq_len: tokens per sequence.
        global_batch: sequences per step.
        micro_batch: sequences per micro-batch over all batch ranks.
        steps: training steps whose losses must track the reference.
        seed: seeds weights and data.
        tol: bound on relative loss error and on per-tensor relative gradient error.
        device: "cpu" (gloo) or "cuda" (NCCL; each rank on its own GPU).
        force_expert_parallel: use the expert-parallel dispatcher even when ep == 1
            (one GPU exercises its code path through NCCL that way).
        ep_async: asynchronous expert-parallel all-to-alls (False: synchronous).

    Returns:
        The worst errors seen (for reporting).
    """
    gen = torch.Generator().manual_seed(seed)
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    batches = [
        torch.randint(0, model_config.vocab_size, (global_batch, seq_len + 1), generator=gen)
        .to(device)
        for _ in range(steps)
    ]
    with torch.device("meta"):
        reference = build_model(model_config)
    reference.to_empty(device=device)
    reference.init_weights(seed)
    ref = _train(reference, batches, micro_batch, None, None, 0, 0)

    layout = dict(layout)
    grad_reduce = layout.pop("grad_reduce", "microbatch")
    dims = ParallelDims(world_size=dist.get_world_size(), **layout)
    with torch.device("meta"):
        model = build_model(model_config)
    if force_expert_parallel and dims.world_size == 1:
        apply_expert_parallel(model, dist.group.WORLD, async_comm=ep_async)
    mesh = parallelize(model, dims, device, seed=seed, ep_async=ep_async)
    group = mesh.group("dp_cp_ep")
    par = _train(model, batches, micro_batch, dims, group, mesh.batch_rank, mesh.rank("cp"),
                 grad_reduce)  # fmt: skip

    where = f"layout {layout}, rank {dist.get_rank()}"
    # Routing first: a flipped near-tie would explain any difference below.
    ref_topk = _rank_topk(ref.topk, dims, mesh.batch_rank, mesh.rank("cp"), micro_batch, seq_len)
    assert_same_routing(par.topk, ref_topk, f"layout {layout}")
    if grad_reduce == "step":
        per_microbatch = _train(model, batches[:1], micro_batch, dims, group, mesh.batch_rank,
                                mesh.rank("cp")).reduce_scatters[0]  # fmt: skip
        (micro, deferred) = par.reduce_scatters[0]
        assert micro > 1 and deferred > 0, f"{where}: {par.reduce_scatters=}"
        assert deferred * micro == per_microbatch[1], (
            f"{where}: {deferred} reduce-scatters per step with grad_reduce='step' over "
            f"{micro} micro-batches, {per_microbatch[1]} without"
        )
    worst = {"loss": 0.0, "grad": 0.0}
    assert par.grads, f"{where}: no gradients recorded"
    for name, grad in par.grads.items():
        err = rel_err(grad, ref.grads[name])
        worst["grad"] = max(worst["grad"], err)
        assert err <= tol, f"{where}: gradient of {name} differs by {err:.2e} (relative norm)"
    for step, (a, b) in enumerate(zip(par.losses, ref.losses, strict=True)):
        err = abs(a - b) / abs(b)
        worst["loss"] = max(worst["loss"], err)
        assert err <= tol, f"{where}: step {step + 1} loss {a} vs one process {b}"
    return worst


def assert_same_routing(par_topk: list[torch.Tensor], ref_topk: list[torch.Tensor],
                        where: str) -> None:
    """Asserts equal top-k ids in every router call, with one message on every rank.

    A collective over the default group: each rank finds its first differing call and
    all of them raise the same `RoutingNearTie`, naming each differing rank's call (a
    different number of router calls is a plain `AssertionError`). `spawn` reports
    whichever rank exits first, so a rank-local message would name a different call from
    run to run although the runs are bit-identical.

    Why near-ties flip at all: the parallel run sums in another order (last-bit
    differences), which AdamW's g / (√v + eps) with the default eps (1e-8) turned, on
    gradient entries of about eps, into weight differences up to lr: by step 3 or 4 the
    router logits of the two runs differed by 1e-2 and close top-k choices went the other
    way (GPT-OSS cp2, seed 3). With `_train`'s eps of 1e-4 the logits stay within about
    1e-6, so a flip is rare; it is a property of the seed, not of the run: change the seed.

    Args:
        par_topk: this rank's top-k ids of the parallel run, one [T, K] per router call.
        ref_topk: the reference's, cut to this rank's tokens (same order).
        where: the layout, for the message.
    """
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, len(par_topk))
    assert all(n == len(ref_topk) for n in counts), (
        f"{where}: router calls per rank {counts}, one process {len(ref_topk)}"
    )
    first = next((i for i, (a, b) in enumerate(zip(par_topk, ref_topk, strict=True))
                  if not torch.equal(a, b)), None)  # fmt: skip
    firsts: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(firsts, first)
    differing = {rank: call for rank, call in enumerate(firsts) if call is not None}
    if differing:
        raise RoutingNearTie(
            f"{where}: top-k routing differs from one process, first in router call "
            + ", ".join(f"{call} on rank {rank}" for rank, call in differing.items())
            + f" (of {len(ref_topk)} calls: steps x micro-batches x MoE layers); a near-tie "
            "flipped, try another seed"
        )


def _rank_topk(ref_topk, dims, batch_rank, cp_rank, micro, seq_len):
    """Cuts each reference router call down to this rank's rows and token positions."""
    rows_per_rank = micro // dims.batch_ranks
    # Without CP a rank holds every position, whatever the parity of seq_len.
    positions = zigzag_positions(seq_len, dims.cp, cp_rank) if dims.cp > 1 else slice(None)
    out = []
    for ids in ref_topk:  # one per (step, micro-batch, MoE layer), [micro·S, K]
        ids = ids.view(micro, seq_len, -1)
        rows = ids[batch_rank * rows_per_rank : (batch_rank + 1) * rows_per_rank]
        out.append(rows[:, positions].reshape(-1, ids.shape[-1]))
    return out


def check_many(cases: list[tuple[Any, list[dict[str, int]]]], **kwargs: Any) -> None:
    """Runs `compare_layout` for each (model config, layouts) case in turn (a `spawn` target).

    Args:
        cases: pairs of an mt-models family config and the layouts to check, each of
            the spawned world size.
        **kwargs: passed to `compare_layout`.
    """
    for model_config, layouts in cases:
        for layout in layouts:
            compare_layout(model_config, layout, **kwargs)


def check_routing_report_is_rank_independent(num_calls: int = 6) -> None:
    """Each rank's routing differs first at a different call (rank r at call 2 + r);
    `assert_same_routing` must raise the same message on every rank, naming all of them
    (a `spawn` target)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_topk = [torch.zeros(4, 2, dtype=torch.long) for _ in range(num_calls)]
    par_topk = [ids.clone() for ids in ref_topk]
    par_topk[2 + rank][0, 0] = 1
    try:
        assert_same_routing(par_topk, ref_topk, "layout {'cp': 2}")
    except AssertionError as error:
        message = str(error)
    else:
        raise AssertionError(f"rank {rank}: differing routing passed assert_same_routing")
    messages: list[str | None] = [None] * world
    dist.all_gather_object(messages, message)
    assert len(set(messages)) == 1, f"rank {rank}: messages differ by rank: {messages}"
    for r in range(world):
        assert f"{2 + r} on rank {r}" in message, f"rank {r} missing from: {message}"


def check_clip_grad_norm_over_sharded_grads(max_norm: float = 1.0) -> None:
    """`clip_grad_norm` over the world returns the norm of every gradient element, for a
    DTensor gradient sharded over the ranks beside a bf16 gradient distinct per rank (as
    an expert's is across ep), and scales each rank's part by max_norm / (total + 1e-6)
    (a `spawn` target)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(2 * world + 1, 5, generator=torch.Generator().manual_seed(0))
    own = [
        torch.randn(7, generator=torch.Generator().manual_seed(1 + r)).to(torch.bfloat16)
        for r in range(world)
    ]
    sharded = nn.Parameter(distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]))
    sharded.grad = distribute_tensor(full, mesh, [Shard(0)])
    expert = nn.Parameter(torch.zeros(7, dtype=torch.bfloat16))
    expert.grad = own[rank].clone()
    local = sharded.grad.to_local().clone()

    total = clip_grad_norm([sharded, expert], max_norm, dist.group.WORLD)

    ref = torch.cat([full.flatten().double()] + [g.double() for g in own]).norm().item()
    assert abs(total - ref) <= 1e-6 * ref, f"rank {rank}: {total=}, {ref=}"
    assert total > max_norm, f"{total=}, {max_norm=}: nothing was clipped"
    scale = max_norm / (total + 1e-6)
    assert torch.equal(sharded.grad.to_local(), local.mul_(scale)), f"rank {rank}: shard"
    assert torch.equal(expert.grad, own[rank].clone().mul_(scale)), f"rank {rank}: expert"


def check_clip_grad_norm_with_an_empty_rank(max_norm: float = 1.0) -> None:
    """`clip_grad_norm` on a rank holding no gradient (an EP rank without a group's
    experts: parameters without `.grad`, or none at all) joins the all-reduce with an fp64
    zero on the reduce device, and the other ranks get the one-process norm and clipping
    (a `spawn` target; rank 0 holds every gradient)."""
    rank = dist.get_rank()
    grads = [
        torch.randn(13, 7, generator=torch.Generator().manual_seed(11)),
        torch.randn(9, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16),
    ]
    ref_params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ref_params, grads, strict=True):
        p.grad = g.clone()
    ref = clip_grad_norm(ref_params, max_norm)  # one process: the reference
    if rank == 0:
        params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
    else:
        params = [nn.Parameter(torch.zeros(3))]  # no .grad
    reduced: list[torch.Tensor] = []
    all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        reduced.append(tensor)
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    try:
        for parameters in (params, params if rank == 0 else []):
            for p, g in zip(params, grads, strict=False):
                if p.grad is not None:
                    p.grad.copy_(g)
            total = clip_grad_norm(parameters, max_norm, dist.group.WORLD)
            assert total == ref, f"rank {rank}: {total=}, one process {ref=}"
            if rank == 0:
                for p, q in zip(params, ref_params, strict=True):
                    assert torch.equal(p.grad, q.grad), f"rank 0: {p.grad=} {q.grad=}"
    finally:
        dist.all_reduce = all_reduce
    want = torch.device("cpu")  # gloo's device, with or without gradients on the rank
    for t in reduced:
        assert (t.device, t.dtype) == (want, torch.float64), f"rank {rank}: {t.device=} {t.dtype=}"


def check_clip_grad_norm_over_ranks(max_norm: float = 1.0) -> None:
    """The spawn target of the `clip_grad_norm` checks, run in one process group: over
    sharded grads, then with a rank that holds none."""
    check_clip_grad_norm_over_sharded_grads(max_norm)
    check_clip_grad_norm_with_an_empty_rank(max_norm)


def check_dispatch_with_idle_rank(num_experts: int = 4, topk: int = 2, dim: int = 8) -> None:
    """EP dispatch → experts → combine equals the local dispatcher when every token picks
    experts of EP rank 0 only, so the other ranks receive zero tokens (a `spawn` target).

    Each rank routes its own tokens; its outputs and the gradients of its tokens, top-k
    weights and (its slice of) the expert weights must equal the local computation, with
    asynchronous and with synchronous all-to-alls.
    """
    from mt_models import LocalDispatcher, Routed
    from mt_ops import GroupedLinear
    from mt_parallel.expert_parallel import ExpertParallelDispatcher

    rank, world = dist.get_rank(), dist.get_world_size()
    local_experts = num_experts // world
    gen = torch.Generator().manual_seed(rank)
    tokens = 5 + rank
    hidden = torch.randn(tokens, dim, generator=gen)
    ids = torch.stack([torch.randperm(local_experts, generator=gen)[:topk] for _ in range(tokens)])
    weights = torch.rand(tokens, topk, generator=gen)
    full = GroupedLinear(num_experts, dim, dim)
    with torch.no_grad():
        full.weight.copy_(torch.randn(num_experts, dim, dim, generator=torch.Generator()))
    mine = GroupedLinear(local_experts, dim, dim)
    with torch.no_grad():
        mine.weight.copy_(full.weight[rank * local_experts : (rank + 1) * local_experts])

    def run(dispatcher, experts):
        h = hidden.clone().requires_grad_()
        w = weights.clone().requires_grad_()
        routed = Routed(hidden_TD=h, residual_TD=h, batch_shape=(1, tokens),
                        topk_ids_TK=ids, topk_weights_TK=w)
        rows, counts, handle = dispatcher.dispatch(routed)
        out = dispatcher.combine(experts(rows, counts), handle)
        out.square().sum().backward()
        return out.detach(), h.grad, w.grad

    ref_out, ref_h, ref_w = run(LocalDispatcher(num_experts), full)
    for async_comm in (True, False):
        mine.weight.grad = None
        out, grad_h, grad_w = run(
            ExpertParallelDispatcher(num_experts, dist.group.WORLD, async_comm=async_comm), mine
        )
        for name, a, b in (("output", out, ref_out), ("hidden grad", grad_h, ref_h),
                           ("weight grad", grad_w, ref_w)):
            err = rel_err(a, b)
            assert err <= 1e-6, f"rank {rank}, {async_comm=}: {name} differs by {err:.2e}"
    # Expert weights: rank 0's gradient collects every rank's tokens; the others none.
    summed = full.weight.grad.clone()
    dist.all_reduce(summed)
    expected = summed[rank * local_experts : (rank + 1) * local_experts]
    assert rel_err(mine.weight.grad, expected) <= 1e-6 or expected.norm() == 0
    if rank > 0:
        assert mine.weight.grad.norm() == 0, "an idle rank's experts must get zero gradient"


def check_fsdp_fused_experts_keep_router_weights(model_config: Any) -> None:
    """Under FSDP2 with bf16 compute, the local dispatcher's fused path (experts'
    ``forward_tokens``, registered with FSDP) gets the tokens in bf16 and the router
    weights as the router made them, and equals the dispatch → experts → combine phases
    (a `spawn` target)."""
    dims = ParallelDims(world_size=dist.get_world_size(), dp=dist.get_world_size())
    with torch.device("meta"):
        model = build_model(model_config)
    parallelize(model, dims, "cpu", seed=0, param_dtype=torch.bfloat16)
    layer = next(m for m in model.model.layers if m.dispatcher is not None)
    experts = layer.mlp.experts
    seen = []
    original = experts.forward_tokens

    def spy(hidden_TD, route):
        seen.append((hidden_TD.dtype, route.topk_weights_TK.dtype))
        return original(hidden_TD, route)

    experts.forward_tokens = spy
    x = torch.randn(2, 8, model_config.hidden_size, generator=torch.Generator().manual_seed(0))
    layer.unshard()  # the phases run outside the layer's forward (and its FSDP hooks)
    routed = layer.attend(x.bfloat16())
    weights_dtype = routed.topk_weights_TK.dtype
    fused = layer.dispatcher.run_experts(routed, experts)
    rows, counts, handle = layer.dispatcher.dispatch(routed)
    phases = layer.dispatcher.combine(experts(rows, counts), handle)
    assert seen == [(torch.bfloat16, weights_dtype)], (seen, weights_dtype)
    assert weights_dtype == torch.float32, "the router's weights are fp32"
    assert torch.equal(fused, phases), rel_err(fused.float(), phases.float())


def check_mesh_ranks_of_flattened_axes() -> None:
    """On 2 ranks, for each layout: `ParallelMesh.rank` of a flattened axis ("dp_ep",
    "dp_cp", "dp_cp_ep") is this rank's index in that axis's group, and no axis warns
    (slicing a flattened dim from the root mesh is deprecated) (a `spawn` target)."""
    import warnings

    from mt_parallel.mesh import build_mesh

    world = dist.get_world_size()
    for layout in ({"dp": world}, {"cp": world}, {"ep": world}):
        mesh = build_mesh(ParallelDims(world_size=world, **layout), "cpu")
        for axis in ("pp", "dp", "cp", "ep", "dp_cp", "dp_ep", "dp_cp_ep"):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                rank = mesh.rank(axis)
            assert rank == dist.get_rank(mesh.group(axis)), f"{layout} {axis}: {rank}"


def check_context_parallel_positions(seq_len: int = 8, window: int = 3) -> None:
    """Asserts, on each rank of a spawned CP group, that the context-parallel core gives the
    one-process attention of its zigzag queries for positions of one row [S] and of each
    row [B, S], and that missing positions fail with a ValueError naming them."""
    from mt_ops import attention
    from mt_parallel.context_parallel import ContextParallelAttention

    cp, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, seq_len, 8, generator=gen) for _ in range(3))  # [B, H, S, D]
    positions_S = zigzag_positions(seq_len, cp, rank)
    mine = (q[:, :, positions_S], k[:, :, positions_S], v[:, :, positions_S])
    core = ContextParallelAttention(dist.group.WORLD)
    expected = attention(q, k, v, causal=True, window=window)[:, :, positions_S]
    for positions in (positions_S, positions_S.expand(2, -1)):
        out = core(*mine, positions_S=positions, scale=None, window=window, sinks_H=None)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    try:
        core(*mine, positions_S=None, scale=None, window=window, sinks_H=None)
    except ValueError as err:
        assert "context parallelism needs position_ids" in str(err), str(err)
    else:
        raise AssertionError("positions_S=None did not raise")


def check_context_parallel_gather_leaves_shared_gradients_alone(seq_len: int = 6) -> None:
    """The key/value all-gather's backward gives each CP rank the sum over ranks of its
    chunk's gradient, and leaves the incoming gradient as it was: here it is also the
    gradient of another branch (`gathered + other` hands both the same tensor), which must
    come out as the one-process value (a `spawn` target)."""
    from mt_parallel.context_parallel import _GatherSeq

    cp, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    mine = torch.randn(2, 3, seq_len // cp, 4, generator=gen, requires_grad=True)
    leaf = torch.randn(2, 3, seq_len, 4, generator=gen, requires_grad=True)
    weight = torch.arange(float(seq_len * 4)).view(seq_len, 4)  # equal on every rank
    other = leaf * 2
    ((_GatherSeq.apply(mine, dist.group.WORLD) + other) * weight).sum().backward()
    assert torch.equal(leaf.grad, (2 * weight).expand_as(leaf)), f"rank {rank}: {leaf.grad=}"
    chunk = weight.chunk(cp, dim=0)[rank]  # every rank's loss reads this rank's keys
    assert torch.equal(mine.grad, (cp * chunk).expand_as(mine)), f"rank {rank}: {mine.grad=}"


def check_context_parallel_refuses_document_positions(seq_len: int = 8) -> None:
    """The context-parallel core refuses per-document positions of packed samples (its
    mask is by global position, so it would let documents see each other) with a
    ValueError naming document masking, on every rank, and takes consecutive global
    positions with an offset, in and out of inference mode (a spawned CP group)."""
    from mt_parallel.context_parallel import ContextParallelAttention

    cp, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, seq_len // cp, 8, generator=gen) for _ in range(3))
    core = ContextParallelAttention(dist.group.WORLD)
    mine = zigzag_positions(seq_len, cp, rank)
    core(q, k, v, positions_S=mine + 3, scale=None, window=None, sinks_H=None)
    documents = torch.arange(seq_len) % (seq_len // 2)  # two packed documents per row
    for inference in (False, True):  # inference tensors have no version counter
        with torch.inference_mode(inference):
            core(q, k, v, positions_S=mine.clone(), scale=None, window=None, sinks_H=None)
            for positions in (documents[mine], torch.stack([mine, documents[mine]])):
                try:
                    core(q, k, v, positions_S=positions, scale=None, window=None, sinks_H=None)
                except ValueError as err:
                    assert "document masking" in str(err) and "cp=1" in str(err), str(err)
                else:
                    raise AssertionError(f"rank {rank}: per-document positions {positions} passed")


def check_layout_errors_name_the_fix(model_config: Any = None) -> None:
    """On 3 ranks: `parallelize` with ep = 3 and 8 experts (naming only the ep sizes that
    also fit 3 ranks: 2, 4 and 8 do not), and with a layout of 4 ranks, raise ValueErrors
    naming the values and the sizes that fit (a `spawn` target)."""
    from mt_models import qwen3_moe

    model_config = model_config or qwen3_moe.debug()
    world = dist.get_world_size()
    cases = [
        (ParallelDims(world_size=world, ep=world),
         rf"parallel.ep \({world}\) must divide num_experts \(8\); choose one of \[1\] \(the "
         rf"divisors of 8 that also divide world_size / \(pp\*cp\) = {world}\)"),
        (ParallelDims(world_size=world + 1, ep=world + 1),
         rf"has {world} ranks but the layout expects {world + 1} \(pp\*dp\*cp\*ep = "
         rf"1\*1\*1\*{world + 1}\); launch {world + 1} processes, or build ParallelDims with "
         rf"world_size={world}"),
    ]  # fmt: skip
    for dims, pattern in cases:
        with torch.device("meta"):
            model = build_model(model_config)
        try:
            parallelize(model, dims, "cpu", seed=0)
        except ValueError as err:
            assert re.search(pattern, str(err)), f"{err} does not match {pattern}"
        else:
            raise AssertionError(f"{dims} did not raise")
