"""Shared fixtures: the packaged tokenizer."""

from __future__ import annotations

import pytest

from mt_data.default_corpus import default_tokenizer_path
from mt_data.tokenizer import LoadedTokenizer, load_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> LoadedTokenizer:
    return load_tokenizer(default_tokenizer_path())
