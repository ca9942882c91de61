"""The `mt-data` command: build corpora from JSON Lines, or build the default corpus.

    mt-data build INPUT... --tokenizer TOKENIZER --output DIR [--text-key text]
                           [--on-error skip|fail] [--no-progress]
    mt-data build-default --output DIR

User mistakes print one line on stderr and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mt_data.build import build_corpus
from mt_data.default_corpus import build_default_corpus
from mt_data.manifest import read_manifest

__all__ = ["main"]

# Bad lines printed with file:line after a build (all are counted).
_PRINTED_BAD_LINES = 20


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mt-data",
        description="Build tokenized corpora in Megatron-LM's indexed format (.bin + .idx).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    build = commands.add_parser(
        "build",
        help="tokenize .jsonl / .jsonl.zst files into a corpus directory",
        description=(
            "Tokenize JSON Lines files (.jsonl, .jsonl.zst, .jsonl.zstd) into DIR, one "
            "<stem>.bin/.idx shard per input file, EOS appended to every document, then "
            "write DIR/manifest.json. Shards already complete in DIR are skipped, so "
            "rerunning an interrupted build resumes it."
        ),
    )
    build.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="input file, directory or glob pattern"
    )
    build.add_argument(
        "--tokenizer",
        required=True,
        help="tokenizer.json, or a directory holding it and tokenizer_config.json (eos_token)",
    )
    build.add_argument("--output", required=True, metavar="DIR", help="corpus directory")
    build.add_argument(
        "--text-key", default="text", help="JSON field holding the text (default: text)"
    )
    build.add_argument(
        "--on-error",
        choices=("skip", "fail"),
        default="skip",
        help="on a malformed line: skip and report it with file:line (default), or stop",
    )
    build.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    default = commands.add_parser(
        "build-default",
        help="build the embedded default corpus (Python's standard library) into DIR",
        description=(
            "Tokenize the running Python's standard library .py files with mt-data's "
            "packaged tokenizer into DIR (no network needed)."
        ),
    )
    default.add_argument("--output", required=True, metavar="DIR", help="corpus directory")
    default.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def _run_build(args: argparse.Namespace) -> int:
    summary = build_corpus(
        args.inputs,
        args.tokenizer,
        args.output,
        text_key=args.text_key,
        on_error=args.on_error,
        progress=not args.no_progress,
    )
    for bad in summary.bad_lines[:_PRINTED_BAD_LINES]:
        print(f"mt-data: skipped {bad}", file=sys.stderr)
    if summary.num_bad_lines > _PRINTED_BAD_LINES:
        print(
            f"mt-data: ... {summary.num_bad_lines - _PRINTED_BAD_LINES} more bad lines",
            file=sys.stderr,
        )
    print(
        f"{summary.output}: {len(summary.shards)} shards ({summary.num_resumed} already "
        f"complete), {summary.num_documents:,} documents, {summary.num_tokens:,} tokens, "
        f"{summary.num_bad_lines} bad lines, {summary.num_empty_documents} empty documents "
        f"skipped, {summary.seconds:.1f} s"
    )
    return 0


def _run_build_default(args: argparse.Namespace) -> int:
    out = build_default_corpus(args.output, progress=not args.no_progress)
    manifest = read_manifest(out) or {}
    print(
        f"{out}: default corpus, {manifest.get('num_documents', 0):,} documents, "
        f"{manifest.get('num_tokens', 0):,} tokens"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `mt-data` command line.

    Args:
        argv: Arguments without the program name; None reads `sys.argv[1:]`.

    Returns:
        Exit status: 0 on success, 2 on a user error (message on stderr), 130 when
        interrupted.
    """
    args = _parser().parse_args(argv)
    try:
        if args.command == "build":
            return _run_build(args)
        return _run_build_default(args)
    except (ValueError, OSError) as e:  # FileNotFoundError, CorpusError, ... are in here
        print(f"mt-data {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mt-data: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
