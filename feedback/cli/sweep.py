"""`sweep`: ΔPPL over a grid of a strategy's parameters, into sweep.csv and (for one or two grid
parameters) a heatmap sweep.html; the last line names the best point only when it beats the baseline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from feedback.cli import common

NAME = "sweep"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="ΔPPL over a grid of strategy parameters -> CSV + heatmap HTML")
    common.add_ppl_args(p)
    common.add_strategy_args(p, None, required=True)
    p.add_argument("--grid", action="append", default=[], metavar="NAME=V1,V2,...")
    p.add_argument(
        "--out-dir", default=None, help="where sweep.csv and sweep.html go (default sweep-STRATEGY)"
    )
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")


def run(args) -> int:
    from feedback.eval import corpus
    from feedback.eval.sweep import best_point, parse_grid, run_sweep
    from feedback.strategies import build_strategy

    docs = corpus.load(args.data, common.warn)
    fixed = dict(args.param)
    cfg = common.ppl_config(args, fixed)
    cfg.resolved_mode()
    lm = common.load(args)
    grid = parse_grid(args.grid, args.strategy, lm.num_layers)
    build_strategy(args.strategy, fixed, lm.num_layers)
    names = list(grid)

    def report(row: dict, done: int, total: int) -> None:
        point = ", ".join(f"{k}={row[k]}" for k in names)
        print(
            f"[{done}/{total}] {point}: ΔPPL {row['delta_pct']:+.3f}% "
            f"[{row['ci95_low']:+.3f}, {row['ci95_high']:+.3f}] ({row['wall_seconds']:.1f} s)",
            file=sys.stderr,
            flush=True,
        )

    rows = run_sweep(lm, docs, args.strategy, grid, cfg, fixed, report)
    _write(args, rows, names)
    print(best_line(best_point(rows, args.strategy, fixed), names))
    if args.json:
        print(json.dumps(rows))
    return 0


def _write(args, rows: list[dict], names: list[str]) -> None:
    """sweep.csv, and the heatmap where the grid has one or two parameters; says what it wrote."""
    from feedback.eval.sweep import to_csv

    out = Path(args.out_dir or f"sweep-{args.strategy}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.csv").write_text(to_csv(rows, names))
    if len(names) <= 2:
        from feedback.eval.figures import sweep_heatmap

        fig = sweep_heatmap(
            rows,
            names[0],
            names[1] if len(names) == 2 else None,
            f"{args.strategy} on {args.data}: ΔPPL % vs baseline ({rows[0]['mode']})",
        )
        fig.write_html(out / "sweep.html", include_plotlyjs=True)
    else:
        print("note: a heatmap needs one or two grid parameters; wrote the CSV only", file=sys.stderr)
    print(f"wrote {out / 'sweep.csv'}" + (f" and {out / 'sweep.html'}" if len(names) <= 2 else ""))


def best_line(best: dict | None, names: list[str]) -> str:
    """The sweep's last line: "best: ..." only for a point that beats the baseline, with the verdict
    on it (`feedback.eval.verdict`); else "best: none", why, and the lowest point."""
    from feedback.eval.verdict import ci_text, not_recommended, verdict

    if best is None:
        return "best: none (every point has strength 0, i.e. measures the baseline again)"
    judged = verdict(best["delta_pct"], [best["ci95_low"], best["ci95_high"]])
    point = (
        ", ".join(f"{k}={best[k]}" for k in names) + f" ΔPPL {best['delta_pct']:+.3f}% "
        f"{ci_text(best['ci95_low'], best['ci95_high'])} ({judged.text}; points with strength 0 left out)"
    )
    why = not_recommended(judged)
    return f"best: {point}" if why is None else f"best: none ({why}); the lowest ΔPPL: {point}"
