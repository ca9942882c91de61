"""The `mt-data` command: build corpora, inspect them, or build the default corpus.

    mt-data build INPUT... --tokenizer PATH --output DIR [--workers N]
                           [--text-key text] [--on-error skip|fail] [--eos-token TOKEN]
                           [--bos | --bos-token TOKEN] [--no-progress]
    mt-data inspect PATH [--tokenizer PATH] [--documents N] [--characters N]
    mt-data build-default --output DIR [--no-progress]

User mistakes print one line on stderr and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool

from mt_data.build import build_corpus
from mt_data.default_corpus import build_default_corpus
from mt_data.inspection import inspect_corpus
from mt_data.manifest import read_manifest
from mt_data.tokenizer import FALLBACK_EOS_TOKENS

__all__ = ["main"]

# Exit status when stdout is a pipe closed early: 128 + SIGPIPE, as a shell reports a
# command killed by it.
_EXIT_BROKEN_PIPE = 141
# Bad lines printed with file:line after a build (all are counted).
_PRINTED_BAD_LINES = 20
# A full disk, a full quota, a file size limit: errors a rerun resumes from.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mt-data",
        description="Build tokenized corpora in Megatron-LM's indexed format (.bin + .idx).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    build = commands.add_parser(
        "build",
        help="tokenize .jsonl / .jsonl.zst / .parquet files into a corpus directory",
        description=(
            "Tokenize JSON Lines files (.jsonl, .jsonl.zst, .jsonl.zstd) and Parquet files "
            "(with pyarrow installed) into DIR, one <stem>.bin/.idx shard per input file in "
            "Megatron-LM's indexed format, EOS appended to every document, then write "
            "DIR/manifest.json. Shards already complete in DIR are skipped, so rerunning "
            "an interrupted build resumes it; the result is the same bytes whatever N is. "
            "DIR holds one corpus: once the build succeeds, shards an earlier build wrote "
            "there for files not among this build's inputs are removed (build into another "
            "DIR to keep them, and mix the two when reading)."
        ),
    )
    build.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="input file, directory or glob pattern"
    )
    build.add_argument(
        "--tokenizer",
        required=True,
        metavar="PATH",
        help="tokenizer.json, or a directory holding it (and tokenizer_config.json or "
        "special_tokens_map.json naming eos_token)",
    )
    build.add_argument("--output", required=True, metavar="DIR", help="corpus directory")
    build.add_argument(
        "--text-key",
        default="text",
        metavar="KEY",
        help="JSON field (Parquet column) holding the text (default: text)",
    )
    build.add_argument(
        "--on-error",
        choices=("skip", "fail"),
        default="skip",
        help="on a malformed line: skip and report it with file:line (default), or stop",
    )
    build.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="tokenizer worker processes (default: one per core this process may use, within "
        "its cgroup CPU quota; 0: none, tokenize in-process)",
    )
    build.add_argument(
        "--eos-token",
        default=None,
        metavar="TOKEN",
        help="EOS token text (default: eos_token of tokenizer_config.json or "
        "special_tokens_map.json, as transformers reads them, else the first of "
        f"{', '.join(FALLBACK_EOS_TOKENS)} in the vocabulary)",
    )
    build.add_argument(
        "--bos",
        action="store_true",
        help="prepend the bos_token of tokenizer_config.json (or special_tokens_map.json) "
        "to every document",
    )
    build.add_argument(
        "--bos-token",
        default=None,
        metavar="TOKEN",
        help="prepend this token to every document instead (implies --bos)",
    )
    build.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    inspect = commands.add_parser(
        "inspect",
        help="print a corpus's shards, documents, tokens and dtype, and decode a sample",
        description=(
            "Print each shard of a corpus directory (or one Megatron shard prefix) with its "
            "documents, tokens and dtype, then decode the first sequences in shard order "
            "(one per document in moetrain corpora; later shards when the first has too "
            "few) with the tokenizer named in manifest.json (or --tokenizer)."
        ),
    )
    inspect.add_argument("path", metavar="PATH", help="corpus directory or shard prefix")
    inspect.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer.json or its directory (default: the one manifest.json names)",
    )
    inspect.add_argument(
        "--documents",
        type=int,
        default=1,
        metavar="N",
        help="sequences to decode, the first in shard order (default: 1)",
    )
    inspect.add_argument(
        "--characters",
        type=int,
        default=300,
        metavar="N",
        help="characters shown per sequence (default: 300)",
    )

    default = commands.add_parser(
        "build-default",
        help="build the embedded default corpus (Python's standard library) into DIR",
        description=(
            "Tokenize the running Python's standard library .py files with mt-data's "
            "packaged tokenizer into DIR (no network needed). DIR must be new, empty, or "
            "hold only an earlier default corpus, which is replaced; if it holds anything "
            "else (say the shards of mt-data build) it is an error and nothing is deleted."
        ),
    )
    default.add_argument(
        "--output",
        required=True,
        metavar="DIR",
        help="corpus directory: new, empty, or an earlier default corpus (replaced)",
    )
    default.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def _run_build(args: argparse.Namespace) -> int:
    # Checked here too, to name the flags (build_corpus names its Python arguments).
    if args.workers is not None and args.workers < 0:
        raise ValueError(f"--workers ({args.workers}) must be >= 0 (0: tokenize in this process)")
    if not args.text_key:
        raise ValueError(
            f"--text-key ({args.text_key!r}) must name a JSON field (Parquet column), e.g. "
            "--text-key text"
        )
    summary = build_corpus(
        args.inputs,
        args.tokenizer,
        args.output,
        text_key=args.text_key,
        on_error=args.on_error,
        workers=args.workers,
        eos_token=args.eos_token,
        bos=args.bos if args.bos_token is None else args.bos_token,
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
    if summary.removed:
        print(f"removed shards of an earlier build no longer listed: {', '.join(summary.removed)}")
    if summary.bad_lines_by_kind:
        kinds = ", ".join(f"{kind} {n}" for kind, n in summary.bad_lines_by_kind.items())
        print(f"bad lines by kind: {kinds}")
    print(f"manifest: {summary.manifest_path}")
    return 0


def _run_inspect(args: argparse.Namespace) -> int:
    print(
        inspect_corpus(
            args.path,
            tokenizer=args.tokenizer,
            documents=args.documents,
            characters=args.characters,
        )
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
        Exit status: 0 on success, 2 on a user error (message on stderr), 1 when a
        tokenizer worker process died, 130 when interrupted, 141 when stdout was a pipe
        closed early (`| head`).
    """
    args = _parser().parse_args(argv)
    try:
        if args.command == "build":
            status = _run_build(args)
        elif args.command == "inspect":
            status = _run_inspect(args)
        else:
            status = _run_build_default(args)
        sys.stdout.flush()  # here, so that a closed pipe is caught below
        return status
    except BrokenPipeError:
        # The reader of stdout left early (`mt-data inspect DIR | head`): stop quietly, as a
        # Unix tool killed by SIGPIPE, with stdout on /dev/null so the flush at exit passes.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _EXIT_BROKEN_PIPE
    except (ValueError, OSError) as e:  # FileNotFoundError, CorpusError, ... are in here
        hint = ""
        if args.command == "build" and isinstance(e, OSError) and e.errno in _NO_SPACE:
            hint = (
                "; free space there (or choose another --output) and rerun the same command "
                "to resume: finished shards are kept"
            )
        print(f"mt-data {args.command}: error: {e}{hint}", file=sys.stderr)
        return 2
    except BrokenProcessPool:
        print(
            f"mt-data {args.command}: error: a tokenizer worker process died (out of memory? "
            "killed?); rerun the same command to resume, with fewer --workers if memory is short",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        # Only a build resumes; inspect has nothing to resume, build-default starts over.
        resume = "; rerun the same command to resume" if args.command == "build" else ""
        print(f"mt-data: interrupted{resume}", file=sys.stderr)
        return 130
