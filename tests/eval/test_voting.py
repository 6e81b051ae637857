"""DeepConf calibration, answer extraction and voting against hand-computed cases."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from feedback.errors import FeedbackError
from feedback.eval.voting import (
    PRESETS,
    Trace,
    answer_matches,
    calibrate_threshold,
    compile_answer_regex,
    extract_answer,
    normalise,
    vote,
    wants_number,
)

REPLIES = Path(__file__).resolve().parents[1] / "data" / "small_model_replies.jsonl"


def test_percentile_direction_for_both_presets():
    lows = [10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0, 19.0, 20.0]
    # DeepConf-low keeps the top 10%: the threshold is the 90th percentile (aggressive)
    assert calibrate_threshold(lows, PRESETS["deepconf-low"]) == pytest.approx(19.0)
    # DeepConf-high keeps 90%: the 10th percentile (safe)
    assert calibrate_threshold(lows, PRESETS["deepconf-high"]) == pytest.approx(11.0)
    assert calibrate_threshold([5.0, 7.0], 50) == pytest.approx(6.0)  # linear interpolation
    assert calibrate_threshold(lows, 100) == 10.0
    kept = [v for v in lows if v >= calibrate_threshold(lows, 90)]
    assert len(kept) == 10  # about eta% of the warm-up traces would survive


@pytest.mark.parametrize("eta", [0, -5, 100.5, float("nan"), "10"])
def test_eta_outside_range_is_refused(eta):
    with pytest.raises(FeedbackError, match=r"eta .* must be in \(0, 100\]"):
        calibrate_threshold([1.0, 2.0], eta)


def test_calibration_needs_values():
    with pytest.raises(FeedbackError, match="at least one warm-up trace"):
        calibrate_threshold([math.nan], 10)


@pytest.mark.parametrize(
    "text, answer",
    [
        (r"so the result is \boxed{42}.", "42"),
        (r"first \boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        ("Working...\nAnswer: Paris.", "paris"),
        ("answer = 1,000.0", "1000"),
        ("The answer is 7 and then 8 apples", "7"),  # what the reply states is its answer
        ("3 + 4 = 7", "7"),
        ("there are no digits in this reply", None),
        ("no digits here", "no digits here"),  # a short phrase is taken whole
        (r"\boxed{ }  Answer: 12", "12"),
        ("Paris.", "paris"),
        ("H2O", "h2o"),
        ("12.", "12"),
        ("The answer is 12.", "12"),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def _replies() -> list[dict]:
    return [json.loads(line) for line in REPLIES.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("item", _replies(), ids=lambda item: item["reply"][:40])
def test_extraction_on_real_small_model_replies(item):
    """Replies the embedded model really gave (sampled at 0.7, the built-in questions); `answer` is
    what a person reads as the reply's final answer, right or wrong."""
    got = extract_answer(item["reply"], question=item["question"])
    assert got == item["answer"], (item["reply"], got)
    if item["answer"] is not None and normalise(item["answer"]) == normalise(item["gold"]):
        assert answer_matches(got, item["gold"])


def test_the_reply_from_the_walk_through_reads_as_nine():
    reply = "12 + 7 = 9 The number 9 is the answer to the equation 12 + 7."
    assert extract_answer(reply, question="What is 12 + 7? Answer with a number.") == "9"
    assert extract_answer(reply) == "9"


def test_questions_that_want_numbers_and_number_words():
    assert wants_number("How many legs does a spider have?") and wants_number("What is 9 times 3?")
    assert not wants_number("What is the capital of France?") and wants_number(None) is None
    assert extract_answer("A spider has eight legs.", question="How many legs does a spider have?") == "8"
    assert (
        extract_answer("The capital of France is Paris.", question="What is the capital of France?")
        == "paris"
    )
    assert (
        extract_answer("Paris is the capital of France.", question="What is the capital of France?")
        == "paris"
    )


def test_answer_matches_numbers_by_value_and_phrases_by_words():
    assert (
        answer_matches("42", "42.0")
        and answer_matches("deep blue", "Blue")
        and answer_matches("paris", "Paris")
    )
    assert (
        not answer_matches("420", "42")
        and not answer_matches("blueish", "blue")
        and not answer_matches(None, "4")
    )
    assert answer_matches("4", None) is None and answer_matches("4", "  ") is None


def test_a_catastrophic_user_regex_is_stopped_by_its_time_limit():
    pattern = compile_answer_regex(r"(a|aa)+$")
    t0 = time.perf_counter()
    with pytest.raises(FeedbackError, match="took longer than"):
        extract_answer("a" * 40 + "!", pattern)
    assert time.perf_counter() - t0 < 3


def test_user_regex_and_bad_regex():
    pattern = compile_answer_regex(r"FINAL\((\w+)\)")
    assert extract_answer("FINAL(a) ... FINAL(Blue)", pattern) == "blue"
    assert extract_answer("nothing", pattern) is None
    assert extract_answer("x = 5", compile_answer_regex(r"\d+")) == "5"
    with pytest.raises(FeedbackError, match="answer regex does not compile"):
        compile_answer_regex("(unclosed")
    with pytest.raises(FeedbackError, match="answer regex does not compile: it nests too deeply"):
        compile_answer_regex("(" * 500)
    with pytest.raises(FeedbackError, match="answer regex is limited to 1000 characters"):
        compile_answer_regex("a" * 1001)


def test_normalise():
    assert normalise(" $3.50$ ") == "3.5" and normalise("1,234") == "1234" and normalise("Yes!") == "yes"
    assert normalise("-2.0") == "-2" and normalise("New   York.") == "new york"


def _t(answer, stopped=False, low=10.0, tail=10.0, tokens=50):
    return Trace(answer, stopped, tokens, low, tail)


def test_majority_and_weighted_votes_with_ties_and_stopped_traces():
    traces = [
        _t("4", low=12.0),
        _t("5", low=18.0),
        _t("4", low=11.0),
        _t("5", stopped=True, low=30.0),
        _t(None, low=40.0),
    ]
    maj = vote(traces)
    assert maj.answer == "4" and maj.voters == 3 and maj.share == pytest.approx(2 / 3)
    w = vote(traces, "lowest_group")
    assert w.tallies == {"4": 23.0, "5": 18.0} and w.answer == "4"
    # keep the top 50% by lowest-group confidence first: only the 18.0 and the 12.0 traces remain
    top = vote(traces, "lowest_group", eta=50)
    assert top.tallies == {"4": 12.0, "5": 18.0} and top.answer == "5"
    tie = vote([_t("a"), _t("b")])
    assert tie.answer == "a" and tie.share == 0.5  # first answer reached wins a tie
    assert vote([_t("x", stopped=True)]).answer is None
    with pytest.raises(FeedbackError, match="vote weight"):
        vote(traces, "mean")


def test_tail_weighting():
    traces = [_t("1", tail=5.0), _t("2", tail=9.0), _t("1", tail=3.0)]
    v = vote(traces, "tail")
    assert v.answer == "2" and v.tallies == {"1": 8.0, "2": 9.0}
    assert np.isclose(v.share, 9 / 17)
