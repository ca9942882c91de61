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

Per chunk, on CUDA, one Triton kernel does everything between the logits matmul and the
two gradient matmuls: each program walks one row of logits twice, an online max and sum
of exponentials (the row's log-sum-exp, fp32), then ``s · exp(logit - lse) - onehot``
written over the logits in their own dtype; the row's loss comes out beside it. That is
6 bytes of memory traffic per bf16 logit. The eager path (CPU) upcasts, runs a softmax and
scales it into the logits' buffer. Under autocast the head weight is cast to the autocast
dtype once per call rather than by every chunk's two matmuls, and on CUDA the weight
gradient is accumulated straight into its fp32 buffer by ``addmm`` with an fp32 output.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from mt_ops._dtypes import autocast_dtype, check_same_dtype, is_integer
from mt_ops._triton import launch, tl, triton, use_kernels

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference"]

# At most this many logits exist at once, in the matmul's dtype (2**28 × 2 B = 512 MiB in
# bf16; the CPU path adds their fp32 softmax, 1 GiB); for V = 151,936 that is 1766 tokens
# per chunk. 2**26 (441 tokens) ran 2.3x slower than eager on an H200 with the eager row
# pass (T = 8192: 81.7 ms vs 35.6 ms, bench_ops_moe.py): the chunk's matmuls were too small.
_CHUNK_LOGITS_ELEMENTS = 2**28


# Logits per step of the row kernel's two sweeps (16 per thread at 8 warps). H200, fwd + bwd
# with bf16 inputs (old and new op timed in one run, V = 151,936, D = 2048): T = 8192
# 53.2 -> 25.7 ms and T = 16384 105.1 -> 52.4 ms, extra peak memory 4.08 -> 2.35 GiB, against
# the eager row pass with autocast's per-chunk head casts and a bf16 weight-gradient product
# upcast and added per chunk (which also rounded each chunk's dW to bf16: 1.1e-3 apart).
_ROW_BLOCK = 4096


@triton.jit
def _xent_rows_kernel(
    logits_ptr, labels_ptr, loss_ptr, vocab_size, row_stride, ignore_index, z_loss_weight,
    NEED_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One row: its loss (lse - logit_y + z·lse², 0 if ignored) and, with NEED_GRAD, the
    gradient ``(1 + 2z·lse)·softmax - onehot(y)`` (zero if ignored) over its logits."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * row_stride
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    target = tl.where(valid, label, 0)
    cols = tl.arange(0, BLOCK_V)
    # Per-lane running max and sum of exp(logit - max); a lane that has only seen masked
    # (-inf) entries keeps its sum at 0 (shifting by 0 instead of -inf avoids inf - inf).
    run_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        ok = start + cols < vocab_size
        x = tl.load(base + start + cols, mask=ok, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, x)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.exp(x - shift)
        run_max = new_max
    row_max = tl.max(run_max, axis=0)
    lse = row_max + tl.log(tl.sum(run_sum * tl.exp(run_max - row_max), axis=0))
    # A label outside [0, V) (a data bug) reads nothing and makes the row's loss NaN.
    in_range = (target >= 0) & (target < vocab_size)
    target_logit = tl.load(base + target, mask=in_range, other=float("nan")).to(tl.float32)
    loss = lse - target_logit + z_loss_weight * lse * lse
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    if NEED_GRAD:
        one = valid.to(tl.float32)
        scale = one * (1.0 + 2.0 * z_loss_weight * lse)
        for start in range(0, vocab_size, BLOCK_V):
            ok = start + cols < vocab_size
            x = tl.load(base + start + cols, mask=ok, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) * scale
            grad = tl.where(start + cols == target, grad - one, grad)
            tl.store(base + start + cols, grad.to(logits_ptr.dtype.element_ty), mask=ok)


def _xent_rows_kernels(
    logits_CV: Tensor, labels_C: Tensor, ignore_index: int, z_loss_weight: float, need_grads: bool
) -> Tensor:
    """Per-row fp32 losses [C]; with ``need_grads`` the logits become their gradient."""
    num_rows, vocab_size = logits_CV.shape
    loss_C = torch.empty(num_rows, dtype=torch.float32, device=logits_CV.device)
    # The kernel reads label i at labels_ptr + i: a strided view (a column) is copied first.
    launch(
        _xent_rows_kernel, (num_rows,), logits_CV, labels_C.contiguous(), loss_C, vocab_size,
        logits_CV.stride(0), ignore_index, z_loss_weight, NEED_GRAD=need_grads,
        BLOCK_V=_ROW_BLOCK, num_warps=8,
    )  # fmt: skip
    return loss_C


def _xent_rows_eager(
    logits_CV: Tensor, labels_C: Tensor, ignore_index: int, z_loss_weight: float, need_grads: bool
) -> Tensor:
    """:func:`_xent_rows_kernels` in eager ops (the CPU path)."""
    valid_C = labels_C != ignore_index  # [C]
    target_C = torch.where(valid_C, labels_C, 0)  # [C]
    if need_grads:
        # The softmax upcasts to fp32 in its own pass; lse comes from the largest logit m
        # and its probability p_m = 1 / Σ exp(logits - m), which is >= 1/V, so its log is
        # well conditioned: lse = m - log p_m.
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
    if need_grads:
        # d(lse - logit_y + z·lse²)/d logits = s·softmax - onehot(y), s = 1 + 2z·lse; zero
        # for ignored rows. One pass scales the probabilities and rounds them into the
        # logits' own buffer; the C target entries are then set from fp32.
        scale_C = valid_C.float()
        if z_loss_weight:
            scale_C = scale_C * (1.0 + 2.0 * z_loss_weight * lse_C)
        rows_C = torch.arange(logits_CV.shape[0], device=logits_CV.device)
        p_target_C = probs_CV[rows_C, target_C]
        torch.mul(probs_CV, scale_C[:, None], out=logits_CV)
        del probs_CV
        logits_CV[rows_C, target_C] = (scale_C * p_target_C - valid_C.float()).to(logits_CV.dtype)
    return torch.where(valid_C, token_loss_C, 0.0)


def _accumulate_weight_grad(grad_weight_VD: Tensor, grad_logits_CV: Tensor, h_CD: Tensor) -> None:
    """``grad_weight += grad_logitsᵀ @ h`` into the fp32 accumulator."""
    if grad_weight_VD.is_cuda and grad_logits_CV.dtype != grad_weight_VD.dtype:
        # cuBLAS accumulates in fp32 and adds into the fp32 buffer: no rounded [V, D]
        # product, no upcast and no separate addition.
        torch.addmm(
            grad_weight_VD, grad_logits_CV.T, h_CD, out_dtype=torch.float32, out=grad_weight_VD
        )
    elif grad_logits_CV.dtype == grad_weight_VD.dtype:
        grad_weight_VD.addmm_(grad_logits_CV.T, h_CD)  # fp32 training: no [V, D] temporary
    else:
        grad_weight_VD += (grad_logits_CV.T @ h_CD).float()


def _check(
    hidden_TD: Tensor, weight_VD: Tensor, labels_T: Tensor, ignore_index: int, z_loss_weight: float
) -> None:
    if not z_loss_weight >= 0:  # negative: rewarded large logits; NaN: a NaN loss
        raise ValueError(
            f"z_loss_weight ({z_loss_weight}) must be >= 0 (0 turns the z-loss off; PaLM uses 1e-4)"
        )
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
    if labels_T.device != hidden_TD.device:
        raise ValueError(
            f"labels are on {labels_T.device} but hidden is on {hidden_TD.device}; move the "
            "labels to the hidden states' device"
        )
    if not is_integer(labels_T.dtype):
        raise ValueError(
            f"labels dtype ({labels_T.dtype}) must be an integer type; pass the target token "
            "ids (a float would be truncated, a bool mask is no label)"
        )
    check_same_dtype(("weight", weight_VD), ("hidden", hidden_TD))
    if labels_T.device.type == "cpu":
        # Free on the host. On GPU no check (it would sync): the row kernel makes such a
        # row's loss NaN instead of reading another row's logits.
        vocab = weight_VD.shape[0]
        bad_T = (labels_T != ignore_index) & ((labels_T < 0) | (labels_T >= vocab))
        if bool(bad_T.any()):
            t = int(bad_T.nonzero()[0, 0])
            raise ValueError(
                f"labels[{t}] is {int(labels_T[t])}, outside [0, V={vocab}) and not "
                f"ignore_index ({ignore_index}); pass token ids of this vocabulary (weight "
                f"has {vocab} rows), or mark unlabelled positions with ignore_index"
            )


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and both input gradients chunk by chunk."""

    @staticmethod
    def forward(
        ctx, hidden_TD, weight_VD, labels_T, ignore_index, chunk_tokens, z_loss_weight, grad_enabled
    ):
        num_tokens, weight_dtype = hidden_TD.shape[0], weight_VD.dtype
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
        dtype = autocast_dtype(hidden_TD.device)
        if dtype is not None:
            # The matmuls below would cast under the caller's autocast; cast the head once
            # here instead of in each chunk's matmuls (twice per chunk with gradients).
            hidden_TD, weight_VD = hidden_TD.to(dtype), weight_VD.to(dtype)
        rows = _xent_rows_kernels if use_kernels(hidden_TD) else _xent_rows_eager
        for start in range(0, num_tokens, chunk_tokens):
            stop = min(start + chunk_tokens, num_tokens)
            h_CD = hidden_TD[start:stop]  # [C, D]
            logits_CV = h_CD @ weight_VD.T  # [C, V], the inputs' (or autocast's) dtype
            token_loss_C = rows(
                logits_CV, labels_T[start:stop], ignore_index, z_loss_weight, need_grads
            )
            loss_sum += token_loss_C.sum()
            if not need_grads:
                continue
            grad_logits_CV = logits_CV  # overwritten in place by the row pass
            if need_hidden_grad:
                grad_hidden_TD[start:stop] = grad_logits_CV @ weight_VD  # [C, D]
            if need_weight_grad:
                _accumulate_weight_grad(grad_weight_VD, grad_logits_CV, h_CD)
        ctx.save_for_backward(grad_hidden_TD, grad_weight_VD)
        ctx.weight_dtype = weight_dtype
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
        labels_T: Target token ids, integer [T]; entries equal to ``ignore_index`` are
            skipped.
        ignore_index: Label value that contributes neither loss nor gradient.
        z_loss_weight: Weight z of the z-loss ``z · logsumexp²`` added per valid token.

    Returns:
        ``(loss_sum, num_valid)``: fp32 scalar sum of cross-entropy over valid labels, and
        int64 scalar count of valid labels.
    """
    _check(hidden_TD, weight_VD, labels_T, ignore_index, z_loss_weight)
    if labels_T.dtype not in (torch.int32, torch.int64):  # gather's only index types
        labels_T = labels_T.long()
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
        labels_T: Target token ids, integer [T]; entries equal to ``ignore_index`` are
            skipped.
        ignore_index: Label value that contributes neither loss nor gradient.
        z_loss_weight: Weight z of the z-loss ``z · logsumexp²`` added per valid token.

    Returns:
        ``(loss_sum, num_valid)``: fp32 scalar sum of cross-entropy over valid labels, and
        int64 scalar count of valid labels.
    """
    _check(hidden_TD, weight_VD, labels_T, ignore_index, z_loss_weight)
    logits_TV = (hidden_TD @ weight_VD.T).float()  # [T, V]
    loss_sum = F.cross_entropy(  # F.cross_entropy takes int64 labels only; the op any int
        logits_TV, labels_T.long(), ignore_index=ignore_index, reduction="sum"
    )
    valid_T = labels_T != ignore_index
    if z_loss_weight:
        lse_T = torch.logsumexp(logits_TV, dim=-1)
        loss_sum = loss_sum + z_loss_weight * torch.where(valid_T, lse_T.square(), 0.0).sum()
    return loss_sum, valid_T.sum()
