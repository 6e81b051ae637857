"""Calibration: each piece of maths against hand-computed values on synthetic data, the per-row
report, Deep Think's own traces, and one tiny end-to-end run through the engine."""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest

from feedback.core.budget import Budget
from feedback.errors import FeedbackError, Stopped
from feedback.eval.calibration import (
    MEASURES,
    MIN_JUDGED_TRACES,
    CalibrationConfig,
    adaptive_ece,
    auroc,
    auroc_interval,
    average_ranks,
    brier,
    builtin_questions,
    calibrate,
    check_questions,
    ece,
    ece_interval,
    equal_mass_bins,
    fit_platt,
    from_deep_think,
    kept_by_threshold,
    measure_report,
    minmax_scale,
    platt_targets,
    read_questions,
    reliability_bins,
    side_too_few,
    sigmoid,
    summarise,
    threshold_report,
    too_few,
)
from feedback.eval.voting import calibrate_threshold


def test_a_perfectly_calibrated_set_has_zero_ece_equal_width_and_equal_mass():
    # three confidences, each bin's accuracy exactly its confidence: 1 of 4, 2 of 4, 3 of 4 right
    p = [0.25] * 4 + [0.5] * 4 + [0.75] * 4
    y = [1, 0, 0, 0] + [1, 1, 0, 0] + [1, 1, 1, 0]
    assert ece(p, y) == pytest.approx(0.0, abs=1e-12)
    assert adaptive_ece(p, y, bins=3) == pytest.approx(0.0, abs=1e-12)
    rng = np.random.default_rng(0)  # outcomes drawn with exactly the stated probability
    p = rng.random(200_000)
    y = rng.random(200_000) < p
    assert ece(p, y) < 0.01 and adaptive_ece(p, y) < 0.01
    assert ece(np.full(1000, 0.9), np.zeros(1000)) == pytest.approx(0.9)  # always sure, always wrong


def test_ece_adaptive_ece_and_reliability_bins_by_hand():
    p, y = [0.9, 0.9, 0.1, 0.6], [1, 0, 0, 1]
    # bin 9: 2 traces, mean 0.9, accuracy 0.5; bin 1: 0.1 vs 0; bin 6: 0.6 vs 1
    assert ece(p, y) == pytest.approx(0.5 * 0.4 + 0.25 * 0.1 + 0.25 * 0.4)
    table = reliability_bins(p, y)
    assert len(table) == 10 and [b["count"] for b in table] == [0, 1, 0, 0, 0, 0, 1, 0, 0, 2]
    assert table[9] == {"lo": 0.9, "hi": 1.0, "count": 2, "confidence": pytest.approx(0.9), "accuracy": 0.5}
    assert table[0]["confidence"] is None and table[0]["accuracy"] is None
    assert reliability_bins([1.0, 0.0], [1, 0], bins=2)[1]["count"] == 1  # p = 1 falls in the last bin
    # equal mass, 2 bins: {0.1 wrong, 0.6 right} (mean 0.35, accuracy 0.5) and {0.9, 0.9} (0.9 vs 0.5)
    assert [b["count"] for b in equal_mass_bins(p, y, 2)] == [2, 2]
    assert adaptive_ece(p, y, bins=2) == pytest.approx(0.5 * 0.15 + 0.5 * 0.4)
    assert len(equal_mass_bins([0.2, 0.4], [0, 1], 10)) == 2  # never more bins than traces
    assert ece([], []) is None and adaptive_ece([], []) is None and brier([], []) is None


def test_brier_by_hand():
    assert brier([0.9, 0.2, 0.5], [1, 0, 1]) == pytest.approx((0.01 + 0.04 + 0.25) / 3)
    assert brier([1, 0], [True, False]) == 0.0


