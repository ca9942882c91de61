"""Scaled dot-product attention: GQA, causal or sliding-window masks at arbitrary positions,
attention sinks, and an optional log-sum-exp.

Eager PyTorch attention materializes the [B, H, Sq, Sk] score matrix, its softmax and their
gradients: O(S²) memory per head. Fused kernels (Flash / cuDNN SDPA, FlashAttention-4)
stream K/V tiles through an online softmax and keep only the per-row log-sum-exp (LSE).
The public op uses ``torch.nn.functional.scaled_dot_product_attention`` (which picks Flash,
cuDNN, memory-efficient or math by capability) for plain causal attention, and SDPA with a
boolean mask for explicit positions. Sinks (GPT-OSS) and LSE requests need the
log-sum-exp, which SDPA does not return: on CUDA they run compiled ``flex_attention`` (a
fused Triton kernel that returns the LSE and takes its gradient) with a block mask built
from the same rules, then :func:`apply_sinks`; so do sliding windows and packed documents
on indices (no explicit positions) on CUDA, where flex skips the blocks that no query sees
(see ``FLEX``). On CPU, and for head dims flex does not compile (not a power of two from 16
to 256), sinks and LSE requests run the reference and masks SDPA.

Conventions:

- Query head ``h`` attends with key/value head ``h // (Hq // Hkv)`` (the
  ``repeat_interleave`` grouping of SDPA's ``enable_gqa`` and Hugging Face's ``repeat_kv``).
- Masks are defined on positions: key j is visible to query i when
  ``kv_pos[j] <= q_pos[i]`` (causal) and ``q_pos[i] - kv_pos[j] < window`` (a window of W
  keys, the query's own included: Hugging Face's ``sliding_window`` convention). Without
  explicit positions both are ``arange`` (top-left aligned, as SDPA's ``is_causal``). A ring
  attention core passes the global positions of a q chunk and a k/v chunk.
- Packed documents: with ``q_document_ids`` / ``kv_document_ids`` a key is visible only to
  queries of the same document (ids equal), on top of the causal and window rules.
- A query that sees no key gets output 0 and LSE ``-inf`` (so an LSE merge ignores it).
- Sinks (GPT-OSS) are one learned logit per query head that joins every softmax row but
  has no value: ``softmax([s, sink])[:-1] @ v = out · sigmoid(lse − sink)``. They are
  applied after normalization by :func:`apply_sinks`, so a context-parallel caller merges
  the partial (out, lse) of its chunks first and applies the sinks once.
- The default scale is ``1 / sqrt(Dqk)``; v may have a head dim Dv different from q/k (MLA).
- q, k and v share a dtype, as SDPA requires, unless autocast is on for their device
  (SDPA then casts them to the autocast dtype).
"""

import math
from functools import cache, lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import (
    AuxRequest,
    BlockMask,
    create_block_mask,
    flex_attention,
)

from mt_ops._dtypes import autocast_off, check_same_dtype, compute_dtype, is_integer

__all__ = ["apply_sinks", "attention", "attention_reference"]

# On CUDA, sinks and LSE requests run flex_attention ("enabled" False: the reference).
# Without them, masks other than plain causal take flex or SDPA with a boolean [Sq, Sk]
# mask by "masks": "auto" sends windows and packed documents on indices to flex (their
# block masks are built without visiting every (query, key) pair), "all" sends explicit
# positions too (create_block_mask, per call), "none" none. H200, GPT-OSS heads
# (bench_ops_attention.py), fwd + bwd, flex against SDPA's mask: window 128, 1.29 against
# 4.24 ms at 4k tokens, 1.73 against 16.01 at 8k; four packed documents, 4.41 against 4.24
# ms at 4k and 5.80 against 16.03 at 8k (with create_block_mask per call: 9.47 and 10.06).
# So documents cost 4% more at 4k and gain from there on, where SDPA's [Sq, Sk] mask (kept
# for the backward, per layer) also grows with S².
FLEX = {"enabled": True, "masks": "auto"}
_MASK_ROUTES = ("auto", "all", "none")


