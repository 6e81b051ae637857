"""`prepare`: convert the embedded GGUF model into the local cache once, and print the cache folder."""

from __future__ import annotations

import sys

NAME = "prepare"


def add_parser(sub) -> None:
    sub.add_parser(NAME, help="convert the embedded GGUF model into the cache (once)")


def run(args) -> int:
    from feedback.core import embedded

    path = embedded.prepare(log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(path)
    return 0
