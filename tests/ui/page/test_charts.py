"""Plotly figures: traces per row, threshold, early-stop markers, divergence, memory, uirevision."""

from __future__ import annotations

import plotly.graph_objects as go
import pytest

from feedback.core.records import RowResult, StepRecord, first_divergence
from feedback.eval.figures import BETTER, DELTA_SCALE, UIREVISION, WORSE, sweep_heatmap
from ui.page.charts import MEMORY_MIN_SPAN_MB, bar_figure, confidence_figure, memory_figure


def make_row(
    name: str,
    confs: list[float],
    groups: list[float] | None = None,
    token_ids: list[int] | None = None,
    **kwargs,
) -> RowResult:
    groups = groups or confs
    steps = [
        StepRecord(
            step=i,
            token_id=i,
            text="t",
            logprob=-0.1,
            prob=0.9,
            confidence=c,
            entropy=0.1,
            group_confidence=g,
            top=[],
            time_ms=1.0,
        )
        for i, (c, g) in enumerate(zip(confs, groups))
    ]
    ids = list(range(len(confs))) if token_ids is None else token_ids
    return RowResult(name=name, strategy=None, params={}, token_ids=ids, steps=steps, **kwargs)


def traces(fig: go.Figure) -> dict[str, go.Scatter]:
    return {t.name: t for t in fig.data}


def test_row_traces_and_layout() -> None:
    fig = confidence_figure([make_row("baseline", [1.0, 2.0]), make_row("feedback", [1.5, 0.5, 1.0])])
    names = traces(fig)
    assert set(names) == {
        "baseline token conf",
        "baseline group conf",
        "feedback token conf",
        "feedback group conf",
    }
    assert list(names["feedback token conf"].x) == [0, 1, 2]
    assert list(names["baseline group conf"].y) == [1.0, 2.0]
    assert names["baseline token conf"].line.color == names["baseline group conf"].line.color
    assert names["baseline token conf"].line.color != names["feedback token conf"].line.color
    assert fig.layout.uirevision == UIREVISION
    assert fig.layout.xaxis.title.text == "decode step" and fig.layout.yaxis.title.text
    assert fig.layout.legend.orientation == "h"


@pytest.mark.parametrize("threshold", [None, 1.25])
def test_threshold_trace_iff_given(threshold: float | None) -> None:
    fig = confidence_figure([make_row("baseline", [1.0, 2.0, 3.0])], threshold=threshold)
    named = traces(fig)
    if threshold is None:
        assert not [n for n in named if n.startswith("threshold")]
    else:
        line = named["threshold 1.25"]  # the legend says the value, to 2 decimals
        assert list(line.y) == [threshold, threshold] and list(line.x) == [0, 2] and line.line.dash == "dash"


def test_early_stop_marker_at_stop_step_group_confidence() -> None:
    stopped = make_row(
        "feedback", [3.0, 2.0, 1.0], groups=[3.0, 2.5, 2.0], stop_reason="early_stop", stop_step=2
    )
    other = make_row("baseline", [3.0, 2.0, 1.0], stop_reason="eos", stop_step=2)
    named = traces(confidence_figure([other, stopped], threshold=2.1))
    marker = named["feedback early stop"]
    assert (list(marker.x), list(marker.y)) == ([2], [2.0])
    assert marker.marker.symbol == "x"
    assert "baseline early stop" not in named


def test_divergence_line_and_labels_do_not_overlap() -> None:
    rows = [make_row("baseline", [1.0, 2.0, 4.0]), make_row("feedback", [0.5, 3.0])]
    fig = confidence_figure(rows, threshold=5.0, divergence=1, window=4)
    (line,) = [sh for sh in fig.layout.shapes if sh.type == "line"]
    assert (line.x0, line.x1, line.yref) == (1, 1, "paper")
    labels = {a.text: a for a in fig.layout.annotations}
    div, win = labels["first divergence: step 1"], labels["window filling (4 tokens)"]
    assert (div.y, div.yanchor) == (1.0, "bottom") and (win.y, win.yanchor) == (
        0.0,
        "bottom",
    )  # top vs bottom
    assert "threshold 5.00" in traces(fig)
    assert not [sh for sh in confidence_figure(rows).layout.shapes if sh.type == "line"]


