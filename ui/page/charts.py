"""Plotly figures for the tabs: confidence curves, memory, ΔPPL bars, votes and traces.

Shared style and colour meanings come from `feedback.eval.figures`; zoom is kept across live updates
through a constant `uirevision`.
"""

from __future__ import annotations

from html import escape

import plotly.graph_objects as go

from feedback.core.records import RowResult
from feedback.eval.figures import BETTER, WORSE, figure
from feedback.eval.voting import answer_matches

# Okabe–Ito colours (colour-blind safe), one per column/side, the same in every chart.
ROW_COLORS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#56B4E9", "#E69F00", "#000000", "#F0E442"]
MARK = "#8c8c8c"  # threshold and divergence lines: readable on light and dark backgrounds
MEMORY_SERIES = [
    ("rss_mb", "RSS (MB)"),
    ("cuda_allocated_mb", "CUDA allocated (MB)"),
    ("cuda_reserved_mb", "CUDA reserved (MB)"),
    ("cuda_peak_mb", "CUDA peak (MB)"),
]
MEMORY_MIN_SPAN_MB = 64.0  # idle noise of a few KB must not look like a steep climb


def plot_text(text) -> str:
    """A name or label from a user or the model as Plotly text: Plotly reads a subset of HTML in
    names, labels and annotations (<a href>, <b>, <br>), so the tags are escaped and shown as typed."""
    return escape(str(text), quote=False)


def row_color(index: int) -> str:
    return ROW_COLORS[index % len(ROW_COLORS)]


def _scatter(**props) -> dict:
    return dict(type="scatter", **props)


def _row_traces(row: RowResult, color: str) -> list[dict]:
    x, name = [s.step for s in row.steps], plot_text(row.name)
    return [
        _scatter(
            x=x,
            y=[s.confidence for s in row.steps],
            name=f"{name} token conf",
            mode="lines+markers",
            line=dict(color=color, width=1),
            marker=dict(size=3),
            opacity=0.45,
            legendgroup=row.name,
        ),
        _scatter(
            x=x,
            y=[s.group_confidence for s in row.steps],
            name=f"{name} group conf",
            mode="lines",
            line=dict(color=color, width=3),
            legendgroup=row.name,
        ),
    ]


def _early_stop_trace(row: RowResult, color: str) -> dict | None:
    if row.stop_reason != "early_stop" or row.stop_step is None:
        return None
    step = next((s for s in row.steps if s.step == row.stop_step), None)
    if step is None:
        return None
    return _scatter(
        x=[step.step],
        y=[step.group_confidence],
        name=f"{plot_text(row.name)} early stop",
        mode="markers",
        marker=dict(symbol="x", size=12, color=color, line=dict(width=2)),
        legendgroup=row.name,
    )


def _x_span(rows: list[RowResult]) -> tuple[float, float]:
    steps = [s.step for row in rows for s in row.steps]
    return (min(steps), max(steps)) if steps else (0.0, 1.0)


