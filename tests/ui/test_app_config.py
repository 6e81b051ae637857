"""Compare-tab values -> RunConfig: every bad value is a clear FeedbackError (shown as gr.Error)."""
from __future__ import annotations

import pytest

from feedback.errors import FeedbackError
from ui.app import UI_MAX_NEW_TOKENS, build_config

GOOD = dict(prompt="hi", chat_template=True, model="embedded", strategy="residual", temperature=0.7, top_p=0.9,
            top_k=40, min_p=0.0, repetition_penalty=1.1, max_new_tokens=64, seed=3, k=20, window=16,
            threshold_mode="off", threshold=10.0, params={"alpha": 0.1})


def test_good_values_build_a_validated_config():
    cfg = build_config(**GOOD)
    assert cfg.sampling.temperature == 0.7 and cfg.sampling.top_k == 40 and cfg.deepconf.threshold is None
    assert [r.name for r in cfg.rows] == ["baseline", "feedback"] and cfg.rows[1].params == {"alpha": 0.1}
    fixed = build_config(**GOOD | {"threshold_mode": "fixed", "threshold": 7.5})
    assert fixed.deepconf.threshold == 7.5


@pytest.mark.parametrize("change, message", [
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": None}, "prompt is empty"),
    ({"max_new_tokens": None}, "max new tokens must be a number"),
    ({"max_new_tokens": 2.5}, "max new tokens must be a whole number"),
    ({"max_new_tokens": UI_MAX_NEW_TOKENS + 1}, "capped at"),
    ({"temperature": float("nan")}, "temperature must be finite"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_p": float("inf")}, "top-p must be finite"),
    ({"seed": 1e30}, "seed"),
    ({"window": 0}, "window"),
    ({"threshold_mode": "fixed", "threshold": None}, "threshold must be a number"),
    ({"strategy": "nope"}, "unknown strategy"),
])
def test_bad_values_are_refused_with_a_message(change, message):
    with pytest.raises(FeedbackError, match=message):
        build_config(**GOOD | change)


def test_parse_number_edge_cases():
    from ui.controls import parse_number

    assert parse_number("3", "n", integer=True) == 3 and parse_number(2.0, "n", integer=True) == 2
    for value, message in [(float("inf"), "finite"), ("x", "must be a number"), (None, "must be a number"),
                           (1.5, "whole number"), (0, r"must be in \[1, 9\]")]:
        with pytest.raises(FeedbackError, match=message):
            parse_number(value, "n", integer=True, lo=1, hi=9)
