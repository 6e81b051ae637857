"""Deep Think's calibration panel: from a run's own traces, no model work."""

from __future__ import annotations

from ui.deepthink.calibration import HEADERS, NO_EXPECTED, view
from ui.page.charts import row_color


def _report(expected):
    def trace(phase, stopped, correct, x):
        return {
            "phase": phase,
            "stopped": stopped,
            "correct": correct,
            "mean": x,
            "tail": x + 0.5,
            "bottom10_group": x - 0.5,
            "lowest_group": x - 1,
        }

    side = {
        "traces": [
            trace("warmup", False, True, 5.0),
            trace("warmup", False, False, 3.0),
            trace("warmup", False, True, 4.5),
            trace("online", False, True, 6.0),
            trace("online", True, False, 2.0),
            trace("online", False, False, 3.5),
        ]
    }
    return {
        "config": {"expected": expected, "eta": 90},
        "thresholds": {"baseline": 2.2, "feedback": 2.2},
        "sides": {"baseline": side, "feedback": side},
    }


def test_the_panel_asks_for_an_expected_answer_without_one():
    note, base, feedback, rows = view(_report(None))
    assert note == NO_EXPECTED and rows == [] and view(None)[0] == NO_EXPECTED
    assert "expected answer" in base.layout.annotations[0].text


def test_reliability_diagram_per_side_and_the_table():
    note, base, feedback, rows = view(_report("42"))
    names = [t.name for t in base.data]
    assert names == ["calibrated", "mean", "tail", "bottom-10% group", "lowest group"]
    assert all(t.line.color == row_color(1) for t in feedback.data[1:]) and base.data[
        1
    ].line.color == row_color(0)
    assert len({t.line.dash for t in base.data[1:]}) == 4  # the measures differ without colour
    assert list(base.layout.xaxis.range) == [0, 1] and "accuracy" in base.layout.yaxis.title.text
    assert len(rows) == 8 and all(len(r) == len(HEADERS) for r in rows)
    assert rows[0][:5] == ["baseline", "mean", 2, 0.5, 1.0]  # 2 online traces kept, one right, ranked first
    assert "stopped ones left out: 1" in note and "threshold 2.20 keeps 2 of 3 warm-up traces" in note
    assert "accuracy 100% vs 67% of all" in note


def test_a_few_traces_are_called_too_few_to_judge_with_their_count():
    note, _, _, rows = view(_report("42"))
    auroc_ci, ece_ci = HEADERS.index("AUROC 95% CI"), HEADERS.index("ECE 95% CI")
    assert all(r[auroc_ci] == "too few" and r[ece_ci] == "too few" for r in rows)
    for side in (
        "baseline",
        "feedback",
    ):  # each side says it, with the count of online traces behind the figures
        assert f"**{side}: too few traces to judge: 2 test traces (at least 10 needed)**" in note
    assert "python -m feedback calibrate" in note


def test_enough_traces_show_each_figure_with_its_interval():
    def trace(phase, correct, x):
        return {
            "phase": phase,
            "stopped": False,
            "correct": correct,
            "mean": x,
            "tail": x,
            "bottom10_group": x,
            "lowest_group": x,
        }

    # 16 online traces, right ones mostly more confident: AUROC 56/64 from 8 right and 8 wrong (4 ties)
    online = [trace("online", True, 5.0 + i) for i in range(8)] + [
        trace("online", False, 1.0 + i) for i in range(8)
    ]
    side = {
        "traces": [trace("warmup", True, 6.0), trace("warmup", False, 2.0), trace("warmup", True, 7.0)]
        + online
    }
    report = {
        "config": {"expected": "42", "eta": 90},
        "thresholds": {"baseline": 2.2, "feedback": 2.2},
        "sides": {"baseline": side, "feedback": side},
    }
    note, _, _, rows = view(report)
    first = dict(zip(HEADERS, rows[0]))
    assert first["test traces"] == 16 and first["AUROC"] == 56 / 64
    lo, hi = (float(v) for v in first["AUROC 95% CI"].strip("[]").split(", "))
    assert lo < 56 / 64 < hi <= 1 and hi - lo > 0.1  # 16 traces: a wide interval, shown as such
    assert first["ECE 95% CI"].startswith("[") and "too few traces to judge" not in note