def _check(
    q: Tensor, k: Tensor, v: Tensor, window: int | None, sinks: Tensor | None, scale: float | None
) -> None:
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale ({scale}) must be a finite number, or None for 1/sqrt(head_dim)")
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
    # SDPA and flex refuse mixed dtypes outside autocast; the fp32 reference would accept them.
    check_same_dtype(("q", q), ("k", k), ("v", v))
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q heads ({num_q_heads}) must be a multiple of k/v heads ({num_kv_heads}); "
            "choose num_key_value_heads dividing num_attention_heads"
        )
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        # A float window would act as its ceiling (2.5 as 3) and True as 1.
        raise ValueError(
            f"window ({window!r}) must be an int number of keys or None for full attention"
        )
    if window is not None and window < 1:
        raise ValueError(f"window ({window}) must be >= 1 or None for full attention")
    if sinks is not None and sinks.shape != (num_q_heads,):
        raise ValueError(
            f"sinks shape ({tuple(sinks.shape)}) must be [Hq] = [{num_q_heads}]; "
            "pass one sink logit per query head"
        )


def _check_documents(q_document_ids: Tensor | None, kv_document_ids: Tensor | None) -> None:
    if (q_document_ids is None) != (kv_document_ids is None):
        raise ValueError(
            "q_document_ids and kv_document_ids must be given together; pass the same "
            "ids twice for self-attention"
        )


def _check_rules(q: Tensor, k: Tensor, **rules: Tensor | None) -> None:
    """Positions and document ids must be integer [S] or [B or 1, S] for their sequence."""
    batch = q.shape[0]
    for name, t in rules.items():
        if t is None:
            continue
        length = q.shape[2] if name.startswith("q_") else k.shape[2]
        if not is_integer(t.dtype):
            raise ValueError(
                f"{name} dtype ({t.dtype}) must be an integer type; pass integer token "
                "positions or document ids (a float would be truncated)"
            )
        rows_ok = t.dim() == 1 or (t.dim() == 2 and t.shape[0] in (1, batch))
        if not rows_ok or t.shape[-1] != length:
            raise ValueError(
                f"{name} shape ({tuple(t.shape)}) must be [{length}] or [B, {length}] with B "
                f"1 or the batch ({batch}); pass one value per token of each row"
            )


def _positions(positions: Tensor | None, length: int, device: torch.device) -> Tensor:
    """Positions as int64 [B or 1, S]."""
    if positions is None:
        return torch.arange(length, device=device)[None]
    if positions.dim() == 1:
        positions = positions[None]
    if positions.shape[-1] != length:
        raise ValueError(
            f"positions shape ({tuple(positions.shape)}) must end in the sequence length "
            f"({length}); pass one position per token"
        )
    return positions.to(device=device, dtype=torch.int64)


def visible_mask(
    q_positions: Tensor | None,
    kv_positions: Tensor | None,
    seq_q: int,
    seq_k: int,
    *,
    causal: bool,
    window: int | None,
    device: torch.device,
    q_document_ids: Tensor | None = None,
    kv_document_ids: Tensor | None = None,
) -> Tensor | None:
    """Boolean [B or 1, 1, Sq, Sk] mask of visible keys, or None when all are visible.

    Args:
        q_positions: Query positions [Sq] or [B, Sq], or None for ``arange(Sq)``.
        kv_positions: Key positions [Sk] or [B, Sk], or None for ``arange(Sk)``.
        seq_q: Sq.
        seq_k: Sk.
        causal: Hide keys after the query position.
        window: Hide keys ``window`` or more positions before the query (None: no limit).
        device: Where the mask lives.
        q_document_ids: Document of each query [Sq] or [B, Sq], or None (one document).
        kv_document_ids: Document of each key [Sk] or [B, Sk], or None (one document).

    Returns:
        The mask, True where the key is visible.
    """
    _check_documents(q_document_ids, kv_document_ids)
    documents = None
    if q_document_ids is not None:
        q_doc = _positions(q_document_ids, seq_q, device)[:, :, None]  # [B|1, Sq, 1]
        kv_doc = _positions(kv_document_ids, seq_k, device)[:, None, :]  # [B|1, 1, Sk]
        documents = (q_doc == kv_doc)[:, None]  # [B|1, 1, Sq, Sk]
    if not causal and window is None:
        return documents
    q_pos = _positions(q_positions, seq_q, device)[:, :, None]  # [B|1, Sq, 1]
    kv_pos = _positions(kv_positions, seq_k, device)[:, None, :]  # [B|1, 1, Sk]
    distance = q_pos - kv_pos  # [B|1, Sq, Sk]
    visible = torch.ones_like(distance, dtype=torch.bool)
    if causal:
        visible &= distance >= 0
    if window is not None:
        visible &= distance < window
    visible = visible[:, None]  # [B|1, 1, Sq, Sk]
    return visible if documents is None else visible & documents