def test_auroc_of_tiny_examples():
    # pairs (right, wrong): 0.35>0.1, 0.35<0.4, 0.8>0.1, 0.8>0.4 -> 3 of 4
    assert auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auroc([1, 2, 3, 4], [0, 0, 1, 1]) == 1.0 and auroc([4, 3, 2, 1], [0, 0, 1, 1]) == 0.0
    assert auroc([5, 5], [1, 0]) == 0.5  # a tie counts one half
    assert auroc([1, 2, 3], [1, 1, 1]) is None and auroc([], []) is None
    assert list(average_ranks([5, 1, 5, 3])) == [3.5, 1.0, 3.5, 2.0]
    with pytest.raises(FeedbackError, match="0/1"):
        auroc([1, 2], [0, 2])
    with pytest.raises(FeedbackError, match="2 scores but 1 labels"):
        auroc([1, 2], [0])


def test_platt_fit_recovers_known_a_and_b():
    rng = np.random.default_rng(1)
    x = rng.normal(12.0, 2.0, 20_000)  # a confidence-like scale, far from 0
    a, b = 1.5, -18.0
    y = rng.random(len(x)) < sigmoid(a * x + b)
    for smooth in (True, False):
        fit = fit_platt(x, y, smooth=smooth)
        assert fit.a == pytest.approx(a, rel=0.05) and fit.b == pytest.approx(b, rel=0.05)
    assert fit(np.array([12.0]))[0] == pytest.approx(sigmoid(fit.a * 12.0 + fit.b))


def test_platt_targets_and_degenerate_fits_stay_finite():
    assert list(platt_targets([1, 1, 0])) == pytest.approx([3 / 4, 3 / 4, 1 / 3])
    const = fit_platt([4.0, 4.0, 4.0], [1, 0, 1])  # no signal: a = 0, b = log-odds of the smoothed accuracy
    rate = (2 * 3 / 4 + 1 / 3) / 3
    assert const.a == 0.0 and const.b == pytest.approx(math.log(rate / (1 - rate)))
    separable = fit_platt([1.0, 2.0, 3.0, 4.0], [0, 0, 1, 1])
    assert math.isfinite(separable.a) and separable.a > 0 and separable([2.5])[0] == pytest.approx(0.5)
    assert all(fit_platt([1.0, 2.0], [1, 1])([1.0, 2.0]) > 0.5)  # all right: high probabilities, finite
    assert sigmoid(np.array([-1000.0, 0.0, 1000.0])).tolist() == [0.0, 0.5, 1.0]  # no overflow
    with pytest.raises(FeedbackError, match="at least one trace"):
        fit_platt([], [])


def test_minmax_scale_and_what_a_threshold_keeps():
    assert minmax_scale([0.0, 5.0, 10.0, 20.0], 0.0, 10.0).tolist() == [0.0, 0.5, 1.0, 1.0]
    assert minmax_scale([3.0], 2.0, 2.0).tolist() == [0.5]
    kept = kept_by_threshold([1.0, 2.0, 3.0, 4.0], [0, 1, 1, 1], 2.0)
    assert kept == {"traces": 4, "kept": 3, "kept_share": 0.75, "accuracy_all": 0.75, "accuracy_kept": 1.0}
    assert kept_by_threshold([1.0], [1], 5.0)["accuracy_kept"] is None