def confidence_figure(
    rows: list[RowResult],
    threshold: float | None = None,
    divergence: dict[int, int] | int | None = None,
    window: int | None = None,
    feed: str | None = None,
    span: tuple[float, float] | None = None,
) -> go.Figure:
    """Token and group confidence per row, with threshold, early stops and where each column first
    differs from column 1 (`divergence`: column index -> step; an int means column 2). Labels sit
    apart: the divergence labels above the plot, the window label at its bottom. Row i's curves
    are traces 2i and 2i + 1, so a live chart can be extended in place: `feed` names the run whose
    points the page's board adds from its token events, `span` the steps the threshold line covers."""
    traces: list[dict] = []
    annotations: list[dict] = []
    shapes: list[dict] = []
    for i, row in enumerate(rows):
        traces += _row_traces(row, row_color(i))
    for i, row in enumerate(rows):
        marker = _early_stop_trace(row, row_color(i))
        if marker is not None:
            traces.append(marker)
    if threshold is not None:
        x0, x1 = span or _x_span(rows)
        traces.append(
            _scatter(
                x=[x0, x1],
                y=[threshold, threshold],
                name=f"threshold {threshold:.2f}",
                mode="lines",
                line=dict(color=MARK, width=1.5, dash="dash"),
            )
        )
    pairs = {1: divergence} if isinstance(divergence, int) else dict(divergence or {})
    for n, (j, step) in enumerate(sorted(pairs.items(), key=lambda p: p[1])):
        color = (
            MARK if len(rows) <= 2 else row_color(j)
        )  # two columns: one neutral line; more: the column's colour
        shapes.append(
            dict(
                type="line",
                xref="x",
                yref="paper",
                x0=step,
                x1=step,
                y0=0,
                y1=1,
                line=dict(color=color, width=1.5, dash="dot"),
            )
        )
        label = (
            f"first divergence: step {step}"
            if len(rows) <= 2
            else f"{plot_text(rows[0].name)} ≠ {plot_text(rows[j].name)}: step {step}"
        )
        annotations.append(
            dict(
                xref="x",
                yref="paper",
                x=step,
                y=1.0 + 0.07 * n,
                yanchor="bottom",
                text=label,
                showarrow=False,
                font=dict(size=11, color=None if len(rows) <= 2 else color),
            )
        )
    if window is not None and window > 1:
        # The early-stop rule only applies once the group window is full (from step window - 1).
        shapes.append(
            dict(
                type="rect",
                xref="x",
                yref="paper",
                x0=-0.5,
                x1=window - 1.5,
                y0=0,
                y1=1,
                fillcolor=MARK,
                opacity=0.10,
                line=dict(width=0),
                layer="below",
            )
        )
        annotations.append(
            dict(
                xref="x",
                yref="paper",
                x=-0.5,
                y=0.0,
                xanchor="left",
                yanchor="bottom",
                text=f"window filling ({window} tokens)",
                showarrow=False,
                font=dict(size=10),
            )
        )
    return figure(
        traces,
        340,
        "decode step",
        "confidence (−mean top-k log p)",
        annotations=annotations,
        shapes=shapes,
        margin=dict(t=30 + 18 * max(0, len(pairs) - 1)),
        **({"meta": {"feed": feed}} if feed else {}),
    )


def memory_figure(
    samples: list[dict], origin_label: str = "the run began", feed: str | None = None
) -> go.Figure:
    """RSS always; CUDA allocated/reserved/peak only when some sample has them. x = seconds since
    `origin_label`; the y range spans at least MEMORY_MIN_SPAN_MB so idle noise stays flat. `feed`
    names the run whose samples the page adds while it streams (the board's `m` events)."""
    t = [s.get("t") for s in samples]
    traces, values_all = [], []
    for i, (key, name) in enumerate(MEMORY_SERIES):
        values = [s.get(key) for s in samples]
        if key == "rss_mb" or any(v is not None for v in values):
            traces.append(_scatter(x=t, y=values, name=name, mode="lines", line=dict(color=row_color(i))))
            values_all += [v for v in values if v is not None]
    layout: dict = {}
    if values_all:
        lo, hi = min(values_all), max(values_all)
        if hi - lo < MEMORY_MIN_SPAN_MB:
            mid = (hi + lo) / 2
            lo, hi = mid - MEMORY_MIN_SPAN_MB / 2, mid + MEMORY_MIN_SPAN_MB / 2
        pad = 0.05 * (hi - lo)
        layout["yaxis"] = dict(range=[max(0.0, lo - pad), hi + pad])
    if feed:
        layout["meta"] = {"feed": feed}
    return figure(traces, 240, f"seconds since {origin_label}", "memory (MB)", **layout)


def bar_figure(labels: list[str], values: list[float], x_title: str, y_title: str) -> go.Figure:
    """Signed bars: blue below zero = feedback better than the baseline, orange above = worse."""
    colors = [BETTER if v < 0 else WORSE for v in values]
    trace = dict(
        type="bar",
        x=[plot_text(label) for label in labels],
        y=values,
        marker=dict(color=colors),
        name=y_title,
        hovertemplate="%{x}<br>%{y:+.4f}<extra></extra>",
    )
    return figure(
        [trace],
        300,
        x_title,
        y_title,
        hovermode="closest",
        showlegend=False,
        margin=dict(l=70),
        xaxis=dict(showticklabels=len(labels) <= 40),
    )


