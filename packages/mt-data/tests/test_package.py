"""The package surface: exports, no torch, `python -m mt_data`."""

from __future__ import annotations

import subprocess
import sys

import mt_data


def test_public_api_is_exported():
    assert set(mt_data.__all__) == {
        "TokenDataset",
        "DataExhausted",
        "IndexedDataset",
        "IndexedDatasetWriter",
        "build_corpus",
        "default_corpus_dir",
        "default_tokenizer_path",
        "token_dtype",
        "zigzag_ranges",
    }
    assert issubclass(mt_data.DataExhausted, Exception)


def test_mt_data_imports_without_torch_and_runs_as_a_module():
    code = "import sys, mt_data, mt_data.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    result = subprocess.run(
        [sys.executable, "-m", "mt_data", "--help"], capture_output=True, text=True, check=True
    )
    assert all(command in result.stdout for command in ("build", "inspect", "build-default"))
