"""mt-data: build and read tokenized corpora for moetrain, on a CPU box, without torch.

Corpora are directories of Megatron-LM indexed shards (`.bin` tokens + `.idx` index) plus
a `manifest.json`, so they move both ways between moetrain and Megatron-LM / NeMo.

- `build_corpus` (CLI `mt-data build`) tokenizes `.jsonl` / `.jsonl.zst` / `.parquet`
  files in worker processes, resumably and crash-safely; `mt-data inspect` shows a corpus.
- `TokenDataset` packs corpora into fixed-length samples, shuffles them globally per
  epoch, mixes corpora by weight, slices each global batch per data rank and per
  context-parallel range (`zigzag_ranges`), returns document positions on request, and
  saves its position for exact resume.
- `default_corpus_dir` builds and caches the embedded default corpus (this Python's
  standard library, tokenized with the packaged `default_tokenizer_path()` BPE), so
  training runs offline on a fresh machine.
- `IndexedDataset` / `IndexedDatasetWriter` read and write single shards.
"""

from mt_data.build import build_corpus
from mt_data.dataset import DataExhausted, TokenDataset, zigzag_ranges
from mt_data.default_corpus import default_corpus_dir, default_tokenizer_path
from mt_data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype

__all__ = [
    "DataExhausted",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "TokenDataset",
    "build_corpus",
    "default_corpus_dir",
    "default_tokenizer_path",
    "token_dtype",
    "zigzag_ranges",
]
