"""Output projection fused with cross-entropy, chunked over tokens.

Legend: T tokens, D model dim, V vocabulary size.

Eager PyTorch computes ``logits = hidden @ weight.T`` ([T, V]), upcasts them to fp32 and
runs ``cross_entropy``; autograd keeps the fp32 logits (or their softmax) alive until the
backward. For V = 151,936 and T = 16k tokens that is ~10 GB for one micro-batch. The public
op walks the tokens in chunks; for each chunk it computes the logits, the loss and,
right away, the gradients with respect to ``hidden`` and ``weight`` (``softmax - onehot``,
two matmuls), then drops the logits. Peak extra memory is one chunk of logits plus an fp32
gradient accumulator for the weight. The backward only scales the stored gradients by the
incoming gradient, so it costs nothing (Liger-Kernel's fused linear cross-entropy does the
same).

Both ops return ``(loss_sum, num_valid)``: the fp32 sum of per-token cross-entropy over
labels that are not ``ignore_index``, and the int64 number of such labels. Normalizing is
the caller's job, so that a global token count can be used across ranks and micro-batches.
Logits are computed in the dtype of the inputs and upcast to fp32 for the softmax, as
Hugging Face models do. Outside autocast ``hidden`` and ``weight`` must share a dtype (the
logits matmul refuses a mix); under ``torch.autocast`` the matmuls run in the autocast
dtype, so bf16 hidden states meet an fp32 head there.

``z_loss_weight`` adds PaLM's z-loss ``z · logsumexp(logits)²`` per valid token to the sum
(it keeps the softmax normalizer near 1); its gradient ``2z · lse · softmax`` folds into
the same chunked pass.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from mt_ops._dtypes import check_same_dtype

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference"]

# At most this many fp32 logits exist at once (2**28 × 4 B = 1 GiB); for V = 151,936 that
# is 1766 tokens per chunk. 2**26 (441 tokens) ran 2.3x slower than eager on an H200
# (T = 8192: 81.7 ms vs 35.6 ms, bench_ops_moe.py): the chunk's matmuls were too small.
_CHUNK_LOGITS_ELEMENTS = 2**28


def _check(hidden_TD: Tensor, weight_VD: Tensor, labels_T: Tensor) -> None:
    if hidden_TD.dim() != 2 or weight_VD.dim() != 2 or hidden_TD.shape[1] != weight_VD.shape[1]:
        raise ValueError(
            f"hidden shape ({tuple(hidden_TD.shape)}) and weight shape "
            f"({tuple(weight_VD.shape)}) must be [T, D] and [V, D]; flatten batch and sequence"
        )
    if labels_T.shape != (hidden_TD.shape[0],):
        raise ValueError(
            f"labels shape ({tuple(labels_T.shape)}) must be [T] = [{hidden_TD.shape[0]}]; "
            "pass one label per hidden row"
        )
    check_same_dtype(("weight", weight_VD), ("hidden", hidden_TD))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and both input gradients chunk by chunk."""

    @staticmethod
    def forward(
        ctx, hidden_TD, weight_VD, labels_T, ignore_index, chunk_tokens, z_loss_weight, grad_enabled
    ):
        num_tokens, vocab_size = hidden_TD.shape[0], weight_VD.shape[0]
        # needs_input_grad ignores grad mode: under no_grad (evaluation) skip the gradients,
        # which would cost two more matmuls per chunk and an fp32 [V, D] accumulator.
        need_hidden_grad = grad_enabled and ctx.needs_input_grad[0]
        need_weight_grad = grad_enabled and ctx.needs_input_grad[1]
        need_grads = need_hidden_grad or need_weight_grad
        valid_T = labels_T != ignore_index  # [T]
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden_TD.device)
        grad_hidden_TD = torch.empty_like(hidden_TD) if need_hidden_grad else None
        grad_weight_VD = (
            torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device)
            if need_weight_grad
            else None
        )
        for start in range(0, num_tokens, chunk_tokens):
            stop = min(start + chunk_tokens, num_tokens)
            h_CD = hidden_TD[start:stop]  # [C, D]
            valid_C = valid_T[start:stop]  # [C]
            target_C = torch.where(valid_C, labels_T[start:stop], 0)  # [C]
            logits_CV = h_CD @ weight_VD.T  # [C, V], the inputs' (or autocast's) dtype
            if need_grads:
                # The softmax upcasts to fp32 in its own pass; lse comes from the largest
                # logit m and its probability p_m = 1 / Σ exp(logits - m), which is >= 1/V,
                # so its log is well conditioned: lse = m - log p_m.
                max_C, argmax_C = logits_CV.max(dim=-1)
                probs_CV = torch.softmax(logits_CV, dim=-1, dtype=torch.float32)
                p_max_C = probs_CV.gather(1, argmax_C[:, None]).squeeze(1)
                lse_C = max_C.float() - p_max_C.log()  # [C]
            else:
                lse_C = torch.logsumexp(logits_CV.float(), dim=-1)  # [C]
            target_logit_C = logits_CV.gather(1, target_C[:, None]).squeeze(1).float()  # [C]
            token_loss_C = lse_C - target_logit_C
            if z_loss_weight:
                token_loss_C = token_loss_C + z_loss_weight * lse_C.square()
            loss_sum += torch.where(valid_C, token_loss_C, 0.0).sum()
            if not need_grads:
                continue
            # d(lse - logit_y + z·lse²)/d logits = s·softmax - onehot(y), s = 1 + 2z·lse;
            # zero for ignored rows. One pass scales the probabilities and rounds them into
            # the logits' own buffer; the C target entries are then set from fp32 (before:
            # an fp32 copy of the logits, exp, a subtraction, two products and a cast, each
            # a pass over [C, V]).
            scale_C = valid_C.float()
            if z_loss_weight:
                scale_C = scale_C * (1.0 + 2.0 * z_loss_weight * lse_C)
            rows_C = torch.arange(stop - start, device=h_CD.device)
            p_target_C = probs_CV[rows_C, target_C]
            grad_logits_CV = torch.mul(probs_CV, scale_C[:, None], out=logits_CV)
            del probs_CV
            grad_logits_CV[rows_C, target_C] = (scale_C * p_target_C - valid_C.float()).to(
                grad_logits_CV.dtype
            )
            if need_hidden_grad:
                grad_hidden_TD[start:stop] = grad_logits_CV @ weight_VD  # [C, D]
            if need_weight_grad:
                grad_weight_VD += (grad_logits_CV.T @ h_CD).float()  # [V, D]
        assert vocab_size == weight_VD.shape[0], f"{vocab_size=}"
        ctx.save_for_backward(grad_hidden_TD, grad_weight_VD)
        ctx.weight_dtype = weight_VD.dtype
        num_valid = valid_T.sum()  # int64 scalar
        ctx.mark_non_differentiable(num_valid)
        return loss_sum, num_valid

    @staticmethod
    def backward(ctx, grad_loss, _grad_count):
        grad_hidden_TD, grad_weight_VD = ctx.saved_tensors
        if grad_hidden_TD is not None:
            grad_hidden_TD = (grad_hidden_TD * grad_loss).to(grad_hidden_TD.dtype)
        if grad_weight_VD is not None:
            grad_weight_VD = (grad_weight_VD * grad_loss).to(ctx.weight_dtype)
        return grad_hidden_TD, grad_weight_VD, None, None, None, None, None


