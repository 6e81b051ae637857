"""Conversations and branches: the next turn's config, and replays that force a token."""

from __future__ import annotations

import pytest

from feedback.core.engine import run_to_end
from feedback.core.records import RowSpec, RunConfig
from feedback.core.sampling import SamplingConfig
from feedback.core.session import branch, continue_run, merge_rerun, rerun
from feedback.errors import FeedbackError

QUESTION = "Name a large animal that lives in the sea."


@pytest.fixture(scope="module")
def first_turn(embedded_lm):
    rows = [
        RowSpec("baseline"),
        RowSpec("feedback", "residual", {"alpha": 0.3}),
        RowSpec("short", prompt="Name a sea animal. One word."),
    ]
    return run_to_end(embedded_lm, RunConfig(prompt=QUESTION, max_new_tokens=24, rows=rows))


def test_the_next_turn_carries_each_rows_own_history(embedded_lm, first_turn):
    cfg = continue_run(first_turn, "How big does it get?")
    assert cfg.prompt == "How big does it get?" and [r.prompt for r in cfg.rows] == [None] * 3
    for spec, answer, asked in zip(
        cfg.rows, first_turn.rows, [QUESTION, QUESTION, "Name a sea animal. One word."]
    ):
        assert spec.messages == [
            {"role": "user", "content": asked},
            {"role": "assistant", "content": answer.text},
        ]
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
    first = run_to_end(
        tiny_lm,
        RunConfig(
            prompt="hi", model="tiny", system_prompt="Be brief.", max_new_tokens=3, rows=[RowSpec("b")]
        ),
    )
    cfg = continue_run(first, "again")
    text = tiny_lm.tokenizer.decode(tiny_lm.encode(cfg.prompt, True, cfg.system_prompt, cfg.rows[0].messages))
    assert text.count("Be brief.") == 1 and text.index("Be brief.") < text.index("hi") < text.index("again")


@pytest.mark.parametrize(
    "message, kwargs, error",
    [
        ("  ", {}, "the next message is empty"),
        ("more", {"chat_template": False}, "needs the chat template"),
    ],
)
def test_continue_refuses(tiny_lm, message, kwargs, error):
    first = run_to_end(tiny_lm, RunConfig(prompt="hi", model="tiny", max_new_tokens=2, **kwargs))
    with pytest.raises(FeedbackError, match=error):
        continue_run(first, message)


def test_a_branch_is_this_text_then_this_token_in_every_row(embedded_lm, first_turn):
    """Every row goes on from the clicked row's text up to the step and the chosen token, even rows
    that had said something else by then (here the prompt variant, which parted at step 2): the rows
    then compare what each does from one point. Only the chosen token is marked chosen."""
    step, clicked = 3, first_turn.rows[1]
    assert first_turn.rows[2].token_ids[:step] != clicked.token_ids[:step]  # a row that had parted
    alternative = clicked.steps[step].top[1].token_id
    cfg = branch(first_turn, "feedback", step, alternative)
    assert [r.chosen for r in cfg.rows] == [1, 1, 1]
    again = run_to_end(embedded_lm, cfg)
    for new in again.rows:
        assert new.token_ids[:step] == clicked.token_ids[:step] and new.token_ids[step] == alternative
        assert [s.forced for s in new.steps[: step + 1]] == [True] * (step + 1)
        assert [s.chosen for s in new.steps[: step + 1]] == [False] * step + [True]  # replay, then the choice
        assert not any(s.forced or s.chosen for s in new.steps[step + 1 :])
    for a, b in zip(clicked.steps[: step + 1], again.rows[1].steps):  # the clicked row's replay saw the same
        assert b.confidence == pytest.approx(a.confidence, abs=1e-4)
    alone = branch(first_turn, "feedback", step, alternative, all_rows=False)
    assert [r.prefix is None for r in alone.rows] == [True, False, True] and alone.rows[1].chosen == 1
    follow = continue_run(again, "And then?")  # a branched run goes on as a conversation
    assert [(r.prefix, r.chosen) for r in follow.rows] == [(None, 0)] * 3


def test_a_branch_of_matching_rows_leaves_the_others_as_they_were(embedded_lm, first_turn):
    step, clicked = first_turn.first_divergence_step, first_turn.rows[1]  # where the baseline parts
    alternative = clicked.steps[step].top[1].token_id
    matches = [r.token_ids[:step] == clicked.token_ids[:step] for r in first_turn.rows]
    assert matches == [True, True, False]  # the baseline said the same so far; the variant did not
    again = run_to_end(embedded_lm, branch(first_turn, "feedback", step, alternative, matching_only=True))
    for old, new, branched in zip(first_turn.rows, again.rows, matches):
        if branched:
            assert new.token_ids[step] == alternative and sum(s.chosen for s in new.steps) == 1
        else:  # left as it was: its own answer again, nothing chosen in it
            assert new.token_ids == old.token_ids and not any(s.chosen for s in new.steps)


def test_forced_steps_still_draw_so_a_sampled_replay_reproduces_the_run(tiny_lm):
    cfg = RunConfig(
        prompt="Once upon a time",
        model="tiny",
        max_new_tokens=16,
        seed=7,
        sampling=SamplingConfig(temperature=1.0),
        rows=[RowSpec("baseline"), RowSpec("fb", "residual", {"alpha": 0.4})],
    )
    first = run_to_end(tiny_lm, cfg)
    same = first.rows[1].token_ids[6]
    again = run_to_end(tiny_lm, branch(first, "fb", 6, same))
    assert [r.token_ids for r in again.rows] == [r.token_ids for r in first.rows]


