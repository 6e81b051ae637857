"""`prepare`: convert the embedded GGUF model into the local cache once, build the fp32 decode kernel
there (`feedback.core.gemv`) where this machine can, and print the model's cache folder."""

from __future__ import annotations

import sys

NAME = "prepare"


def add_parser(sub) -> None:
    sub.add_parser(
        NAME, help="convert the embedded GGUF model and build the decode kernel into the cache (once)"
    )


def run(args) -> int:
    from feedback.core import embedded, gemv

    path = embedded.prepare(log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(f"fp32 decode kernel: {gemv.describe()}", file=sys.stderr)  # built now: an image starts with it
    print(path)
    return 0
