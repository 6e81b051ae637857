"""Every registered strategy: strength 0 is the baseline, only its own row changes, hooks go away,
and perplexity modes agree (parallel = exact when non-recurrent; jacobi -> exact when recurrent)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from feedback.core.engine import Engine
from feedback.core.records import RowSpec, RunConfig
from feedback.errors import FeedbackError
from feedback.eval.perplexity import PPLConfig, token_nlls
from feedback.strategies import REGISTRY, get_strategy
from feedback.strategies.deep_cache import mix_logits

STRONG = {"residual": {"alpha": 0.5}, "soft_token": {"beta": 0.5}, "deep_cache": {"lam": 0.5, "gate": -1.0},
          "anchor": {"alpha": 0.5, "prompt_tokens": 4}, "inner_loop": {"loops": 2, "beta": 0.8}}
# Strategies that act on hidden states (restate, prompt-level, changes the prompt instead: tests/strategies/test_restate.py)
HIDDEN = sorted(name for name, cls in REGISTRY.items() if not cls.prompt_level)
TEXT = "Rivers carry water from mountains to the sea, and the sea returns it as rain over the mountains."


def test_registry_has_all_six():
    assert set(REGISTRY) == {"residual", "soft_token", "deep_cache", "anchor", "inner_loop", "restate"}
    assert not get_strategy("deep_cache").recurrent and not get_strategy("anchor").recurrent
    assert not get_strategy("inner_loop").recurrent and get_strategy("restate").prompt_level
    assert get_strategy("residual").recurrent and get_strategy("soft_token").recurrent


@pytest.mark.parametrize("name", HIDDEN)
def test_strength_zero_reproduces_baseline_in_generation(tiny_lm, name, hook_count):
    zero = {REGISTRY[name].strength_param: 0.0}
    seen = []
    cfg = RunConfig(prompt="hello world, this is a test", model="tiny", max_new_tokens=12,
                    rows=[RowSpec("b"), RowSpec("f", name, zero)])
    Engine(tiny_lm).run(cfg, observer=lambda s, live, lg: seen.append(lg.clone()))
    for lg in seen:
        assert torch.max(torch.abs(lg[0] - lg[1])).item() <= 1e-5
    assert hook_count(tiny_lm.model) == 0


@pytest.mark.parametrize("name", HIDDEN)
def test_strategy_touches_only_its_own_row(tiny_lm, name, hook_count):
    seen = []
    cfg = RunConfig(prompt="one two three four five six seven", model="tiny", max_new_tokens=12,
                    rows=[RowSpec("a"), RowSpec("f", name, STRONG[name]), RowSpec("c")])
    Engine(tiny_lm).run(cfg, observer=lambda s, live, lg: seen.append(lg.clone()))
    assert all(torch.equal(lg[0], lg[-1]) for lg in seen if lg.shape[0] == 3)
    assert any(not torch.equal(lg[0], lg[1]) for lg in seen[1:] if lg.shape[0] == 3)
    assert hook_count(tiny_lm.model) == 0


@pytest.mark.parametrize("name", HIDDEN)
def test_hooks_removed_after_failure_and_stop(tiny_lm, name, hook_count):
    def boom(step, live, logits):
        if step == 3:
            raise RuntimeError("fail")

    cfg = RunConfig(prompt="hi there", model="tiny", max_new_tokens=8, rows=[RowSpec("b"), RowSpec("f", name, {})])
    with pytest.raises(RuntimeError):
        Engine(tiny_lm).run(cfg, observer=boom)
    assert hook_count(tiny_lm.model) == 0
    run = Engine(tiny_lm).start(cfg)
    for event in run:
        run.stop()
    assert hook_count(tiny_lm.model) == 0 and run.result.rows[1].stop_reason == "stopped"


@pytest.mark.parametrize("name", HIDDEN)
def test_strength_zero_reproduces_baseline_perplexity(tiny_lm, name):
    ids = tiny_lm.tokenizer(TEXT)["input_ids"]
    zero = {REGISTRY[name].strength_param: 0.0}
    for mode in ("exact", "jacobi") if REGISTRY[name].recurrent else ("exact", "parallel"):
        base, fb = token_nlls(tiny_lm, ids, PPLConfig(name, zero, mode=mode))
        assert np.max(np.abs(base - fb)) <= 1e-4, mode


@pytest.mark.parametrize("name, extra", [("deep_cache", {}), ("anchor", {}), ("inner_loop", {"mode": "loop"}),
                                         ("inner_loop", {"mode": "euler"})])
def test_non_recurrent_parallel_equals_exact(embedded_lm, name, extra):
    ids = embedded_lm.tokenizer(TEXT)["input_ids"]
    _, exact = token_nlls(embedded_lm, ids, PPLConfig(name, STRONG[name] | extra, mode="exact"))
    base, par = token_nlls(embedded_lm, ids, PPLConfig(name, STRONG[name] | extra, mode="parallel"))
    assert np.max(np.abs(exact - par)) <= 1e-3
    assert np.max(np.abs(par - base)) > 1e-2  # and it does change something


@pytest.mark.parametrize("name", ["residual", "soft_token"])
def test_jacobi_converges_to_exact(embedded_lm, name):
    ids = embedded_lm.tokenizer(TEXT)["input_ids"][:24]
    _, exact = token_nlls(embedded_lm, ids, PPLConfig(name, STRONG[name], mode="exact"))
    errors = [np.max(np.abs(token_nlls(embedded_lm, ids, PPLConfig(name, STRONG[name], mode="jacobi",
                                                                     passes=p))[1] - exact)) for p in (2, 6, 25)]
    assert errors[0] > errors[1] > errors[2] and errors[2] <= 1e-3
    with pytest.raises(FeedbackError, match="recurrent"):
        PPLConfig(name, {}, mode="parallel").resolved_mode()


def test_deep_cache_raises_probability_of_a_repeated_continuation(tiny_lm):
    """A random tiny model cannot copy; the cache can: the second copy of a random token sequence
    must become more likely, and the first copy (nothing to copy from) unchanged."""
    g = torch.Generator().manual_seed(0)
    chunk = torch.randint(100, 40000, (20,), generator=g).tolist()
    ids = [tiny_lm.tokenizer.bos_token_id or 1] + chunk + chunk
    cfg = PPLConfig("deep_cache", {"lam": 0.5, "theta": 50.0, "gate": -1.0}, mode="parallel")
    base, fb = token_nlls(tiny_lm, ids, cfg)
    second = slice(len(chunk) + 1, None)  # targets of the repeat (after its first token)
    assert fb[second].mean() < base[second].mean() - 0.5
    assert np.all(fb[second] < base[second])


def test_mix_logits_hand_computed_case():
    """One query, two keys: weights softmax(theta*cos) land on the keys' next tokens."""
    logits = torch.zeros(1, 4)  # uniform LM over 4 tokens
    q = torch.tensor([[1.0, 0.0]])
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    nxt = torch.tensor([2, 3])
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = mix_logits(logits, q, keys, nxt, mask, lam=0.5, theta=1.0, gate=-1.0).exp()[0]
    w = torch.softmax(torch.tensor([1.0, 0.0]), dim=0)
    expected = 0.5 * torch.full((4,), 0.25) + 0.5 * torch.tensor([0.0, 0.0, w[0], w[1]])
    assert torch.allclose(out, expected, atol=1e-6)
    gated = mix_logits(logits, q, keys, nxt, mask, lam=0.5, theta=1.0, gate=0.99).exp()[0]  # best cos = 1
    assert torch.allclose(gated, expected, atol=1e-6)
    closed = mix_logits(logits, torch.tensor([[0.6, 0.8]]), keys, nxt, mask, 0.5, 1.0, gate=0.9).exp()[0]
    assert torch.allclose(closed, torch.full((4,), 0.25), atol=1e-6)  # best cos 0.8 < gate: LM only
    sure = torch.tensor([[5.0, 0.0, 0.0, 0.0]])  # the LM is confident (top p ~0.98)
    kept = mix_logits(sure, q, keys, nxt, mask, 0.5, 1.0, gate=-1.0, max_p=0.5).exp()[0]
    assert torch.allclose(kept, torch.softmax(sure, dim=-1)[0], atol=1e-6)
    unsure = mix_logits(logits, q, keys, nxt, mask, 0.5, 1.0, gate=-1.0, max_p=0.5).exp()[0]
    assert torch.allclose(unsure, expected, atol=1e-6)  # top p 0.25 <= 0.5: mixed


@pytest.mark.parametrize("name, params, message", [
    ("deep_cache", {"lam": 1.5}, "lam=1.5 is out of range"),
    ("deep_cache", {"window": 0}, "window=0 is out of range"),
    ("deep_cache", {"gate": float("nan")}, "gate must be finite"),
    ("soft_token", {"top_k": 0}, "top_k=0 is out of range"),
    ("soft_token", {"tau": 0}, "tau=0.0 is out of range"),
    ("anchor", {"source_layer": 99}, "source_layer=99 is out of range"),
])
def test_new_strategies_validate(name, params, message):
    with pytest.raises(FeedbackError, match=message):
        get_strategy(name)(params, 30)
