"""Megatron-LM compatibility, checked with Megatron-LM's own code (megatron-core, on CPU).

megatron-core imports torch, so this module costs ~10 s of import once; it is skipped
where megatron-core is not installed (it is in the workspace's dev group).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from mt_data import IndexedDataset, TokenDataset, build_corpus, token_dtype
from mt_data.default_corpus import default_tokenizer_path, iter_default_documents


@pytest.fixture(scope="module")
def megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def _texts() -> list[str]:
    sources = iter_default_documents()
    texts = [next(sources)[:5000] for _ in range(20)]
    return [*texts, "héllo wörld 🎉 日本語\r\n\ttabs", "x" * 3, "<|endoftext|> inside"]


def test_megatron_indexed_dataset_reads_our_corpus_token_for_token(tmp_path, megatron, tokenizer):
    texts = _texts()
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    build_corpus([path], default_tokenizer_path(), tmp_path / "out", workers=1, progress=False)

    theirs = megatron.IndexedDataset(str(tmp_path / "out" / "docs"))
    assert len(theirs) == len(texts)
    assert theirs.index.dtype == np.uint16
    assert theirs.document_indices.tolist() == list(range(len(texts) + 1))
    plain = Tokenizer.from_file(str(default_tokenizer_path()))
    plain.encode_special_tokens = True  # special-token text in a document is plain text
    for i, text in enumerate(texts):
        expected = [*plain.encode(text, add_special_tokens=False).ids, tokenizer.eos_id]
        assert theirs[i].tolist() == expected
        assert theirs.get(i, offset=1, length=2).tolist() == expected[1:3]


def _big_vocab_tokenizer(directory, size: int = 70_000):
    words = {f"w{i}": i for i in range(size - 1)}
    words["<|endoftext|>"] = size - 1
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    return directory


def test_vocabularies_from_65500_are_stored_as_int32_as_megatron_chooses(tmp_path, megatron):
    for vocab in (4096, 65_499, 65_500, 151_936):
        assert np.dtype(megatron.DType.optimal_dtype(vocab)) == token_dtype(vocab)
    tokenizer = _big_vocab_tokenizer(tmp_path / "tok")
    path = tmp_path / "big.jsonl"
    path.write_text('{"text": "w1 w65535 w69998"}\n{"text": "w70000 w3"}\n')
    build_corpus([path], tokenizer, tmp_path / "out", workers=0, progress=False)
    theirs = megatron.IndexedDataset(str(tmp_path / "out" / "big"))
    assert theirs.index.dtype == np.int32
    assert [theirs[i].tolist() for i in range(2)] == [[1, 65535, 69998, 69999], [0, 3, 69999]]


def test_our_writer_and_megatrons_builder_write_the_same_bytes(tmp_path, megatron):
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 4096, size=n) for n in (5, 1, 300, 0, 17)]
    builder = megatron.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for document in documents:
        builder.add_document(document, [len(document)])
    builder.finalize(str(tmp_path / "theirs.idx"))
    from mt_data import IndexedDatasetWriter

    with IndexedDatasetWriter(tmp_path / "ours", np.uint16) as writer:
        for document in documents:
            writer.add_document(document)
    for suffix in (".bin", ".idx"):
        ours = (tmp_path / f"ours{suffix}").read_bytes()
        assert ours == (tmp_path / f"theirs{suffix}").read_bytes()


def test_token_dataset_reads_a_megatron_corpus_with_multi_sentence_documents(tmp_path, megatron):
    # Megatron's preprocess_data --split-sentences writes one sequence per sentence and
    # groups them into documents; position ids must restart per document only.
    documents = [[[11, 12, 13], [14, 15, 0]], [[21, 22, 0]], [[31], [32], [33, 34, 0]]]
    builder = megatron.IndexedDatasetBuilder(str(tmp_path / "meg.bin"), dtype=np.uint16)
    for sentences in documents:
        builder.add_document(np.concatenate(sentences), [len(s) for s in sentences])
    builder.finalize(str(tmp_path / "meg.idx"))
    assert len(IndexedDataset(tmp_path / "meg")) == 6

    dataset = TokenDataset(tmp_path / "meg", seq_len=12)  # a shard prefix, as --data-path
    tokens, positions = dataset.take(1, return_positions=True)
    assert tokens.tolist() == [[11, 12, 13, 14, 15, 0, 21, 22, 0, 31, 32, 33, 34]]
    assert positions.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3]]
