"""`python -m ui.render_cost`: server time the Compare handler spends building HTML and charts, as a
share of decode time, measured on the real handler, runner and engine (no browser, no network)."""
from __future__ import annotations

import argparse
import json

from feedback.serve.pool import ModelPool
from ui.layout import FeedbackLensApp

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def measure(tokens: int, columns: int = 2) -> dict:
    """One real Compare run with `columns` columns (column 1 the baseline, the others residual at
    different strengths) through the page's own handler."""
    app = FeedbackLensApp(ModelPool(["embedded"]))
    app.build()
    tab = app.compare
    names = [n for c in tab.cols for n in c.api_names]
    fn = app.runner.wrap("compare", tab.prepare_compare, names)
    values = []
    for col in tab.cols:
        strategy = "none" if col.index == 0 else "residual"
        params = [0.05 * col.index if (s, p) == ("residual", "alpha") else comp.value
                  for (s, p), comp in zip(col.panel.keys, col.panel.components)]
        values += [col.name.value, strategy, "", "", *params]
    shared = [PROMPT, "", True, "embedded", "confidence", 0.0, 1.0, 0, 0.0, 1.0, tokens, 0, 20, 32, "off", 4.5, "",
              "", columns]
    updates = list(fn(*shared, *values, None))
    run = updates[-1][tab.run_json]
    steps = len(run["rows"][0]["steps"])
    return {"columns": columns, "tokens": steps, "updates": len(updates), "decode_s": run["wall_seconds"],
            "ui_s": run["ui_seconds"], "ui_share_of_decode": run["ui_seconds"] / run["wall_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--columns", type=int, default=2, choices=[2, 3, 4])
    args = parser.parse_args()
    print(json.dumps(measure(args.tokens, args.columns), indent=2))


if __name__ == "__main__":
    main()
