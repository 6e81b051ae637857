"""Plotly figures: traces per row, threshold, early-stop markers, divergence, memory, uirevision."""
from __future__ import annotations

import plotly.graph_objects as go
import pytest

from feedback.records import RowResult, StepRecord
from ui.charts import UIREVISION, confidence_figure, first_divergence, memory_figure


def make_row(name: str, confs: list[float], groups: list[float] | None = None,
             token_ids: list[int] | None = None, **kwargs) -> RowResult:
    groups = groups or confs
    steps = [StepRecord(step=i, token_id=i, text="t", logprob=-0.1, prob=0.9, confidence=c, entropy=0.1,
                        group_confidence=g, top=[], time_ms=1.0)
             for i, (c, g) in enumerate(zip(confs, groups))]
    ids = list(range(len(confs))) if token_ids is None else token_ids
    return RowResult(name=name, strategy=None, params={}, token_ids=ids, steps=steps, **kwargs)


def traces(fig: go.Figure) -> dict[str, go.Scatter]:
    return {t.name: t for t in fig.data}


def test_row_traces_and_layout() -> None:
    fig = confidence_figure([make_row("baseline", [1.0, 2.0]), make_row("feedback", [1.5, 0.5, 1.0])])
    names = traces(fig)
    assert set(names) == {"baseline token conf", "baseline group conf",
                          "feedback token conf", "feedback group conf"}
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
        assert "threshold" not in named
    else:
        assert list(named["threshold"].y) == [threshold, threshold]
        assert list(named["threshold"].x) == [0, 2]
        assert named["threshold"].line.dash == "dash"


def test_early_stop_marker_at_stop_step_group_confidence() -> None:
    stopped = make_row("feedback", [3.0, 2.0, 1.0], groups=[3.0, 2.5, 2.0],
                       stop_reason="early_stop", stop_step=2)
    other = make_row("baseline", [3.0, 2.0, 1.0], stop_reason="eos", stop_step=2)
    named = traces(confidence_figure([other, stopped], threshold=2.1))
    marker = named["feedback early stop"]
    assert (list(marker.x), list(marker.y)) == ([2], [2.0])
    assert marker.marker.symbol == "x"
    assert "baseline early stop" not in named


def test_divergence_line_and_annotation() -> None:
    rows = [make_row("baseline", [1.0, 2.0, 4.0]), make_row("feedback", [0.5, 3.0])]
    fig = confidence_figure(rows, threshold=5.0, divergence_step=1)
    line = traces(fig)["first divergence"]
    assert list(line.x) == [1, 1]
    assert list(line.y) == [0.5, 5.0]
    assert any(a.text == "diverge @ 1" for a in fig.layout.annotations)
    assert "first divergence" not in traces(confidence_figure(rows))


def test_window_shading() -> None:
    fig = confidence_figure([make_row("baseline", [1.0] * 5)], window=4)
    assert len(fig.layout.shapes) == 1 and fig.layout.shapes[0].x1 == 2.5
    assert not confidence_figure([make_row("baseline", [1.0])]).layout.shapes


def test_empty_inputs() -> None:
    for rows in ([], [make_row("baseline", []), make_row("feedback", [])]):
        fig = confidence_figure(rows, threshold=1.0, divergence_step=0, window=8)
        assert fig.layout.uirevision == UIREVISION and fig.layout.xaxis.title.text == "decode step"
        fig.to_json()
    empty = memory_figure([])
    assert [t.name for t in empty.data] == ["RSS (MB)"] and empty.layout.uirevision == UIREVISION


def mem_sample(t: float, rss: float, cuda: tuple[float, float, float] | None = None) -> dict:
    """A `MemorySample.to_dict()`-shaped reading; the CUDA figures are None on CPU."""
    allocated, reserved, peak = cuda or (None, None, None)
    return {"t": t, "rss_mb": rss, "cuda_allocated_mb": allocated, "cuda_reserved_mb": reserved,
            "cuda_peak_mb": peak}


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


@pytest.mark.parametrize(("a", "b", "expected"), [
    ([1, 2, 3], [1, 2, 3], None),
    ([1, 2, 3], [1, 5, 3], 1),
    ([9, 2], [1, 2], 0),
    ([1, 2], [1, 2, 3], 2),
    ([1, 2, 3, 4], [1, 2], 2),
    ([], [1], 0),
    ([], [], None),
])
def test_first_divergence(a: list[int], b: list[int], expected: int | None) -> None:
    rows = [make_row("baseline", [1.0] * len(a), token_ids=a),
            make_row("feedback", [1.0] * len(b), token_ids=b)]
    assert first_divergence(rows) == expected


def test_first_divergence_needs_two_rows() -> None:
    assert first_divergence([]) is None
    assert first_divergence([make_row("baseline", [1.0])]) is None


def test_sweep_heatmap_cells_and_diverging_scale():
    from ui.charts import sweep_heatmap

    rows = [{"alpha": a, "layer": l, "delta_pct": d, "ci95_width": 0.4}
            for (a, l, d) in [(0.0, 3, 0.0), (0.1, 3, -1.5), (0.0, 9, 0.0), (0.1, 9, 2.5)]]
    fig = sweep_heatmap(rows, "alpha", "layer", "t")
    hm = fig.data[0]
    assert hm.type == "heatmap" and list(hm.x) == ["0.0", "0.1"] and list(hm.y) == ["3", "9"]
    assert [list(r) for r in hm.z] == [[0.0, -1.5], [0.0, 2.5]]
    assert hm.zmid == 0 and hm.zmin == -2.5 and hm.zmax == 2.5
    assert hm.text[0][1] == "-1.50%<br>±0.20"
    one = sweep_heatmap(rows[:2], "alpha")
    assert list(one.data[0].y) == [""] and len(one.data[0].z[0]) == 2


def test_deep_think_figures():
    from ui.charts import histogram_figure, trace_figure, vote_figure

    side = {"votes": {"lowest_group": {"tallies": {"42": 30.0, "41": 10.0}}}, "threshold": 5.0,
            "traces": [{"name": "t0", "phase": "warmup", "excluded": False, "stopped": False,
                        "group_confidence": [6.0, 6.5, 7.0]},
                       {"name": "t1", "phase": "online", "excluded": True, "stopped": True,
                        "group_confidence": [5.5, 4.0]}]}
    votes = vote_figure({"baseline": side})
    assert list(votes.data[0].x) == ["42", "41"] and list(votes.data[0].y) == [0.75, 0.25]
    curves = trace_figure("baseline", side)
    names = [t.name for t in curves.data]
    assert "t1 stopped" in names and curves.data[-1].name == "threshold" and list(curves.data[-1].y) == [5.0, 5.0]
    stop = next(t for t in curves.data if t.name == "t1 stopped")
    assert list(stop.x) == [1] and list(stop.y) == [4.0]
    hist = histogram_figure({"baseline": [4.0, 5.0], "feedback": [6.0]}, {"baseline": 4.5, "feedback": 6.0})
    assert len(hist.data) == 2 and [s.x0 for s in hist.layout.shapes] == [4.5, 6.0]
