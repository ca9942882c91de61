"""Scaled dot-product attention with grouped-query heads and an optional log-sum-exp.

Eager PyTorch attention materializes the [B, H, S, S] score matrix, its softmax and their
gradients: O(S²) memory per head. Fused kernels (Flash / cuDNN SDPA, FlashAttention-4)
stream K/V tiles through an online softmax and keep only the per-row log-sum-exp (LSE).
The public op uses ``torch.nn.functional.scaled_dot_product_attention`` (which picks
Flash, cuDNN, memory-efficient or math by capability) whenever the LSE is not requested.
Context parallelism needs the LSE to merge partial results; until a kernel returns it,
``return_lse=True`` runs the reference.

Conventions: query head ``h`` attends with key/value head ``h // (Hq // Hkv)`` (the
``repeat_interleave`` grouping of SDPA's ``enable_gqa`` and Hugging Face's ``repeat_kv``);
the causal mask is aligned top-left (query ``i`` sees keys ``0..i``), as SDPA's
``is_causal``. The default scale is ``1 / sqrt(head_dim of q)``.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["attention", "attention_reference"]


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v shapes ({tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}) must be "
            "4-D [B, H, S, head_dim]; transpose heads to dim 1"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k shape ({tuple(k.shape)}) and v shape ({tuple(v.shape)}) must agree in "
            "[B, Hkv, S]; project k and v from the same tokens"
        )
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q shape ({tuple(q.shape)}) and k shape ({tuple(k.shape)}) must agree in batch "
            "and head_dim; use the same batch and q/k head size"
        )
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q heads ({num_q_heads}) must be a multiple of k/v heads ({num_kv_heads}); "
            "choose num_key_value_heads dividing num_attention_heads"
        )


def attention(
    q_BHSD: Tensor,
    k_BHSD: Tensor,
    v_BHSD: Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Softmax attention of queries over keys, with GQA when k/v have fewer heads.

    Args:
        q_BHSD: Queries [B, Hq, Sq, Dqk].
        k_BHSD: Keys [B, Hkv, Sk, Dqk], Hq a multiple of Hkv.
        v_BHSD: Values [B, Hkv, Sk, Dv].
        causal: Mask keys after the query position (top-left aligned).
        scale: Multiplier of q·k; ``1 / sqrt(Dqk)`` when None.
        return_lse: Also return the fp32 log-sum-exp of the scaled scores per query.

    Returns:
        ``out`` [B, Hq, Sq, Dv] in the dtype of q, or ``(out, lse)`` with lse [B, Hq, Sq]
        in fp32 when ``return_lse``.
    """
    _check(q_BHSD, k_BHSD, v_BHSD)
    if return_lse:
        return attention_reference(
            q_BHSD, k_BHSD, v_BHSD, causal=causal, scale=scale, return_lse=True
        )
    return F.scaled_dot_product_attention(
        q_BHSD,
        k_BHSD,
        v_BHSD,
        is_causal=causal,
        scale=scale,
        enable_gqa=q_BHSD.shape[1] != k_BHSD.shape[1],
    )


def attention_reference(
    q_BHSD: Tensor,
    k_BHSD: Tensor,
    v_BHSD: Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Explicit fp32 reference of :func:`attention`: scores, mask, log-sum-exp, softmax.

    Args:
        q_BHSD: Queries [B, Hq, Sq, Dqk].
        k_BHSD: Keys [B, Hkv, Sk, Dqk], Hq a multiple of Hkv.
        v_BHSD: Values [B, Hkv, Sk, Dv].
        causal: Mask keys after the query position (top-left aligned).
        scale: Multiplier of q·k; ``1 / sqrt(Dqk)`` when None.
        return_lse: Also return the fp32 log-sum-exp of the scaled scores per query.

    Returns:
        ``out`` [B, Hq, Sq, Dv] in the dtype of q, or ``(out, lse)`` with lse [B, Hq, Sq]
        in fp32 when ``return_lse``.
    """
    _check(q_BHSD, k_BHSD, v_BHSD)
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    group = q_BHSD.shape[1] // k_BHSD.shape[1]
    k = k_BHSD.float().repeat_interleave(group, dim=1)  # [B, Hq, Sk, Dqk]
    v = v_BHSD.float().repeat_interleave(group, dim=1)  # [B, Hq, Sk, Dv]
    scores = torch.matmul(q_BHSD.float(), k.transpose(-2, -1)) * scale  # [B, Hq, Sq, Sk]
    if causal:
        seq_q, seq_k = scores.shape[-2:]
        visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, Sq]
    probs = torch.exp(scores - lse.unsqueeze(-1))  # [B, Hq, Sq, Sk]
    out = torch.matmul(probs, v).to(q_BHSD.dtype)  # [B, Hq, Sq, Dv]
    return (out, lse) if return_lse else out