def _separating(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n traces whose measure predicts being right (p = σ(2x)): an AUROC of about 0.75."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, n)
    return x, (rng.random(n) < sigmoid(2 * x)).astype(float)


def test_too_few_traces_or_one_class_cannot_judge_a_measure_and_say_how_many():
    assert too_few([1, 0] * 5) is None  # 10 traces, 5 right, 5 wrong: enough
    assert too_few([1, 0] * 4) == "too few traces to judge: 8 test traces (at least 10 needed)"
    assert too_few([1] * 30) == (
        "too few traces to judge: 30 test traces, 30 right and 0 wrong (at least 2 of each needed)"
    )  # one class: nothing to rank, however many
    assert "1 right and 11 wrong" in too_few([1] + [0] * 11)
    assert too_few([]) == "too few traces to judge: 0 test traces (at least 10 needed)"
    x, y = _separating(8)
    assert auroc_interval(x, y) is None and ece_interval(sigmoid(x), y) is None
    assert (
        auroc_interval(np.arange(30.0), np.ones(30)) is None
        and ece_interval(np.full(30, 0.9), np.ones(30)) is None
    )


def test_the_auroc_interval_holds_the_estimate_and_narrows_with_more_traces():
    widths = []
    for n in (MIN_JUDGED_TRACES, 100, 2000):
        x, y = _separating(n)
        lo, hi = auroc_interval(x, y)
        assert 0 <= lo <= auroc(x, y) <= hi <= 1
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2] and widths[2] < 0.06
    # a perfect ranking from a few traces is not a certainty: the interval reaches well below 1
    lo, hi = auroc_interval(np.arange(12.0), [0] * 6 + [1] * 6)
    assert hi == 1.0 and 0.6 < lo < 0.95
    # moderate samples: close to the textbook estimate ± 1.96 SE, SE from Hanley & McNeil's Q1 and Q2
    x, y = _separating(400, seed=3)
    a, n1 = auroc(x, y), int(y.sum())
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    se = math.sqrt(
        (a * (1 - a) + (n1 - 1) * (q1 - a * a) + (400 - n1 - 1) * (q2 - a * a)) / (n1 * (400 - n1))
    )
    lo, hi = auroc_interval(x, y)
    assert lo == pytest.approx(a - 1.96 * se, abs=0.005) and hi == pytest.approx(a + 1.96 * se, abs=0.005)


def test_the_ece_interval_holds_the_estimate_narrows_with_more_traces_and_is_reproducible():
    widths = []
    for n in (MIN_JUDGED_TRACES * 3, 300, 3000):
        x, y = _separating(n, seed=1)
        p = sigmoid(2 * x)
        lo, hi = ece_interval(p, y)
        assert 0 <= lo <= ece(p, y) <= hi <= 1
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2]
    x, y = _separating(40)
    assert ece_interval(sigmoid(x), y) == ece_interval(sigmoid(x), y)  # a fixed seed
    assert ece_interval(sigmoid(x), y) != ece_interval(sigmoid(x), y, seed=1)
    # each resample's ECE is `ece` of the traces it picked (same seed, same picks)
    p, y = np.r_[np.full(10, 0.2), np.full(10, 0.8)], np.r_[np.zeros(7), np.ones(3), np.ones(6), np.zeros(4)]
    picks = np.random.default_rng(0).integers(0, 20, size=(200, 20))
    each = [ece(p[k], y[k]) for k in picks]
    lo, hi = np.percentile(each, [2.5, 97.5])
    assert ece_interval(p, y, resamples=200) == (
        pytest.approx(min(lo, ece(p, y))),
        pytest.approx(max(hi, ece(p, y))),
    )


def test_the_report_carries_each_interval_or_why_there_is_none():
    x, y = _separating(200)
    t = measure_report(x[:100], y[:100], x[100:], y[100:])["test"]
    assert t["too_few"] is None and t["auroc_ci95"][0] <= t["auroc"] <= t["auroc_ci95"][1]
    assert t["ece_ci95"][0] <= t["ece"] <= t["ece_ci95"][1]
    few = measure_report(x[:100], y[:100], x[100:106], y[100:106])["test"]
    assert few["auroc_ci95"] is None and few["ece_ci95"] is None and "6 test traces" in few["too_few"]
    json.dumps(t)
    rows = summarise(
        [_trace("b", "dev", 0, bool(c), v) for c, v in zip(y[:40], x[:40])]
        + [_trace("b", "test", 1, bool(c), v) for c, v in zip(y[40:46], x[40:46])],
        [90],
    )
    assert side_too_few(rows["b"]) == "too few traces to judge: 6 test traces (at least 10 needed)"
    rows = summarise(
        [_trace("b", "dev", 0, bool(c), v) for c, v in zip(y[:40], x[:40])]
        + [_trace("b", "test", 1, bool(c), v) for c, v in zip(y[40:80], x[40:80])],
        [90],
    )
    assert side_too_few(rows["b"]) is None