def apply_sinks(out_BHSD: Tensor, lse_BHS: Tensor, sinks_H: Tensor) -> Tensor:
    """Folds attention sinks into a normalized attention output: ``out · sigmoid(lse − sink)``.

    ``softmax([scores, sink])`` without the sink column equals ``softmax(scores) ·
    Σexp(scores) / (Σexp(scores) + exp(sink))``, and that ratio is ``sigmoid(lse − sink)``.
    Apply it once, after merging the partial results of all key chunks.

    Args:
        out_BHSD: Attention output normalized over the keys [B, Hq, Sq, Dv].
        lse_BHS: fp32 log-sum-exp of the scaled scores over the same keys [B, Hq, Sq].
        sinks_H: One sink logit per query head [Hq].

    Returns:
        The output with sinks, in the dtype of ``out_BHSD`` (computed in fp32, in fp64
        when any input is fp64).
    """
    dtype = compute_dtype(out_BHSD.dtype, lse_BHS.dtype)
    keep_BHS = torch.sigmoid(lse_BHS.to(dtype) - sinks_H.to(dtype)[None, :, None])  # [B, Hq, Sq]
    return (out_BHSD.to(dtype) * keep_BHS[..., None]).to(out_BHSD.dtype)


def _with_sinks(out_BHSD: Tensor, lse_BHS: Tensor, sinks_H: Tensor | None):
    """``(out, lse)`` with the sinks folded in (both unchanged without sinks)."""
    if sinks_H is None:
        return out_BHSD, lse_BHS
    sinks_BHS = sinks_H.to(lse_BHS.dtype)[None, :, None].expand_as(lse_BHS)
    lse_with_sink = torch.logaddexp(lse_BHS, sinks_BHS)
    return apply_sinks(out_BHSD, lse_BHS, sinks_H), lse_with_sink


@cache
def _compiled_flex():
    # Default dynamic shapes: one static compile, and on a second sequence length one
    # dynamic-shape recompile (instead of one per length up to dynamo's recompile limit,
    # then the eager, O(S²) flex fallback) for generation and evaluation lengths.
    return torch.compile(flex_attention)


def _flex_supported(q_BHSD: Tensor, v_BHSD: Tensor) -> bool:
    dims = (q_BHSD.shape[-1], v_BHSD.shape[-1])
    return (
        FLEX["enabled"]
        and q_BHSD.is_cuda
        and all(16 <= d <= 256 and d & (d - 1) == 0 for d in dims)
        and min(q_BHSD.shape[2], v_BHSD.shape[2]) > 0
    )


def _mask_rules(seq_q, seq_k, device, q_positions, kv_positions, q_document_ids,
                kv_document_ids):  # fmt: skip
    """The given positions and document ids as int64 [B or 1, S] (None where not given)."""
    given = [q_positions, kv_positions, q_document_ids, kv_document_ids]
    lengths = [seq_q, seq_k, seq_q, seq_k]
    return [
        None if t is None else _positions(t, n, device) for t, n in zip(given, lengths, strict=True)
    ]


