"""Grouped linear: one matmul per expert over that expert's consecutive rows.

Legend: R routed rows, D input dim, O output dim, E experts.

``y[rows of e] = x[rows of e] @ w[e].T (+ b[e])`` with ``w`` laid out [E, O, D] like
``nn.Linear.weight`` stacked over experts. Eager PyTorch loops over experts: E small
matmuls, E launches and a host sync to read the counts, which leaves the GPU idle for
small experts. A grouped GEMM runs all experts in one launch from device-side offsets.

The public op is an autograd function: on CUDA for bf16 with 16-byte aligned dims
(D and O multiples of 8) forward, input gradient and weight gradient are each one
``torch._grouped_mm`` (the weight gradient groups the contraction dim: ``dyᵀ x`` per
expert); elsewhere they are per-expert loops. The bias gradient is a segmented sum over
each expert's rows (``torch.segment_reduce``, no atomics). With a
:class:`~mt_ops.deferred_wgrad.WeightGradQueue` the weight gradient is deferred into it.

Outside autocast ``x``, ``w`` and ``bias`` must share a dtype, as for ``nn.Linear``. Under
``torch.autocast`` the op computes in the autocast dtype whatever their dtypes, and the
gradients come back in the parameters' dtypes.
"""

import torch
from torch import Tensor, nn

from mt_ops._counts import check_counts
from mt_ops._dtypes import autocast_dtype, check_same_dtype, compute_dtype, is_integer
from mt_ops.deferred_wgrad import WeightGradQueue, weight_grad_or_defer

__all__ = ["GroupedLinear", "grouped_linear", "grouped_linear_reference", "segment_sum"]

# torch._grouped_mm needs 16-byte aligned row strides: 8 bf16 elements.
_GROUPED_MM_ALIGN = 8


def _check_shapes(
    x_RD: Tensor,
    w_EOD: Tensor,
    tokens_per_expert_E: Tensor,
    bias_EO: Tensor | None = None,
    num_rows: int | None = None,
) -> list[int] | None:
    """Shapes, count dtype and (host counts only) their values; ``num_rows`` is what the
    counts sum to when x holds tokens rather than the routed rows (default R of x).
    Returns the host counts it checked, as a list; None for device counts."""
    if x_RD.dim() != 2 or w_EOD.dim() != 3 or x_RD.shape[1] != w_EOD.shape[2]:
        raise ValueError(
            f"x shape ({tuple(x_RD.shape)}) and w shape ({tuple(w_EOD.shape)}) must be "
            "[R, D] and [E, O, D]; stack expert weights as [E, out, in]"
        )
    if tokens_per_expert_E.shape != (w_EOD.shape[0],):
        raise ValueError(
            f"tokens_per_expert shape ({tuple(tokens_per_expert_E.shape)}) must be "
            f"[E] = [{w_EOD.shape[0]}]; pass one count per expert"
        )
    dtype = tokens_per_expert_E.dtype
    if not is_integer(dtype):
        raise ValueError(
            f"tokens_per_expert dtype ({dtype}) must be an integer type; pass the plan's "
            "tokens_per_expert_E (int64) or a torch.bincount of the expert ids"
        )
    if bias_EO is not None and bias_EO.shape != w_EOD.shape[:2]:
        raise ValueError(
            f"bias shape ({tuple(bias_EO.shape)}) must be [E, O] = {tuple(w_EOD.shape[:2])}"
        )
    if tokens_per_expert_E.device.type == "cpu":
        # Host counts cost no sync to check; device counts stay unchecked (the grouped GEMMs
        # read them on the device, and a check would stall the stream every call).
        rows = x_RD.shape[0] if num_rows is None else num_rows
        counts = tokens_per_expert_E.tolist()
        check_counts(counts, rows)
        return counts
    return None


