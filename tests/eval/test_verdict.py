"""The verdict on a ΔPPL with its CI (feedback/eval/verdict.py), and when a best setting is a
recommendation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from feedback.eval.verdict import IMPROVES, NOISE, WORSE, ci_text, not_recommended, verdict


@pytest.mark.parametrize(
    "delta, ci, kind, says",
    [
        (-0.5, [-0.9, -0.1], IMPROVES, "CI excludes 0: a real improvement"),
        (-0.1, [-0.4, 0.2], NOISE, "within noise: CI spans 0"),
        (-0.1, [-0.4, 0.0], NOISE, "within noise"),  # a CI that reaches 0 does not exclude it
        (
            0.214,
            [-0.1, 0.5],
            WORSE,
            "no better than the baseline: ΔPPL ≥ 0; CI spans 0",
        ),  # the reported Sweep best
        (0.491, [0.1, 0.9], WORSE, "worse than the baseline: CI above 0"),  # the reported Tune test result
        (0.0, [-0.1, 0.1], WORSE, "no better than the baseline"),
        (-0.01, [0.001, 0.2], WORSE, "CI above 0"),  # the interval outweighs a point estimate outside it
    ],
)
def test_each_delta_and_interval_gets_its_verdict(delta, ci, kind, says):
    v = verdict(delta, ci)
    assert v.kind == kind and says in v.text
    assert v.beats_baseline == (kind != WORSE)


def test_without_an_interval_only_the_sign_counts_and_never_as_a_real_improvement():
    for ci in (None, [math.nan, math.nan], [None, None]):  # bootstrap off; NaN blanked to None in JSON
        assert verdict(-2.0, ci).kind == NOISE and "no CI" in verdict(-2.0, ci).text
        assert verdict(2.0, ci).kind == WORSE and "CI" not in verdict(2.0, ci).text
    assert verdict(None, None).kind == WORSE and verdict(math.nan, [-1, 1]).kind == WORSE


def test_numpy_numbers_are_numbers():
    assert verdict(np.float32(-1.0), [np.float64(-2.0), np.float32(-0.5)]).kind == IMPROVES


def test_a_best_is_recommended_only_when_it_beats_the_baseline_and_holds_on_test():
    better, noise, worse = verdict(-1, [-2, -0.5]), verdict(-1, [-2, 1]), verdict(0.5, [0.1, 0.9])
    assert not_recommended(better) is None and not_recommended(noise) is None
    assert not_recommended(worse) == "no point beats the baseline"
    assert not_recommended(worse, better, noun="trial") == "no trial beats the baseline"  # dev decides first
    assert not_recommended(better, noise) is None
    why = not_recommended(noise, worse, noun="trial")
    assert why.startswith("the best trial is not confirmed on the test text") and "CI above 0" in why


def test_an_interval_is_printed_signed_or_said_to_be_missing():
    assert ci_text(-0.5123, 0.1) == "[-0.512, +0.100]"
    assert ci_text(math.nan, math.nan) == ci_text(None, None) == "(no CI)"
