"""deep_cache: a repeated continuation becomes more likely, the mixture against a hand computation
(gate and max_p included), and validation messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from feedback.errors import FeedbackError
from feedback.eval.perplexity import PPLConfig, token_nlls
from feedback.strategies import get_strategy
from feedback.strategies.deep_cache import mix_logits


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


@pytest.mark.parametrize(
    "params, message",
    [
        ({"lam": 1.5}, "lam=1.5 is out of range"),
        ({"window": 0}, "window=0 is out of range"),
        ({"gate": float("nan")}, "gate must be finite"),
    ],
)
def test_deep_cache_validation_messages(params, message):
    with pytest.raises(FeedbackError, match=message):
        get_strategy("deep_cache")(params, 30)