def _trace(side, split, question, correct, x):
    return {
        "side": side,
        "split": split,
        "question": question,
        "correct": correct,
        **{m: x for m in MEASURES},
    }


def test_threshold_report_pooled_on_dev_applied_to_test_and_per_question():
    dev = [_trace("b", "dev", 0, c, x) for c, x in [(0, 1.0), (1, 2.0), (1, 3.0)]] + [
        _trace("b", "dev", 2, c, x) for c, x in [(0, 5.0), (1, 6.0)]
    ]
    test = [_trace("b", "test", 1, c, x) for c, x in [(0, 1.5), (1, 4.0)]]
    rep = threshold_report(dev, test, eta=50)
    assert rep["threshold"] == calibrate_threshold([1, 2, 3, 5, 6], 50) == 3.0
    assert rep["dev"] == {
        "traces": 5,
        "kept": 3,
        "kept_share": 0.6,
        "accuracy_all": 0.6,
        "accuracy_kept": 2 / 3,
    }
    assert rep["test"]["kept"] == 1 and rep["test"]["accuracy_kept"] == 1.0
    # per question: q0's threshold 2.0 keeps {2, 3} (both right), q2's 5.5 keeps {6} (right)
    assert rep["per_question_dev"] == {
        "traces": 5,
        "kept": 3,
        "kept_share": 0.6,
        "accuracy_all": 0.6,
        "accuracy_kept": 1.0,
    }
    assert threshold_report(dev, test, 50, threshold=10.0)["dev"]["kept"] == 0  # a given threshold is used


def test_measure_report_and_summary_of_a_measure_that_separates():
    rng = np.random.default_rng(2)
    dev_x, test_x = rng.normal(0, 1, 400), rng.normal(0, 1, 400)
    dev_y, test_y = rng.random(400) < sigmoid(3 * dev_x), rng.random(400) < sigmoid(3 * test_x)
    rep = measure_report(dev_x, dev_y, test_x, test_y)
    t = rep["test"]
    assert rep["platt"]["a"] == pytest.approx(3, rel=0.3) and t["auroc"] > 0.8 and rep["dev"]["auroc"] > 0.8
    assert t["brier"] < t["brier_base_rate"] and t["ece"] < 0.1 and t["adaptive_ece"] < 0.1
    assert sum(b["count"] for b in t["reliability"]) == 400 and t["uncalibrated_minmax_ece"] is not None
    empty = measure_report(dev_x, dev_y, [], [])
    assert empty["test"]["ece"] is None and empty["test"]["reliability"] == [] and empty["platt"] is not None
    traces = [
        _trace("baseline", "dev" if i % 2 == 0 else "test", i % 4, i % 3 == 0, float(i)) for i in range(12)
    ]
    traces[0]["tail"] = None  # an empty trace has no measure: left out of that measure only
    out = summarise(traces, [10, 90])
    s = out["baseline"]
    assert s["traces"] == {"dev": 6, "test": 6} and s["measures"]["tail"]["dev"]["traces"] == 5
    assert s["measures"]["mean"]["dev"]["traces"] == 6 and [th["eta"] for th in s["thresholds"]] == [10, 90]
    json.dumps(out)


def _deep_think_report(expected):
    def trace(phase, stopped, correct, x):
        return {
            "phase": phase,
            "stopped": stopped,
            "correct": correct,
            "mean": x,
            "tail": x,
            "bottom10_group": x,
            "lowest_group": x,
        }

    side = {
        "traces": [
            trace("warmup", False, True, 5.0),
            trace("warmup", False, False, 3.0),
            trace("online", False, True, 6.0),
            trace("online", True, False, 2.0),
            trace("online", False, False, 4.0),
        ]
    }
    return {
        "config": {"expected": expected, "eta": 90},
        "thresholds": {"baseline": 3.2, "feedback": 3.2},
        "sides": {"baseline": side, "feedback": side},
    }


