"""restate: the prompt asks for a restatement, the reply opens with the forced marker, the
restatement ends on a line end, end of turn or its token limit, the answer follows the forced
transition, parts are marked, and a reference answer is scored after the restatement."""

from __future__ import annotations

import pytest

from feedback.core import quality
from feedback.core.engine import start_run
from feedback.core.records import RowSpec, RunConfig
from feedback.errors import FeedbackError
from feedback.eval.perplexity import PPLConfig
from feedback.strategies import build_strategy
from feedback.strategies.restate import INSTRUCTION, OPENING, TRANSITION


def _ids(tok, text):
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_a_restate_row_restates_then_answers(tiny_lm):
    tok = tiny_lm.tokenizer
    cfg = RunConfig(
        prompt="Tom has 3 apples and buys 4 more. How many now?",
        model="tiny",
        max_new_tokens=30,
        reference="He has 7.",
        rows=[RowSpec("b"), RowSpec("r", "restate", {"max_tokens": 5})],
    )
    run = start_run(tiny_lm, cfg)
    for _ in run:
        pass
    base, row = run.result.rows
    assert INSTRUCTION in tok.decode(run.rows[1].prompt_ids) and INSTRUCTION not in tok.decode(
        run.rows[0].prompt_ids
    )
    opening, transition = _ids(tok, OPENING), _ids(tok, TRANSITION)
    assert row.token_ids[: len(opening)] == opening
    start = row.metrics["answer_start"]
    assert row.token_ids[start - len(transition) : start] == transition
    assert row.metrics["restatement_tokens"] <= 5
    parts = [s.part for s in row.steps]
    assert parts == (
        ["restate"] * (start - len(transition))
        + ["transition"] * len(transition)
        + ["answer"] * (len(parts) - start)
    )
    assert all(s.part is None for s in base.steps)
    # the reference is scored after the prompt and the restatement, by the plain model
    expected = quality.reference_ppl(
        tiny_lm, run.rows[1].prompt_ids + row.token_ids[:start], _ids(tok, " He has 7."), None, {}
    )["reference_ppl"]
    assert row.metrics["reference_ppl"] == pytest.approx(expected, rel=1e-6)
    assert row.metrics["reference_ppl_with_strategy"] is True


def test_the_restatement_ends_at_end_of_turn_a_line_end_or_its_limit(tiny_lm):
    tok = tiny_lm.tokenizer
    word, newline, eos = _ids(tok, " apples")[0], _ids(tok, "\n")[0], tok.eos_token_id
    transition = _ids(tok, TRANSITION)

    def reply(tokens, max_tokens=48):
        s = build_strategy("restate", {"max_tokens": max_tokens}, 4)
        s.reset()
        s.begin(tok, [eos])
        return [s.choose(step, t) for step, t in enumerate(tokens)]

    n = len(_ids(tok, OPENING))
    for last in (eos, newline):
        got = reply([word] * n + [word, word, last] + [word] * len(transition))
        assert [t for t, _ in got[n + 2 : n + 2 + len(transition)]] == transition  # replaced, then the marker
        assert got[-1] == (word, "answer")
    capped = reply([word] * (n + 2 + len(transition) + 1), max_tokens=2)
    assert [t for t, _ in capped[n + 2 : n + 2 + len(transition)]] == transition


def test_text_perplexity_is_refused_with_the_reason():
    with pytest.raises(FeedbackError, match="prompt-level strategy"):
        PPLConfig("restate", {}).resolved_mode()