def _mask_mod(causal, window, batch, rules):
    """flex's mask_mod for :func:`visible_mask`'s rules (``rules`` from :func:`_mask_rules`).

    The kernel evaluates it in partial blocks for every row of the batch: hence the
    (stride-0) expansion of the given rules to the full batch. Missing positions are indices.
    """
    q_pos, kv_pos, q_doc, kv_doc = (
        None if t is None else t.expand(batch, t.shape[1]) for t in rules
    )

    def visible(b, h, q_idx, kv_idx):
        q_at = q_idx if q_pos is None else q_pos[b, q_idx]
        kv_at = kv_idx if kv_pos is None else kv_pos[b, kv_idx]
        distance = q_at - kv_at
        seen = distance >= 0 if causal else distance == distance
        if window is not None:
            seen = seen & (distance < window)
        if q_doc is not None:
            seen = seen & (q_doc[b, q_idx] == kv_doc[b, kv_idx])
        return seen

    return visible


def _block_mask(
    causal, window, batch, seq_q, seq_k, device,
    q_positions, kv_positions, q_document_ids, kv_document_ids,
):  # fmt: skip
    """flex's BlockMask for :func:`visible_mask`'s rules (arguments as there), from
    ``create_block_mask``, which evaluates the rules over every (query, key) pair."""
    rules = _mask_rules(seq_q, seq_k, device, q_positions, kv_positions, q_document_ids,
                        kv_document_ids)  # fmt: skip
    # One block mask for the whole batch when no rule varies by row.
    mask_batch = max([t.shape[0] for t in rules if t is not None], default=1)
    visible = _mask_mod(causal, window, batch, rules)
    return create_block_mask(visible, mask_batch, None, seq_q, seq_k, device=device)


_FLEX_BLOCK = 128  # flex_attention's default block size, both dims


