"""Plotly heatmaps of a long-context recall job (`feedback.eval.recall`): each row's accuracy per
context length × depth of the fact, and each strategy's difference from the baseline, in the
project's shared figure style (`figures.figure`). The difference keeps the project's colour
meaning: blue = feedback better (here: more facts recalled), orange = worse."""

from __future__ import annotations

from html import escape
from pathlib import Path

import plotly.graph_objects as go

from feedback.eval.figures import BETTER, NEUTRAL, WORSE, figure

ACCURACY_SCALE = [[0.0, NEUTRAL], [1.0, "#404040"]]  # plain accuracy: light (none) .. dark (all)
GAIN_SCALE = [
    [0.0, WORSE],
    [0.5, NEUTRAL],
    [1.0, BETTER],
]  # accuracy difference: negative worse .. positive better
GAIN_LEGEND = "blue = feedback recalled more facts (better), orange = fewer (worse)"


def _axes(lengths: list[int], depths: list[float]) -> tuple[list[str], list[str]]:
    return [f"{d:g}%" for d in depths], [f"{n:,}" for n in lengths]


def _figure(trace: dict, lengths: list[int], title: str) -> go.Figure:
    return figure(
        [trace],
        160 + 48 * len(lengths),
        "depth of the fact in the text",
        "context length (tokens)",
        title=dict(text=escape(title, quote=False), font=dict(size=13)),
        hovermode="closest",
        margin=dict(l=70, r=15, t=50, b=45),
        xaxis=dict(type="category"),
        yaxis=dict(type="category"),
    )


def accuracy_heatmap(
    grid: list[list[float | None]],
    counts: list[list[int]],
    lengths: list[int],
    depths: list[float],
    title: str,
) -> go.Figure:
    """One row's share of facts recalled per length (y) × depth (x); each cell says right / asked."""
    x, y = _axes(lengths, depths)
    text = [
        [("" if v is None else f"{v:.0%}<br>{round(v * n)}/{n}") for v, n in zip(row, ns)]
        for row, ns in zip(grid, counts)
    ]
    trace = dict(
        type="heatmap",
        x=x,
        y=y,
        z=grid,
        text=text,
        texttemplate="%{text}",
        colorscale=ACCURACY_SCALE,
        zmin=0,
        zmax=1,
        colorbar=dict(title=dict(text="accuracy", side="right")),
        hovertemplate="length %{y} tokens, depth %{x}<br>accuracy %{z:.0%}<extra></extra>",
    )
    return _figure(trace, lengths, title)


def difference_heatmap(
    diff: list[list[float | None]], lengths: list[int], depths: list[float], title: str
) -> go.Figure:
    """A strategy's accuracy minus the baseline's per cell, on a scale centred on 0 (no change)."""
    x, y = _axes(lengths, depths)
    text = [[("" if v is None else f"{v:+.0%}") for v in row] for row in diff]
    trace = dict(
        type="heatmap",
        x=x,
        y=y,
        z=diff,
        text=text,
        texttemplate="%{text}",
        colorscale=GAIN_SCALE,
        zmid=0,
        zmin=-1,
        zmax=1,
        colorbar=dict(title=dict(text="Δ accuracy<br>blue better<br>orange worse", side="right")),
        hovertemplate="length %{y} tokens, depth %{x}<br>Δ accuracy %{z:+.0%}<extra></extra>",
    )
    return _figure(trace, lengths, title)


def recall_figures(res: dict) -> dict[str, go.Figure]:
    """Every heatmap of a result (`recall.summarise`'s keys), by name: one per row, then
    "<row> − <baseline>" per strategy row."""
    names = list(res["rows"])
    out = {
        name: accuracy_heatmap(
            res["accuracy"][name], res["counts"], res["lengths"], res["depths"], f"{name}: facts recalled"
        )
        for name in names
    }
    for name in names[1:]:
        out[f"{name} − {names[0]}"] = difference_heatmap(
            res["difference"][name],
            res["lengths"],
            res["depths"],
            f"{name} − {names[0]}: accuracy difference",
        )
    return out


def write_html(path: Path, res: dict, title: str = "Long-context recall") -> None:
    """One self-contained page with every heatmap of a result."""
    figs = list(recall_figures(res).values())
    parts = [fig.to_html(full_html=False, include_plotlyjs=i == 0) for i, fig in enumerate(figs)]
    Path(path).write_text(
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{escape(title)}</title></head>'
        f"<body><p>{GAIN_LEGEND}</p>" + "".join(parts) + "</body></html>",
        encoding="utf-8",
    )
