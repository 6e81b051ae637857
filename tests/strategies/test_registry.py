"""The registry and the checks every hidden-state strategy must pass: the listing and its unknown-name
message, presets valid at any depth, strength 0 is the baseline (generation and perplexity), only
its own row changes, hooks go away after a failure or a stop, and the perplexity modes agree
(parallel = exact when non-recurrent; jacobi -> exact when recurrent)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from feedback.core.engine import run_to_end, start_run
from feedback.core.records import RowSpec, RunConfig
from feedback.errors import FeedbackError
from feedback.eval.perplexity import PPLConfig, token_nlls
from feedback.strategies import REGISTRY, PromptStrategy, get_strategy

# Settings strong enough that each hidden-state strategy visibly changes its row.
STRONG = {
    "residual": {"alpha": 0.5},
    "soft_token": {"beta": 0.5},
    "deep_cache": {"lam": 0.5, "gate": -1.0},
    "anchor": {"alpha": 0.5, "prompt_tokens": 4},
    "inner_loop": {"loops": 2, "beta": 0.8},
}
# Strategies that act on hidden states (restate, prompt-level, changes the prompt instead:
# tests/strategies/test_restate.py)
HIDDEN = sorted(name for name, cls in REGISTRY.items() if not issubclass(cls, PromptStrategy))
TEXT = "Rivers carry water from mountains to the sea, and the sea returns it as rain over the mountains."
# Non-recurrent strategies run in one parallel pass; where one has several modes, each is checked.
VARIANTS = {"inner_loop": ({"mode": "loop"}, {"mode": "euler"})}
NON_RECURRENT = [
    (name, extra) for name in HIDDEN if not REGISTRY[name].recurrent for extra in VARIANTS.get(name, ({},))
]
RECURRENT = [name for name in HIDDEN if REGISTRY[name].recurrent]


def test_registry_and_unknown_name():
    assert "residual" in REGISTRY
    with pytest.raises(
        FeedbackError,
        match=(
            "unknown strategy 'nope'; available: anchor, deep_cache, inner_loop, residual, restate, "
            "soft_token"
        ),
    ):
        get_strategy("nope")


def test_registry_has_every_strategy():
    assert set(REGISTRY) == {"residual", "soft_token", "deep_cache", "anchor", "inner_loop", "restate"}
    assert not get_strategy("deep_cache").recurrent and not get_strategy("anchor").recurrent
    assert not get_strategy("inner_loop").recurrent and issubclass(get_strategy("restate"), PromptStrategy)
    assert get_strategy("residual").recurrent and get_strategy("soft_token").recurrent


@pytest.mark.parametrize("layers", [4, 12, 30, 80])
def test_every_preset_is_valid_for_any_depth_and_explained(layers):
    for name, cls in REGISTRY.items():
        assert cls.presets and cls.formula, name
        names = [p.name for p in cls.presets]
        assert names[0] == "visible effect" and len(set(names)) == len(names)
        for preset in cls.presets:
            values = cls.preset_values(preset.name, layers)  # validated: layer presets scale with depth
            assert set(values) == {p.name for p in cls.params} and len(preset.note) > 30
        schema = cls.schema(layers)
        assert [p["name"] for p in schema["presets"]] == names and schema["formula"] == cls.formula
    assert REGISTRY["residual"].preset_values("tuned for perplexity", 30)["target_layer"] == 3
    with pytest.raises(FeedbackError, match="unknown preset"):
        REGISTRY["residual"].preset_values("turbo", 30)
    anchor = {p["name"]: p for p in REGISTRY["anchor"].schema(layers)["params"]}
    assert anchor["prompt_tokens"]["perplexity_only"] and not anchor["alpha"]["perplexity_only"]


@pytest.mark.parametrize("name", HIDDEN)
def test_strength_zero_reproduces_baseline_in_generation(tiny_lm, name, hook_count):
    zero = {REGISTRY[name].strength_param: 0.0}
    seen = []
    cfg = RunConfig(
        prompt="hello world, this is a test",
        model="tiny",
        max_new_tokens=12,
        rows=[RowSpec("b"), RowSpec("f", name, zero)],
    )
    run_to_end(tiny_lm, cfg, observer=lambda s, live, lg: seen.append(lg.clone()))
    for lg in seen:
        assert torch.max(torch.abs(lg[0] - lg[1])).item() <= 1e-5
    assert hook_count(tiny_lm.model) == 0


@pytest.mark.parametrize("name", HIDDEN)
def test_strategy_touches_only_its_own_row(tiny_lm, name, hook_count):
    seen = []
    cfg = RunConfig(
        prompt="one two three four five six seven",
        model="tiny",
        max_new_tokens=12,
        rows=[RowSpec("a"), RowSpec("f", name, STRONG[name]), RowSpec("c")],
    )
    run_to_end(tiny_lm, cfg, observer=lambda s, live, lg: seen.append(lg.clone()))
    assert all(torch.equal(lg[0], lg[-1]) for lg in seen if lg.shape[0] == 3)
    assert any(not torch.equal(lg[0], lg[1]) for lg in seen[1:] if lg.shape[0] == 3)
    assert hook_count(tiny_lm.model) == 0


@pytest.mark.parametrize("name", HIDDEN)
def test_hooks_removed_after_failure_and_stop(tiny_lm, name, hook_count):
    def boom(step, live, logits):
        if step == 3:
            raise RuntimeError("fail")

    cfg = RunConfig(
        prompt="hi there", model="tiny", max_new_tokens=8, rows=[RowSpec("b"), RowSpec("f", name, {})]
    )
    with pytest.raises(RuntimeError):
        run_to_end(tiny_lm, cfg, observer=boom)
    assert hook_count(tiny_lm.model) == 0
    run = start_run(tiny_lm, cfg)
    for _ in run:
        run.stop()
    assert hook_count(tiny_lm.model) == 0 and run.result.rows[1].stop_reason == "stopped"


@pytest.mark.parametrize("name", HIDDEN)
def test_strength_zero_reproduces_baseline_perplexity(tiny_lm, name):
    ids = tiny_lm.tokenizer(TEXT)["input_ids"]
    zero = {REGISTRY[name].strength_param: 0.0}
    for mode in ("exact", "jacobi") if REGISTRY[name].recurrent else ("exact", "parallel"):
        base, fb = token_nlls(tiny_lm, ids, PPLConfig(name, zero, mode=mode))
        assert np.max(np.abs(base - fb)) <= 1e-4, mode


@pytest.mark.parametrize("name, extra", NON_RECURRENT)
def test_non_recurrent_parallel_equals_exact(embedded_lm, name, extra):
    ids = embedded_lm.tokenizer(TEXT)["input_ids"]
    _, exact = token_nlls(embedded_lm, ids, PPLConfig(name, STRONG[name] | extra, mode="exact"))
    base, par = token_nlls(embedded_lm, ids, PPLConfig(name, STRONG[name] | extra, mode="parallel"))
    assert np.max(np.abs(exact - par)) <= 1e-3
    assert np.max(np.abs(par - base)) > 1e-2  # and it does change something


@pytest.mark.parametrize("name", RECURRENT)
def test_jacobi_converges_to_exact(embedded_lm, name):
    ids = embedded_lm.tokenizer(TEXT)["input_ids"][:24]
    _, exact = token_nlls(embedded_lm, ids, PPLConfig(name, STRONG[name], mode="exact"))
    errors = [
        np.max(
            np.abs(
                token_nlls(embedded_lm, ids, PPLConfig(name, STRONG[name], mode="jacobi", passes=p))[1]
                - exact
            )
        )
        for p in (2, 6, 25)
    ]
    assert errors[0] > errors[1] > errors[2] and errors[2] <= 1e-3
    with pytest.raises(FeedbackError, match="recurrent"):
        PPLConfig(name, {}, mode="parallel").resolved_mode()
