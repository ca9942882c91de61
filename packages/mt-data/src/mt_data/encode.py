"""Turn a `RawBatch` into tokens: the work each builder worker process does.

`encode_batch` parses the batch's JSON lines (or takes its Parquet texts), tokenizes the
documents with one `encode_batch_fast` call, appends EOS (and prepends BOS if asked) and
returns the tokens of the whole batch as one array plus one length per document, so the
result crosses the process boundary as two buffers rather than a million Python ints.

The same function runs in the main process when the build uses no worker processes, so
the output cannot depend on the number of workers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from mt_data.sources import BadLine, RawBatch
from mt_data.tokenizer import LoadedTokenizer, TokenizerSpec, load_tokenizer

__all__ = ["EncodedBatch", "encode_batch", "init_worker", "worker_encode_batch"]

_UTF8_BOM = b"\xef\xbb\xbf"


@dataclass
class EncodedBatch:
    """The tokens of one batch of documents.

    Attributes:
        tokens: Every kept document's tokens, EOS included, back to back (int64).
        lengths: Tokens per kept document (int64), in input order.
        bad_lines: Items that could not become a document, with their line numbers.
        empty_documents: Documents whose text was empty, skipped.
        num_bytes: Input bytes the batch accounts for.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    bad_lines: list[BadLine] = field(default_factory=list)
    empty_documents: int = 0
    num_bytes: int = 0


def _loads(line: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        raise
    except ValueError:
        # Valid JSON with a number of more than 4300 digits in some field, which int()
        # refuses (sys.get_int_max_str_digits): read integers as floats, the text needs none.
        return json.loads(line, parse_int=float)


def _parse_line(raw: bytes, text_key: str) -> str | tuple[str, str]:
    """The document text of one JSON line, or (kind, reason) when there is none."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return "invalid_utf8", f"invalid UTF-8 at byte {e.start}"
    try:
        record = _loads(line)
    except json.JSONDecodeError as e:
        return "malformed_json", f"malformed JSON ({e.msg} at column {e.colno})"
    except RecursionError:  # json's parser recurses once per nesting level
        return "malformed_json", "malformed JSON (nested too deeply to parse)"
    if not isinstance(record, dict):
        return "not_an_object", f"expected a JSON object, got {type(record).__name__}"
    if text_key not in record:
        keys = ", ".join(list(record)[:5])
        return "missing_text", f"no {text_key!r} field (fields: {keys})"
    return _check_text(record[text_key], text_key, "\\u" in line)


def _check_text(text: object, text_key: str, may_hold_surrogates: bool) -> str | tuple[str, str]:
    if isinstance(text, bytes):  # a Parquet binary column
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            return "invalid_utf8", f"field {text_key!r}: invalid UTF-8 at byte {e.start}"
    if text is None:
        return "missing_text", f"field {text_key!r} is null"
    if not isinstance(text, str):
        return "non_string_text", f"field {text_key!r} is {type(text).__name__}, not a string"
    if may_hold_surrogates:
        # JSON escapes can spell lone surrogates ("\ud800"), which are not text.
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "invalid_utf8", f"field {text_key!r} holds a lone surrogate escape"
    return text


def encode_batch(
    batch: RawBatch, tokenizer: LoadedTokenizer, text_key: str, path: str
) -> EncodedBatch:
    """Parse and tokenize one batch.

    Args:
        batch: Raw JSON lines or texts of one file.
        tokenizer: The loaded tokenizer (BOS/EOS settings included).
        text_key: JSON field holding the text.
        path: The input file, for bad-line messages.

    Returns:
        The batch's tokens and counts.
    """
    texts: list[str] = []
    bad: list[BadLine] = []
    empty = 0
    for offset, item in enumerate(batch.items):
        if batch.kind == "jsonl":
            if item.startswith(_UTF8_BOM):
                # Files saved by some editors start with one; files (or zstd frames) joined
                # with `cat` hold one at a later line. No JSON line can start with it.
                item = item[len(_UTF8_BOM) :]
            if not item.strip():
                continue  # blank lines are not documents
            parsed = _parse_line(item, text_key)
        else:
            parsed = _check_text(item, text_key, True)
        if isinstance(parsed, tuple):
            bad.append(BadLine(path, batch.first_line + offset, *parsed))
        elif not parsed:
            empty += 1
        else:
            texts.append(parsed)
    ids_per_doc = tokenizer.encode_documents(texts)
    lengths = np.fromiter((len(ids) for ids in ids_per_doc), dtype=np.int64, count=len(texts))
    flat: list[int] = []
    for ids in ids_per_doc:
        flat += ids
    tokens = np.array(flat, dtype=np.int64)
    return EncodedBatch(tokens, lengths, bad, empty, batch.num_bytes)


# Worker-process state: the tokenizer is loaded once per process by `init_worker`.
_WORKER: dict[str, object] = {}


def init_worker(spec: TokenizerSpec, text_key: str) -> None:
    """Initializer of a builder worker process: load the tokenizer, single-threaded.

    Args:
        spec: How to load the tokenizer (path, EOS/BOS overrides).
        text_key: JSON field holding the text.
    """
    # Each worker is one process on one core; the tokenizer's own thread pool would
    # oversubscribe the cores the other workers use.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    _WORKER["tokenizer"] = load_tokenizer(spec.path, eos_token=spec.eos_token, bos=spec.bos)
    _WORKER["text_key"] = text_key


def worker_encode_batch(batch: RawBatch, path: str) -> EncodedBatch:
    """`encode_batch` with the tokenizer `init_worker` loaded in this process.

    Args:
        batch: Raw JSON lines or texts of one file.
        path: The input file, for bad-line messages.

    Returns:
        The batch's tokens and counts.
    """
    tokenizer = _WORKER["tokenizer"]
    assert isinstance(tokenizer, LoadedTokenizer), "init_worker did not run in this process"
    return encode_batch(batch, tokenizer, str(_WORKER["text_key"]), path)
