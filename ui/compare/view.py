"""What the Compare tab shows, as plain data: views that say what to put on the page (column texts,
the metrics table and headings, charts, the status line, the finished run), built from engine records and
configs. The works (`ui.compare.work`) and the tab's handlers build views; only the tab turns a view
into updates of its components.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from feedback.core.records import RowResult, RowSpec, RunConfig, RunResult, first_divergence
from ui import charts, render
from ui.compare.settings import badges


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

    def __or__(self, other: "PageView") -> "PageView":
        """This view with what `other` sets on top of it."""
        changes = {f.name: getattr(other, f.name) for f in fields(other) if getattr(other, f.name) is not None}
        return replace(self, **changes)


@dataclass
class RunView(PageView):
    """What a Compare run (a first turn, a follow-up, a branch, a reload) shows. The per-column
    lists go from column 1; a column they do not reach is left as it is."""

    columns: int | None = None  # how many columns the page shows (the others are hidden)
    headings: list[str] | None = None
    turns: list[str] | None = None  # each column's conversation so far
    texts: list[str] | None = None
    metrics: str | None = None  # one table: a row per metric, a column per column
    diff: bool | None = None  # whether the diff view's legend shows
    confidence: Any = None  # the confidence chart
    feed: str | None = None  # while streaming, the chart's new points (charts.feed_start / feed_lines)
    memory: Any = None  # the memory chart ...
    mem_state: dict | None = None  # ... and its samples, kept by the page
    result: dict | None = None  # a finished run: its JSON, what Continue and branches go on from


@dataclass
class CalibrationView(PageView):
    """What Calibrate shows: once it is done, the threshold it set, its note and histogram."""

    threshold: float | None = None  # early stop set to fixed at this threshold
    note: str | None = None
    histogram: Any = None


def _first_user_turn(messages: list[dict] | None) -> str | None:
    return next((m["content"] for m in messages or [] if m.get("role") == "user"), None)


def modified(spec: RowSpec, first: RowSpec | None = None) -> list[str]:
    """What a column overrides of the run's shared input (for its heading's badges). In a
    conversation every column's history differs (their own answers); its prompt counts as modified
    when it began from another question than column 1 (`first`)."""
    prompt = spec.prompt is not None or (
        first is not None and spec.messages is not None
        and _first_user_turn(spec.messages) != _first_user_turn(first.messages))
    return [what for what, changed in (("prompt", prompt), ("system prompt", spec.system_prompt is not None))
            if changed]


def heading(index: int, spec: RowSpec, first: RowSpec | None = None) -> str:
    """Column `index`'s heading for `spec`: its chart colour, name, strategy and parameters, what it
    overrides (`first`: column 1's spec, for conversations) and its own settings."""
    return render.column_heading(spec.name, spec.strategy, spec.params, charts.row_color(index),
                                 modified(spec, first), badges(spec))


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
        same = ("every column matches column 1" if not div else "vs column 1, first difference: " + ", ".join(
            f"{result.rows[j].name} at step {d}" for j, d in div.items()))
    return f"Done{stopped} in {result.wall_seconds:.1f} s · prompt {result.prompt_tokens} tokens · {same}" \
           f"{branch_text(result.rows)}{fast_text(result)}"


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
        note += f"; {', '.join(left)} left as {'it was' if len(left) == 1 else 'they were'} (different text before it)"
    return note


def fast_text(result: RunResult) -> str:
    precision = result.config.get("precision") or ""
    return f" · {precision}" if precision.startswith("fast") else ""


def frame(cfg: RunConfig) -> RunView:
    """What a run shows before its first token: its columns, their headings and each column's
    conversation so far."""
    turns = [render.render_turns(spec.messages or [], spec.prompt if spec.prompt is not None else cfg.prompt,
                                 own_prompt=spec.prompt is not None) for spec in cfg.rows]
    return RunView(columns=len(cfg.rows), headings=[heading(i, spec, cfg.rows[0]) for i, spec in enumerate(cfg.rows)],
                   turns=turns)


def outputs(rows: list[RowResult], view: str, live: bool, caches: list | None = None) -> RunView:
    """Every column's text (in the token `view`: "confidence", "plain", "markdown" or "diff") and the
    metrics table."""
    div = divergences(rows, live)
    caches = caches or [None] * len(rows)
    texts, running = [], [live and row.stop_reason is None for row in rows]
    for index, (row, cache, streaming) in enumerate(zip(rows, caches, running)):
        at = div.get(index) if index else min(div.values(), default=None)
        if view == "diff":
            texts.append(render.render_diff(rows[0].steps, row.steps, live=streaming))
        elif view == "markdown":
            texts.append(render.render_markdown(row.steps, live=streaming, row=row.name))
        else:
            texts.append(render.render_tokens(row.steps, view, live=streaming, cache=cache, diverge_at=at,
                                              row=row.name))
    metrics = render.render_metrics(rows, running, render.best_marks(rows),
                                    [charts.row_color(i) for i in range(len(rows))])
    return RunView(texts=texts, metrics=metrics, diff=view == "diff")


def confidence_chart(rows: list[RowResult], threshold: float | None, window: int, live: bool = False):
    return charts.confidence_figure(rows, threshold, divergences(rows, live), window)


def finished(data: dict, view: str) -> RunView:
    """A stored run (a RunResult dict) as it showed when it finished: columns, conversations,
    texts in the token `view`, metrics and confidence chart."""
    result = RunResult.from_dict(data)
    cfg = RunConfig.from_dict(result.config)
    chart = confidence_chart(result.rows, cfg.deepconf.threshold, cfg.deepconf.window)
    return frame(cfg) | outputs(result.rows, view, live=False) | RunView(confidence=chart, result=data)
