"""`python -m ui.render_cost`: server time the Compare handler spends on what the page is sent (the
board's token events, the metrics table, the charts), as a share of decode time, measured on the
real handler, runner and engine (no browser, no network)."""

from __future__ import annotations

import argparse
import json

from feedback.serve.pool import ModelPool
from ui.layout import FeedbackLensApp
from ui.page.controls import NONE, api_name
from ui.page.settings import column_key

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def measure(tokens: int, columns: int = 2) -> dict:
    """One real Compare run with `columns` columns (column 1 the baseline, the others residual at
    different strengths) through the page's own handler."""
    app = FeedbackLensApp(ModelPool(["embedded"]))
    demo = app.build()
    tab = app.compare
    values = tab.initial_values() | {"prompt": PROMPT, "max_new_tokens": tokens, "columns": columns}
    for col in tab.ui.cols:
        strategy = NONE if col.index == 0 else "residual"
        values |= {
            column_key(col.index, "strategy"): strategy,
            column_key(col.index, api_name("residual", "alpha")): 0.05 * col.index,
        }
    compare = next(f.fn for f in demo.fns.values() if f.api_name == "compare")  # as the page wired it
    updates = list(compare(None, **values))
    run = updates[-1][tab.ui.out.run_json.data]
    steps = len(run["rows"][0]["steps"])
    return {
        "columns": columns,
        "tokens": steps,
        "updates": len(updates),
        "decode_s": run["wall_seconds"],
        "ui_s": run["ui_seconds"],
        "ui_share_of_decode": run["ui_seconds"] / run["wall_seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--columns", type=int, default=2, choices=[2, 3, 4])
    args = parser.parse_args()
    print(json.dumps(measure(args.tokens, args.columns), indent=2))


if __name__ == "__main__":
    main()
