"""`mt-data inspect`: what a corpus holds, and a decoded sample to eyeball."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from mt_data.corpus import resolve_shards
from mt_data.indexed import IndexedDataset
from mt_data.manifest import file_sha256, read_manifest
from mt_data.tokenizer import read_tokenizer

__all__ = ["inspect_corpus"]


def _decode_start(decoder: Any, tokens: np.ndarray, characters: int) -> str:
    """The first `characters` characters of a sequence's text, "..." after them if it
    has more, decoding only a start of the sequence (a whole book took seconds and GBs).

    The start grows until its text is longer than `characters + 1`: only its last
    character may differ from the whole sequence's text (a character cut in two).
    """
    count = characters + 2
    while True:
        text = decoder.decode(tokens[:count].tolist(), skip_special_tokens=False)
        if count >= len(tokens):
            return text[:characters] + ("..." if len(text) > characters else "")
        if len(text) > characters + 1:
            return text[:characters] + "..."
        count *= 2


def inspect_corpus(
    path: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    documents: int = 1,
    characters: int = 300,
) -> str:
    """A report of a corpus: per shard documents, tokens and dtype; totals; decoded text.

    The decoded sample is the corpus's first `documents` sequences in shard order: the
    first shard's, then the next shard's when it has fewer. A sequence is one document
    in corpora moetrain writes; a Megatron-LM shard may split a document into several.

    Args:
        path: A corpus directory or one shard prefix (Megatron-LM corpora work too).
        tokenizer: Tokenizer to decode with; None uses the one named in manifest.json
            (no decoding when there is neither).
        documents: Sequences to decode, the first in shard order (continuing into later
            shards).
        characters: Characters of each decoded sequence to show.

    Returns:
        The report, several lines.

    Raises:
        ValueError: If `path` holds no shards or a shard is unreadable, `tokenizer` is
            given but unreadable, or `documents` or `characters` is negative.
    """
    for name, value in (("documents", documents), ("characters", characters)):
        if value < 0:
            raise ValueError(f"--{name} ({value}) must be >= 0")
    prefixes = resolve_shards([path])
    shards = [IndexedDataset(p) for p in prefixes]
    lines = [f"{'shard':<32} {'documents':>12} {'tokens':>15}  dtype"]
    for prefix, shard in zip(prefixes, shards, strict=True):
        num_docs = len(shard.document_indices) - 1
        lines.append(f"{prefix.name:<32} {num_docs:>12,} {shard.num_tokens:>15,}  {shard.dtype}")
    total_docs = sum(len(s.document_indices) - 1 for s in shards)
    total_tokens = sum(s.num_tokens for s in shards)
    total = f"total ({len(shards)} shard{'s' if len(shards) != 1 else ''})"
    lines.append(f"{total:<32} {total_docs:>12,} {total_tokens:>15,}")
    manifest = read_manifest(prefixes[0].parent) or {}
    if manifest:
        lines.append(
            f"manifest: tokenizer {manifest.get('tokenizer')}, vocab_size "
            f"{manifest.get('vocab_size')}, eos {manifest.get('eos_token')!r} "
            f"(id {manifest.get('eos_id')}), bad lines {manifest.get('num_bad_lines')}, "
            f"empty documents {manifest.get('num_empty_documents')}"
        )
    # A tokenizer given is loaded (its errors name it); the manifest's may not be on this
    # machine.
    source = tokenizer or manifest.get("tokenizer")
    if source is None:
        lines.append("(no tokenizer to decode with: pass --tokenizer)")
        return "\n".join(lines)
    if tokenizer is None and not Path(source).exists():
        lines.append(f"(the manifest's tokenizer {source} is not here: pass --tokenizer)")
        return "\n".join(lines)
    built_with = manifest.get("tokenizer_sha256")
    if tokenizer is None and built_with is not None and file_sha256(source) != built_with:
        # Retrained or replaced in place: its ids would decode to other text, silently.
        lines.append(
            f"(the manifest's tokenizer {source} has changed since the build (its SHA-256 "
            "differs): pass --tokenizer with the one the corpus was built with)"
        )
        return "\n".join(lines)
    # Only to decode: a tokenizer without a findable EOS (a corpus built with --eos-token)
    # must not stop the report.
    decoder, _ = read_tokenizer(source)
    shown = 0
    for shard in shards:
        for i in range(len(shard)):
            if shown >= documents:
                break
            tokens = shard[i]
            lines.append(f"--- {shard.idx_path.stem} sequence {i}: {len(tokens)} tokens ---")
            lines.append(_decode_start(decoder, tokens, characters))
            shown += 1
    return "\n".join(lines)
