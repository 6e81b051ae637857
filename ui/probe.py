"""A program's check of a running app: one `/compare` call through gradio_client, made as a client
would make it, and one JSON line on stdout (seconds, each column's tokens and text, the status).

`python -m ui.probe URL [--max-new-tokens N]`. `python -m feedback doctor` runs it in its own
process against the `app.py` it started: the library may not import Gradio or its client
(`.importlinter`), the UI may.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

PROMPT = "What is the capital of France?"


def probe(url: str, max_new_tokens: int) -> dict:
    from gradio_client import Client

    client = Client(url, verbose=False)
    started = time.perf_counter()
    outputs = client.predict(PROMPT, max_new_tokens=max_new_tokens, api_name="/compare")
    seconds = time.perf_counter() - started
    status, run = outputs[-2], outputs[-1]  # Compare's last two outputs: the status line and the run
    return {
        "seconds": round(seconds, 3),
        "prompt": PROMPT,
        "status": re.sub(r"<[^>]+>", "", str(status)).strip(),
        "rows": [{"name": r["name"], "tokens": len(r["token_ids"]), "text": r["text"]} for r in run["rows"]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ui.probe", description=__doc__.splitlines()[0])
    p.add_argument("url", help="the app's address, e.g. http://127.0.0.1:7860")
    p.add_argument("--max-new-tokens", type=int, default=8)
    args = p.parse_args(argv)
    print(json.dumps(probe(args.url, args.max_new_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
