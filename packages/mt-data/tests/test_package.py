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


def test_every_cli_option_has_help_stating_its_default_and_a_metavar_saying_what_it_takes():
    import argparse

    from mt_data.cli import _parser

    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    checked = []
    for command in commands.choices.values():
        for action in command._actions:
            option = max(action.option_strings, key=len, default=None)
            if option is None or option == "--help":
                continue
            assert action.help, f"{command.prog} {option} has no help"
            if action.default not in (None, False):
                assert "default" in action.help, f"{command.prog} {option}: {action.help!r}"
            if action.nargs != 0 and not action.choices:  # not its name in capitals
                assert action.metavar, f"{command.prog} {option} shows no metavar"
            checked.append(option)
    assert {"--characters", "--documents", "--workers", "--text-key"} <= set(checked)