def _check(
    x_RD: Tensor, w_EOD: Tensor, tokens_per_expert_E: Tensor, bias_EO: Tensor | None
) -> list[int] | None:
    """`_check_shapes` (its return value) and, outside autocast, one dtype for all."""
    counts = _check_shapes(x_RD, w_EOD, tokens_per_expert_E, bias_EO)
    # Under autocast grouped_linear casts x and w to the autocast dtype and the bias to the
    # output's, so only calls outside autocast need matching dtypes.
    check_same_dtype(("w", w_EOD), ("x", x_RD), ("bias", bias_EO))
    return counts


def _wide_counts(tokens_per_expert_E: Tensor) -> Tensor:
    """The counts as int32 / int64, the only integer types of repeat_interleave (the bias)
    and segment_reduce (its gradient); narrower integers are widened to int64."""
    if tokens_per_expert_E.dtype in (torch.int32, torch.int64):
        return tokens_per_expert_E
    return tokens_per_expert_E.long()


def _use_grouped_mm(x_RD: Tensor, w_EOD: Tensor) -> bool:
    return (
        x_RD.is_cuda
        and x_RD.dtype == torch.bfloat16
        and w_EOD.dtype == torch.bfloat16
        and x_RD.shape[1] % _GROUPED_MM_ALIGN == 0
        and w_EOD.shape[1] % _GROUPED_MM_ALIGN == 0
        and x_RD.shape[0] > 0
    )


def _offsets(tokens_per_expert_E: Tensor) -> Tensor:
    return torch.cumsum(tokens_per_expert_E, dim=0).to(torch.int32)  # [E], row ends


class _SplitSizes:
    """The counts as a list, for the per-expert loops: read from the device (a host sync)
    and checked at most once per op, however many loops (forward, input and weight
    gradients) split by them; host counts come already checked by `_check_shapes`."""

    def __init__(self, num_rows: int, checked: list[int] | None):
        self._num_rows = num_rows
        self._list = checked

    def get(self, tokens_per_expert_E: Tensor) -> list[int]:
        """The counts, read from `tokens_per_expert_E` and checked on the first call when on
        the device. The backward passes its saved counts (version-checked by autograd), not
        the caller's tensor, which may have been reused in place since the forward."""
        if self._list is None:
            counts = tokens_per_expert_E.tolist()  # host sync: the loop needs the split sizes
            check_counts(counts, self._num_rows)
            self._list = counts
        return self._list


def _forward(
    x_RD: Tensor, w_EOD: Tensor, tokens_per_expert_E: Tensor, sizes: _SplitSizes
) -> Tensor:
    if _use_grouped_mm(x_RD, w_EOD):
        offs = _offsets(tokens_per_expert_E)
        return torch._grouped_mm(x_RD, w_EOD.transpose(-2, -1), offs=offs)  # [R, O]
    split = torch.split(x_RD, sizes.get(tokens_per_expert_E))
    pieces = [x_e @ w_EOD[e].T for e, x_e in enumerate(split)]
    return torch.cat(pieces) if pieces else x_RD.new_zeros(x_RD.shape[0], w_EOD.shape[1])


def _input_grad(
    dy_RO: Tensor, w_EOD: Tensor, tokens_per_expert_E: Tensor, sizes: _SplitSizes
) -> Tensor:
    if _use_grouped_mm(dy_RO, w_EOD) and w_EOD.shape[2] % _GROUPED_MM_ALIGN == 0:
        return torch._grouped_mm(dy_RO, w_EOD, offs=_offsets(tokens_per_expert_E))  # [R, D]
    split = torch.split(dy_RO, sizes.get(tokens_per_expert_E))
    pieces = [g_e @ w_EOD[e] for e, g_e in enumerate(split)]
    return torch.cat(pieces) if pieces else dy_RO.new_zeros(dy_RO.shape[0], w_EOD.shape[2])


