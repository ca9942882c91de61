"""Load a Hugging Face `tokenizers` tokenizer and find its end-of-document token.

Document text is encoded as plain text: a literal `<|endoftext|>` inside a document is
tokenized as the characters it is made of, never as the EOS id (the tokenizer's
`encode_special_tokens` is switched on), so only the builder decides where documents end.
Truncation and padding that a tokenizer.json may set are switched off: documents are
stored whole and unpadded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

__all__ = [
    "FALLBACK_EOS_TOKENS",
    "SPECIAL_TOKEN_FILES",
    "LoadedTokenizer",
    "TokenizerSpec",
    "load_tokenizer",
    "read_tokenizer",
]

# The files beside a tokenizer.json that may name its special tokens (`eos_token`,
# `bos_token`: a string or an AddedToken dict); `_special_token` says which is asked first.
SPECIAL_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# Files of tokenizers `transformers` reads without a tokenizer.json (sentencepiece, BPE
# vocab + merges, WordPiece); it converts them and `save_pretrained` writes one.
_SLOW_TOKENIZER_FILES = frozenset({"tokenizer.model", "vocab.json", "merges.txt", "vocab.txt"})
# Tried in order when none of SPECIAL_TOKEN_FILES names the EOS token.
FALLBACK_EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


@dataclass(frozen=True)
class TokenizerSpec:
    """How to load a tokenizer: picklable, so worker processes can load the same one.

    Attributes:
        path: A tokenizer.json or a directory holding one.
        eos_token: EOS override; None takes `eos_token` of tokenizer_config.json (or
            special_tokens_map.json, or a known EOS in the vocabulary: `load_tokenizer`).
        bos: Prepend a BOS token: False, True (`bos_token` of tokenizer_config.json or
            special_tokens_map.json), or the token's text.
    """

    path: str
    eos_token: str | None = None
    bos: bool | str = False


@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer with the facts a corpus needs.

    Attributes:
        tokenizer: The `tokenizers.Tokenizer`.
        path: The tokenizer.json it was read from (absolute).
        eos_token: The end-of-document token's text, appended to every document.
        eos_id: Its id.
        vocab_size: Number of ids including added tokens (decides the token dtype).
        bos_token: The token prepended to every document, or None.
        bos_id: Its id, or None.
    """

    tokenizer: Tokenizer
    path: Path
    eos_token: str
    eos_id: int
    vocab_size: int
    bos_token: str | None = None
    bos_id: int | None = None

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each document as stored: [BOS] + text ids + EOS.

        Args:
            texts: Documents to tokenize; special-token text inside them is plain text.

        Returns:
            One list of ids per text.
        """
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        eos = [self.eos_id]
        if self.bos_id is None:
            return [encoding.ids + eos for encoding in encodings]
        bos = [self.bos_id]
        return [bos + encoding.ids + eos for encoding in encodings]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens and without the EOS.

        Args:
            texts: Documents to tokenize (in parallel inside the `tokenizers` library).

        Returns:
            One list of ids per text.
        """
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [encoding.ids for encoding in encodings]


def _read_config(config_path: Path, parsed: dict[Path, dict]) -> dict:
    """The JSON object in `config_path` ({} for another JSON value), parsed once per load:
    `parsed` holds the files this load has parsed already."""
    if config_path not in parsed:
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(
                f"{config_path}: cannot read it as JSON ({e}); fix or remove it"
            ) from e
        parsed[config_path] = config if isinstance(config, dict) else {}
    return parsed[config_path]


def _token_from_config(config_path: Path, key: str, parsed: dict[Path, dict]) -> str | None:
    token = _read_config(config_path, parsed).get(key)
    if isinstance(token, dict):  # the AddedToken form: {"content": "</s>", ...}
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def _special_token(file: Path, key: str, parsed: dict[Path, dict]) -> tuple[str | None, str]:
    """`key` (`eos_token`, `bos_token`) from the files beside `file` that may name it:
    (token, that file), or (None, what was looked at). `parsed`: see `_read_config`.

    The first that names it, in transformers' precedence: a tokenizer_config.json with
    `added_tokens_decoder` (saved by transformers >= 4.34, which then does not read
    special_tokens_map.json) first, else special_tokens_map.json first (older files: its
    tokens override tokenizer_config.json's).
    """
    config_path = file.parent / SPECIAL_TOKEN_FILES[0]
    modern = config_path.is_file() and "added_tokens_decoder" in _read_config(config_path, parsed)
    looked = {}
    for name in SPECIAL_TOKEN_FILES if modern else SPECIAL_TOKEN_FILES[::-1]:
        path = file.parent / name
        if not path.is_file():
            looked[name] = f"there is no {name}"
            continue
        token = _token_from_config(path, key, parsed)
        if token is not None:
            return token, str(path)
        looked[name] = f"{path} names no {key!r}"
    return None, ", ".join(looked[name] for name in SPECIAL_TOKEN_FILES)


