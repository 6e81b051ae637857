"""Stacks (`a+b`): names and parameters, the same exactness checks as single strategies (every member
at strength 0 is the baseline; a member switched off leaves the other exactly as it is alone; a stack
of non-recurrent members scores in one parallel pass exactly as token by token), state kept per
member, hooks gone afterwards, and the tuner's joint search space."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from feedback.core.engine import run_to_end
from feedback.core.records import RowSpec, RunConfig
from feedback.errors import FeedbackError
from feedback.eval.perplexity import PPLConfig, token_nlls
from feedback.eval.sweep import is_noop, parse_grid
from feedback.eval.tune import parse_fixed, search_space
from feedback.strategies import REGISTRY, build_strategy, get_strategy
from feedback.strategies.stack import join_params, split_params

TEXT = "Rivers carry water from mountains to the sea, and the sea returns it as rain over the mountains."
STRONG = {
    "inner_loop": {"loops": 2, "beta": 0.8},
    "deep_cache": {"lam": 0.5, "gate": -1.0},
    "residual": {"alpha": 0.5},
    "anchor": {"alpha": 0.5, "prompt_tokens": 4},
}


def stacked(*members: str, off: str | None = None) -> tuple[str, dict]:
    """The stack of `members` at their strong settings, `off` switched off."""
    params = {m: dict(STRONG[m]) for m in members}
    if off:
        params[off][REGISTRY[off].strength_param] = 0.0
    return "+".join(members), join_params(params)


def greedy_logits(lm, rows: list[RowSpec], tokens: int = 10) -> list[torch.Tensor]:
    seen = []
    cfg = RunConfig(
        prompt="one two three four five six seven", model="tiny", max_new_tokens=tokens, rows=rows
    )
    run_to_end(lm, cfg, observer=lambda s, live, lg: seen.append(lg.clone()))
    return seen


def test_names_parameters_and_presets():
    cls = get_strategy("inner_loop+deep_cache")
    assert cls is get_strategy("inner_loop+deep_cache") and cls.member_names() == ("inner_loop", "deep_cache")
    names = [p.name for p in cls.params]
    assert (
        names[0] == "inner_loop.start_layer" and "deep_cache.lam" in names and len(names) == len(set(names))
    )
    end = next(p for p in cls.params if p.name == "inner_loop.end_layer")
    assert end.at_least == "inner_loop.start_layer"  # the tuner's ordering constraint keeps its member's name
    assert not cls.recurrent and cls.edits_prompt  # inner_loop changes the prompt's own states
    assert get_strategy("residual+deep_cache").recurrent
    # presets both members have, each member at its own
    assert [p.name for p in cls.presets] == ["visible effect", "tuned for perplexity"]
    tuned = cls.preset_values("tuned for perplexity", 30)
    assert tuned == join_params(
        {
            "inner_loop": REGISTRY["inner_loop"].preset_values("tuned for perplexity", 30),
            "deep_cache": REGISTRY["deep_cache"].preset_values("tuned for perplexity", 30),
        }
    )
    schema = cls.schema(30)
    assert (
        schema["members"] == ["inner_loop", "deep_cache"]
        and schema["params"][0]["name"] == "inner_loop.start_layer"
    )
    assert split_params({"a.x": 1, "b.y": 2}, ("a", "b")) == {"a": {"x": 1}, "b": {"y": 2}}


@pytest.mark.parametrize(
    "name, message",
    [
        ("inner_loop+inner_loop", "each strategy once"),
        ("restate+deep_cache", "restate is prompt-level"),
        ("inner_loop+", "one of its names is empty"),
        ("inner_loop+nope", "unknown strategy 'nope'"),
    ],
)
def test_bad_stacks_are_refused(name, message):
    with pytest.raises(FeedbackError, match=message):
        get_strategy(name)


def test_parameters_name_their_member():
    with pytest.raises(FeedbackError, match="named <strategy>.<parameter>.*got 'lam'"):
        build_strategy("inner_loop+deep_cache", {"lam": 0.1}, 30)
    with pytest.raises(FeedbackError, match=r"member deep_cache: parameter lam=2.0 is out of range"):
        build_strategy("inner_loop+deep_cache", {"deep_cache.lam": 2}, 30)
    s = build_strategy("inner_loop+deep_cache", {"deep_cache.lam": "0.1"}, 30)
    assert s.values["deep_cache.lam"] == 0.1 and s.parts[1].values["lam"] == 0.1
    assert s.parts[0].values == REGISTRY["inner_loop"].validate({}, 30)  # the other member at its defaults


def test_switched_off_only_when_every_member_is():
    cls = get_strategy("inner_loop+deep_cache")
    assert cls.switched_off({"inner_loop.beta": 0, "deep_cache.lam": 0})
    assert not cls.switched_off({"inner_loop.beta": 0})
    assert is_noop("inner_loop+deep_cache", {"inner_loop.beta": 0, "deep_cache.lam": 0, "delta_pct": 1.0})
    with pytest.raises(FeedbackError, match="inner_loop.beta=0 and deep_cache.lam=0 switches inner_loop"):
        parse_fixed({"inner_loop.beta": 0, "deep_cache.lam": 0}, "inner_loop+deep_cache", 30)


def test_tuner_and_sweep_search_the_stack_jointly():
    space = search_space("inner_loop+deep_cache", 30, {"inner_loop.mode": "loop"})
    assert {"inner_loop.beta", "deep_cache.lam", "deep_cache.layer"} <= set(space)
    assert space["deep_cache.lam"].log and space["deep_cache.layer"].high == 29
    grid = parse_grid(["deep_cache.lam=0,0.1", "inner_loop.beta=0.2"], "inner_loop+deep_cache", 30)
    assert grid == {"deep_cache.lam": [0.0, 0.1], "inner_loop.beta": [0.2]}


@pytest.mark.parametrize("members", [("inner_loop", "deep_cache"), ("residual", "anchor")])
def test_every_member_at_strength_zero_is_the_baseline(tiny_lm, hook_count, members):
    name, params = stacked(*members)
    for m in members:
        params[f"{m}.{REGISTRY[m].strength_param}"] = 0.0
    for lg in greedy_logits(tiny_lm, [RowSpec("b"), RowSpec("s", name, params)]):
        assert torch.max(torch.abs(lg[0] - lg[1])).item() <= 1e-5
    assert hook_count(tiny_lm.model) == 0
    ids = tiny_lm.tokenizer(TEXT)["input_ids"]
    for mode in ("exact", "jacobi") if get_strategy(name).recurrent else ("exact", "parallel"):
        base, fb = token_nlls(tiny_lm, ids, PPLConfig(name, params, mode=mode))
        assert np.max(np.abs(base - fb)) <= 1e-4, mode


@pytest.mark.parametrize(
    "members, off",
    [
        (("inner_loop", "deep_cache"), "deep_cache"),
        (("inner_loop", "deep_cache"), "inner_loop"),
        (("residual", "anchor"), "anchor"),
    ],
)
def test_a_member_switched_off_leaves_the_other_as_it_is_alone(tiny_lm, hook_count, members, off):
    """Rows: the other member alone, the stack with `off` at strength 0, a plain row; the first two
    decode identically and the plain row is untouched (each member's state and hooks are its own)."""
    name, params = stacked(*members, off=off)
    (alone,) = [m for m in members if m != off]
    rows = [RowSpec("alone", alone, STRONG[alone]), RowSpec("stack", name, params), RowSpec("plain")]
    seen = greedy_logits(tiny_lm, rows)
    for lg in seen:
        assert torch.max(torch.abs(lg[0] - lg[1])).item() <= 1e-5
    assert any(not torch.equal(lg[0], lg[2]) for lg in seen[1:])  # and the strategy does act
    assert hook_count(tiny_lm.model) == 0


def test_stack_acts_as_both_and_reports_both_costs(tiny_lm):
    name, params = stacked("inner_loop", "deep_cache")
    run = run_to_end(
        tiny_lm,
        RunConfig(
            prompt="one two three four five",
            model="tiny",
            max_new_tokens=8,
            rows=[RowSpec("il", "inner_loop", STRONG["inner_loop"]), RowSpec("stack", name, params)],
        ),
    )
    il, stack = run.rows
    assert stack.strategy == name and stack.params == build_strategy(name, params, tiny_lm.num_layers).values
    assert stack.metrics["extra_layer_passes"] == il.metrics["extra_layer_passes"] > 0


def test_non_recurrent_stack_parallel_equals_exact(embedded_lm):
    """Each member is exact in one parallel pass, so the stack is too."""
    name, params = stacked("inner_loop", "deep_cache")
    ids = embedded_lm.tokenizer(TEXT)["input_ids"]
    _, exact = token_nlls(embedded_lm, ids, PPLConfig(name, params, mode="exact"))
    base, par = token_nlls(embedded_lm, ids, PPLConfig(name, params, mode="parallel"))
    assert np.max(np.abs(exact - par)) <= 1e-3
    _, il = token_nlls(embedded_lm, ids, PPLConfig("inner_loop", STRONG["inner_loop"], mode="parallel"))
    assert np.max(np.abs(par - base)) > 1e-2 and np.max(np.abs(par - il)) > 1e-3  # both members act
    with pytest.raises(FeedbackError, match="recurrent"):
        PPLConfig("residual+deep_cache", {}, mode="parallel").resolved_mode()
