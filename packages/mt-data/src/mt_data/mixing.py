"""Mixing corpora by weight: which corpus each sample of the global order comes from.

Global sample t comes from the corpus that is furthest behind its share,
`argmax_c (w_c · (t + 1) - n_c)`, where n_c counts the samples already taken from
corpus c (Megatron-LM's BlendedDataset rule; ties go to the first corpus). Every prefix
of the order then keeps each corpus within about one sample of its share: within one for
two corpora, while with five or more a corpus can fall up to ~1.2 samples behind
(measured with random weights). The rule depends only on (t, n), which the reader's
state holds.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mt_data.manifest import read_manifest

__all__ = ["PathLike", "corpus_specs", "manifest_facts", "mix_schedule"]

PathLike = str | os.PathLike[str]


def mix_schedule(
    weights_C: np.ndarray, consumed: int, consumed_C: np.ndarray, count: int
) -> np.ndarray:
    """Corpus of each of the next `count` global samples.

    Args:
        weights_C: Normalized weight of each corpus (sums to 1).
        consumed: Samples taken so far, all corpora together.
        consumed_C: Samples taken so far from each corpus.
        count: Samples to schedule.

    Returns:
        int64 corpus index per sample.
    """
    if len(weights_C) == 1:
        return np.zeros(count, dtype=np.int64)
    taken_C = consumed_C.astype(np.float64)
    out = np.empty(count, dtype=np.int64)
    for i in range(count):
        c = int(np.argmax(weights_C * (consumed + i + 1) - taken_C))
        out[i] = c
        taken_C[c] += 1
    return out


def corpus_specs(data: Any) -> list[tuple[list[PathLike], float]]:
    """The corpora of TokenDataset's `data_dir` argument, with their weights.

    Args:
        data: A path, a list of paths (one corpus), or a mapping `{path or tuple of
            paths: weight}` (a mix).

    Returns:
        `[(paths, weight)]`, one entry per corpus.

    Raises:
        ValueError: If `data` is none of those, or a weight is not a positive finite number.
    """
    if isinstance(data, str | os.PathLike):
        return [([data], 1.0)]
    if isinstance(data, Mapping):
        if not data:
            raise ValueError("data_dir is an empty mapping; give {path: weight, ...}")
        specs = []
        for key, weight in data.items():
            paths = [key] if isinstance(key, str | os.PathLike) else list(key)
            if (
                isinstance(weight, bool)
                or not isinstance(weight, numbers.Real)
                or not 0 < weight < math.inf  # NaN too: it compares false
            ):
                raise ValueError(f"weight of {key} ({weight!r}) must be a positive finite number")
            specs.append((paths, float(weight)))
        return specs
    if isinstance(data, Sequence) and data:
        return [(list(data), 1.0)]
    raise ValueError(
        f"data_dir ({data!r}) must be a path, a list of paths (one corpus), or a mapping "
        "{path: weight} (a mix of corpora)"
    )


def manifest_facts(directories: Sequence[PathLike]) -> tuple[int | None, int | None]:
    """The vocabulary size and EOS id the manifests of the shards' directories agree on.

    Args:
        directories: The directories holding the shards (repeats are read once).

    Returns:
        (largest `vocab_size`, `eos_id`), None where no manifest says.

    Raises:
        ValueError: If the manifests name different EOS ids or tokenizer files.
    """
    vocab, eos_ids, hashes = None, set(), set()
    for directory in dict.fromkeys(Path(d) for d in directories):
        manifest = read_manifest(directory) or {}
        if manifest.get("vocab_size") is not None:
            vocab = max(vocab or 0, int(manifest["vocab_size"]))
        if manifest.get("eos_id") is not None:
            eos_ids.add(int(manifest["eos_id"]))
        if manifest.get("tokenizer_sha256"):
            hashes.add(manifest["tokenizer_sha256"])
    if len(eos_ids) > 1 or len(hashes) > 1:
        raise ValueError(
            f"the corpora were built with different tokenizers (EOS ids {sorted(eos_ids)}, "
            f"{len(hashes)} tokenizer files); mix corpora built with one tokenizer"
        )
    return vocab, (eos_ids.pop() if eos_ids else None)
