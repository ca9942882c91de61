"""The `mt-train` command line.

    mt-train pretrain [RECIPE] [--config FILE.toml] [KEY=VALUE ...] [--print-config]

`python -m mt_train ...` is the same program.
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
--print-config shows every key with its value. A run resumes from the newest complete
checkpoint in its run_dir; a changed config wins over the saved one.
"""


def _recipe_lines() -> str:
    lines = []
    for name, fn in RECIPES.items():
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        lines.append(f"  {name:<16}{summary}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Returns the argument parser of `mt-train`."""
    parser = argparse.ArgumentParser(
        prog="mt-train", description="Train mixture-of-experts language models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    pretrain = sub.add_parser(
        "pretrain",
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
    pretrain.add_argument("--config", metavar="FILE.toml", help="TOML file of config overrides")
    pretrain.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    return parser


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    logger = logging.getLogger("mt_train")
    logger.handlers[:] = [handler]
    # Under torchrun only rank 0 reports progress; every rank reports warnings.
    logger.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit code."""
    parser = build_parser()
    # Overrides may come before or after the options: collect the ones argparse left.
    args, rest = parser.parse_known_args(argv)
    unknown_options = [r for r in rest if r.startswith("-")]
    if unknown_options:
        parser.error(f"unrecognized arguments: {' '.join(unknown_options)}")
    args.args = list(getattr(args, "args", [])) + rest
    _configure_logging()
    from mt_train.overrides import resolve_config
    from mt_train.recipes import get_recipe

    positional = list(args.args)
    recipe = "debug"
    if positional and "=" not in positional[0]:
        recipe = positional.pop(0)
    try:
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
    from mt_train.train import pretrain

    try:
        pretrain(cfg)
    except ValueError as err:
        print(f"mt-train: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
