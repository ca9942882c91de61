"""Expert parallelism: each EP rank holds E/ep experts; tokens travel to them and back.

Legend: T tokens on this rank, D model dim, E experts of the layer, e = E/ep local
experts, K top-k, N token rows sent (one per (token, destination rank) pair), M rows
received, R routed rows on the expert side (one per (received row, local expert) pair).

dispatch (on the token's rank):
    1. For every token, the EP ranks that own at least one of its K experts
       (mt_ops.plan_dispatch with num_ranks). A token is
       sent once to each such rank, not once per expert (deduplication): N ≤ T·min(K, ep).
    2. all-to-all of the row counts (with the top-k choices each rank's rows carry for its
       experts, so the receiver knows R: one host sync per dispatch while K and ep are at
       most 16; past that plan_dispatch runs its eager reference, whose range check and
       bincount sync too), then of the rows, with their top-k ids and weights.
    3. On the expert rank: the received rows' choices of local experts are sorted by
       expert (mt_ops.plan_dispatch, choices of other ranks' experts go to a dropped
       bucket) and gathered into the grouped-GEMM layout.
combine (the reverse):
    4. On the expert rank: each received row's local expert outputs are weighted by
       their top-k weights and summed (pre-summed), so a row returns once per rank.
    5. all-to-all back; each token adds the partial sums of the ranks it visited.

Every step is differentiable: the all-to-all's backward is the all-to-all the other way.

Asynchronous mode (the default): the three dispatch all-to-alls (top-k ids, rows,
weights) are launched without waiting, in that order, on a side CUDA stream on GPU
(gloo's worker thread on CPU; either way they run one after another), and the
expert-side planning runs on the ids while the rows are still in flight; the compute
stream waits on an event only where it reads a received tensor. The combine's
all-to-all and every backward one are waited on at once, so they stay synchronous. The synchronous
mode (`async_comm=False`, `parallel.ep_comm=sync`) runs each all-to-all to completion
in turn on the compute stream; both give the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mt_models import Routed
from mt_models.dispatch import check_top_k
from mt_models.layers.experts import GroupedExperts
from mt_ops import DispatchPlan, permute, plan_dispatch, unpermute
from mt_parallel.dims import check_ep_divides_experts


def _exchange(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    """all_to_all_single of rows, synchronous on the current stream."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with autograd: the backward sends gradients back."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The EP communication stream of a CUDA device (one per device), None off GPU."""
    if device.type != "cuda":
        return None
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


class _Launched:
    """An all-to-all in flight: its output buffer and how to wait for it.

    GPU: the collective runs on the device's EP side stream (shared by every EP group and
    both directions), which first waits for the producer of x; an event marks its end.
    CPU: an asynchronous gloo op.
    """

    def __init__(self, x: Tensor, out_splits: list[int], in_splits: list[int], group):
        x = x.contiguous()
        # Allocated on the compute stream, which reads it (after `wait`).
        self.out = x.new_empty((sum(out_splits), *x.shape[1:]))
        self.stream = _side_stream(x.device)
        if self.stream is None:
            self.work = dist.all_to_all_single(
                self.out, x, out_splits, in_splits, group=group, async_op=True
            )
            return
        self.stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(self.stream):
            work = dist.all_to_all_single(
                self.out, x, out_splits, in_splits, group=group, async_op=True
            )
            work.wait()  # the side stream (not the host) waits for the collective
            self.event = torch.cuda.Event()
            self.event.record(self.stream)
        # The caching allocator must not reuse x or out before the side stream is done.
        x.record_stream(self.stream)
        self.out.record_stream(self.stream)

    def wait(self) -> Tensor:
        """Makes the current stream (CPU: the host) wait; returns the received rows."""
        if self.stream is None:
            self.work.wait()
        else:
            torch.cuda.current_stream(self.out.device).wait_event(self.event)
        return self.out


class _StartAllToAll(torch.autograd.Function):
    """Launches an all-to-all (`PendingAllToAll.wait` waits for it); the backward sends
    the gradient back synchronously: nothing in backward would overlap it."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits, in_splits, group, pending: PendingAllToAll):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        pending.launched = _Launched(x, out_splits, in_splits, group)
        return pending.launched.out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None, None


class PendingAllToAll:
    """A differentiable all-to-all in flight (from `start_all_to_all`)."""

    def __init__(self, x: Tensor, out_splits: list[int], in_splits: list[int], group):
        self.launched: _Launched | None = None
        self._out = _StartAllToAll.apply(x, out_splits, in_splits, group, self)

    def wait(self) -> Tensor:
        """Waits for the rows (the compute stream waits, not the host, on GPU).

        Returns:
            The received rows [sum(out_splits), ...], grouped by source rank.
        """
        self.launched.wait()
        return self._out


