"""What the Compare tab shows, as plain data: views that say what to put on the page (the board's
document of the columns, the metrics table, charts, the status line, the finished run), built from
engine records and configs. The works (`ui.compare.work`) and the tab's handlers build views; only
the tab turns a view into updates of its components.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from feedback.core.records import RowResult, RowSpec, RunConfig, RunResult, first_divergence
from ui.compare.stream import finished_doc, modified
from ui.page import charts, render
from ui.page.settings import badges


@dataclass
class Status:
    """A status line: its text and kind ("info", "wait", "stopped", "error")."""

    text: str
    kind: str = "info"


@dataclass
class PageView:
    """What a run shows on the page; a field left None leaves that part as it is."""

    busy: bool | None = None  # True: the run button off and Stop on; False: the other way round
    status: Status | None = None

    def __or__(self, other: PageView) -> PageView:
        """This view with what `other` sets on top of it."""
        changes = {
            f.name: getattr(other, f.name) for f in fields(other) if getattr(other, f.name) is not None
        }
        return replace(self, **changes)


@dataclass
class RunView(PageView):
    """What a Compare run (a first turn, a follow-up, a branch, a reload) shows."""

    columns: int | None = None  # how many columns the settings show (the others are hidden)
    board: str | None = None  # the columns: the run's token events (ui.compare.stream)
    metrics: str | None = None  # one table: a row per metric, a column per column
    confidence: Any = None  # the confidence chart
    memory: Any = None  # the memory chart ...
    mem_state: dict | None = None  # ... and its samples, kept by the page
    result: dict | None = None  # a finished run: its JSON, what Continue and branches go on from


@dataclass
class CalibrationView(PageView):
    """What Calibrate shows: once it is done, the threshold it set, its note and histogram."""

    threshold: float | None = None  # early stop set to fixed at this threshold
    note: str | None = None
    histogram: Any = None


def heading(index: int, spec: RowSpec, first: RowSpec | None = None) -> str:
    """Column `index`'s heading for `spec`: its chart colour, name, strategy and parameters, what it
    overrides (`first`: column 1's spec, for conversations) and its own settings."""
    return render.column_heading(
        spec.name, spec.strategy, spec.params, charts.row_color(index), modified(spec, first), badges(spec)
    )


def divergences(rows: list[RowResult], live: bool = False) -> dict[int, int]:
    """Column index -> first step where it differs from column 1 (while streaming, only once both
    have reached that step: until then it is a prefix, not a divergence)."""
    out = {}
    for j, row in enumerate(rows[1:], start=1):
        d = first_divergence(rows[0].token_ids, row.token_ids)
        if d is not None and not (live and (len(rows[0].steps) <= d or len(row.steps) <= d)):
            out[j] = d
    return out


def done_text(result: RunResult) -> str:
    div = divergences(result.rows)
    stopped = " (stopped)" if any(r.stop_reason == "stopped" for r in result.rows) else ""
    if len(result.rows) == 2:
        same = "the columns are identical" if not div else f"the columns first differ at step {div[1]}"
    else:
        same = (
            "every column matches column 1"
            if not div
            else "vs column 1, first difference: "
            + ", ".join(f"{result.rows[j].name} at step {d}" for j, d in div.items())
        )
    return (
        f"Done{stopped} in {result.wall_seconds:.1f} s · prompt {result.prompt_tokens} tokens · {same}"
        f"{branch_text(result.rows)}{fast_text(result)}"
    )


def branch_text(rows: list[RowResult]) -> str:
    """What a branch did, counted in choices (not in the tokens replayed before them): which
    columns took the chosen token, and which were left as they were."""
    took = [r.name for r in rows if any(s.chosen for s in r.steps)]
    if not took:
        return ""
    left = [r.name for r in rows if r.name not in took and any(s.forced for s in r.steps)]
    where = "every column" if len(took) == len(rows) else ", ".join(took)
    note = f" · branched: your token in {where}"
    if left:
        note += (
            f"; {', '.join(left)} left as {'it was' if len(left) == 1 else 'they were'}"
            " (different text before it)"
        )
    return note


def fast_text(result: RunResult) -> str:
    precision = result.config.get("precision") or ""
    return f" · {precision}" if precision.startswith("fast") else ""


def metrics(rows: list[RowResult], running: list[bool] | None = None) -> RunView:
    """The metrics table of `rows` (`running`: which still stream)."""
    return RunView(
        metrics=render.render_metrics(
            rows, running, render.best_marks(rows), [charts.row_color(i) for i in range(len(rows))]
        )
    )


def confidence_chart(rows: list[RowResult], threshold: float | None, window: int, live: bool = False):
    return charts.confidence_figure(rows, threshold, divergences(rows, live), window)


def finished(data: dict) -> RunView:
    """A stored run (a RunResult dict) as it showed when it finished: its columns on the board,
    metrics and confidence chart."""
    result = RunResult.from_dict(data)
    cfg = RunConfig.from_dict(result.config)
    chart = confidence_chart(result.rows, cfg.deepconf.threshold, cfg.deepconf.window)
    return RunView(
        columns=len(cfg.rows),
        board=finished_doc(result.run_id, cfg, result.rows).text,
        confidence=chart,
        result=data,
    ) | metrics(result.rows)
