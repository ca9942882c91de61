"""Where the EOS (and BOS) token comes from in a Hugging Face tokenizer directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from mt_data import IndexedDataset
from mt_data.cli import main
from mt_data.tokenizer import load_tokenizer


def _tokenizer_dir(directory: Path, **files: object) -> Path:
    """A model directory: a word-level tokenizer.json whose special tokens, `<s>` and
    `<eot>`, are added tokens and none of the usual EOS names, plus `files` as JSON
    (`tokenizer_config`, `special_tokens_map`)."""
    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(
        [AddedToken("<s>", special=True), AddedToken("<eot>", special=True)]
    )
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    for name, content in files.items():
        (directory / f"{name}.json").write_text(json.dumps(content))
    return directory


def test_eos_missing_from_tokenizer_config_comes_from_special_tokens_map(tmp_path):
    directory = _tokenizer_dir(
        tmp_path / "tok",
        tokenizer_config={"model_max_length": 2048, "eos_token": None},
        special_tokens_map={"bos_token": "<s>", "eos_token": {"content": "<eot>"}},
    )
    loaded = load_tokenizer(directory, bos=True)
    assert (loaded.eos_token, loaded.eos_id) == ("<eot>", 4)
    assert (loaded.bos_token, loaded.bos_id) == ("<s>", 3)


ADDED_TOKENS_DECODER = {"3": {"content": "<s>", "special": True}, "4": {"content": "<eot>"}}


@pytest.mark.parametrize(
    ("tokenizer_config", "eos"),
    [
        # Saved by transformers >= 4.34: special_tokens_map.json is not read.
        ({"eos_token": "<s>", "added_tokens_decoder": ADDED_TOKENS_DECODER}, "<s>"),
        # Older files: special_tokens_map.json overrides tokenizer_config.json.
        ({"eos_token": "<s>"}, "<eot>"),
    ],
)
def test_eos_named_by_both_files_is_the_one_transformers_takes(tmp_path, tokenizer_config, eos):
    # tokenizer_config.json always won, so a directory of the older kind whose files
    # disagree gave the corpus another EOS than the model's (transformers').
    directory = _tokenizer_dir(
        tmp_path / "tok",
        tokenizer_config=tokenizer_config,
        special_tokens_map={"eos_token": {"content": "<eot>"}},
    )
    assert load_tokenizer(directory).eos_token == eos
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    assert reference.eos_token == eos


def test_a_load_reads_tokenizer_config_json_once_for_both_eos_and_bos(tmp_path, monkeypatch):
    # It was parsed four times: for the added_tokens_decoder check and the token, for each
    # of the EOS and the BOS.
    config = {"eos_token": "<eot>", "bos_token": "<s>", "added_tokens_decoder": {}}
    directory = _tokenizer_dir(
        tmp_path / "tok", tokenizer_config=config, special_tokens_map={"eos_token": "<s>"}
    )
    reads = []
    read_text = Path.read_text

    def counting_read_text(self, *args, **kwargs):
        reads.append(self.name)
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counting_read_text)
    loaded = load_tokenizer(directory, bos=True)
    assert (loaded.eos_token, loaded.bos_token) == ("<eot>", "<s>")
    assert reads.count("tokenizer_config.json") == 1, reads
    assert "special_tokens_map.json" not in reads  # transformers >= 4.34's files: not read
    load_tokenizer(directory, bos=True)  # a new load reads the files again
    assert reads.count("tokenizer_config.json") == 2, reads


def test_eos_missing_from_tokenizer_config_falls_back_to_a_known_token_in_the_vocabulary(
    tmp_path,
):
    directory = tmp_path / "tok"
    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tokenizer.add_special_tokens(["</s>"])
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    loaded = load_tokenizer(directory)
    assert (loaded.eos_token, loaded.eos_id) == ("</s>", 2)


def test_an_eos_found_nowhere_is_an_error_naming_the_files_and_the_option(tmp_path):
    directory = _tokenizer_dir(
        tmp_path / "tok", tokenizer_config={"model_max_length": 2048}
    ).resolve()
    with pytest.raises(ValueError) as err:
        load_tokenizer(directory)
    message = str(err.value)
    assert str(directory / "tokenizer_config.json") in message
    assert "special_tokens_map.json" in message
    assert "eos_token" in message and "--eos-token" in message
    assert load_tokenizer(directory, eos_token="<eot>").eos_id == 4


def test_cli_build_with_an_eos_found_nowhere_exits_2_naming_the_option(tmp_path, capsys):
    directory = _tokenizer_dir(tmp_path / "tok")  # no config file at all
    data = tmp_path / "a.jsonl"
    data.write_text('{"text": "hello world"}\n')
    argv = ["build", str(data), "--tokenizer", str(directory), "--output", str(tmp_path / "out"),
            "--workers", "0", "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--eos-token" in err and "tokenizer_config.json" in err
    assert main([*argv, "--eos-token", "<eot>"]) == 0
    assert IndexedDataset(tmp_path / "out" / "a")[0].tolist() == [1, 2, 4]


def test_a_model_directory_with_only_a_slow_tokenizer_says_how_to_get_tokenizer_json(tmp_path):
    directory = tmp_path / "llama"
    directory.mkdir()
    (directory / "tokenizer.model").write_bytes(b"sentencepiece")  # no tokenizer.json
    (directory / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    with pytest.raises(FileNotFoundError) as err:
        load_tokenizer(directory)
    message = str(err.value)
    assert f"{directory.resolve() / 'tokenizer.json'}: no such file" in message
    assert "tokenizer.model" in message and "save_pretrained" in message