def start_all_to_all(
    x: Tensor, out_splits: list[int], in_splits: list[int], group
) -> PendingAllToAll:
    """Launches a differentiable all-to-all of rows without waiting for it.

    On GPU it runs on a side stream of the device; on CPU as an asynchronous gloo op.
    Its backward (the all-to-all the other way) is synchronous.

    Args:
        x: rows to send, grouped by destination rank [sum(in_splits), ...].
        out_splits: rows to receive from each rank.
        in_splits: rows to send to each rank.
        group: the process group.

    Returns:
        A handle whose `wait()` gives the received rows.
    """
    return PendingAllToAll(x, out_splits, in_splits, group)


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    """Differentiable all-to-all of rows: send `in_splits[r]` rows to rank r.

    Args:
        x: rows to send, grouped by destination rank [sum(in_splits), ...].
        out_splits: rows to receive from each rank.
        in_splits: rows to send to each rank.
        group: the process group.

    Returns:
        The received rows [sum(out_splits), ...], grouped by source rank.
    """
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass
class ExpertParallelHandle:
    """What `combine` needs to send expert outputs home.

    Attributes:
        plan: the expert-side routing plan of the received rows (with a dropped bucket).
        weights_MK: received top-k weights, zero where the expert is not local [M, K].
        num_routed: rows that reach a local expert (R).
        send_plan: the token-side plan over ranks: its first N rows are the sent rows,
            grouped by destination rank, then token.
        send_splits: rows sent to each EP rank.
        recv_splits: rows received from each EP rank.
        num_tokens: T.
    """

    plan: DispatchPlan
    weights_MK: Tensor
    num_routed: int
    send_plan: DispatchPlan
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int