def _weight_grad(
    dy_RO: Tensor, x_RD: Tensor, tokens_per_expert_E: Tensor, w_EOD: Tensor, sizes: _SplitSizes
) -> Tensor:
    if _use_grouped_mm(x_RD, w_EOD) and dy_RO.shape[1] % _GROUPED_MM_ALIGN == 0:
        # Grouped over the contraction dim: dW[e] = dy[rows of e]ᵀ @ x[rows of e].
        offs = _offsets(tokens_per_expert_E)
        return torch._grouped_mm(dy_RO.T, x_RD, offs=offs)  # [E, O, D]
    grad_EOD = torch.zeros(w_EOD.shape, dtype=dy_RO.dtype, device=dy_RO.device)
    counts = sizes.get(tokens_per_expert_E)
    pairs = zip(torch.split(dy_RO, counts), torch.split(x_RD, counts), strict=True)
    for e, (g_e, x_e) in enumerate(pairs):
        if g_e.shape[0]:
            grad_EOD[e] = g_e.T @ x_e
    return grad_EOD


def segment_sum(t_RO: Tensor, tokens_per_expert_E: Tensor) -> Tensor:
    """Sums each expert's consecutive rows (the per-expert bias gradient), in fp32 or wider.

    Args:
        t_RO: Rows grouped by expert [R, O].
        tokens_per_expert_E: Rows per expert [E], summing to R.

    Returns:
        [E, O] in fp32 (fp64 for fp64 rows); zero for experts with no rows.
    """
    dtype = compute_dtype(t_RO.dtype)
    if t_RO.shape[0] == 0:
        return t_RO.new_zeros(tokens_per_expert_E.numel(), t_RO.shape[1], dtype=dtype)
    return torch.segment_reduce(
        t_RO.to(dtype),
        "sum",
        lengths=_wide_counts(tokens_per_expert_E).to(t_RO.device),
        axis=0,
        unsafe=True,
        initial=0.0,
    )


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, w_EOD, tokens_per_expert_E, bias_EO, queue, param, sizes):
        y_RO = _forward(x_RD, w_EOD, tokens_per_expert_E, sizes)
        if bias_EO is not None:
            bias_RO = bias_EO.repeat_interleave(
                tokens_per_expert_E, dim=0, output_size=x_RD.shape[0]
            )  # [R, O]
            y_RO = y_RO + bias_RO.to(y_RO.dtype)
        ctx.save_for_backward(x_RD, w_EOD, tokens_per_expert_E)
        ctx.bias_dtype = None if bias_EO is None else bias_EO.dtype
        ctx.queue = queue
        ctx.weight_param = param  # the leaf parameter (w_EOD may be its autocast copy)
        ctx.sizes = sizes  # the backward splits by the counts the forward read (saved above)
        return y_RO

    @staticmethod
    def backward(ctx, dy_RO):
        x_RD, w_EOD, counts_E = ctx.saved_tensors
        dy_RO = dy_RO.contiguous()
        sizes = ctx.sizes
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _input_grad(dy_RO, w_EOD, counts_E, sizes)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad_or_defer(
                ctx.weight_param,
                ctx.queue,
                lambda: _weight_grad(dy_RO, x_RD, counts_E, w_EOD, sizes),
            )
        grad_b = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
            grad_b = segment_sum(dy_RO, counts_E).to(ctx.bias_dtype)
        return grad_x, grad_w, None, grad_b, None, None, None


