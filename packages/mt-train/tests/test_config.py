"""Recipes, TOML files and key=value overrides resolve to one validated config."""

import json
import os
import re
import subprocess
import sys

import pytest

from mt_train.cli import main
from mt_train.config import JobConfig, check_pipeline_micro_batch_tokens
from mt_train.optim import lr_at
from mt_train.overrides import resolve_config
from mt_train.recipes import RECIPES, get_recipe


def test_overrides_parse_values_by_the_type_they_replace():
    cfg = resolve_config(
        get_recipe("debug"),
        overrides=[
            "training.max_steps=7",
            "training.lr=1e-3",
            "checkpoint.resume=false",
            "run_dir=runs/x",
            "model.mlp_only_layers=0,2",
        ],
    )
    assert cfg.training.max_steps == 7 and cfg.training.lr == 1e-3
    assert cfg.checkpoint.resume is False and cfg.run_dir == "runs/x"
    assert list(cfg.model.mlp_only_layers) == [0, 2]


def test_the_model_family_cannot_be_overridden_and_the_error_says_so(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('model_family = "gpt_oss"\n')
    for kwargs in ({"overrides": ["model_family=gpt_oss"]}, {"toml_path": path}):
        with pytest.raises(ValueError, match="^model_family cannot be set .*start from a recipe "
                           "of the family you want"):  # fmt: skip
            resolve_config(get_recipe("debug"), **kwargs)


def test_unknown_key_fails_with_the_closest_valid_key():
    with pytest.raises(ValueError, match=r"did you mean 'training.max_steps'"):
        resolve_config(get_recipe("debug"), overrides=["training.max_step=3"])
    with pytest.raises(ValueError, match=r"did you mean 'training.max_steps'"):
        resolve_config(get_recipe("debug"), overrides=["max_steps=3"])


def test_bad_values_fail_validation_with_the_rule():
    with pytest.raises(ValueError, match="micro_batch_size .* must divide"):
        resolve_config(get_recipe("debug"), overrides=["training.micro_batch_size=3"])
    with pytest.raises(ValueError, match="cannot parse training.max_steps='ten'"):
        resolve_config(get_recipe("debug"), overrides=["training.max_steps=ten"])
    with pytest.raises(ValueError, match="must look like key=value"):
        resolve_config(get_recipe("debug"), overrides=["training.max_steps"])
    with pytest.raises(ValueError, match="parallel.ep_comm .'ring'. must be 'async' or 'sync'"):
        resolve_config(get_recipe("debug"), overrides=["parallel.ep_comm=ring"])
    for bad, rule in (("training.lr=nan", "training.lr .nan. must be finite"),
                      ("training.beta2=1.5", "must be in .0, 1."),
                      ("training.num_threads=-3", "training.num_threads .-3. .* must be >= 0"),
                      ("parallel.grad_reduce=never", "parallel.grad_reduce"),
                      ("training.grad_clip=nan", r"training.grad_clip \(nan\) finite and >= 0"),
                      ("parallel.timeout_s=nan", r"parallel.timeout_s \(nan\) must be finite"),
                      ("parallel.timeout_s=inf", r"parallel.timeout_s \(inf\) must be finite"),
                      ("seed=-1", r"^seed \(-1\) must be >= 0")):  # fmt: skip
        with pytest.raises(ValueError, match=rule):
            resolve_config(get_recipe("debug"), overrides=[bad])
    with pytest.raises(ValueError, match=r"data.document_masking needs parallel.cp=1 \(got 2\)"):
        overrides = ["data.document_masking=true", "parallel.cp=2"]
        resolve_config(get_recipe("debug"), overrides=overrides)
    with pytest.raises(ValueError, match=r"profile.trace_steps \('10,12'\) starts after "
                       r"training.max_steps \(5\), so no step would be traced"):
        overrides = ["profile.trace_steps=10,12", "training.max_steps=5"]
        resolve_config(get_recipe("debug"), overrides=overrides)


def test_pipeline_layouts_it_cannot_schedule_are_refused_naming_the_keys_and_fix():
    tiny = ["model.num_hidden_layers=4", "training.global_batch_size=4",
            "training.micro_batch_size=1"]  # fmt: skip
    cfg = resolve_config(get_recipe("tiny"), overrides=[*tiny, "parallel.pp=2"])
    assert cfg.parallel.pp == 2  # 4 micro-batches, 4 layers: accepted
    for more in ("parallel.dp=2", "parallel.cp=2", "parallel.ep=2"):  # composed too
        cfg = resolve_config(get_recipe("tiny"), overrides=[*tiny, "parallel.pp=2", more])
        assert cfg.parallel.pp == 2
    for bad, rule in (
        ("training.micro_batch_size=2", r"at least 2\*pp = 4 micro-batches .* "
         r"training.global_batch_size \(4\) / training.micro_batch_size \(2\) = 2; raise "
         r"training.global_batch_size to at least 8"),
        ("model.num_hidden_layers=3", r"2\*pp = 4 stages .* model.num_hidden_layers is 3"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=rule):
            overrides = [*tiny, "parallel.pp=2", *bad.split()]
            resolve_config(get_recipe("tiny"), overrides=overrides)


def test_pipeline_micro_batch_of_2_24_tokens_per_rank_is_refused_before_any_work():
    # One pipeline's micro-batch, as the executor sees it: micro_batch_size / (dp*ep)
    # sequences of seq_len / cp tokens. Here 32 / (2*2) = 8 x 2**22 / 2 = 2**24 tokens.
    layout = ["model.num_hidden_layers=4", "training.global_batch_size=224",
              "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.cp=2",
              f"data.seq_len={2**22}"]  # fmt: skip
    rule = (
        r"training.micro_batch_size \(32\) / \(parallel.dp \* parallel.ep = 2\*2\) = 8 "
        r"sequences of data.seq_len \(4194304\) / parallel.cp \(2\) = 2097152 tokens = "
        r"16777216 tokens.* fp32, exact below 2\*\*24 \(16777216\); lower "
        r"training.micro_batch_size to at most 28 or data.seq_len to at most 4194300"
    )
    with pytest.raises(ValueError, match=rule):
        resolve_config(get_recipe("tiny"), overrides=[*layout, "training.micro_batch_size=32"])
    # 7 sequences per rank (2**24 - 2**21 tokens) fit: the check divides by dp*ep and cp.
    cfg = resolve_config(get_recipe("tiny"), overrides=[*layout, "training.micro_batch_size=28"])
    assert cfg.training.micro_batch_size == 28
    # dp=-1 is known only with the world size: setup checks with the derived dp.
    layout[3] = "parallel.dp=-1"
    cfg = resolve_config(get_recipe("tiny"), overrides=[*layout, "training.micro_batch_size=32"])
    with pytest.raises(ValueError, match=rule):
        check_pipeline_micro_batch_tokens(cfg, dp=2)
    check_pipeline_micro_batch_tokens(cfg, dp=4)  # 4 sequences per rank: 2**23 tokens
    # Without the pipeline nothing is sent as fp32 counts: no limit here.
    overrides = [*layout[:2], f"data.seq_len={2**25}", "training.micro_batch_size=32"]
    cfg = resolve_config(get_recipe("tiny"), overrides=overrides)
    check_pipeline_micro_batch_tokens(cfg, dp=1)


def test_setup_refuses_a_pipeline_micro_batch_of_2_24_tokens_with_dp_derived_before_any_work(
    tmp_path, monkeypatch
):
    # parallel.dp=-1 leaves the split to the world size: setup checks once it knows it.
    import torch

    from mt_train import train
    from mt_train.distributed import Env

    def never(*args, **kwargs):
        raise AssertionError("setup read data or built the model before refusing the layout")

    world = Env(rank=0, world_size=16, local_rank=0, device=torch.device("cpu"))
    monkeypatch.setattr(train, "init_distributed", lambda *args: world)
    monkeypatch.setattr(train, "_open_datasets", never)
    monkeypatch.setattr(train, "build_model", never)
    overrides = ["model.num_hidden_layers=4", "training.global_batch_size=224",
                 "parallel.pp=2", "parallel.ep=2", "parallel.cp=2", f"data.seq_len={2**22}",
                 "training.micro_batch_size=32", f"run_dir={tmp_path / 'run'}",
                 "training.device=cpu"]  # fmt: skip
    cfg = resolve_config(get_recipe("tiny"), overrides=overrides)
    with pytest.raises(ValueError, match=r"parallel.dp \* parallel.ep = 2\*2\) = 8 sequences"):
        train.setup(cfg)  # 16 ranks / (pp*cp*ep = 8): dp = 2
    assert not (tmp_path / "run").exists()


def test_toml_file_adjusts_the_recipe_and_command_line_wins(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('run_dir = "runs/t"\n[training]\nmax_steps = 9\nlr = 1\n')
    cfg = resolve_config(get_recipe("debug"), toml_path=path, overrides=["training.max_steps=4"])
    assert cfg.run_dir == "runs/t" and cfg.training.max_steps == 4 and cfg.training.lr == 1.0
    path.write_text("[training]\nmax_stepz = 9\n")
    with pytest.raises(ValueError, match=r"run.toml.*did you mean 'training.max_steps'"):
        resolve_config(get_recipe("debug"), toml_path=path)
    path.write_text('[training]\nmax_steps = "nine"\n')
    with pytest.raises(ValueError, match="expected int"):
        resolve_config(get_recipe("debug"), toml_path=path)


def test_a_key_that_is_none_takes_the_type_its_field_declares_and_null_sets_none(tmp_path):
    # Qwen3's sliding_window is None in the recipe; its field is `int | None`.
    for text in ("32.5", "abc", "true"):
        with pytest.raises(ValueError, match=rf"model.sliding_window='{text}' as int \| None"):
            resolve_config(get_recipe("debug"), overrides=[f"model.sliding_window={text}"])
    with pytest.raises(ValueError, match=r"model.rope_scaling='yarn' as dict \| None"):
        resolve_config(get_recipe("debug"), overrides=["model.rope_scaling=yarn"])
    cfg = resolve_config(get_recipe("debug"), overrides=["model.sliding_window=32"])
    assert cfg.model.sliding_window == 32
    path = tmp_path / "run.toml"
    path.write_text("[model]\nsliding_window = 32.5\n")
    with pytest.raises(ValueError, match=r"run.toml: model.sliding_window = 32.5 .*int \| None"):
        resolve_config(get_recipe("debug"), toml_path=path)
    # `null` reaches an `X | None` field that is set now (None: full attention / q_proj).
    cfg = resolve_config(get_recipe("debug-gpt-oss"), overrides=["model.sliding_window=null"])
    assert cfg.model.sliding_window is None
    cfg = resolve_config(get_recipe("debug-deepseek-v2"), overrides=["model.q_lora_rank=null"])
    assert cfg.model.q_lora_rank is None
    assert resolve_config(get_recipe("debug"), overrides=["data.path=null"]).data.path == "null"


def test_a_toml_table_sets_a_dict_field_that_is_none_in_the_recipe(tmp_path):
    # The command line sets it as JSON (model.rope_scaling={...}); TOML as a table.
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}
    path = tmp_path / "run.toml"
    for text in ("[model.rope_scaling]\nrope_type = 'yarn'\nfactor = 2.0\n"
                 "original_max_position_embeddings = 1024\n",
                 "[model]\nrope_scaling = { rope_type = 'yarn', factor = 2.0, "
                 "original_max_position_embeddings = 1024 }\n"):  # fmt: skip
        path.write_text(text)
        cfg = resolve_config(get_recipe("debug"), toml_path=path,
                             overrides=["model.rope_scaling.factor=4"])  # fmt: skip
        assert cfg.model.rope_scaling == yarn | {"factor": 4.0}
    path.write_text("[model]\nrope_scaling = 3\n")
    with pytest.raises(ValueError, match=r"model.rope_scaling = 3 has type int, expected dict"):
        resolve_config(get_recipe("debug"), toml_path=path)


def test_a_list_of_strings_takes_comma_separated_words():
    types = ["full_attention", "sliding_attention"] * 2
    for text in (",".join(types), ",".join(f'"{t}"' for t in types), json.dumps(types)):
        cfg = resolve_config(get_recipe("debug-gpt-oss"), overrides=[f"model.layer_types={text}"])
        assert cfg.model.layer_types == types
    with pytest.raises(ValueError, match=r"cannot parse model.mlp_only_layers='0,x' as tuple"):
        resolve_config(get_recipe("debug"), overrides=["model.mlp_only_layers=0,x"])


def test_list_items_of_another_type_are_refused_naming_the_item(tmp_path):
    for text, item in (("[1.5]", "1.5 has type float"), ("[true]", "True has type bool"),
                       ('["x"]', "'x' has type str")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"model.mlp_only_layers='.*: item {item}, "
                           "expected int"):  # fmt: skip
            resolve_config(get_recipe("debug"), overrides=[f"model.mlp_only_layers={text}"])
    with pytest.raises(ValueError, match="item 1 has type int, expected str"):
        resolve_config(get_recipe("debug-gpt-oss"), overrides=["model.layer_types=[1,2]"])
    path = tmp_path / "c.toml"
    path.write_text('[model]\nmlp_only_layers = ["a"]\n')
    with pytest.raises(ValueError, match=r"c.toml: model.mlp_only_layers = \['a'\]: item 'a' "
                       "has type str, expected int"):  # fmt: skip
        resolve_config(get_recipe("debug"), toml_path=path)


def test_a_dict_field_the_recipe_sets_can_be_replaced_whole_or_set_to_null():
    # GPT-OSS's rope_scaling is YaRN in the recipe: its leaves are keys, and so is the field.
    linear = {"rope_type": "linear", "factor": 2.0}
    cfg = resolve_config(get_recipe("debug-gpt-oss"),
                         overrides=[f"model.rope_scaling={json.dumps(linear)}",
                                    "model.rope_scaling.factor=4"])  # fmt: skip
    assert cfg.model.rope_scaling == linear | {"factor": 4.0}
    cfg = resolve_config(get_recipe("debug-gpt-oss"), overrides=["model.rope_scaling=null"])
    assert cfg.model.rope_scaling is None
    with pytest.raises(ValueError, match=r"model.rope_scaling='yarn' as dict \| None"):
        resolve_config(get_recipe("debug-gpt-oss"), overrides=["model.rope_scaling=yarn"])


def test_config_round_trips_through_plain_data():
    cfg = get_recipe("debug")
    again = JobConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again.to_dict() == cfg.to_dict()


def test_unknown_recipe_suggests_a_known_one():
    with pytest.raises(ValueError, match="did you mean 'debug'"):
        get_recipe("debg")


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = get_recipe("debug").training
    assert lr_at(1, cfg) == pytest.approx(cfg.lr / cfg.warmup_steps)
    assert lr_at(cfg.warmup_steps, cfg) == pytest.approx(cfg.lr)
    assert lr_at(cfg.max_steps, cfg) == pytest.approx(cfg.lr * cfg.min_lr_ratio)
    lrs = [lr_at(s, cfg) for s in range(cfg.warmup_steps, cfg.max_steps + 1)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_print_config_and_help(capsys):
    assert main(["pretrain", "debug", "--print-config", "training.max_steps=3"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["training"]["max_steps"] == 3 and printed["model_family"] == "qwen3_moe"
    with pytest.raises(SystemExit) as exit_info:
        main(["pretrain", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for name in RECIPES:
        assert f"  {name}  " in help_text  # a gap between every name and its summary


def test_cli_reports_bad_input_without_a_traceback(capsys):
    assert main(["pretrain", "debug", "training.max_step=3"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'training.max_steps'" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [["training.max_steps"], ["seed", "--print-config"], ["tiny", "training.max_steps"]],
)
def test_a_config_key_without_a_value_is_named_as_one_not_as_an_unknown_recipe(argv, capsys):
    assert main(["pretrain", *argv]) == 2
    err = capsys.readouterr().err
    key = next(a for a in argv if a not in RECIPES and not a.startswith("-"))
    assert f"{key!r} is a config key without a value; write {key}=VALUE" in err, err
    assert "unknown recipe" not in err


@pytest.mark.parametrize("argv", [["./my.toml"], ["tiny", "runs/a.b"], ["my.toml"]])
def test_a_word_that_is_no_config_key_is_not_called_one(argv, capsys):
    assert main(["pretrain", *argv]) == 2
    err = capsys.readouterr().err
    assert "config key without a value" not in err, err
    if argv[-1].endswith(".toml"):  # a config file given without --config
        assert f"pass a TOML file with --config {argv[-1]}" in err, err


def test_python_dash_m_runs_the_same_cli():
    result = subprocess.run(
        [sys.executable, "-m", "mt_train", "pretrain", "--print-config", "seed=5"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["seed"] == 5


def test_a_config_file_that_is_a_directory_or_binary_names_the_file(tmp_path, capsys):
    binary = tmp_path / "weights.toml"
    binary.write_bytes(b"\xff\xfe\x00junk")
    for path in (tmp_path, binary):
        assert main(["pretrain", "debug", "--config", str(path), "--print-config"]) == 2
        err = capsys.readouterr().err
        assert f"config file {path} cannot be read" in err and "Traceback" not in err


def test_a_run_dir_that_is_a_file_is_a_one_line_error(tmp_path, capsys):
    taken = tmp_path / "notes.txt"
    taken.write_text("not a run directory\n")
    for run_dir, rule in ((taken, "is a file"), (taken / "run", "cannot be created")):
        assert main(["pretrain", "tiny", f"run_dir={run_dir}", "training.max_steps=1"]) == 2
        err = capsys.readouterr().err
        assert f"run_dir ({str(run_dir)!r}) {rule}" in err and "Traceback" not in err


def test_a_checkpoints_path_that_cannot_be_a_directory_fails_before_any_step(
    tmp_path, capsys, monkeypatch
):
    import mt_train.train

    def train_step(*args):
        raise AssertionError("a step ran before the checkpoint directory was checked")

    monkeypatch.setattr(mt_train.train, "train_step", train_step)
    (tmp_path / "checkpoints").write_text("a file where checkpoints go\n")
    assert main(["pretrain", "tiny", f"run_dir={tmp_path}", "training.max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'checkpoints'} cannot be created" in err and "Traceback" not in err, err


def test_a_run_dir_and_init_from_starting_with_a_tilde_are_under_the_home_directory(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('run_dir = "~/runs/r"\ninit_from = "~/hf"\n')
    cfg = resolve_config(get_recipe("tiny"), toml_path=path)
    assert cfg.run_dir == os.path.join(os.path.expanduser("~"), "runs", "r")
    assert cfg.init_from == os.path.join(os.path.expanduser("~"), "hf")


def test_a_validation_path_without_an_interval_is_an_error_naming_both_keys(capsys):
    argv = ["pretrain", "tiny", "validation.path=/data/heldout", "--print-config"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "validation.path ('/data/heldout') is set but validation.interval is 0" in err
    assert "set validation.interval=N" in err and "Traceback" not in err
    assert main([*argv, "validation.interval=50"]) == 0  # both set: validation runs


def test_an_empty_run_dir_is_refused_not_taken_as_the_current_directory(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    assert main(["pretrain", "tiny", "run_dir=", "training.max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert "run_dir ('') is empty, which would put checkpoints and metrics in the current" in err
    assert "set run_dir=runs/NAME" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    assert main(["pretrain", "tiny", "run_dir=.", "--print-config"]) == 0  # said on purpose


def test_every_option_has_help_stating_its_default_and_is_in_the_module_docstring():
    import argparse

    import mt_train.cli

    def subparsers(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield sub
                    yield from subparsers(sub)

    checked = []
    for sub in subparsers(mt_train.cli.build_parser()):
        for action in sub._actions:
            option = max(action.option_strings, key=len, default=None)
            if option is None or option == "--help":
                continue
            assert action.help, f"{sub.prog} {option} has no help"
            if action.default not in (None, False):
                assert "default" in action.help, f"{sub.prog} {option}: {action.help!r}"
            assert f"{option} " in mt_train.cli.__doc__ or f"{option}]" in mt_train.cli.__doc__, (
                f"{sub.prog} {option} is missing from mt_train/cli.py's docstring"
            )
            checked.append(option)
    assert {"--top-p", "--seed", "--device", "--max-new-tokens", "--max-shard-size"} <= set(
        checked
    )


@pytest.mark.parametrize(
    ("recipe", "override", "key"),
    [
        ("debug", "model.rms_norm_eps=nan", "model.rms_norm_eps"),
        ("debug", "model.rope_theta=inf", "model.rope_theta"),
        ("debug", "model.router_aux_loss_coef=nan", "model.router_aux_loss_coef"),
        ("debug", "model.router_z_loss_coef=inf", "model.router_z_loss_coef"),
        ("debug", "model.initializer_range=nan", "model.initializer_range"),
        ("debug-gpt-oss", "model.rope_scaling.beta_fast=inf", "model.rope_scaling.beta_fast"),
        ("debug-deepseek-v2", "model.routed_scaling_factor=nan", "model.routed_scaling_factor"),
    ],
)
def test_a_nan_or_infinite_number_anywhere_in_the_config_is_refused_naming_its_key(
    recipe, override, key, capsys
):
    # Each would train on NaN (or silently change the model) and print Infinity/NaN, which
    # is no JSON, into config.json and every checkpoint's train_state.json.
    value = override.partition("=")[2]
    message = rf"^{re.escape(key)} \({value}\) must be a finite number"
    with pytest.raises(ValueError, match=message):
        resolve_config(get_recipe(recipe), overrides=[override])
    assert main(["pretrain", recipe, override, "--print-config"]) == 2
    assert capsys.readouterr().out == ""


def test_grad_clip_inf_is_refused_pointing_at_0_which_disables_clipping(capsys):
    with pytest.raises(ValueError, match=r"training.grad_clip \(inf\) .*0 disables clipping"):
        resolve_config(get_recipe("debug"), overrides=["training.grad_clip=inf"])
    assert main(["pretrain", "debug", "training.grad_clip=0", "--print-config"]) == 0
    json.loads(capsys.readouterr().out, parse_constant=pytest.fail)  # plain JSON


def test_print_config_is_plain_json_that_a_strict_reader_accepts(capsys):
    for recipe in RECIPES:
        assert main(["pretrain", recipe, "--print-config"]) == 0
        json.loads(capsys.readouterr().out, parse_constant=pytest.fail)


def test_a_value_for_a_whole_section_says_it_is_a_section_not_an_unknown_key(tmp_path):
    rule = r"^'training' is a section of the config, not one value \(in the command line\); "
    with pytest.raises(ValueError, match=rule + "set its keys, e.g. training.max_steps="):
        resolve_config(get_recipe("debug"), overrides=["training=3"])
    with pytest.raises(ValueError, match=r"^'model' is a section .*e.g. model.vocab_size="):
        resolve_config(get_recipe("debug"), overrides=['model={"vocab_size": 8}'])
    path = tmp_path / "c.toml"
    for text in ("training = 3\n", "[[training]]\nmax_steps = 3\n"):
        path.write_text(text)
        with pytest.raises(ValueError, match=rf"^'training' is a section .*in {path}"):
            resolve_config(get_recipe("debug"), toml_path=path)


def test_a_key_below_a_single_value_says_that_value_has_no_keys(tmp_path):
    with pytest.raises(ValueError, match=r"^unknown config key 'training.max_steps.x' in the "
                       r"command line: training.max_steps is one value \(150\), not a section; "
                       r"write training.max_steps=VALUE"):  # fmt: skip
        resolve_config(get_recipe("debug"), overrides=["training.max_steps.x=3"])
    path = tmp_path / "c.toml"
    path.write_text("[training.max_steps]\nx = 3\n")
    with pytest.raises(ValueError, match=r"training.max_steps is one value \(150\), not a sec"):
        resolve_config(get_recipe("debug"), toml_path=path)


def test_help_says_a_toml_table_merges_into_a_dict_but_a_json_override_replaces_it(
    tmp_path, capsys
):
    # TOML cannot tell a table from an inline table, so a dict field takes the keys a TOML
    # file lists; a JSON object on the command line is the whole new value.
    path = tmp_path / "c.toml"
    path.write_text("[model]\nrope_scaling = {rope_type = 'linear', factor = 2.0}\n")
    from_toml = resolve_config(get_recipe("debug-gpt-oss"), toml_path=path).model.rope_scaling
    json_override = 'model.rope_scaling={"rope_type": "linear", "factor": 2.0}'
    from_cli = resolve_config(get_recipe("debug-gpt-oss"), overrides=[json_override])
    assert from_cli.model.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert from_toml["beta_fast"] == get_recipe("debug-gpt-oss").model.rope_scaling["beta_fast"]
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "a TOML table sets only the keys it lists, also in a dict such as" in help_text
    assert "model.rope_scaling; a JSON object on the command line replaces the dict whole" in (
        help_text
    )


@pytest.mark.parametrize(
    ("recipe", "overrides"),
    [
        ("tiny", ["training.max_steps=7", "seed=3", "model.mlp_only_layers=1"]),
        ("debug-gpt-oss", ['model.rope_scaling={"rope_type": "linear", "factor": 2.0}',
                           "model.sliding_window=null", "training.lr=0.1"]),  # fmt: skip
        ("debug-deepseek-v2", ["model.q_lora_rank=null", "data.path=/data/c"]),
    ],
)
def test_a_printed_or_saved_config_json_passed_back_with_config_gives_the_same_config(
    recipe, overrides, tmp_path, capsys
):
    assert main(["pretrain", recipe, *overrides, "--print-config"]) == 0
    saved = tmp_path / "config.json"  # what --print-config prints and run_dir/config.json holds
    saved.write_text(capsys.readouterr().out)
    again = resolve_config(get_recipe(recipe), toml_path=saved)
    assert json.loads(json.dumps(again.to_dict())) == json.loads(saved.read_text())
    assert main(["pretrain", recipe, "--config", str(saved), "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(saved.read_text())


def test_a_config_json_of_another_family_or_broken_json_is_refused_naming_the_file(
    tmp_path, capsys
):
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(get_recipe("debug-gpt-oss").to_dict()))
    rule = rf"^{saved} is a config of model family 'gpt_oss', but the recipe's is 'qwen3_moe'"
    with pytest.raises(ValueError, match=rule + "; start from a gpt_oss recipe"):
        resolve_config(get_recipe("debug"), toml_path=saved)
    saved.write_text('{"seed": 1,\n "training": {"lr": }}\n')
    with pytest.raises(ValueError, match=rf"^config file {saved} is not valid JSON: .*line 2"):
        resolve_config(get_recipe("debug"), toml_path=saved)


def test_more_threads_than_usable_cores_is_refused_before_any_thread_starts(
    tmp_path, capsys, monkeypatch
):
    # training.num_threads=100000 started 100000 OpenMP threads and stalled the machine.
    import torch

    def set_num_threads(n):
        raise AssertionError(f"torch.set_num_threads({n}) ran before the check")

    monkeypatch.setattr(torch, "set_num_threads", set_num_threads)
    cores = len(os.sched_getaffinity(0))
    argv = ["pretrain", "tiny", f"run_dir={tmp_path / 'r'}", f"training.num_threads={cores + 1}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"training.num_threads ({cores + 1}) exceeds the {cores} CPU cores" in err, err
    assert f"set at most {cores}" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_data_and_validation_paths_starting_with_a_tilde_are_under_the_home_directory(tmp_path):
    # The shell leaves data.path=~/c alone (data.path is no shell variable name), and no
    # shell expands a TOML file: as run_dir and init_from, the config expands it.
    home = os.path.expanduser("~")
    path = tmp_path / "c.toml"
    path.write_text('[data]\npath = "~/corpus"\n[validation]\npath = "~/held"\ninterval = 5\n')
    for kwargs in ({"toml_path": path},
                   {"overrides": ["data.path=~/corpus", "validation.path=~/held",
                                  "validation.interval=5"]}):  # fmt: skip
        cfg = resolve_config(get_recipe("tiny"), **kwargs)
        assert cfg.data.path == os.path.join(home, "corpus")
        assert cfg.validation.path == os.path.join(home, "held")


def test_pretrain_usage_shows_one_optional_recipe_then_overrides(capsys):
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    usage = " ".join(capsys.readouterr().out.split("\n\n")[0].split())
    assert usage == (
        "usage: mt-train pretrain [-h] [--config FILE.toml] [--print-config] [RECIPE] "
        "[KEY=VALUE ...]"
    )


def test_a_second_config_file_is_refused_not_silently_dropping_the_first(tmp_path, capsys):
    first, second = tmp_path / "a.toml", tmp_path / "b.toml"
    first.write_text("[training]\nmax_steps = 9\n")
    second.write_text("seed = 4\n")
    argv = ["pretrain", "tiny", "--config", str(first), "--config", str(second), "--print-config"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--config is given more than once ({first}, {second}); give one file" in err, err


@pytest.mark.parametrize(
    ("recipe", "override", "rule"),
    [
        ("debug", "model.vocab_size=0", r"^model.vocab_size \(0\) must be >= 1"),
        ("debug", "model.rope_theta=-1", r"^model.rope_theta \(-1.0\) and model.rms_norm_eps"),
        ("debug-gpt-oss", "model.num_hidden_layers=2", r"^model.layer_types \(\['sliding"),
        ("debug-deepseek-v2", "model.topk_group=5", r"^model: group_limited_greedy needs"),
    ],
)
def test_a_model_config_error_names_the_model_section_as_the_keys_are_written(
    recipe, override, rule
):
    with pytest.raises(ValueError, match=rule):
        resolve_config(get_recipe(recipe), overrides=[override])


def test_a_toml_scalar_for_a_dict_field_the_recipe_sets_is_a_type_error(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nrope_scaling = 3\n")
    with pytest.raises(ValueError, match=r"c.toml: model.rope_scaling = 3 has type int, expected "
                       r"dict \| None"):  # fmt: skip
        resolve_config(get_recipe("debug-gpt-oss"), toml_path=path)


def test_path_options_written_with_an_equals_sign_expand_a_leading_tilde(
    tmp_path, monkeypatch, capsys
):
    # '--config=~/x.toml' is one word, whose ~ no shell expands (only a word's first ~):
    # the file was 'config file ~/x.toml does not exist'; so were --out, --hf, --checkpoint.
    import argparse

    import mt_train.cli

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "x.toml").write_text("seed = 7\n")
    assert main(["pretrain", "tiny", "--config=~/x.toml", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["seed"] == 7

    def commands(parser, words):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield sub, [*words, name]
                    yield from commands(sub, [*words, name])

    checked = []
    for sub, words in commands(mt_train.cli.build_parser(), []):
        paths = [a for a in sub._actions if a.metavar in ("DIR", "FILE.toml") and a.option_strings]
        if not paths:
            continue
        argv = [*words, *(f"{a.option_strings[0]}=~/{a.dest}" for a in paths)]
        if "generate" in words:
            argv += ["--prompt", "hi"]
        args, _ = mt_train.cli.build_parser().parse_known_args(argv)
        for action in paths:
            value = getattr(args, action.dest)
            value = value[0] if isinstance(value, list) else value  # --config appends
            assert value == str(tmp_path / action.dest), (words, action.option_strings)
            checked.append(f"{words[-1]} {action.option_strings[0]}")
    assert sorted(checked) == [
        "generate --checkpoint", "hf-to-mt --hf", "hf-to-mt --out", "mt-to-hf --checkpoint",
        "mt-to-hf --out", "pretrain --config",
    ]  # fmt: skip


@pytest.mark.parametrize("blank", [" ", "\t", "  \n"])
def test_a_blank_wandb_project_is_refused_naming_the_key(blank, tmp_path, capsys):
    # W&B took project ' ' (an offline run was written under it, to fail when synced);
    # '' is the documented way to turn W&B off.
    message = rf"^metrics.wandb_project \({re.escape(repr(blank))}\) is blank"
    with pytest.raises(ValueError, match=message):
        resolve_config(get_recipe("tiny"), overrides=[f"metrics.wandb_project={blank}"])
    toml = tmp_path / "blank.toml"
    toml.write_text(f"[metrics]\nwandb_project = {json.dumps(blank)}\n")
    assert main(["pretrain", "tiny", "--config", str(toml), "--print-config"]) == 2
    assert "metrics.wandb_project=''" in capsys.readouterr().err
    assert main(["pretrain", "tiny", "metrics.wandb_project=", "--print-config"]) == 0


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        ("debug", ["model.rope_theta=-1"],
         "model.rope_theta (-1.0) and model.rms_norm_eps (1e-06) must be > 0"),
        ("debug", ["model.num_key_value_heads=3"],
         "model.num_key_value_heads (3) must divide model.num_attention_heads (4); choose a "
         "divisor"),
        ("debug", ["model.num_experts_per_tok=99"],
         "model.num_experts_per_tok (99) must be in [1, model.num_experts=8]; lower the top-k "
         "or add experts"),
        ("debug-gpt-oss", ["model.num_hidden_layers=2"],
         "for each of the 2 layers; after changing model.num_hidden_layers, set "
         "model.layer_types again, or to None"),
        ("debug-deepseek-v2", ["model.topk_group=5"],
         "model: group_limited_greedy needs model.n_group (4) dividing model.n_routed_experts "
         "(8) and model.topk_group (5) in [1, model.n_group]"),
        ("debug-deepseek-v2", ["model.topk_group=1", "model.num_experts_per_tok=3"],
         "(model.topk_group 1 of model.n_group 4 groups of 2); raise model.topk_group or lower "
         "model.num_experts_per_tok"),
        ("debug-deepseek-v2", ['model.rope_scaling={"rope_type": "yarn", "mscale_all_dim": 1}'],
         "model.rope_scaling ({'rope_type': 'yarn', 'mscale_all_dim': 1}) sets mscale_all_dim "
         "but no factor"),
    ],
)  # fmt: skip
def test_every_model_field_a_model_config_error_names_is_spelled_as_the_key_is_written(
    recipe, overrides, message
):
    # Only the first field had its model. prefix: 'must divide num_attention_heads (4)'
    # named a key no override or --print-config spells so.
    with pytest.raises(ValueError) as info:
        resolve_config(get_recipe(recipe), overrides=overrides)
    assert message in str(info.value)


_PATH_KEYS_AND_FIXES = [
    ("run_dir", "set run_dir=runs/NAME (or run_dir=. for the current directory)"),
    ("data.path", "or data.path='' for the embedded default corpus"),
    ("init_from", "or init_from='' to start from fresh weights"),
    ("validation.path", "or validation.path='' to turn validation off"),
]


@pytest.mark.parametrize(("key", "fix"), _PATH_KEYS_AND_FIXES)
@pytest.mark.parametrize("blank", [" ", "   ", "\t", " \n"])
def test_a_blank_path_is_refused_naming_the_key_value_and_fix(key, fix, blank, tmp_path):
    # run_dir='  ' made a directory named '  ' and wrote the run there; the other keys
    # failed later (data.path at the loader, init_from after setup) or, for
    # validation.path, blamed validation.interval.
    interval = ["validation.interval=5"] if key == "validation.path" else []  # path in use
    with pytest.raises(ValueError) as info:
        resolve_config(get_recipe("tiny"), overrides=[f"{key}={blank}", *interval])
    message = str(info.value)
    assert message.startswith(f"{key} ({blank!r}) is blank; "), message
    assert fix in message and "\n" not in message
    section, _, name = key.rpartition(".")
    toml = tmp_path / "blank.toml"
    toml.write_text((f"[{section}]\n" if section else "") + f"{name} = {json.dumps(blank)}\n")
    with pytest.raises(ValueError, match=re.escape(f"{key} ({blank!r}) is blank; ")):
        resolve_config(get_recipe("tiny"), toml_path=toml, overrides=interval)


@pytest.mark.parametrize(("key", "fix"), _PATH_KEYS_AND_FIXES)
def test_a_path_with_a_nul_character_is_refused_naming_the_key(key, fix, tmp_path):
    # No file system takes a NUL in a path: run_dir failed as a bare 'embedded null byte'.
    section, _, name = key.rpartition(".")
    toml = tmp_path / "nul.toml"
    toml.write_text((f"[{section}]\n" if section else "") + f'{name} = "runs/a\\u0000b"\n')
    interval = ["validation.interval=5"] if key == "validation.path" else []
    with pytest.raises(ValueError) as info:
        resolve_config(get_recipe("tiny"), toml_path=toml, overrides=interval)
    message = str(info.value)
    assert message.startswith(f"{key} ('runs/a\\x00b') contains a NUL character"), message
    assert fix in message


def test_empty_paths_keep_their_meanings():
    # data.path '' is the embedded corpus, init_from '' fresh weights, validation.path ''
    # no validation; only run_dir '' is refused (test above), and '.' names the cwd.
    cfg = resolve_config(
        get_recipe("tiny"), overrides=["data.path=", "init_from=", "validation.path=",
                                       "run_dir=."]
    )  # fmt: skip
    assert (cfg.data.path, cfg.init_from, cfg.validation.path, cfg.run_dir) == ("", "", "", ".")
    assert not cfg.validation.enabled


def test_a_blank_run_dir_on_the_command_line_is_a_one_line_error_and_writes_nothing(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    assert main(["pretrain", "tiny", "run_dir=  ", "training.max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert "run_dir ('  ') is blank; set run_dir=runs/NAME" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []
