"""Parameter sweeps: perplexity for every point of a grid of strategy parameters (baseline once)."""

from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import threading
from collections.abc import Callable

from feedback.core.budget import Budget
from feedback.core.model import LoadedModel
from feedback.errors import FeedbackError
from feedback.eval.corpus import Document
from feedback.eval.perplexity import PPLConfig, ScoringProgress, Tally, document_ids, evaluate, scoring_work
from feedback.strategies import get_strategy

MAX_POINTS = 400
CSV_FIELDS = [
    "delta_pct",
    "ci95_low",
    "ci95_high",
    "ci95_width",
    "baseline_ppl",
    "feedback_ppl",
    "mode",
    "tokens",
    "wall_seconds",
]


def parse_grid(
    items: list[str], strategy: str, num_layers: int, fields: list[str] | None = None
) -> dict[str, list]:
    """`--grid alpha=0,0.05 --grid target_layer=3,9` -> {"alpha": [0.0, 0.05], "target_layer": [3, 9]},
    every value parsed and validated by the strategy's parameter schema. `fields`: what each item is
    called where it was typed, for the refusals (the page's "grid x"; the command line's --grid)."""
    known = {p.name: p for p in get_strategy(strategy).params}
    grid: dict[str, list] = {}
    for i, item in enumerate(items):
        field = fields[i] if fields else "--grid"
        name, sep, values = item.partition("=")
        name = name.strip()
        if not sep or not values.strip():
            raise FeedbackError(f"{field} expects NAME=V1,V2,..., got {item!r}")
        if name not in known:
            raise FeedbackError(
                f"{field}: unknown parameter {name!r} for strategy {strategy}; it takes {', '.join(known)}"
            )
        if name in grid:
            raise FeedbackError(f"{field}: parameter {name} appears twice in the grid")
        grid[name] = [known[name].coerce(v.strip(), num_layers) for v in values.split(",")]
    if not grid:
        raise FeedbackError(f"give at least one {fields[0] if fields else '--grid'} NAME=V1,V2,...")
    points = 1
    for values in grid.values():
        points *= len(values)
    if points > MAX_POINTS:
        raise FeedbackError(f"the grid has {points} points; at most {MAX_POINTS}")
    return grid


def run_sweep(
    lm: LoadedModel,
    docs: list[Document],
    strategy: str,
    grid: dict[str, list],
    base: PPLConfig,
    fixed: dict | None = None,
    on_point: Callable[[dict, int, int], None] | None = None,
    stop: threading.Event | None = None,
    progress: Callable[[ScoringProgress], None] | None = None,
    budget: Budget | None = None,
) -> list[dict]:
    """One perplexity evaluation per grid point; rows carry the point's parameters and the results.
    Setting `stop` ends the sweep (raising `Stopped`) within one forward pass; the points already
    finished have been handed to `on_point`. `progress` hears after every window where the sweep
    stands: the point, the document and tokens within it, the token-forwards since the start."""
    names = list(grid)
    points = list(itertools.product(*grid.values()))
    if budget is not None:  # the whole grid, checked before the first point
        cfg = dataclasses.replace(base, strategy=strategy, params=dict(fixed or {}))
        cfg.validate(lm.context_length)
        counts = [len(ids) for ids in document_ids(lm, docs, cfg)]
        budget.check_scoring(*scoring_work(counts, cfg, len(points)))
    baseline_cache: dict = {}
    tally = (
        Tally(progress, len(points), "point") if progress else None
    )  # one through the sweep: forwards add up
    rows = []
    for i, values in enumerate(points):
        params = {**(fixed or {}), **dict(zip(names, values))}
        cfg = dataclasses.replace(base, strategy=strategy, params=params)
        if tally is not None:
            tally.point = i + 1
        res = evaluate(lm, docs, cfg, baseline_cache=baseline_cache, stop=stop, tally=tally)
        lo, hi = res["ci95"]
        row = {
            **dict(zip(names, values)),
            "delta_pct": res["delta_pct"],
            "ci95_low": lo,
            "ci95_high": hi,
            "ci95_width": hi - lo,
            "baseline_ppl": res["baseline_ppl"],
            "feedback_ppl": res["feedback_ppl"],
            "mode": res["mode"],
            "tokens": res["tokens"],
            "wall_seconds": res["wall_seconds"],
        }
        rows.append(row)
        if on_point:
            on_point(row, i + 1, len(points))
    return rows


def is_noop(strategy: str, params: dict) -> bool:
    """Whether these parameters switch the strategy off (its strength is 0): such a point measures
    the baseline again, so it can never be "the best setting"."""
    cls = get_strategy(strategy)
    known = {p.name for p in cls.params}
    return cls.switched_off({k: v for k, v in params.items() if k in known})


def best_point(rows: list[dict], strategy: str, fixed: dict | None = None) -> dict | None:
    """The grid point with the lowest ΔPPL among those that change anything (None if none does).
    Lowest is not better than the baseline: `feedback.eval.verdict` judges whether it is (ΔPPL < 0)
    and whether its CI excludes 0, before anything calls it a recommendation."""
    live = [r for r in rows if not is_noop(strategy, {**(fixed or {}), **r})]
    return min(live, key=lambda r: r["delta_pct"]) if live else None


def to_csv(rows: list[dict], names: list[str]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=[*names, *CSV_FIELDS])
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()
