"""Train mt-data's default tokenizer on this Python's standard library sources.

Writes packages/mt-data/src/mt_data/assets/tokenizer.json (and tokenizer_config.json):
a byte-level BPE with 4096 entries, `<|endoftext|>` (id 0) as the end-of-document token,
a byte-level pre-tokenizer and decoder, so any text round-trips. The documents are
exactly those of the default corpus (`mt_data.default_corpus.iter_default_documents`).

Run it once, from the repository root, and commit the result:

    uv run python tools/train_default_tokenizer.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mt_data.default_corpus import default_tokenizer_path, iter_default_documents

VOCAB_SIZE = 4096
EOS_TOKEN = "<|endoftext|>"


def train(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE on the default corpus's documents.

    Args:
        vocab_size: Entries in the vocabulary, the EOS token and 256 byte symbols included.

    Returns:
        The trained tokenizer.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_default_documents(), trainer=trainer)
    return tokenizer


def main() -> None:
    """Train and write the tokenizer files into mt-data's assets directory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=default_tokenizer_path().parent)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()
    start = time.perf_counter()
    tokenizer = train(args.vocab_size)
    args.output.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.output / "tokenizer.json"), pretty=False)
    config = {"eos_token": EOS_TOKEN}
    (args.output / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    size = (args.output / "tokenizer.json").stat().st_size
    print(
        f"wrote {args.output / 'tokenizer.json'} ({size / 1024:.0f} KiB, vocab "
        f"{tokenizer.get_vocab_size()}) in {time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