def test_window_shading() -> None:
    fig = confidence_figure([make_row("baseline", [1.0] * 5)], window=4)
    assert (
        len(fig.layout.shapes) == 1 and fig.layout.shapes[0].x1 == 2.5 and fig.layout.shapes[0].type == "rect"
    )
    assert not confidence_figure([make_row("baseline", [1.0])]).layout.shapes


def test_empty_inputs() -> None:
    for rows in ([], [make_row("baseline", []), make_row("feedback", [])]):
        fig = confidence_figure(rows, threshold=1.0, divergence=0, window=8)
        assert fig.layout.uirevision == UIREVISION and fig.layout.xaxis.title.text == "decode step"
        fig.to_json()
    empty = memory_figure([])
    assert [t.name for t in empty.data] == ["RSS (MB)"] and empty.layout.uirevision == UIREVISION


def mem_sample(t: float, rss: float, cuda: tuple[float, float, float] | None = None) -> dict:
    """A `MemorySample.to_dict()`-shaped reading; the CUDA figures are None on CPU."""
    allocated, reserved, peak = cuda or (None, None, None)
    return {
        "t": t,
        "rss_mb": rss,
        "cuda_allocated_mb": allocated,
        "cuda_reserved_mb": reserved,
        "cuda_peak_mb": peak,
    }


def test_memory_cpu_only_rss() -> None:
    samples = [mem_sample(0.0, 100.0), mem_sample(0.5, 110.0)]
    fig = memory_figure(samples)
    assert [t.name for t in fig.data] == ["RSS (MB)"]
    assert list(fig.data[0].x) == [0.0, 0.5] and list(fig.data[0].y) == [100.0, 110.0]
    assert fig.layout.uirevision == UIREVISION


def test_memory_cuda_traces_when_present() -> None:
    samples = [mem_sample(0.0, 100.0), mem_sample(1.0, 100.0, cuda=(500.0, 600.0, 700.0))]
    named = traces(memory_figure(samples))
    assert set(named) == {"RSS (MB)", "CUDA allocated (MB)", "CUDA reserved (MB)", "CUDA peak (MB)"}
    assert list(named["CUDA reserved (MB)"].y) == [None, 600.0]


def test_memory_axis_is_time_since_the_run_and_idle_noise_stays_flat() -> None:
    samples = [mem_sample(0.0, 1000.0), mem_sample(5.0, 1000.015)]
    fig = memory_figure(samples)
    lo, hi = fig.layout.yaxis.range
    assert hi - lo >= MEMORY_MIN_SPAN_MB and lo < 1000.0 < hi
    assert fig.layout.xaxis.title.text == "seconds since the run began"
    assert (
        memory_figure(samples, "the page opened").layout.xaxis.title.text == "seconds since the page opened"
    )
    wide = memory_figure([mem_sample(0.0, 1000.0), mem_sample(1.0, 1500.0)])
    assert wide.layout.yaxis.range[1] - wide.layout.yaxis.range[0] > 500


def test_charts_are_transparent_so_they_take_the_theme() -> None:
    fig = confidence_figure([make_row("baseline", [1.0])])
    assert fig.layout.paper_bgcolor == "rgba(0,0,0,0)" and fig.layout.plot_bgcolor == "rgba(0,0,0,0)"
    from ui.page.theme import CSS

    assert ".dark .js-plotly-plot" in CSS and "fill: var(--body-text-color)" in CSS


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 3], [1, 5, 3], 1),
        ([9, 2], [1, 2], 0),
        ([1, 2], [1, 2, 3], 2),
        ([1, 2, 3, 4], [1, 2], 2),
        ([], [1], 0),
        ([], [], None),
    ],
)
def test_first_divergence(a: list[int], b: list[int], expected: int | None) -> None:
    assert first_divergence(a, b) == expected


