"""Plotly figures for the compare tab: confidence curves and memory, zoom kept via `uirevision`."""
from __future__ import annotations

import math
from functools import lru_cache

import plotly.graph_objects as go
import plotly.io as pio

from feedback.records import RowResult

UIREVISION = "feedback-lens"
ROW_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
MEMORY_SERIES = [
    ("rss_mb", "RSS (MB)"),
    ("cuda_allocated_mb", "CUDA allocated (MB)"),
    ("cuda_reserved_mb", "CUDA reserved (MB)"),
    ("cuda_peak_mb", "CUDA peak (MB)"),
]


def row_color(index: int) -> str:
    return ROW_COLORS[index % len(ROW_COLORS)]


@lru_cache(maxsize=1)
def _template() -> dict:
    return pio.templates["plotly_white"].to_plotly_json()


def _figure(traces: list[dict], height: int, x_title: str, y_title: str, **layout) -> go.Figure:
    """Build from plain dicts without plotly's per-property validation: ~15x faster (measured
    12 ms -> 0.8 ms for five 160-point traces), which keeps live chart updates cheap."""
    spec = dict(
        uirevision=UIREVISION, height=height, template=_template(),
        margin=dict(l=50, r=15, t=40, b=40),
        legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0),
        xaxis=dict(title=dict(text=x_title)), yaxis=dict(title=dict(text=y_title)), hovermode="x unified",
    ) | layout
    return go.Figure(dict(data=traces, layout=spec), _validate=False)


def _scatter(**props) -> dict:
    return dict(type="scatter", **props)


def first_divergence(rows: list[RowResult]) -> int | None:
    """First step where rows 0 and 1 chose different tokens (the shorter length if one is a prefix)."""
    if len(rows) < 2:
        return None
    a, b = rows[0].token_ids, rows[1].token_ids
    diverged = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if diverged is None and len(a) != len(b):
        return min(len(a), len(b))
    return diverged


def _row_traces(row: RowResult, color: str) -> list[dict]:
    x = [s.step for s in row.steps]
    return [
        _scatter(x=x, y=[s.confidence for s in row.steps], name=f"{row.name} token conf",
                 mode="lines+markers", line=dict(color=color, width=1), marker=dict(size=3),
                 opacity=0.45, legendgroup=row.name),
        _scatter(x=x, y=[s.group_confidence for s in row.steps], name=f"{row.name} group conf",
                 mode="lines", line=dict(color=color, width=3), legendgroup=row.name),
    ]


def _early_stop_trace(row: RowResult, color: str) -> dict | None:
    if row.stop_reason != "early_stop" or row.stop_step is None:
        return None
    step = next((s for s in row.steps if s.step == row.stop_step), None)
    if step is None:
        return None
    return _scatter(x=[step.step], y=[step.group_confidence], name=f"{row.name} early stop",
                    mode="markers", marker=dict(symbol="x", size=12, color=color, line=dict(width=2)),
                    legendgroup=row.name)


def _y_span(rows: list[RowResult], threshold: float | None) -> tuple[float, float]:
    """Range of all plotted confidences (and the threshold), for the divergence line."""
    values = [v for row in rows for s in row.steps for v in (s.confidence, s.group_confidence)
              if math.isfinite(v)]
    if threshold is not None:
        values.append(threshold)
    return (min(values), max(values)) if values else (0.0, 1.0)


def _x_span(rows: list[RowResult]) -> tuple[float, float]:
    steps = [s.step for row in rows for s in row.steps]
    return (min(steps), max(steps)) if steps else (0.0, 1.0)


def confidence_figure(rows: list[RowResult], threshold: float | None = None,
                      divergence_step: int | None = None, window: int | None = None) -> go.Figure:
    """Token and group confidence per row, with threshold, early stops and the first divergence."""
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
        x0, x1 = _x_span(rows)
        traces.append(_scatter(x=[x0, x1], y=[threshold, threshold], name="threshold", mode="lines",
                               line=dict(color="#d62728", width=1.5, dash="dash")))
    if divergence_step is not None:
        y0, y1 = _y_span(rows, threshold)
        traces.append(_scatter(x=[divergence_step, divergence_step], y=[y0, y1], name="first divergence",
                               mode="lines", line=dict(color="#7f7f7f", width=1.5, dash="dot")))
        annotations.append(dict(x=divergence_step, y=y1, text=f"diverge @ {divergence_step}", showarrow=False,
                                yanchor="bottom", font=dict(size=11)))
    if window is not None and window > 1:
        # The early-stop rule only applies once the group window is full (from step window - 1).
        shapes.append(dict(type="rect", xref="x", yref="paper", x0=-0.5, x1=window - 1.5, y0=0, y1=1,
                           fillcolor="#7f7f7f", opacity=0.08, line=dict(width=0), layer="below"))
        annotations.append(dict(xref="x", yref="paper", x=-0.5, y=1, xanchor="left", yanchor="top",
                                text=f"window filling ({window})", showarrow=False, font=dict(size=10)))
    return _figure(traces, 320, "decode step", "confidence (−mean top-k log p)",
                   annotations=annotations, shapes=shapes)