class ExpertParallelDispatcher:
    """Dispatches tokens to the EP ranks that own their experts.

    Args:
        num_experts: E, experts of the layer over all EP ranks.
        group: the EP process group.
        async_comm: overlap the dispatch all-to-alls with each other and with the
            expert-side planning, on a side CUDA stream on GPU; False runs each
            all-to-all to completion in turn (the synchronous fallback).
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup, *, async_comm: bool = True):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        check_ep_divides_experts(self.ep, num_experts)
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep
        self.async_comm = async_comm

    def _send(self, x: Tensor, out_splits: list[int], in_splits: list[int]):
        """Starts an all-to-all; returns a zero-argument function giving its rows."""
        if self.async_comm:
            return start_all_to_all(x, out_splits, in_splits, self.group).wait
        out = all_to_all(x, out_splits, in_splits, self.group)
        return lambda: out

    def dispatch(self, routed: Routed) -> tuple[Tensor, Tensor, ExpertParallelHandle]:
        """Sends each token once to every EP rank that owns one of its experts.

        Args:
            routed: an MoE layer's `attend` output (global expert ids).

        Returns:
            `(tokens_RD, tokens_per_expert_e, handle)` for the local experts.
        """
        check_top_k(routed, "ExpertParallelDispatcher.dispatch")
        ids_TK, weights_TK = routed.topk_ids_TK, routed.topk_weights_TK
        num_tokens = ids_TK.shape[0]
        # The deduplicated send mask and per-rank counts come from mt-ops's planning kernels.
        source = plan_dispatch(ids_TK, self.num_experts, num_ranks=self.ep)
        # Per destination rank: the rows sent (deduplicated tokens) and the top-k choices
        # they carry for that rank's experts; a receiver's choices sum to its R.
        choices_P = source.tokens_per_expert_E.view(self.ep, self.num_local).sum(1)
        counts_P2 = torch.stack([source.tokens_per_rank_P.to(torch.int64), choices_P], 1)
        recv_counts_P2 = torch.empty_like(counts_P2)
        dist.all_to_all_single(recv_counts_P2, counts_P2, group=self.group)
        # The one host sync of a dispatch: the all-to-alls and the permute need sizes as ints.
        sizes = torch.cat([counts_P2[:, 0], recv_counts_P2[:, 0], recv_counts_P2[:, 1].sum()[None]])
        sizes = sizes.tolist()
        send_splits, recv_splits = sizes[: self.ep], sizes[self.ep : 2 * self.ep]
        num_routed = sizes[-1]
        # The send order (grouped by rank, then token) is a dispatch plan over ranks: slot
        # (t, p) holds p where token t visits rank p, else bucket P, sorted last and dropped.
        # permute then writes each sent row once, and combine's unpermute sums each token's
        # returned rows without atomics.
        rank_ids_TP = torch.arange(self.ep, device=ids_TK.device).expand(num_tokens, -1)
        rank_ids_TP = torch.where(source.token_to_rank_TP, rank_ids_TP, self.ep)
        send_plan = plan_dispatch(rank_ids_TP, self.ep + 1)
        num_sent = sum(send_splits)
        send_token_ids_N = send_plan.sorted_token_ids_R[:num_sent]

        # Ids first: the expert-side plan needs only them, so it overlaps the rows' trip
        # (the all-to-alls of one group run in turn, in launch order; weights are read last).
        ids_MK = self._send(ids_TK.index_select(0, send_token_ids_N), recv_splits, send_splits)
        x_MD = self._send(
            permute(routed.hidden_TD, send_plan, num_rows=num_sent), recv_splits, send_splits
        )
        weights_MK = self._send(
            weights_TK.index_select(0, send_token_ids_N), recv_splits, send_splits
        )

        local_MK = ids_MK() - self.ep_rank * self.num_local
        is_local_MK = (local_MK >= 0) & (local_MK < self.num_local)
        # Choices of other ranks' experts go to bucket e (= num_local), sorted last.
        local_MK = torch.where(is_local_MK, local_MK, self.num_local)
        plan = plan_dispatch(local_MK, self.num_local + 1)
        tokens_per_expert_e = plan.tokens_per_expert_E[: self.num_local]  # sums to num_routed
        # Only rows of local experts are written: the bucket of other ranks' choices (most of
        # the M·K rows once ep > 1) is dropped, and unpermute counts it as zero.
        tokens_RD = permute(x_MD(), plan, num_rows=num_routed)  # [R, D]
        weights = weights_MK()
        handle = ExpertParallelHandle(
            plan=plan,
            weights_MK=weights * is_local_MK.to(weights.dtype),
            num_routed=num_routed,
            send_plan=send_plan,
            send_splits=send_splits,
            recv_splits=recv_splits,
            num_tokens=num_tokens,
        )
        return tokens_RD, tokens_per_expert_e, handle

    def combine(self, expert_out_RD: Tensor, handle: ExpertParallelHandle) -> Tensor:
        """Pre-sums each row's local expert outputs, sends them home and adds them up.

        Args:
            expert_out_RD: local expert outputs in dispatch order [R, D].
            handle: from `dispatch`.

        Returns:
            `out_TD` [T, D]: each token's top-k weighted sum of expert outputs.
        """
        partial_MD = unpermute(
            expert_out_RD, handle.plan, handle.weights_MK, num_rows=handle.num_routed
        )  # [M, D]: other ranks' choices count as zero
        # Waited on at once, so nothing to overlap: the plain synchronous exchange.
        back_ND = all_to_all(partial_MD, handle.send_splits, handle.recv_splits, self.group)
        # Each token's rows from the ranks it visited, summed in fp32 in rank order (the
        # same bits every run); ranks it did not visit count as zero.
        ones_TP = back_ND.new_ones(handle.num_tokens, self.ep, dtype=torch.float32)
        out_TD = unpermute(back_ND, handle.send_plan, ones_TP, num_rows=back_ND.shape[0])
        return out_TD  # [T, D]


def _slice_experts(experts: GroupedExperts, first: int, count: int) -> None:
    """Keeps experts [first, first + count) of a (meta-device) GroupedExperts module."""
    total = experts.num_experts
    for module in experts.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            assert param.shape[0] == total, f"{name}: {tuple(param.shape)=}, {total=}"
            sliced = nn.Parameter(
                param.detach()[first : first + count].clone(), requires_grad=param.requires_grad
            )
            setattr(module, name, sliced)
        if hasattr(module, "num_experts"):
            module.num_experts = count
    experts.first_expert_id = experts.first_expert_id + first


def apply_expert_parallel(
    model: nn.Module, group: dist.ProcessGroup, *, async_comm: bool = True
) -> None:
    """Gives each EP rank its slice of every MoE layer's experts and an EP dispatcher.

    Call it on the meta-device model, before materializing and `init_weights` (which
    names experts by global id, so the weights equal those of one process).

    Args:
        model: an mt-models causal LM.
        group: the EP process group.
        async_comm: asynchronous all-to-alls (see `ExpertParallelDispatcher`).
    """
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    moe_layers = []  # (layer, its experts), all checked before the first slice
    for name, layer in model.named_modules():
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if not isinstance(experts, GroupedExperts) or getattr(layer, "dispatcher", None) is None:
            continue
        if isinstance(layer.dispatcher, ExpertParallelDispatcher):
            # Slicing again would cut this rank's experts to a slice of a slice.
            raise ValueError(
                f"{name!r} already has an expert-parallel dispatcher (its experts are this "
                f"rank's {experts.num_experts} of {layer.dispatcher.num_experts}); apply "
                "expert parallelism once, to a freshly built model"
            )
        check_ep_divides_experts(ep, experts.num_experts)
        moe_layers.append((layer, experts))
    for layer, experts in moe_layers:
        total = experts.num_experts
        local = total // ep
        _slice_experts(experts, rank * local, local)
        layer.dispatcher = ExpertParallelDispatcher(total, group, async_comm=async_comm)
