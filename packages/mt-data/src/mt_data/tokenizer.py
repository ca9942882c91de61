"""Load a Hugging Face `tokenizers` tokenizer and find its end-of-document token."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

__all__ = ["FALLBACK_EOS_TOKENS", "LoadedTokenizer", "load_tokenizer"]

# Tried in order when no tokenizer_config.json names the EOS token.
FALLBACK_EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer with the facts a corpus needs.

    Attributes:
        tokenizer: The `tokenizers.Tokenizer`.
        path: The tokenizer.json it was read from (absolute).
        eos_token: The end-of-document token's text, appended to every document.
        eos_id: Its id.
        vocab_size: Number of ids including added tokens (decides the token dtype).
    """

    tokenizer: Tokenizer
    path: Path
    eos_token: str
    eos_id: int
    vocab_size: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens and without the EOS.

        Args:
            texts: Documents to tokenize (in parallel inside the `tokenizers` library).

        Returns:
            One list of ids per text.
        """
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [encoding.ids for encoding in encodings]


def _eos_from_config(config_path: Path) -> str | None:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_path}: cannot read it as JSON ({e}); fix or remove it") from e
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):  # the AddedToken form: {"content": "</s>", ...}
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def load_tokenizer(path: str | Path) -> LoadedTokenizer:
    """Read a tokenizer.json (or a directory holding one) and resolve its EOS token.

    The EOS token is `eos_token` of the `tokenizer_config.json` beside the tokenizer.json
    when there is one, else the first of `FALLBACK_EOS_TOKENS` in the vocabulary.

    Args:
        path: A `tokenizer.json` file, or a directory (a Hugging Face model directory)
            holding `tokenizer.json` and usually `tokenizer_config.json`.

    Returns:
        The loaded tokenizer with its EOS id and vocabulary size.

    Raises:
        FileNotFoundError: If there is no tokenizer.json at `path`.
        ValueError: If the file cannot be parsed or no EOS token can be found.
    """
    path = Path(path).expanduser().resolve()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"tokenizer {file}: no such file; pass a tokenizer.json or a directory holding one"
        )
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a bare Exception
        raise ValueError(f"{file}: not a valid tokenizers JSON file ({e})") from e

    config_path = file.parent / "tokenizer_config.json"
    if config_path.is_file():
        eos_token = _eos_from_config(config_path)
        if eos_token is None:
            raise ValueError(f"{config_path}: has no string 'eos_token'; add one")
        source = str(config_path)
    else:
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        eos_token = next((t for t in FALLBACK_EOS_TOKENS if t in vocab), None)
        if eos_token is None:
            raise ValueError(
                f"{file}: cannot find the EOS token: there is no tokenizer_config.json beside "
                f"it and none of {FALLBACK_EOS_TOKENS} is in the vocabulary; write a "
                'tokenizer_config.json with {"eos_token": "..."} next to it'
            )
        source = "the fallback list"
    eos_id = tokenizer.token_to_id(eos_token)
    if eos_id is None:
        raise ValueError(
            f"EOS token {eos_token!r} (from {source}) is not in the vocabulary of {file}"
        )
    return LoadedTokenizer(
        tokenizer=tokenizer,
        path=file,
        eos_token=eos_token,
        eos_id=eos_id,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
    )
