"""The Perplexity tab's Recall section (ui/perplexity/recall.py): its handler runs a small grid through the
shared ModelRunner as the page wires it (the tiny model: mechanics only), draws the heatmaps as each
prompt finishes and at the end, and refuses what the served limits or the model's context do not
allow, naming the field, before anything waits."""

from __future__ import annotations

import types

import gradio as gr
import pytest

from feedback.core.budget import Budget
from feedback.serve.limits import RECALL_ITEMS, RECALL_NEW_TOKENS
from ui.perplexity.recall import RecallSection, verdict


@pytest.fixture(scope="module")
def section(tiny_lm):
    from feedback.serve.pool import ModelPool
    from ui.page.runner import ModelRunner

    runner = ModelRunner(ModelPool.serving(tiny_lm), budget=Budget(scored_tokens=5_000, decoded_tokens=1_000))
    with gr.Blocks() as demo:
        sec = RecallSection(runner.pool, runner)
        sec.build(tiny_lm.num_layers)
    sec.demo = demo
    return sec


def event(section, api: str):
    return next(fn for fn in section.demo.fns.values() if fn.api_name == api)


def values(section, **changes) -> dict:
    ev = event(section, "recall")
    return {n: c.value for n, c in zip(ev.input_keyword_names, ev.inputs, strict=True)} | changes


def run(section, session: str, **changes) -> list[dict]:
    ev = event(section, "recall")
    return [
        u
        for u in ev.fn(types.SimpleNamespace(session_hash=session), **values(section, **changes))
        if isinstance(u, dict)
    ]


def test_the_handler_runs_a_small_grid_and_draws_the_heatmaps(section, monkeypatch):
    # the runner sends what arrived in the last 0.2 s as one update; the tiny model's two prompts
    # can both finish within that, so updates go out as items come, to see the first prompt's
    monkeypatch.setattr("ui.page.runner.UPDATE_EVERY_S", 0.0)
    updates = run(
        section, "recall-run", lengths="96", depths="0, 100", items=1, max_new_tokens=2, deep_cache_lam=0.5
    )
    first, last = updates[0], updates[-1]
    assert (
        first[section.run]["interactive"] is False
        and "Starting: 2 prompts (1 item × 1 length × 2 depths)" in first[section.status]
    )
    assert "Done in" in last[section.status] and last[section.run]["interactive"] is True
    res = last[section.result]
    assert res["instances"] == 2 and list(res["rows"]) == ["baseline", "deep_cache"]
    assert res["row_specs"][1]["params"]["lam"] == 0.5 and res["config"]["depths"] == [0.0, 100.0]
    heat = last[section.difference_plot]
    assert (
        heat.data[0].type == "heatmap"
        and list(heat.data[0].x) == ["0%", "100%"]
        and list(heat.data[0].y) == ["96"]
    )
    assert "deep_cache − baseline" in heat.layout.title.text
    assert (
        last[section.summary].startswith("**deep_cache** recalled")
        and "McNemar exact p" in last[section.summary]
    )
    partial = [
        u
        for u in updates
        if section.strategy_plot in u
        and "(1 of 2 prompts)" in (u[section.strategy_plot].layout.title.text or "")
    ]
    assert partial, "the heatmaps are drawn after the first prompt too"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"lengths": "600"}, "lengths: 600 tokens is beyond the model's context of 512"),
        ({"lengths": "5000"}, "lengths must be between 64 and 4096"),
        ({"lengths": "96, 128, 160, 192, 224, 256"}, "lengths: at most 5 values here"),
        ({"depths": "50, 101"}, "depths must be between 0 and 100"),
        ({"items": RECALL_ITEMS.hi + 1}, f"items must be between 1 and {RECALL_ITEMS.hi:g}"),
        ({"max_new_tokens": RECALL_NEW_TOKENS.hi + 1}, "max new tokens must be between"),
        ({"deep_cache_lam": 99}, "deep_cache: parameter lam=99.0 is out of range"),
        (
            {"items": 8, "lengths": "256", "depths": "0, 50, 100"},
            r"FEEDBACK_BUDGET_SCORED_TOKENS\). It fits with items 1",
        ),
    ],
)
def test_refusals_name_the_field_before_anything_waits(section, changes, message):
    with pytest.raises(gr.Error, match=message):
        run(section, "recall-refused", **changes)


def test_the_verdict_says_what_the_numbers_mean():
    res = {
        "rows": {"baseline": {"right": 3, "instances": 4}, "fb": {"right": 4, "instances": 4}},
        "tests": {
            "fb": {
                "mcnemar": {"baseline_only_right": 0, "strategy_only_right": 1, "p": 1.0},
                "gold_logprob": {"mean_diff": 0.4, "ci95": [0.1, 0.7], "method": "items resampled"},
            }
        },
    }
    text = verdict(res, "fb")
    assert "recalled 4 of 4 facts, the baseline 3" in text and "(no clear difference)" in text
    assert (
        "+0.400 nats per prompt, 95% CI [+0.100, +0.700] — higher with feedback (the CI excludes 0)" in text
    )