def memory_figure(samples: list[dict]) -> go.Figure:
    """RSS always; CUDA allocated/reserved/peak only when some sample has them."""
    t = [s.get("t") for s in samples]
    traces = []
    for key, name in MEMORY_SERIES:
        values = [s.get(key) for s in samples]
        if key == "rss_mb" or any(v is not None for v in values):
            traces.append(_scatter(x=t, y=values, name=name, mode="lines"))
    return _figure(traces, 240, "time (s)", "memory (MB)")


def sweep_heatmap(rows: list[dict], x: str, y: str | None = None, title: str = "") -> go.Figure:
    """ΔPPL % over a grid of one or two parameters; each cell also shows its 95% CI width.
    Blue is better than the baseline (lower perplexity), red worse, white no change."""
    xs = sorted({r[x] for r in rows})
    ys = sorted({r[y] for r in rows}) if y else [""]
    cell = {(r[x], r[y] if y else ""): r for r in rows}
    z, text = [], []
    for yv in ys:
        z.append([cell[(xv, yv)]["delta_pct"] if (xv, yv) in cell else None for xv in xs])
        text.append([f"{cell[(xv, yv)]['delta_pct']:+.2f}%<br>±{cell[(xv, yv)]['ci95_width'] / 2:.2f}"
                     if (xv, yv) in cell else "" for xv in xs])
    bound = max([abs(v) for row in z for v in row if v is not None] or [1.0])
    trace = dict(type="heatmap", x=[str(v) for v in xs], y=[str(v) for v in ys], z=z, text=text,
                 texttemplate="%{text}", colorscale="RdBu", reversescale=True, zmid=0, zmin=-bound, zmax=bound,
                 colorbar=dict(title=dict(text="ΔPPL %")), hovertemplate=f"{x}=%{{x}}<br>" +
                 (f"{y}=%{{y}}<br>" if y else "") + "ΔPPL %{z:+.3f}%<extra></extra>")
    return _figure([trace], 420 if y else 220, x, y or "", title=dict(text=title), hovermode="closest",
                   margin=dict(l=60, r=15, t=50, b=40))


def bar_figure(labels: list[str], values: list[float], x_title: str, y_title: str) -> go.Figure:
    """Signed bars (blue below zero = better than baseline, red above = worse)."""
    colors = ["#1f77b4" if v < 0 else "#d62728" for v in values]
    trace = _scatter(x=labels, y=values, marker=dict(color=colors), hovertemplate="%{x}<br>%{y:+.4f}<extra></extra>")
    trace["type"] = "bar"
    return _figure([trace], 300, x_title, y_title, hovermode="closest", showlegend=False)


def vote_figure(sides: dict[str, dict]) -> go.Figure:
    """Confidence-weighted vote shares per answer, one bar group per side."""
    traces = []
    for i, (side, rep) in enumerate(sides.items()):
        tallies = rep["votes"]["lowest_group"]["tallies"]
        total = sum(tallies.values()) or 1.0
        answers = sorted(tallies, key=lambda a: -tallies[a])
        traces.append(dict(type="bar", name=side, x=[str(a) for a in answers],
                           y=[tallies[a] / total for a in answers], marker=dict(color=row_color(i))))
    return _figure(traces, 280, "answer", "weighted vote share", barmode="group", hovermode="closest")


def trace_figure(side: str, rep: dict, color_index: int = 0) -> go.Figure:
    """Group confidence of every trace of one side, the threshold, and where traces were stopped."""
    traces: list[dict] = []
    color = row_color(color_index)
    longest = 1
    for t in rep["traces"]:
        curve = t["group_confidence"]
        longest = max(longest, len(curve))
        dash = "dot" if t["phase"] == "warmup" else "solid"
        traces.append(_scatter(x=list(range(len(curve))), y=curve, mode="lines", name=t["name"],
                               line=dict(color=color, width=1, dash=dash), opacity=0.35 if t["excluded"] else 0.8,
                               showlegend=False, hovertemplate=f"{t['name']}<br>step %{{x}}<br>%{{y:.3f}}<extra></extra>"))
        if t["stopped"] and curve:
            traces.append(_scatter(x=[len(curve) - 1], y=[curve[-1]], mode="markers", showlegend=False,
                                   marker=dict(symbol="x", size=10, color="#d62728"), name=f"{t['name']} stopped"))
    traces.append(_scatter(x=[0, longest - 1], y=[rep["threshold"]] * 2, mode="lines", name="threshold",
                           line=dict(color="#d62728", dash="dash", width=1.5)))
    return _figure(traces, 300, "decode step", f"{side}: group confidence", hovermode="closest")


def histogram_figure(values: dict[str, list[float]], thresholds: dict[str, float]) -> go.Figure:
    """Warm-up lowest group confidences per side, and where each side's threshold falls."""
    traces = [dict(type="histogram", x=v, name=side, opacity=0.6, marker=dict(color=row_color(i)))
              for i, (side, v) in enumerate(values.items())]
    shapes, annotations = [], []
    for i, (side, s) in enumerate(thresholds.items()):
        shapes.append(dict(type="line", xref="x", yref="paper", x0=s, x1=s, y0=0, y1=1,
                           line=dict(color=row_color(i), dash="dash")))
        annotations.append(dict(xref="x", yref="paper", x=s, y=1 - 0.08 * i, text=f"{side} s = {s:.3f}",
                                showarrow=False, yanchor="bottom"))
    return _figure(traces, 240, "lowest group confidence of a warm-up trace", "traces", barmode="overlay",
                   hovermode="closest", shapes=shapes, annotations=annotations)