def linear_cross_entropy(
    hidden_TD: Tensor,
    weight_VD: Tensor,
    labels_T: Tensor,
    *,
    ignore_index: int = -100,
    z_loss_weight: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy of ``hidden @ weight.T`` without materializing all logits.

    Args:
        hidden_TD: Final hidden states [T, D].
        weight_VD: Output projection (lm head) [V, D], same dtype as ``hidden_TD`` unless
            autocast is on for their device.
        labels_T: Target token ids [T]; entries equal to ``ignore_index`` are skipped.
        ignore_index: Label value that contributes neither loss nor gradient.
        z_loss_weight: Weight z of the z-loss ``z · logsumexp²`` added per valid token.

    Returns:
        ``(loss_sum, num_valid)``: fp32 scalar sum of cross-entropy over valid labels, and
        int64 scalar count of valid labels.
    """
    _check(hidden_TD, weight_VD, labels_T)
    chunk_tokens = max(1, _CHUNK_LOGITS_ELEMENTS // max(1, weight_VD.shape[0]))
    return _ChunkedLinearCrossEntropy.apply(
        hidden_TD, weight_VD, labels_T, ignore_index, chunk_tokens, float(z_loss_weight),
        torch.is_grad_enabled(),
    )  # fmt: skip


def linear_cross_entropy_reference(
    hidden_TD: Tensor,
    weight_VD: Tensor,
    labels_T: Tensor,
    *,
    ignore_index: int = -100,
    z_loss_weight: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Reference of :func:`linear_cross_entropy`: full fp32 logits and ``F.cross_entropy``.

    Args:
        hidden_TD: Final hidden states [T, D].
        weight_VD: Output projection (lm head) [V, D], same dtype as ``hidden_TD`` unless
            autocast is on for their device.
        labels_T: Target token ids [T]; entries equal to ``ignore_index`` are skipped.
        ignore_index: Label value that contributes neither loss nor gradient.
        z_loss_weight: Weight z of the z-loss ``z · logsumexp²`` added per valid token.

    Returns:
        ``(loss_sum, num_valid)``: fp32 scalar sum of cross-entropy over valid labels, and
        int64 scalar count of valid labels.
    """
    _check(hidden_TD, weight_VD, labels_T)
    logits_TV = (hidden_TD @ weight_VD.T).float()  # [T, V]
    loss_sum = F.cross_entropy(logits_TV, labels_T, ignore_index=ignore_index, reduction="sum")
    valid_T = labels_T != ignore_index
    if z_loss_weight:
        lse_T = torch.logsumexp(logits_TV, dim=-1)
        loss_sum = loss_sum + z_loss_weight * torch.where(valid_T, lse_T.square(), 0.0).sum()
    return loss_sum, valid_T.sum()
