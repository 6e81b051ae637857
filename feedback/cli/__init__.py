"""Command line: python -m feedback {generate, prepare, ppl, sweep, tune, deepthink, qa, calibrate, lmeval,
recall, batch, merge, bench, doctor}.

One module per command, each with its flags beside its handler: `add_parser(sub)` adds the
subcommand and its flags, `run(args) -> int` runs it. The flags several commands share, the model
loader and the output helpers are `feedback.cli.common`. `main` turns what a command raises into
one line on stderr and an exit status."""

from __future__ import annotations

import argparse
import os
import sys

from feedback.cli import (
    batch,
    bench,
    calibrate,
    common,
    deepthink,
    doctor,
    generate,
    lmeval,
    merge,
    ppl,
    prepare,
    qa,
    recall,
    sweep,
    tune,
)
from feedback.errors import FeedbackError, one_line

# An unexpected failure prints one line; with this set to 1 the command raises it, traceback and all.
TRACEBACK_ENV = "FEEDBACK_TRACEBACK"

# The installed console script (pyproject.toml); `python -m feedback` is the same command.
SCRIPT = "feedback-lens"

# Every command, in the order `python -m feedback --help` lists them.
COMMANDS = (
    generate,
    prepare,
    ppl,
    sweep,
    tune,
    deepthink,
    qa,
    calibrate,
    lmeval,
    recall,
    batch,
    merge,
    bench,
    doctor,
)


def program() -> str:
    """How the user called the command line, for its usage lines."""
    return SCRIPT if os.path.basename(sys.argv[0]) == SCRIPT else "python -m feedback"


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command in COMMANDS."""
    parser = common.Parser(prog=program(), description="Feedback Lens: baseline vs activation feedback")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=common.Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command: its own exit status, 2 and one line for a refused input (FeedbackError), 130
    when interrupted, 1 and one line for any other failure (its traceback with FEEDBACK_TRACEBACK=1)."""
    args = build_parser().parse_args(argv)
    command = next(c for c in COMMANDS if c.NAME == args.command)
    try:
        return command.run(args)
    except FeedbackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a failure mid-run (a model's layer, the machine): one line, not 100
        if os.environ.get(TRACEBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
            raise
        print(
            f"error: {args.command} failed: {one_line(exc)} (set {TRACEBACK_ENV}=1 for the traceback)",
            file=sys.stderr,
        )
        return 1
