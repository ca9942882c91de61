"""mt-train generate: prompt encoding (the sampling loop runs in tests/test_pretrain.py)."""

import pytest
import torch

from mt_data import default_tokenizer_path
from mt_data.tokenizer import load_tokenizer
from mt_train.cli import main
from mt_train.generate import encode_prompt, generate, sample_next


def test_special_tokens_in_a_prompt_are_their_ids_and_the_tokenizer_is_left_as_it_was():
    loaded = load_tokenizer(default_tokenizer_path())
    eos_text = loaded.tokenizer.id_to_token(loaded.eos_id)
    prompt = f"def f():{eos_text}x"
    # The training tokenizer reads special tokens in text as plain text ...
    assert loaded.eos_id not in loaded.tokenizer.encode(prompt).ids
    # ... a prompt (a chat template's markers) gets the special id, as Hugging Face does.
    ids = encode_prompt(loaded.tokenizer, prompt)
    assert ids.count(loaded.eos_id) == 1
    assert loaded.tokenizer.decode(ids, skip_special_tokens=False) == prompt
    assert loaded.tokenizer.encode_special_tokens  # restored for training use


def test_an_unknown_device_is_a_value_error_naming_it():
    for device in ("tpu", "mps"):
        with pytest.raises(ValueError, match=rf"--device \('{device}'\) must be cpu, cuda"):
            generate("no-checkpoint-needed", "x", device=device)


def test_ctrl_c_during_generate_prints_one_line_and_exits_130(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("mt_train.generate.generate", interrupted)
    assert main(["generate", "--checkpoint", "ckpt", "--prompt", "x"]) == 130
    err = capsys.readouterr().err
    assert err == "mt-train: interrupted\n"


def test_sampling_at_a_tiny_temperature_picks_the_likeliest_token():
    logits_V = torch.tensor([1.0, 3.0, 2.0, -torch.inf])
    generator = torch.Generator().manual_seed(0)
    # 3.0 / 1e-40 overflows float32: the softmax was NaN and multinomial raised.
    for temperature in (1e-40, 1e-300):
        assert sample_next(logits_V, temperature, 0.9, generator) == 1


def test_top_p_keeps_the_smallest_set_reaching_it_and_temperature_flattens_the_rest():
    # Only the greedy limits (a tiny temperature, a tiny top_p) were tested. Probabilities
    # 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps tokens 0 and 1 (0.5 < 0.7 <= 0.8), drawn 5:3;
    # temperature 2 with top_p 1 draws in proportion to sqrt(p). 4000 draws: a share's
    # standard deviation is <= 0.008, so 0.04 is five of them.
    probs = [0.5, 0.3, 0.15, 0.05]
    logits_V = torch.tensor(probs).log()
    cases = [(1.0, 0.7, [5, 3, 0, 0]), (2.0, 1.0, [p**0.5 for p in probs])]
    for temperature, top_p, weights in cases:
        generator = torch.Generator().manual_seed(0)
        draws = [sample_next(logits_V, temperature, top_p, generator) for _ in range(4000)]
        shares = torch.bincount(torch.tensor(draws), minlength=4).double() / len(draws)
        expected = torch.tensor(weights, dtype=torch.float64) / sum(weights)
        assert (shares[expected == 0] == 0).all(), (temperature, top_p, shares)
        torch.testing.assert_close(shares, expected, rtol=0, atol=0.04)


def test_a_nan_temperature_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"--temperature \(nan\)"):
        generate("no-checkpoint-needed", "x", temperature=float("nan"))


def test_a_cuda_device_index_past_the_gpus_here_is_a_value_error_naming_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"--device cuda:2: this machine has 2 CUDA devices "
                       r"\(cuda:0 to cuda:1\)"):  # fmt: skip
        generate("no-checkpoint-needed", "x", device="cuda:2")


def test_generate_help_names_every_device_it_takes(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--device DEVICE cpu (default), cuda or cuda:N (the Nth GPU)" in help_text


def test_a_checkpoint_that_cannot_be_read_is_one_line_naming_it_and_exit_1(
    tmp_path, monkeypatch, capsys
):
    # An OSError (a name too long, a directory without read permission) was a traceback.
    checkpoint = tmp_path / ("c" * 300)  # longer than a file name may be
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mt-train: error: OSError: [Errno ") and "File name too long" in err
    assert err.endswith(f"; reading --checkpoint {checkpoint} or its tokenizer failed\n")
    assert err.count("\n") == 1

    def denied(checkpoint, *args, **kwargs):  # as a user other than root would meet it
        raise PermissionError(13, "Permission denied", f"{checkpoint}/.metadata")

    monkeypatch.setattr("mt_train.generate.generate", denied)
    assert main(["generate", "--checkpoint", "ckpt", "--prompt", "x"]) == 1
    assert capsys.readouterr().err == (
        "mt-train: error: PermissionError: [Errno 13] Permission denied: 'ckpt/.metadata'; "
        "reading --checkpoint ckpt or its tokenizer failed\n"
    )