def test_from_deep_think_uses_the_runs_own_traces():
    assert (
        from_deep_think(_deep_think_report(None)) is None and from_deep_think(_deep_think_report(" ")) is None
    )
    res = from_deep_think(_deep_think_report("42"))
    base = res["sides"]["baseline"]
    assert res["stopped_left_out"] == {"baseline": 1, "feedback": 1}
    assert (
        base["traces"] == {"dev": 2, "test": 2} and base["measures"]["lowest_group"]["test"]["auroc"] == 1.0
    )
    th = base["thresholds"][0]
    assert (
        th["eta"] == 90
        and th["threshold"] == 3.2
        and th["dev"]["kept"] == 1
        and th["dev"]["accuracy_kept"] == 1.0
    )
    json.dumps(res)


def test_bad_settings_and_question_sets_are_refused_naming_the_field():
    for cfg, message in [
        (CalibrationConfig(samples=0), "samples per question"),
        (CalibrationConfig(bins=1), "bins"),
        (CalibrationConfig(etas=[0]), "eta"),
        (CalibrationConfig(etas=[]), "at least one eta"),
        (CalibrationConfig(strategy="nope"), "unknown strategy"),
        (CalibrationConfig(answer_regex="(x"), "does not compile"),
        (CalibrationConfig(top_p=0), "top_p"),
        (CalibrationConfig(max_new_tokens=0), "max_new_tokens"),
    ]:
        with pytest.raises(FeedbackError, match=message):
            cfg.validate(30)
    assert any("shorter than the window" in w for w in CalibrationConfig(window=99).validate(30))
    assert any("greedy" in w for w in CalibrationConfig(temperature=0).validate(30))
    with pytest.raises(FeedbackError, match="at least 2 questions"):
        check_questions([{"question": "q", "answer": 1}])
    with pytest.raises(FeedbackError, match="question 2 needs a gold 'answer'"):
        check_questions([{"question": "q", "answer": 1}, {"question": "r", "answer": " "}])
    assert builtin_questions().is_file() and len(read_questions("builtin")) == 16


def test_a_tiny_run_through_the_engine(tiny_lm):
    questions = [{"question": "What is 2+2?", "answer": "4"}, {"question": "Name a colour.", "answer": "red"}]
    cfg = CalibrationConfig(samples=2, max_new_tokens=4, window=2, temperature=1.0, params={"alpha": 0.3})
    seen = []
    res = calibrate(tiny_lm, questions, cfg, progress=lambda i, n, q: seen.append(i))
    json.dumps(res)
    assert seen == [1, 2] and res["split"]["dev"] == 1 and res["split"]["test"] == 1
    assert len(res["traces"]) == 2 * 2 * 2 and {t["split"] for t in res["traces"]} == {"dev", "test"}
    assert all(isinstance(t["correct"], bool) and 1 <= t["tokens"] <= 4 for t in res["traces"])
    for side in ("baseline", "feedback"):
        s = res["sides"][side]
        assert s["traces"] == {"dev": 2, "test": 2} and set(s["measures"]) == set(MEASURES)
        assert [th["eta"] for th in s["thresholds"]] == [10.0, 90.0]
    first = [t for t in res["traces"] if t["sample"] == 0 and t["question"] == 0]
    assert first[0]["side"] == "baseline" and first[1]["side"] == "feedback"
    with pytest.raises(FeedbackError, match="FEEDBACK_BUDGET_DECODED_TOKENS"):
        calibrate(tiny_lm, questions, cfg, budget=Budget(decoded_tokens=10))
    with pytest.raises(FeedbackError, match="question 2 is .* exceeds the model context of 512 tokens"):
        calibrate(tiny_lm, [questions[0], {"question": "word " * 600, "answer": "x"}], cfg)
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        calibrate(tiny_lm, questions, cfg, stop=stop)