def test_a_branch_can_force_several_tokens(tiny_lm):
    first = run_to_end(tiny_lm, RunConfig(prompt="hi", model="tiny", max_new_tokens=8))
    cfg = branch(first, 0, 2, [11, 12, 13])
    assert cfg.rows[0].prefix == first.rows[0].token_ids[:2] + [11, 12, 13]
    assert run_to_end(tiny_lm, cfg).rows[0].token_ids[2:5] == [11, 12, 13]


@pytest.mark.parametrize(
    "args, error",
    [
        (("nope", 1, 5), "unknown row 'nope'"),
        ((7, 1, 5), "row 7 does not exist"),
        (("baseline", 8, 5), "step 8 is outside row baseline's answer"),
        (("baseline", -1, 5), "step -1 is outside"),
        (("baseline", 1, []), "needs one or more token ids"),
        (("baseline", 6, [1, 2, 3]), "prefix has 9 tokens but max_new_tokens is 8"),
    ],
)
def test_bad_branches_are_refused(tiny_lm, args, error):
    first = run_to_end(tiny_lm, RunConfig(prompt="hi", model="tiny", max_new_tokens=8))
    with pytest.raises(FeedbackError, match=error):
        branch(first, *args)


def test_a_row_that_ended_before_the_branch_point_and_does_not_match_is_replayed_whole(tiny_lm):
    eos = tiny_lm.eos_token_ids[0]
    first = run_to_end(
        tiny_lm,
        RunConfig(
            prompt="hi",
            model="tiny",
            max_new_tokens=8,
            rows=[RowSpec("short", prefix=[5, eos]), RowSpec("long")],
        ),
    )
    again = run_to_end(tiny_lm, branch(first, "long", 4, 9, matching_only=True))
    assert again.rows[0].token_ids == [5, eos] and again.rows[0].stop_reason == "eos"
    shared = run_to_end(tiny_lm, branch(first, "long", 4, 9))  # by default it goes on from "long"'s text
    assert shared.rows[0].token_ids[:5] == first.rows[1].token_ids[:4] + [9]
    assert again.rows[1].token_ids[:5] == first.rows[1].token_ids[:4] + [9]


def test_one_row_rerun_with_new_settings_stands_beside_the_others(tiny_lm):
    rows = [RowSpec("base"), RowSpec("fb", "residual", {"alpha": 0.1}), RowSpec("hot", temperature=0.9)]
    first = run_to_end(tiny_lm, RunConfig(prompt="hi", model="tiny", max_new_tokens=8, seed=3, rows=rows))
    changed = RowSpec("fb strong", "residual", {"alpha": 0.4})
    cfg = rerun(first, "fb", changed)
    assert [r.name for r in cfg.rows] == ["fb strong"] and cfg.seed == 3 and cfg.max_new_tokens == 8
    merged = merge_rerun(first, "fb", run_to_end(tiny_lm, cfg))
    # the new row is what a whole run with its settings gives it; the others are untouched
    whole = run_to_end(
        tiny_lm,
        RunConfig(prompt="hi", model="tiny", max_new_tokens=8, seed=3, rows=[rows[0], changed, rows[2]]),
    )
    assert [r.token_ids for r in merged.rows] == [r.token_ids for r in whole.rows]
    assert [r.name for r in merged.rows] == ["base", "fb strong", "hot"]
    assert merged.config["rows"][1]["params"] == {"alpha": 0.4} and merged.rows[0] is first.rows[0]
    assert merged.run_id != first.run_id and merged.prompt_tokens == first.prompt_tokens
    # its speed was measured alone, the others' in their batch: the row says so
    assert merged.rows[1].metrics["rerun_alone"] and not any("rerun_alone" in r.metrics for r in first.rows)
    assert rerun(first, 2).rows == [first_spec(first, 2)]  # no spec: the row as it was


def first_spec(result, index: int) -> RowSpec:
    return RunConfig.from_dict(result.config).rows[index]


def test_a_rerun_keeps_names_unique_and_its_row_must_exist(tiny_lm):
    first = run_to_end(
        tiny_lm, RunConfig(prompt="hi", model="tiny", max_new_tokens=2, rows=[RowSpec("a"), RowSpec("b")])
    )
    with pytest.raises(FeedbackError, match="another row is already called 'a'"):
        rerun(first, "b", RowSpec("a"))
    with pytest.raises(FeedbackError, match="row 5 does not exist"):
        rerun(first, 5)


def test_a_stopped_run_keeps_what_was_shown(tiny_lm):
    from feedback.core.session import keep_shown

    cfg = RunConfig(
        prompt="hi",
        model="tiny",
        max_new_tokens=10,
        key_facts=["the"],
        rows=[RowSpec("a"), RowSpec("b", "residual", {"alpha": 0.2})],
    )
    full = run_to_end(tiny_lm, cfg)
    seen = keep_shown(full, 4)
    for row, whole in zip(seen.rows, full.rows):
        assert row.token_ids == whole.token_ids[:4] and [s.step for s in row.steps] == [0, 1, 2, 3]
        assert row.text == "".join(s.text for s in whole.steps[:4]) and (row.stop_reason, row.stop_step) == (
            "stopped",
            3,
        )
        assert row.metrics["length"] == 4 and "key_fact_recall" in row.metrics
    assert full.rows[0].metrics["length"] == len(full.rows[0].token_ids)  # the run itself is left as it was
    only_b = keep_shown(full, 2, rows=[1])
    assert only_b.rows[0] is full.rows[0] and len(only_b.rows[1].steps) == 2
    assert keep_shown(full, 99).rows == full.rows  # nothing to cut