def _block_ranges(ids_BS: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """Smallest and largest id in each 128-token block: two int64 [B, ceil(S/128)]."""
    num_blocks = -(-length // _FLEX_BLOCK)
    pad = num_blocks * _FLEX_BLOCK - length  # the last id repeated: the ranges stay exact
    padded = torch.cat([ids_BS, ids_BS[:, -1:].expand(-1, pad)], dim=1)
    blocks = padded.view(ids_BS.shape[0], num_blocks, _FLEX_BLOCK)
    return blocks.amin(-1), blocks.amax(-1)


def _document_block_mask(causal, window, batch, seq_q, seq_k, device,
                         q_document_ids, kv_document_ids):  # fmt: skip
    """The BlockMask of causal / window rules on indices plus documents, classified per
    (query block, key block) from the blocks' document ranges and index distances: O(B ·
    Sq/128 · Sk/128) work, where ``create_block_mask`` evaluates every (query, key) pair
    (per call, so per layer). Its full blocks (where the kernel skips the rules) equal
    create_block_mask's; its partial blocks are a superset, equal for self-attention with
    non-decreasing ids (packed rows, as ``document_ids`` numbers them), more where blocks'
    id ranges overlap without a shared id. Blocks at a sequence end are always partial."""
    rules = _mask_rules(seq_q, seq_k, device, None, None, q_document_ids, kv_document_ids)
    q_doc, kv_doc = rules[2], rules[3]
    q_low, q_high = _block_ranges(q_doc, seq_q)  # [Bq, QB]
    kv_low, kv_high = _block_ranges(kv_doc, seq_k)  # [Bk, KB]
    # Some key shares a query's document only if the blocks' id ranges overlap; all do
    # only if both blocks hold one and the same document.
    some = (q_low[:, :, None] <= kv_high[:, None, :]) & (kv_low[:, None, :] <= q_high[:, :, None])
    one_q, one_kv = q_low == q_high, kv_low == kv_high
    every = one_q[:, :, None] & one_kv[:, None, :] & (q_low[:, :, None] == kv_low[:, None, :])
    # Index distances q - k over a block pair run from first_q - last_k to last_q - first_k.
    q_first = torch.arange(0, seq_q, _FLEX_BLOCK, device=device)
    kv_first = torch.arange(0, seq_k, _FLEX_BLOCK, device=device)
    q_last = (q_first + _FLEX_BLOCK - 1).clamp(max=seq_q - 1)
    kv_last = (kv_first + _FLEX_BLOCK - 1).clamp(max=seq_k - 1)
    low = q_first[:, None] - kv_last[None, :]  # [QB, KB]
    high = q_last[:, None] - kv_first[None, :]
    if causal:
        some, every = some & (high >= 0), every & (low >= 0)
    if window is not None:
        some, every = some & (low < window), every & (high < window)
    whole = (q_last - q_first == _FLEX_BLOCK - 1)[:, None] & (kv_last - kv_first == _FLEX_BLOCK - 1)
    full = every & whole
    partial = some & ~full

    def indices(blocks):  # [B, QB, KB] bool -> counts [B, 1, QB], listed blocks first
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)
        return blocks.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    return BlockMask.from_kv_blocks(
        *indices(partial), *indices(full), BLOCK_SIZE=_FLEX_BLOCK,
        mask_mod=_mask_mod(causal, window, batch, rules), seq_lengths=(seq_q, seq_k),
    )  # fmt: skip


@lru_cache(maxsize=16)
def _index_block_mask(causal, window, seq_q, seq_k, device, inference_mode):
    """The block mask of causal / window rules on indices, built once per shape (every
    layer of a step, and every step, reuses it); keyed on inference mode too, since
    tensors made under it cannot be saved for a backward."""
    del inference_mode
    return _block_mask(causal, window, 1, seq_q, seq_k, device, None, None, None, None)


def _flex_attention_lse(
    q_BHSD: Tensor,
    k_BHSD: Tensor,
    v_BHSD: Tensor,
    *,
    causal: bool,
    scale: float | None,
    window: int | None,
    q_positions: Tensor | None,
    kv_positions: Tensor | None,
    q_document_ids: Tensor | None,
    kv_document_ids: Tensor | None,
    compiled: bool = True,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of :func:`attention` without sinks, by ``flex_attention``.

    The block mask applies :func:`visible_mask`'s rules per (query, key) pair; a query
    that sees no key gets output 0 and LSE -inf, as the reference. ``compiled=False`` runs
    flex eagerly (its unfused math path), which is how CPU tests check the mask logic.
    """
    batch, seq_q, seq_k = q_BHSD.shape[0], q_BHSD.shape[2], k_BHSD.shape[2]
    device = q_BHSD.device
    _check_documents(q_document_ids, kv_document_ids)
    block_mask = None
    if q_positions is None and kv_positions is None and q_document_ids is None:
        if causal or window is not None:  # rules on indices only: one mask per shape
            block_mask = _index_block_mask(
                causal, window, seq_q, seq_k, device, torch.is_inference_mode_enabled()
            )
    elif q_positions is None and kv_positions is None:
        block_mask = _document_block_mask(
            causal, window, batch, seq_q, seq_k, device, q_document_ids, kv_document_ids
        )
    else:
        block_mask = _block_mask(
            causal, window, batch, seq_q, seq_k, device,
            q_positions, kv_positions, q_document_ids, kv_document_ids,
        )  # fmt: skip
    run = _compiled_flex() if compiled else flex_attention
    out, aux = run(
        q_BHSD, k_BHSD, v_BHSD, block_mask=block_mask, scale=scale,
        enable_gqa=q_BHSD.shape[1] != k_BHSD.shape[1], return_aux=AuxRequest(lse=True),
    )  # fmt: skip
    return out, aux.lse


def attention(
    q_BHSD: Tensor,
    k_BHSD: Tensor,
    v_BHSD: Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
    sinks: Tensor | None = None,
    q_positions: Tensor | None = None,
    kv_positions: Tensor | None = None,
    q_document_ids: Tensor | None = None,
    kv_document_ids: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Softmax attention of queries over keys, with GQA when k/v have fewer heads.

    Args:
        q_BHSD: Queries [B, Hq, Sq, Dqk].
        k_BHSD: Keys [B, Hkv, Sk, Dqk], Hq a multiple of Hkv.
        v_BHSD: Values [B, Hkv, Sk, Dv].
        causal: Mask keys after the query position.
        scale: Multiplier of q·k; ``1 / sqrt(Dqk)`` when None.
        window: Sliding window: each query sees at most this many most recent keys
            (itself included); None for no limit.
        sinks: fp32 sink logit per query head [Hq], or None for no sinks.
        q_positions: Global query positions [Sq] or [B, Sq] (None: ``arange(Sq)``).
        kv_positions: Global key positions [Sk] or [B, Sk] (None: ``arange(Sk)``).
        q_document_ids: Document of each query [Sq] or [B, Sq] (packed rows), or None.
        kv_document_ids: Document of each key [Sk] or [B, Sk], or None.
        return_lse: Also return the fp32 log-sum-exp of the scaled scores per query
            (including the sink term when sinks are given).

    Returns:
        ``out`` [B, Hq, Sq, Dv] in the dtype of q, or ``(out, lse)`` with lse [B, Hq, Sq]
        in fp32 (fp64 for fp64 q on CPU) when ``return_lse``.
    """
    _check(q_BHSD, k_BHSD, v_BHSD, window, sinks, scale)
    _check_rules(
        q_BHSD, k_BHSD, q_positions=q_positions, kv_positions=kv_positions,
        q_document_ids=q_document_ids, kv_document_ids=kv_document_ids,
    )  # fmt: skip
    kwargs = dict(
        causal=causal,
        scale=scale,
        window=window,
        sinks=sinks,
        q_positions=q_positions,
        kv_positions=kv_positions,
        q_document_ids=q_document_ids,
        kv_document_ids=kv_document_ids,
    )
    indexed = q_positions is None and kv_positions is None
    plain = window is None and q_document_ids is None and kv_document_ids is None and indexed
    needs_lse = return_lse or sinks is not None
    flex = _flex_supported(q_BHSD, v_BHSD)
    if needs_lse and not flex:
        return attention_reference(q_BHSD, k_BHSD, v_BHSD, return_lse=return_lse, **kwargs)
    if FLEX["masks"] not in _MASK_ROUTES:
        raise ValueError(f"FLEX['masks'] ({FLEX['masks']!r}) must be one of {_MASK_ROUTES}")
    masked_flex = FLEX["masks"] == "all" or (FLEX["masks"] == "auto" and indexed)
    if needs_lse or (flex and not plain and masked_flex):
        del kwargs["sinks"]
        out, lse = _with_sinks(*_flex_attention_lse(q_BHSD, k_BHSD, v_BHSD, **kwargs), sinks)
        return (out, lse) if return_lse else out
    enable_gqa = q_BHSD.shape[1] != k_BHSD.shape[1]
    if plain:
        return F.scaled_dot_product_attention(
            q_BHSD, k_BHSD, v_BHSD, is_causal=causal, scale=scale, enable_gqa=enable_gqa
        )
    mask = visible_mask(
        q_positions,
        kv_positions,
        q_BHSD.shape[2],
        k_BHSD.shape[2],
        causal=causal,
        window=window,
        device=q_BHSD.device,
        q_document_ids=q_document_ids,
        kv_document_ids=kv_document_ids,
    )
    # Causal self-attention by index always shows a query itself: no check, no host sync.
    self_attention = causal and q_BHSD.shape[2] == k_BHSD.shape[2]
    positioned = q_positions is not None or kv_positions is not None or not self_attention
    if mask is not None and positioned and not bool(mask.any(-1).all()):
        # SDPA returns NaN for a query that sees no key; the reference returns 0.
        return attention_reference(q_BHSD, k_BHSD, v_BHSD, **kwargs)
    return F.scaled_dot_product_attention(
        q_BHSD, k_BHSD, v_BHSD, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )


def attention_reference(
    q_BHSD: Tensor,
    k_BHSD: Tensor,
    v_BHSD: Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
    sinks: Tensor | None = None,
    q_positions: Tensor | None = None,
    kv_positions: Tensor | None = None,
    q_document_ids: Tensor | None = None,
    kv_document_ids: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Explicit reference of :func:`attention`: scores, mask, log-sum-exp, softmax, sinks;
    computed in fp32 (fp64 for fp64 q).

    Args:
        q_BHSD: Queries [B, Hq, Sq, Dqk].
        k_BHSD: Keys [B, Hkv, Sk, Dqk], Hq a multiple of Hkv.
        v_BHSD: Values [B, Hkv, Sk, Dv].
        causal: Mask keys after the query position.
        scale: Multiplier of q·k; ``1 / sqrt(Dqk)`` when None.
        window: Sliding window in keys (itself included), or None.
        sinks: fp32 sink logit per query head [Hq], or None.
        q_positions: Global query positions [Sq] or [B, Sq] (None: ``arange(Sq)``).
        kv_positions: Global key positions [Sk] or [B, Sk] (None: ``arange(Sk)``).
        q_document_ids: Document of each query [Sq] or [B, Sq] (packed rows), or None.
        kv_document_ids: Document of each key [Sk] or [B, Sk], or None.
        return_lse: Also return the fp32 log-sum-exp (including the sink term).

    Returns:
        ``out`` [B, Hq, Sq, Dv] in the dtype of q, or ``(out, lse)`` with lse [B, Hq, Sq]
        in fp32 (fp64 for fp64 q) when ``return_lse``.
    """
    _check(q_BHSD, k_BHSD, v_BHSD, window, sinks, scale)
    _check_rules(
        q_BHSD, k_BHSD, q_positions=q_positions, kv_positions=kv_positions,
        q_document_ids=q_document_ids, kv_document_ids=kv_document_ids,
    )  # fmt: skip
    # In fp32 under autocast too (it would run the matmuls in BF16 and return a BF16 LSE):
    # as flex does on CUDA, which autocast leaves alone.
    with autocast_off(q_BHSD.device):
        return _attention_math(
            q_BHSD, k_BHSD, v_BHSD, causal=causal, scale=scale, window=window, sinks=sinks,
            q_positions=q_positions, kv_positions=kv_positions, q_document_ids=q_document_ids,
            kv_document_ids=kv_document_ids, return_lse=return_lse,
        )  # fmt: skip


def _attention_math(
    q_BHSD, k_BHSD, v_BHSD, *, causal, scale, window, sinks, q_positions, kv_positions,
    q_document_ids, kv_document_ids, return_lse,
):  # fmt: skip
    """The body of :func:`attention_reference` (arguments checked, autocast off)."""
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    group = q_BHSD.shape[1] // k_BHSD.shape[1]
    dtype = compute_dtype(q_BHSD.dtype)
    k = k_BHSD.to(dtype).repeat_interleave(group, dim=1)  # [B, Hq, Sk, Dqk]
    v = v_BHSD.to(dtype).repeat_interleave(group, dim=1)  # [B, Hq, Sk, Dv]
    scores = torch.matmul(q_BHSD.to(dtype), k.transpose(-2, -1)) * scale  # [B, Hq, Sq, Sk]
    mask = visible_mask(
        q_positions,
        kv_positions,
        scores.shape[-2],
        scores.shape[-1],
        causal=causal,
        window=window,
        device=scores.device,
        q_document_ids=q_document_ids,
        kv_document_ids=kv_document_ids,
    )
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # A row with no visible key: max 0, sum 0 → out 0, lse -inf, finite gradients.
    if scores.shape[-1] == 0:  # no keys at all (empty sequence)
        row_max = scores.new_zeros(*scores.shape[:-1], 1)
    else:
        row_max = scores.amax(dim=-1, keepdim=True).detach()  # [B, Hq, Sq, 1]
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp_scores = torch.exp(scores - row_max)  # [B, Hq, Sq, Sk]
    row_sum = exp_scores.sum(dim=-1, keepdim=True)  # [B, Hq, Sq, 1]
    has_keys = row_sum > 0
    safe_sum = torch.where(has_keys, row_sum, torch.ones_like(row_sum))
    probs = exp_scores / safe_sum
    lse = torch.where(
        has_keys, row_max + torch.log(safe_sum), torch.full_like(row_sum, float("-inf"))
    ).squeeze(-1)  # [B, Hq, Sq]
    out = torch.matmul(probs, v)  # [B, Hq, Sq, Dv]
    out, lse = _with_sinks(out, lse, sinks)
    out = out.to(q_BHSD.dtype)
    return (out, lse) if return_lse else out
