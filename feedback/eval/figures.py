"""Plotly figures the library writes itself (the sweep heatmap of `python -m feedback sweep`), and
the figure style and colours every chart of the project shares, so one colour means one thing
everywhere: for ΔPPL, blue = feedback better (lower perplexity), orange = worse.

Backgrounds are transparent so a chart takes the page's colour; in the app, CSS gives its text and
grid lines the theme's colours (light or dark).
"""
from __future__ import annotations

import plotly.graph_objects as go

UIREVISION = "feedback-lens"
# Colour-blind-safe pairs (Okabe–Ito / ColorBrewer): they differ in lightness as well as hue.
BETTER, WORSE, NEUTRAL = "#2166ac", "#e08214", "#f7f7f7"
DELTA_SCALE = [[0.0, BETTER], [0.5, NEUTRAL], [1.0, WORSE]]  # ΔPPL: negative (better) .. positive (worse)
DELTA_LEGEND = "blue = feedback lower perplexity (better), orange = higher (worse)"
GRID = "rgba(128,128,128,0.25)"


def figure(traces: list[dict], height: int, x_title: str, y_title: str, **layout) -> go.Figure:
    """A figure from plain dicts without plotly's per-property validation: ~15x faster (measured
    12 ms -> 0.8 ms for five 160-point traces), which keeps live chart updates cheap."""
    axis = dict(gridcolor=GRID, zerolinecolor=GRID, linecolor=GRID, automargin=True)
    spec = dict(
        uirevision=UIREVISION, height=height, paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)",
        font=dict(size=12), margin=dict(l=55, r=15, t=30, b=45),
        legend=dict(orientation="h", yanchor="top", y=-0.22, xanchor="left", x=0, bgcolor="rgba(0,0,0,0)"),
        xaxis=dict(title=dict(text=x_title), **axis), yaxis=dict(title=dict(text=y_title), **axis),
        hovermode="x unified", modebar=dict(orientation="v", bgcolor="rgba(0,0,0,0)"),
    )
    for key, value in layout.items():  # nested dicts (axes, legend) merge instead of replacing
        spec[key] = spec[key] | value if isinstance(value, dict) and isinstance(spec.get(key), dict) else value
    return go.Figure(dict(data=traces, layout=spec), _validate=False)


def sweep_heatmap(rows: list[dict], x: str, y: str | None = None, title: str = "") -> go.Figure:
    """ΔPPL % over a grid of one or two parameters; each cell also shows ± half its 95% CI width.
    The colour scale is centred on 0 (no change) and symmetric, so the same colour means the same
    size of change in both directions."""
    xs = sorted({r[x] for r in rows})
    ys = sorted({r[y] for r in rows}) if y else [""]
    cell = {(r[x], r[y] if y else ""): r for r in rows}
    z, text = [], []
    for yv in ys:
        z.append([cell[(xv, yv)]["delta_pct"] if (xv, yv) in cell else None for xv in xs])
        text.append([f"{cell[(xv, yv)]['delta_pct']:+.2f}%<br>±{cell[(xv, yv)]['ci95_width'] / 2:.2f}"
                     if (xv, yv) in cell else "" for xv in xs])
    bound = max([abs(v) for row in z for v in row if v is not None] or [1.0]) or 1.0
    trace = dict(type="heatmap", x=[str(v) for v in xs], y=[str(v) for v in ys], z=z, text=text,
                 texttemplate="%{text}", colorscale=DELTA_SCALE, zmid=0, zmin=-bound, zmax=bound,
                 colorbar=dict(title=dict(text="ΔPPL %<br>blue better<br>orange worse", side="right")),
                 hovertemplate=f"{x}=%{{x}}<br>" + (f"{y}=%{{y}}<br>" if y else "") + "ΔPPL %{z:+.3f}%<extra></extra>")
    return figure([trace], 420 if y else 240, x, y or "", title=dict(text=title, font=dict(size=13)),
                  hovermode="closest", margin=dict(l=60, r=15, t=50, b=45),
                  xaxis=dict(type="category"), yaxis=dict(type="category"))