def read_tokenizer(path: str | Path) -> tuple[Tokenizer, Path]:
    """Parse a tokenizer.json (or the one in a directory) as it is, say to decode with it;
    no EOS token is looked for.

    Args:
        path: A `tokenizer.json` file, or a directory holding one.

    Returns:
        The `tokenizers.Tokenizer` and the absolute path of the file it was read from.

    Raises:
        FileNotFoundError: If there is no tokenizer.json at `path`.
        ValueError: If the file cannot be parsed.
    """
    path = Path(path).expanduser().resolve()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        slow = [name for name in sorted(_SLOW_TOKENIZER_FILES) if (file.parent / name).is_file()]
        if path.is_dir() and slow:
            raise FileNotFoundError(
                f"tokenizer {file}: no such file; {path} holds only a slow tokenizer "
                f"({', '.join(slow)}); write its tokenizer.json with transformers: "
                f"AutoTokenizer.from_pretrained({str(path)!r}).save_pretrained({str(path)!r})"
            )
        raise FileNotFoundError(
            f"tokenizer {file}: no such file; pass a tokenizer.json or a directory holding one"
        )
    try:
        return Tokenizer.from_file(str(file)), file
    except Exception as e:  # the Rust side raises a bare Exception
        raise ValueError(f"{file}: not a valid tokenizers JSON file ({e})") from e


def load_tokenizer(
    path: str | Path, *, eos_token: str | None = None, bos: bool | str = False
) -> LoadedTokenizer:
    """Read a tokenizer.json (or a directory holding one) and resolve its EOS token.

    The EOS token is `eos_token` when given, else `eos_token` of the
    `tokenizer_config.json` or `special_tokens_map.json` beside the tokenizer.json (where
    both name one, the one `transformers` takes: tokenizer_config.json's when it has
    `added_tokens_decoder`, else special_tokens_map.json's), else the first of
    `FALLBACK_EOS_TOKENS` in the vocabulary (added tokens included).

    Args:
        path: A `tokenizer.json` file, or a directory (a Hugging Face model directory)
            holding `tokenizer.json` and usually `tokenizer_config.json`.
        eos_token: The EOS token's text, overriding the config.
        bos: Prepend a BOS token to every document: False (default), True for
            `bos_token` of tokenizer_config.json (or special_tokens_map.json), or the
            token's text.

    Returns:
        The loaded tokenizer with its EOS id and vocabulary size.

    Raises:
        FileNotFoundError: If there is no tokenizer.json at `path`.
        ValueError: If the file cannot be parsed or no EOS token can be found.
    """
    tokenizer, file = read_tokenizer(path)
    tokenizer.encode_special_tokens = True  # "<|endoftext|>" in a document is plain text
    # A tokenizer.json may carry truncation and padding for a model's inputs (max_length
    # 512, pad to the batch's longest): documents would be cut short or padded, silently.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    parsed: dict[Path, dict] = {}  # tokenizer_config.json is read for the EOS and the BOS
    if eos_token is not None:
        source = "the eos_token argument"
    else:
        eos_token, source = _special_token(file, "eos_token", parsed)
    if eos_token is None:
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        eos_token = next((t for t in FALLBACK_EOS_TOKENS if t in vocab), None)
        if eos_token is None:
            raise ValueError(
                f"{file}: cannot find the EOS token: {source}, and none of "
                f"{', '.join(FALLBACK_EOS_TOKENS)} is in its vocabulary; pass the token that "
                "ends a document as --eos-token TOKEN (eos_token= in Python), or add "
                f'"eos_token" to {file.parent / SPECIAL_TOKEN_FILES[0]}'
            )
        source = "the fallback list"
    eos_id = tokenizer.token_to_id(eos_token)
    if eos_id is None:
        raise ValueError(
            f"EOS token {eos_token!r} (from {source}) is not in the vocabulary of {file}; "
            "pass the token that ends a document as --eos-token TOKEN (eos_token= in Python)"
        )
    bos_token, bos_id = _resolve_bos(tokenizer, file, bos, parsed)
    return LoadedTokenizer(
        tokenizer=tokenizer,
        path=file,
        eos_token=eos_token,
        eos_id=eos_id,
        vocab_size=_vocab_size(tokenizer),
        bos_token=bos_token,
        bos_id=bos_id,
    )


def _vocab_size(tokenizer: Tokenizer) -> int:
    """Largest token id + 1 (ids may have gaps, so not the number of entries)."""
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    return max(ids, default=-1) + 1


def _resolve_bos(
    tokenizer: Tokenizer, file: Path, bos: bool | str, parsed: dict[Path, dict]
) -> tuple[str | None, int | None]:
    if bos is False:
        return None, None
    if bos is True:
        token, looked = _special_token(file, "bos_token", parsed)
        if token is None:
            raise ValueError(
                f"bos=True (--bos) takes 'bos_token' from {' or '.join(SPECIAL_TOKEN_FILES)} "
                f"beside {file}, but {looked}; pass the BOS token's text instead "
                "(--bos-token TOKEN)"
            )
    elif isinstance(bos, str) and bos:
        token = bos
    else:
        raise ValueError(f"bos ({bos!r}) must be False, True or a token's text (--bos-token TOKEN)")
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"BOS token {token!r} is not in the vocabulary of {file}")
    return token, token_id
