"""Conversations and branches: the next turn's config, and replays that force a token."""
from __future__ import annotations

import pytest

from feedback.core.engine import run_to_end
from feedback.core.records import RowSpec, RunConfig
from feedback.core.sampling import SamplingConfig
from feedback.core.session import branch, continue_run
from feedback.errors import FeedbackError

QUESTION = "Name a large animal that lives in the sea."


@pytest.fixture(scope="module")
def first_turn(embedded_lm):
    rows = [RowSpec("baseline"), RowSpec("feedback", "residual", {"alpha": 0.3}),
            RowSpec("short", prompt="Name a sea animal. One word.")]
    return run_to_end(embedded_lm, RunConfig(prompt=QUESTION, max_new_tokens=24, rows=rows))


def test_the_next_turn_carries_each_rows_own_history(embedded_lm, first_turn):
    cfg = continue_run(first_turn, "How big does it get?")
    assert cfg.prompt == "How big does it get?" and [r.prompt for r in cfg.rows] == [None] * 3
    for spec, answer, asked in zip(cfg.rows, first_turn.rows, [QUESTION, QUESTION, "Name a sea animal. One word."]):
        assert spec.messages == [{"role": "user", "content": asked}, {"role": "assistant", "content": answer.text}]
        assert spec.prefix is None and spec.strategy == answer.strategy
    second = run_to_end(embedded_lm, cfg)
    third = continue_run(second, "Thanks.")
    assert [len(r.messages) for r in third.rows] == [4, 4, 4]
    assert third.rows[2].messages[2] == {"role": "user", "content": "How big does it get?"}
    assert third.rows[2].messages[3]["content"] == second.rows[2].text
    # each row's second turn is exactly that row's conversation run on its own
    alone = run_to_end(embedded_lm, RunConfig(prompt=cfg.prompt, max_new_tokens=24, rows=[cfg.rows[2]]))
    assert alone.rows[0].token_ids == second.rows[2].token_ids


def test_the_system_prompt_carries_over_and_is_not_repeated(tiny_lm):
    first = run_to_end(tiny_lm, RunConfig(prompt="hi", model="tiny", system_prompt="Be brief.", max_new_tokens=3,
                                          rows=[RowSpec("b")]))
    cfg = continue_run(first, "again")
    text = tiny_lm.tokenizer.decode(tiny_lm.encode(cfg.prompt, True, cfg.system_prompt, cfg.rows[0].messages))
    assert text.count("Be brief.") == 1 and text.index("Be brief.") < text.index("hi") < text.index("again")


@pytest.mark.parametrize("message, kwargs, error", [
    ("  ", {}, "the next message is empty"),
    ("more", {"chat_template": False}, "needs the chat template"),
])
def test_continue_refuses(tiny_lm, message, kwargs, error):
    first = run_to_end(tiny_lm, RunConfig(prompt="hi", model="tiny", max_new_tokens=2, **kwargs))
    with pytest.raises(FeedbackError, match=error):
        continue_run(first, message)


def test_a_branch_replays_every_row_then_forces_the_token(embedded_lm, first_turn):
    step = 3
    alternative = first_turn.rows[1].steps[step].top[1].token_id
    cfg = branch(first_turn, "feedback", step, alternative)
    again = run_to_end(embedded_lm, cfg)
    for old, new in zip(first_turn.rows, again.rows):
        if len(old.token_ids) <= step:  # ended before the branch point: replayed whole
            assert new.token_ids == old.token_ids and new.stop_reason == old.stop_reason
            continue
        assert new.token_ids[:step] == old.token_ids[:step] and new.token_ids[step] == alternative
        assert [s.forced for s in new.steps[:step + 1]] == [True] * (step + 1)
        assert not any(s.forced for s in new.steps[step + 1:])
        for a, b in zip(old.steps[:step + 1], new.steps):  # the replay saw the same distributions
            assert b.confidence == pytest.approx(a.confidence, abs=1e-4)
    alone = branch(first_turn, "feedback", step, alternative, all_rows=False)
    assert [r.prefix is None for r in alone.rows] == [True, False, True]


def test_forced_steps_still_draw_so_a_sampled_replay_reproduces_the_run(tiny_lm):
    cfg = RunConfig(prompt="Once upon a time", model="tiny", max_new_tokens=16, seed=7,
                    sampling=SamplingConfig(temperature=1.0),
                    rows=[RowSpec("baseline"), RowSpec("fb", "residual", {"alpha": 0.4})])
    first = run_to_end(tiny_lm, cfg)
    same = first.rows[1].token_ids[6]
    again = run_to_end(tiny_lm, branch(first, "fb", 6, same))
    assert [r.token_ids for r in again.rows] == [r.token_ids for r in first.rows]


def test_a_branch_can_force_several_tokens(tiny_lm):
    first = run_to_end(tiny_lm, RunConfig(prompt="hi", model="tiny", max_new_tokens=8))
    cfg = branch(first, 0, 2, [11, 12, 13])
    assert cfg.rows[0].prefix == first.rows[0].token_ids[:2] + [11, 12, 13]
    assert run_to_end(tiny_lm, cfg).rows[0].token_ids[2:5] == [11, 12, 13]


@pytest.mark.parametrize("args, error", [
    (("nope", 1, 5), "unknown row 'nope'"),
    ((7, 1, 5), "row 7 does not exist"),
    (("baseline", 8, 5), "step 8 is outside row baseline's answer"),
    (("baseline", -1, 5), "step -1 is outside"),
    (("baseline", 1, []), "needs one or more token ids"),
    (("baseline", 6, [1, 2, 3]), "prefix has 9 tokens but max_new_tokens is 8"),
])
def test_bad_branches_are_refused(tiny_lm, args, error):
    first = run_to_end(tiny_lm, RunConfig(prompt="hi", model="tiny", max_new_tokens=8))
    with pytest.raises(FeedbackError, match=error):
        branch(first, *args)


def test_a_row_that_ended_before_the_branch_point_is_replayed_whole(tiny_lm):
    eos = tiny_lm.eos_token_ids[0]
    first = run_to_end(tiny_lm, RunConfig(prompt="hi", model="tiny", max_new_tokens=8,
                                          rows=[RowSpec("short", prefix=[5, eos]), RowSpec("long")]))
    again = run_to_end(tiny_lm, branch(first, "long", 4, 9))
    assert again.rows[0].token_ids == [5, eos] and again.rows[0].stop_reason == "eos"
    assert again.rows[1].token_ids[:5] == first.rows[1].token_ids[:4] + [9]