def grouped_linear(
    x_RD: Tensor,
    w_EOD: Tensor,
    tokens_per_expert_E: Tensor,
    bias_EO: Tensor | None = None,
    *,
    wgrad_queue: WeightGradQueue | None = None,
) -> Tensor:
    """Multiply each expert's rows by that expert's weight (transposed), plus its bias.

    Args:
        x_RD: Routed rows [R, D], expert e's rows consecutive, in expert order.
        w_EOD: Stacked weights [E, O, D], of the dtype of ``x_RD`` (and ``bias_EO``)
            unless autocast is on for their device.
        tokens_per_expert_E: Rows per expert, integer [E], summing to R.
        bias_EO: Optional per-expert bias [E, O], added to each of the expert's rows.
        wgrad_queue: If given, the weight gradient is pushed there instead of being
            computed in the backward (see :mod:`mt_ops.deferred_wgrad`).

    Returns:
        ``y`` [R, O] in the dtype of ``x_RD`` (the autocast dtype under autocast).
    """
    checked = _check(x_RD, w_EOD, tokens_per_expert_E, bias_EO)
    sizes = _SplitSizes(x_RD.shape[0], checked)
    tokens_per_expert_E = _wide_counts(tokens_per_expert_E)
    param = w_EOD
    dtype = autocast_dtype(x_RD.device)
    if dtype is not None:
        # A custom Function sees no autocast: compute in the autocast dtype explicitly, as
        # nn.Linear would, and let autograd cast the gradient back to the parameter dtype.
        x_RD, w_EOD = x_RD.to(dtype), w_EOD.to(dtype)
    return _GroupedLinearFn.apply(
        x_RD, w_EOD, tokens_per_expert_E, bias_EO, wgrad_queue, param, sizes
    )


class GroupedLinear(nn.Module):
    """E linear maps stacked in one module: expert e's rows go through ``weight[e]``.

    The module form of :func:`grouped_linear`, so that precision conversions
    (``convert_to_fp8``) and deferred weight gradients can swap or wrap it the way they
    do ``nn.Linear``. ``__init__`` holds shapes only; the owner initializes the weights.

    Args:
        num_experts: E, experts held by this module.
        in_features: D.
        out_features: O.
        bias: Whether each expert has a bias ``bias`` [E, O] (GPT-OSS).
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features)) if bias else None
        self.wgrad_queue: WeightGradQueue | None = None

    def forward(self, x_RD: Tensor, tokens_per_expert_E: Tensor) -> Tensor:
        """Applies expert e's weight to its consecutive rows.

        Args:
            x_RD: Rows grouped by expert, in expert order [R, D].
            tokens_per_expert_E: Rows per expert [E], summing to R.

        Returns:
            ``y`` [R, O].
        """
        return grouped_linear(
            x_RD, self.weight, tokens_per_expert_E, self.bias, wgrad_queue=self.wgrad_queue
        )

    def extra_repr(self) -> str:
        return f"{self.num_experts}, {self.in_features}, {self.out_features}"


def grouped_linear_reference(
    x_RD: Tensor, w_EOD: Tensor, tokens_per_expert_E: Tensor, bias_EO: Tensor | None = None
) -> Tensor:
    """Reference of :func:`grouped_linear`: a Python loop of one matmul per expert.

    Args:
        x_RD: Routed rows [R, D], expert e's rows consecutive, in expert order.
        w_EOD: Stacked weights [E, O, D], of the dtype of ``x_RD`` (and ``bias_EO``)
            unless autocast is on for their device.
        tokens_per_expert_E: Rows per expert, integer [E], summing to R.
        bias_EO: Optional per-expert bias [E, O], added to each of the expert's rows.

    Returns:
        ``y`` [R, O] in the dtype of ``x_RD`` (the autocast dtype under autocast).
    """
    checked = _check(x_RD, w_EOD, tokens_per_expert_E, bias_EO)
    counts = _SplitSizes(x_RD.shape[0], checked).get(tokens_per_expert_E)
    pieces = []
    for e, x_e in enumerate(torch.split(x_RD, counts, dim=0)):
        y_e = x_e @ w_EOD[e].T  # [count_e, O], the autocast dtype under autocast
        # The bias in the product's dtype, as nn.Linear under autocast (x's dtype promoted
        # a bf16 product back to fp32).
        pieces.append(y_e if bias_EO is None else y_e + bias_EO[e].to(y_e.dtype))
    if not pieces:
        return x_RD.new_zeros(x_RD.shape[0], w_EOD.shape[1])
    return torch.cat(pieces, dim=0)  # [R, O]