def vote_figure(sides: dict[str, dict], expected: str | None = None) -> go.Figure:
    """DeepConf's weighted vote shares per answer, one bar group per side; with `expected`, the
    answers that match it are outlined and labelled "expected" (or the chart says none got a vote)."""
    traces, right = [], set()
    for i, (side, rep) in enumerate(sides.items()):
        tallies = rep["votes"]["lowest_group"]["tallies"]
        total = sum(tallies.values()) or 1.0
        answers = sorted(tallies, key=lambda a: -tallies[a])
        hits = [bool(answer_matches(a, expected)) for a in answers]
        right |= {plot_text(a) for a, hit in zip(answers, hits) if hit}
        traces.append(
            dict(
                type="bar",
                name=side,
                x=[plot_text(a) for a in answers],
                y=[tallies[a] / total for a in answers],
                marker=dict(
                    color=row_color(i),
                    line=dict(
                        color=[MARK if h else "rgba(0,0,0,0)" for h in hits],
                        width=[3 if h else 0 for h in hits],
                    ),
                ),
            )
        )
    notes = [
        dict(
            x=a,
            y=1.0,
            xref="x",
            yref="paper",
            yanchor="bottom",
            text="expected",
            showarrow=False,
            font=dict(size=11),
        )
        for a in sorted(right)
    ]
    if expected is not None and not right:
        notes.append(
            dict(
                x=1.0,
                y=1.0,
                xref="paper",
                yref="paper",
                xanchor="right",
                yanchor="bottom",
                showarrow=False,
                font=dict(size=11),
                text=f"expected answer {plot_text(expected)!s}: no votes",
            )
        )
    return figure(
        traces,
        280,
        "answer",
        "weighted vote share",
        barmode="group",
        hovermode="closest",
        xaxis=dict(type="category"),
        annotations=notes,
        margin=dict(t=40),
    )


def trace_figure(side: str, rep: dict, color_index: int = 0) -> go.Figure:
    """Group confidence of every trace of one side, the threshold, and where traces were stopped."""
    traces: list[dict] = []
    color = row_color(color_index)
    longest = 1
    for t in rep["traces"]:
        curve = t["group_confidence"]
        longest = max(longest, len(curve))
        dash = "dot" if t["phase"] == "warmup" else "solid"
        traces.append(
            _scatter(
                x=list(range(len(curve))),
                y=curve,
                mode="lines",
                name=t["name"],
                line=dict(color=color, width=1, dash=dash),
                opacity=0.35 if t["excluded"] else 0.8,
                showlegend=False,
                hovertemplate=f"{t['name']}<br>step %{{x}}<br>%{{y:.3f}}<extra></extra>",
            )
        )
        if t["stopped"] and curve:
            traces.append(
                _scatter(
                    x=[len(curve) - 1],
                    y=[curve[-1]],
                    mode="markers",
                    showlegend=False,
                    marker=dict(symbol="x", size=10, color=color),
                    name=f"{t['name']} stopped",
                )
            )
    traces.append(
        _scatter(
            x=[0, longest - 1],
            y=[rep["threshold"]] * 2,
            mode="lines",
            name=f"threshold {rep['threshold']:.2f}",
            line=dict(color=MARK, dash="dash", width=1.5),
        )
    )
    return figure(traces, 300, "decode step", f"{side}: group confidence", hovermode="closest")


def histogram_figure(values: dict[str, list[float]], thresholds: dict[str, float]) -> go.Figure:
    """Warm-up lowest group confidences per side, and where each side's threshold falls."""
    traces = [
        dict(type="histogram", x=v, name=side, opacity=0.6, marker=dict(color=row_color(i)))
        for i, (side, v) in enumerate(values.items())
    ]
    shapes, annotations = [], []
    for i, (side, s) in enumerate(thresholds.items()):
        shapes.append(
            dict(
                type="line",
                xref="x",
                yref="paper",
                x0=s,
                x1=s,
                y0=0,
                y1=1,
                line=dict(color=row_color(i), dash="dash"),
            )
        )
        annotations.append(
            dict(
                xref="x",
                yref="paper",
                x=s,
                y=1 - 0.1 * i,
                text=f"{side} s = {s:.2f}",
                showarrow=False,
                yanchor="bottom",
                xanchor="left",
            )
        )
    return figure(
        traces,
        260,
        "lowest group confidence of a warm-up trace",
        "traces",
        barmode="overlay",
        hovermode="closest",
        shapes=shapes,
        annotations=annotations,
        margin=dict(t=40),
    )


def empty_figure(message: str, height: int = 200) -> go.Figure:
    """A blank chart that says what will appear there (instead of an empty box)."""
    return figure(
        [],
        height,
        "",
        "",
        xaxis=dict(visible=False),
        yaxis=dict(visible=False),
        annotations=[
            dict(text=message, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5, font=dict(size=13))
        ],
    )
