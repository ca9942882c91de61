"""Grouped linear: one matmul per expert over that expert's consecutive rows.

Legend: R routed rows, D input dim, O output dim, E experts.

``y[rows of e] = x[rows of e] @ w[e].T`` with ``w`` laid out [E, O, D] like
``nn.Linear.weight`` stacked over experts. Eager PyTorch loops over experts: E small
matmuls, E launches and a host sync to read the counts, which leaves the GPU idle for
small experts. A grouped GEMM runs all experts in one launch from device-side offsets.

The public op uses ``torch._grouped_mm`` on CUDA for bf16 when the dims are 16-byte
aligned (D and O multiples of 8); everywhere else it runs the reference loop.
"""

import torch
from torch import Tensor, nn

__all__ = ["GroupedLinear", "grouped_linear", "grouped_linear_reference"]

# torch._grouped_mm needs 16-byte aligned row strides: 8 bf16 elements.
_GROUPED_MM_ALIGN = 8


def _check(x_RD: Tensor, w_EOD: Tensor, tokens_per_expert_E: Tensor) -> None:
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


def grouped_linear(x_RD: Tensor, w_EOD: Tensor, tokens_per_expert_E: Tensor) -> Tensor:
    """Multiply each expert's rows by that expert's weight (transposed).

    Args:
        x_RD: Routed rows [R, D], expert e's rows consecutive, in expert order.
        w_EOD: Stacked weights [E, O, D].
        tokens_per_expert_E: Rows per expert, integer [E], summing to R.

    Returns:
        ``y`` [R, O] in the dtype of ``x_RD``.
    """
    _check(x_RD, w_EOD, tokens_per_expert_E)
    use_grouped_mm = (
        x_RD.is_cuda
        and x_RD.dtype == torch.bfloat16
        and w_EOD.dtype == torch.bfloat16
        and x_RD.shape[1] % _GROUPED_MM_ALIGN == 0
        and w_EOD.shape[1] % _GROUPED_MM_ALIGN == 0
        and x_RD.shape[0] > 0
    )
    if not use_grouped_mm:
        return grouped_linear_reference(x_RD, w_EOD, tokens_per_expert_E)
    offsets_E = torch.cumsum(tokens_per_expert_E, dim=0).to(torch.int32)  # [E], row ends
    return torch._grouped_mm(x_RD, w_EOD.transpose(-2, -1), offs=offsets_E)  # [R, O]


class GroupedLinear(nn.Module):
    """E linear maps stacked in one module: expert e's rows go through ``weight[e]``.

    The module form of :func:`grouped_linear`, so that precision conversions
    (``convert_to_fp8``) and deferred weight gradients can swap or wrap it the way they
    do ``nn.Linear``. ``__init__`` holds shapes only; the owner initializes the weights.

    Args:
        num_experts: E, experts held by this module.
        in_features: D.
        out_features: O.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))

    def forward(self, x_RD: Tensor, tokens_per_expert_E: Tensor) -> Tensor:
        """Applies expert e's weight to its consecutive rows.

        Args:
            x_RD: Rows grouped by expert, in expert order [R, D].
            tokens_per_expert_E: Rows per expert [E], summing to R.

        Returns:
            ``y`` [R, O].
        """
        return grouped_linear(x_RD, self.weight, tokens_per_expert_E)

    def extra_repr(self) -> str:
        return f"{self.num_experts}, {self.in_features}, {self.out_features}"


def grouped_linear_reference(x_RD: Tensor, w_EOD: Tensor, tokens_per_expert_E: Tensor) -> Tensor:
    """Reference of :func:`grouped_linear`: a Python loop of one matmul per expert.

    Args:
        x_RD: Routed rows [R, D], expert e's rows consecutive, in expert order.
        w_EOD: Stacked weights [E, O, D].
        tokens_per_expert_E: Rows per expert, integer [E], summing to R.

    Returns:
        ``y`` [R, O] in the dtype of ``x_RD``.
    """
    _check(x_RD, w_EOD, tokens_per_expert_E)
    counts = tokens_per_expert_E.tolist()  # host sync: the loop needs the split sizes
    if sum(counts) != x_RD.shape[0]:
        raise ValueError(
            f"tokens_per_expert sums to {sum(counts)} but x has R={x_RD.shape[0]} rows; "
            "counts must add up to the routed rows"
        )
    pieces = [
        x_e @ w_EOD[e].T  # [count_e, O]
        for e, x_e in enumerate(torch.split(x_RD, counts, dim=0))
    ]
    if not pieces:
        return x_RD.new_zeros(x_RD.shape[0], w_EOD.shape[1])
    return torch.cat(pieces, dim=0)  # [R, O]
