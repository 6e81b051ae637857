"""`python -m ui.bench`: server time the Compare handler spends building HTML and charts, as a
share of decode time, measured on the real handler, runner and engine (no browser, no network)."""
from __future__ import annotations

import argparse
import json

from feedback.model import ModelPool
from ui.app import FeedbackLensApp

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def measure(tokens: int) -> dict:
    app = FeedbackLensApp(ModelPool(["embedded"]))
    app.build()
    tab = app.compare
    fn = app.runner.wrap("compare", tab.prepare_compare, tab.panel.api_names)
    values = [PROMPT, True, "embedded", "residual", "confidence", 0.0, 1.0, 0, 0.0, 1.0, tokens, 0, 20, 32,
              "off", 4.5]
    updates = list(fn(*values, *[c.value for c in tab.panel.components], None))
    run = updates[-1][tab.run_json]
    steps = len(run["rows"][0]["steps"])
    return {"tokens": steps, "updates": len(updates), "decode_s": run["wall_seconds"], "ui_s": run["ui_seconds"],
            "ui_share_of_decode": run["ui_seconds"] / run["wall_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    print(json.dumps(measure(args.tokens), indent=2))


if __name__ == "__main__":
    main()
