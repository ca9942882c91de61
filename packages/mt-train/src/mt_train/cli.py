"""The `mt-train` command line.

    mt-train pretrain [RECIPE] [--config FILE.toml] [KEY=VALUE ...] [--print-config]
    mt-train convert hf-to-mt --hf DIR --out DIR [--no-progress]
    mt-train convert mt-to-hf --checkpoint DIR --out DIR [--max-shard-size 5GB]
                              [--dtype bfloat16|float16|float32] [--no-progress]
    mt-train generate --checkpoint DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
                      [--top-p P] [--seed N] [--device cpu|cuda|cuda:N]

`python -m mt_train ...` is the same program. A path given as ``--out=~/x`` starts at
the home directory, as ``--out ~/x`` does in a shell.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from mt_train.recipes import RECIPES

_PRETRAIN_EPILOG = """\
recipes:
{recipes}

overrides use dotted keys, e.g.:
  mt-train pretrain debug training.max_steps=20 run_dir=runs/r
  mt-train pretrain --config my.toml training.lr=1e-3
  mt-train pretrain debug precision.fp8=true  # FP8 GEMMs: GPUs of capability 8.9+, CPU emulates
--print-config shows every key with its value. The command line wins over the TOML
file; a TOML table sets only the keys it lists, also in a dict such as
model.rope_scaling; a JSON object on the command line replaces the dict whole
(model.rope_scaling='{{"rope_type": "linear", "factor": 2.0}}'), null clears it. A run
resumes from the newest complete checkpoint in its run_dir; a changed config wins over
the saved one.
"""


def _recipe_lines() -> str:
    lines = []
    width = max(map(len, RECIPES)) + 2
    for name, fn in RECIPES.items():
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        lines.append(f"  {name:<{width}}{summary}")
    return "\n".join(lines)


def _path(text: str) -> str:
    """The argparse type of path options: a leading ``~`` is the home directory, as in the
    config's paths (``--out=~/hf`` is one word, and a shell expands only a word's first ~)."""
    return os.path.expanduser(text)


def build_parser() -> argparse.ArgumentParser:
    """Returns the argument parser of `mt-train`."""
    parser = argparse.ArgumentParser(
        prog="mt-train", description="Train mixture-of-experts language models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    pretrain = sub.add_parser(
        "pretrain",
        # argparse would write the positionals as "[[RECIPE] [KEY=VALUE ...] ...]".
        usage="%(prog)s [-h] [--config FILE.toml] [--print-config] [RECIPE] [KEY=VALUE ...]",
        help="train a model from a recipe",
        description="Train a model from a recipe (default: debug), adjusted by a TOML "
        "file and KEY=VALUE overrides.",
        epilog=_PRETRAIN_EPILOG.format(recipes=_recipe_lines()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pretrain.add_argument(
        "args",
        nargs="*",
        metavar="[RECIPE] [KEY=VALUE ...]",
        help="a recipe name (first, optional) and config overrides",
    )
    pretrain.add_argument(
        "--config",
        action="append",
        type=_path,
        metavar="FILE.toml",
        help="TOML file of config overrides, or a .json file as --print-config prints it "
        "(a run's config.json): passed back, it gives the same config",
    )
    pretrain.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    convert = sub.add_parser(
        "convert",
        help="convert between Hugging Face directories and mt checkpoints",
        description="Convert weights between a Hugging Face directory (config.json + "
        "safetensors) and an mt checkpoint (PyTorch DCP, Hub keys).",
    )
    direction = convert.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    hf_to_mt = direction.add_parser(
        "hf-to-mt", help="Hugging Face directory -> model-only mt checkpoint (for init_from)"
    )
    hf_to_mt.add_argument(
        "--hf", required=True, type=_path, metavar="DIR", help="Hugging Face directory"
    )
    hf_to_mt.add_argument(
        "--out",
        required=True,
        type=_path,
        metavar="DIR",
        help="checkpoint to write: a new or empty directory; an existing one with files is "
        "refused (written beside it and renamed when complete)",
    )
    hf_to_mt.add_argument(
        "--no-progress", action="store_true", help="draw no progress bars (on stderr)"
    )
    mt_to_hf = direction.add_parser(
        "mt-to-hf", help="mt checkpoint (a run's step_N or hf-to-mt output) -> Hugging Face"
    )
    mt_to_hf.add_argument(
        "--checkpoint", required=True, type=_path, metavar="DIR", help="mt checkpoint"
    )
    mt_to_hf.add_argument(
        "--out",
        required=True,
        type=_path,
        metavar="DIR",
        help="directory to write: a new or empty directory; an existing one with files is "
        "refused (written beside it and renamed when complete)",
    )
    mt_to_hf.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest safetensors shard in bytes, or with a unit: KB, MB, GB, TB count in "
        "powers of 10 (as Hugging Face does), KiB, MiB, GiB, TiB in powers of 2; e.g. 5GB "
        "(10^9 bytes), 500MB, 2GiB (default 5GB)",
    )
    mt_to_hf.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        help="write every floating-point tensor in this dtype and name it in config.json, "
        "except what transformers keeps in float32 in such a model: DeepSeek-V2's router "
        "mlp.gate.weight (bfloat16, float16) and GPT-OSS's RMSNorm weights (float16). "
        "Default: each tensor's stored dtype, float32 for a training checkpoint's master "
        "weights and the source's for an hf-to-mt output; config.json names the embedding's",
    )
    mt_to_hf.add_argument(
        "--no-progress", action="store_true", help="draw no progress bars (on stderr)"
    )
    gen = sub.add_parser(
        "generate",
        help="sample text from a checkpoint",
        description="Continue a prompt with a checkpoint's model (greedy by default; "
        "--temperature > 0 samples with top-p).",
    )
    gen.add_argument("--checkpoint", required=True, type=_path, metavar="DIR", help="mt checkpoint")
    gen.add_argument("--prompt", required=True, metavar="TEXT", help="text to continue")
    gen.add_argument(
        "--max-new-tokens", type=int, default=64, metavar="N", help="tokens to add (default: 64)"
    )
    gen.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 (default) decodes greedily"
    )
    gen.add_argument(
        "--top-p",
        type=float,
        default=0.9,
        metavar="P",
        help="when sampling, draw from the likeliest tokens whose probability reaches P "
        "(default: 0.9)",
    )
    gen.add_argument(
        "--seed", type=int, default=0, metavar="N", help="seed of the sampling (default: 0)"
    )
    gen.add_argument(
        "--device",
        default="cpu",
        metavar="DEVICE",
        help="cpu (default), cuda or cuda:N (the Nth GPU)",
    )
    return parser


def _generate(args: argparse.Namespace) -> int:
    from mt_train.generate import generate

    try:
        text = generate(
            args.checkpoint,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            device=args.device,
        )
    except ValueError as err:
        print(f"mt-train: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a directory without read permission, a failing disk
        print(
            f"mt-train: error: {type(err).__name__}: {err}; reading --checkpoint "
            f"{args.checkpoint} or its tokenizer failed",
            file=sys.stderr,
        )
        return 1
    print(text)
    return 0


def _collective_timeout_hint(err: BaseException) -> str | None:
    """A clear message for a collective that timed out (a hung or dead rank), else None."""
    text = str(err)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return (
            f"waiting for the other ranks timed out ({text.splitlines()[0][:200]}): some "
            "rank never joined or stopped answering (crashed, hung, or much slower). Check "
            "every rank's log for the first error; parallel.timeout_s sets how long ranks "
            "wait"
        )
    return None


def _convert(args: argparse.Namespace) -> int:
    from mt_train.convert import hf_to_mt, mt_to_hf, parse_size

    try:
        if args.direction == "hf-to-mt":
            out = hf_to_mt(args.hf, args.out, progress=not args.no_progress)
        else:
            import torch

            size = parse_size(args.max_shard_size)
            dtype = None if args.dtype is None else getattr(torch, args.dtype)
            out = mt_to_hf(
                args.checkpoint, args.out, size, progress=not args.no_progress, dtype=dtype
            )
    except ValueError as err:
        print(f"mt-train: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, a read-only file system: the run failed, not usage
        # Reading the source can fail too (permissions): the message names both ends.
        hf = args.direction == "hf-to-mt"
        source = f"--hf {args.hf}" if hf else f"--checkpoint {args.checkpoint}"
        print(
            f"mt-train: error: {type(err).__name__}: {err}; converting {source} failed and "
            f"--out {args.out} was not written (nothing is left there)",
            file=sys.stderr,
        )
        return 1
    print(f"wrote {out}")
    return 0


def _report_failed_save(err: BaseException) -> bool:
    """Prints a failed checkpoint write (a full disk, say) as one error line plus the note
    `mt_train.checkpoint` added (which checkpoint, the free space, that the previous one
    stands); True when `err` is one. Other errors keep their traceback."""
    from mt_train.checkpoint import first_failure
    from mt_train.distributed import first_line

    notes = [n for n in getattr(err, "__notes__", ()) if n.startswith("mt-train: writing")]
    if not notes:
        return False
    cause = first_failure(err)
    print(f"mt-train: error: {type(cause).__name__}: {first_line(cause)}", file=sys.stderr)
    print(notes[0].removeprefix("mt-train: "), file=sys.stderr)
    return True


def _is_config_key(word: str) -> bool:
    """True for a word that names a config key (a top-level one or one under a section:
    ``seed``, ``training.max_steps``), not a recipe, a file or a path."""
    import dataclasses
    import re

    from mt_train.config import JobConfig

    if word in RECIPES or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", word):
        return False
    top_level = {f.name for f in dataclasses.fields(JobConfig)}
    return word.split(".")[0] in top_level and not word.endswith(".toml")


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    logger = logging.getLogger("mt_train")
    logger.handlers[:] = [handler]
    # Under torchrun only rank 0 reports progress; every rank reports its own warnings
    # (one that every rank would give alike is given by rank 0 alone).
    logger.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
    logger.propagate = False


def entry() -> None:
    """The ``mt-train`` script and ``python -m mt_train``: runs `main` and exits with its code.

    A rank of a multi-process run (torchrun sets ``WORLD_SIZE`` > 1) that finished leaves
    with ``os._exit`` once its streams and logs are flushed. `main` has already destroyed
    the process group, yet gloo's teardown in the interpreter's exit still aborted a rank
    of a finished run now and then ("terminate called without an active exception",
    SIGABRT; torchrun then reports the run failed: seen in CI with two CPU ranks under
    load). Every file the run writes is closed and synced by then.
    """
    code = main()
    if code == 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit code.

    A Ctrl-C that the training loop does not turn into a save and a clean stop (one
    during setup, a second one, or one in convert or generate) prints one line and
    returns 130, as a shell reports a process ended by SIGINT.
    """
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("mt-train: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    # Overrides may come before or after the options: collect the ones argparse left.
    args, rest = parser.parse_known_args(argv)
    unknown_options = [r for r in rest if r.startswith("-")]
    if unknown_options:
        parser.error(f"unrecognized arguments: {' '.join(unknown_options)}")
    if args.command != "pretrain" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.args = list(getattr(args, "args", [])) + rest
    if args.command == "pretrain" and args.config:  # a list, so a second one is not lost
        if len(args.config) > 1:
            parser.error(
                f"--config is given more than once ({', '.join(args.config)}); give one file "
                "(set the other's keys as KEY=VALUE, which win over the file)"
            )
        args.config = args.config[0]
    _configure_logging()
    if args.command == "convert":
        return _convert(args)
    if args.command == "generate":
        return _generate(args)
    from mt_train.overrides import resolve_config
    from mt_train.recipes import get_recipe

    positional = list(args.args)
    recipe = "debug"
    try:
        for word in positional:
            if "=" not in word and _is_config_key(word):
                raise ValueError(
                    f"{word!r} is a config key without a value; write {word}=VALUE "
                    "(--print-config shows every key with its value)"
                )
        if positional and "=" not in positional[0]:
            recipe = positional.pop(0)
            if recipe not in RECIPES and recipe.endswith(".toml"):
                raise ValueError(
                    f"{recipe!r} is not a recipe; pass a TOML file with --config {recipe}"
                )
        extra = [p for p in positional if "=" not in p]
        if extra:
            raise ValueError(
                f"unexpected argument {extra[0]!r}: give the recipe first and overrides as "
                "KEY=VALUE"
            )
        cfg = resolve_config(get_recipe(recipe), toml_path=args.config, overrides=positional)
    except ValueError as err:
        print(f"mt-train: error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    from torch.distributed.checkpoint import CheckpointException

    from mt_train.distributed import RankFailedError, leave_process_group
    from mt_train.train import NonFiniteError, pretrain

    try:
        pretrain(cfg)
    except ValueError as err:
        print(f"mt-train: error: {err}", file=sys.stderr)
        return 2
    except (NonFiniteError, RankFailedError) as err:
        print(f"mt-train: error: {err}", file=sys.stderr)
        return 1
    except RuntimeError as err:
        hint = _collective_timeout_hint(err)
        if hint is not None:
            print(f"mt-train: error: {hint}", file=sys.stderr)
            return 1
        if _report_failed_save(err):
            return 1
        raise
    except (OSError, CheckpointException) as err:  # (CheckpointException: a BaseException)
        if _report_failed_save(err):
            return 1
        raise
    leave_process_group()  # every rank finished (or stopped at one agreed step boundary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
