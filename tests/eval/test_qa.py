"""Question answering per row: accuracy from the extracted answers, the gold answer's perplexity,
restate rows judged on what follows their restatement."""

from __future__ import annotations

import math

import pytest

from feedback.core.records import RowResult, RowSpec, StepRecord, answer_text
from feedback.errors import FeedbackError
from feedback.eval.qa import evaluate_qa


def _step(i, text, part=None):
    return StepRecord(i, i, text, -1.0, 0.3, 1.0, 1.0, 1.0, [], 1.0, part=part)


def test_reply_answer_leaves_out_the_restatement():
    row = RowResult(
        "r",
        "restate",
        {},
        steps=[
            _step(0, "Key facts: 3 and 4", "restate"),
            _step(1, "\n\nAnswer:", "transition"),
            _step(2, " 7", "answer"),
        ],
    )
    assert answer_text(row) == "\n\nAnswer: 7"
    plain = RowResult("b", None, {}, text="It is 7.", steps=[_step(0, "It is 7.")])
    assert answer_text(plain) == "It is 7."


def test_accuracy_and_gold_perplexity_per_row(tiny_lm):
    questions = [
        {"question": "What is 3 + 4? Answer with a number.", "answer": 7},
        {"question": "Capital of France? One word.", "answer": "Paris"},
    ]
    rows = [RowSpec("plain"), RowSpec("restate", "restate", {"max_tokens": 2})]
    seen = []
    res = evaluate_qa(tiny_lm, questions, rows, max_new_tokens=8, progress=lambda i, n: seen.append((i, n)))
    assert seen == [(1, 2), (2, 2)] and res["questions"] == 2
    for name in ("plain", "restate"):
        rights = [item["rows"][name]["right"] for item in res["items"]]
        assert res["rows"][name]["accuracy"] == sum(rights) / 2
        ppls = [item["rows"][name]["reference_ppl"] for item in res["items"]]
        assert res["rows"][name]["gold_ppl"] == pytest.approx(math.exp(sum(map(math.log, ppls)) / 2))
    assert all(item["rows"]["restate"]["text"].startswith("Key facts:") for item in res["items"])


def test_empty_inputs_refused(tiny_lm):
    with pytest.raises(FeedbackError, match="question set is empty"):
        evaluate_qa(tiny_lm, [], [RowSpec("plain")])
    with pytest.raises(FeedbackError, match="at least one row"):
        evaluate_qa(tiny_lm, [{"question": "q", "answer": 1}], [])


def test_the_built_in_question_set_is_where_the_commands_look():
    from feedback.eval.deepthink import load_questions
    from feedback.eval.qa import BUILTIN_QUESTIONS

    assert len(load_questions(BUILTIN_QUESTIONS)) == 16  # `qa` and `calibrate` without --questions read it