def test_one_colour_meaning_for_delta_ppl_everywhere():
    """Blue = feedback better (lower perplexity), orange = worse: heatmap and bars alike."""
    rows = [
        {"alpha": a, "layer": layer, "delta_pct": d, "ci95_width": 0.4}
        for (a, layer, d) in [(0.0, 3, 0.0), (0.1, 3, -1.5), (0.0, 9, 0.0), (0.1, 9, 2.5)]
    ]
    fig = sweep_heatmap(rows, "alpha", "layer", "t")
    hm = fig.data[0]
    assert hm.type == "heatmap" and list(hm.x) == ["0.0", "0.1"] and list(hm.y) == ["3", "9"]
    assert [list(r) for r in hm.z] == [[0.0, -1.5], [0.0, 2.5]]
    assert hm.zmid == 0 and hm.zmin == -2.5 and hm.zmax == 2.5
    assert hm.text[0][1] == "-1.50%<br>±0.20"
    scale = [tuple(stop) for stop in hm.colorscale]
    assert (
        scale[0] == (0.0, BETTER) and scale[-1] == (1.0, WORSE) and DELTA_SCALE[0][1] == BETTER
    )  # low z = blue
    assert "blue better" in hm.colorbar.title.text
    one = sweep_heatmap(rows[:2], "alpha")
    assert list(one.data[0].y) == [""] and len(one.data[0].z[0]) == 2
    bars = bar_figure(["a", "b"], [-0.5, 0.5], "x", "y")
    assert list(bars.data[0].marker.color) == [BETTER, WORSE]


def test_deep_think_figures():
    from ui.page.charts import histogram_figure, trace_figure, vote_figure

    side = {
        "votes": {"lowest_group": {"tallies": {"42": 30.0, "41": 10.0}}},
        "threshold": 5.0,
        "traces": [
            {
                "name": "t0",
                "phase": "warmup",
                "excluded": False,
                "stopped": False,
                "group_confidence": [6.0, 6.5, 7.0],
            },
            {
                "name": "t1",
                "phase": "online",
                "excluded": True,
                "stopped": True,
                "group_confidence": [5.5, 4.0],
            },
        ],
    }
    votes = vote_figure({"baseline": side})
    assert list(votes.data[0].x) == ["42", "41"] and list(votes.data[0].y) == [0.75, 0.25]
    assert not votes.layout.annotations
    marked = vote_figure({"baseline": side}, expected="41")  # the expected answer is marked where it stands
    assert list(marked.data[0].marker.line.width) == [0, 3] and [
        a.text for a in marked.layout.annotations
    ] == ["expected"]
    assert marked.layout.annotations[0].x == "41"
    missing = vote_figure({"baseline": side}, expected="7")
    assert "expected answer 7: no votes" in missing.layout.annotations[0].text
    curves = trace_figure("baseline", side)
    names = [t.name for t in curves.data]
    assert (
        "t1 stopped" in names
        and curves.data[-1].name == "threshold 5.00"
        and list(curves.data[-1].y) == [5.0, 5.0]
    )
    stop = next(t for t in curves.data if t.name == "t1 stopped")
    assert list(stop.x) == [1] and list(stop.y) == [4.0]
    hist = histogram_figure({"baseline": [4.0, 5.0], "feedback": [6.0]}, {"baseline": 4.5, "feedback": 6.0})
    assert len(hist.data) == 2 and [s.x0 for s in hist.layout.shapes] == [4.5, 6.0]


def test_names_and_labels_are_plain_text_in_plotly():
    """Plotly reads <a href>, <b> and <br> in names, labels and annotations: a column name or a
    token is shown as typed, never as markup."""
    hostile = "<a href='javascript:alert(1)'>x</a>"
    rows = [make_row(hostile, [1.0, 2.0]), make_row("<b>two</b>", [1.0, 3.0])]
    fig = confidence_figure(rows, divergence={1: 1})
    shown = [t.name for t in fig.data] + [a.text for a in fig.layout.annotations]
    assert not any("<a" in s or "<b>" in s for s in shown)
    assert "&lt;a href='javascript:alert(1)'&gt;x&lt;/a&gt; token conf" in shown
    assert list(bar_figure(["<br>", "ok"], [0.1, -0.1], "t", "d").data[0].x) == ["&lt;br&gt;", "ok"]
