"""residual: defaults that scale with depth, validation messages, the update against a hand
computation, and row isolation."""

from __future__ import annotations

import pytest
import torch

from feedback.core.engine import run_to_end
from feedback.core.records import RowSpec, RunConfig
from feedback.errors import FeedbackError
from feedback.strategies import BatchView, build_strategy
from feedback.strategies.residual import ResidualStrategy


def test_residual_defaults_scale_with_depth():
    s = build_strategy("residual", {}, 30)
    assert s.values == {"alpha": 0.05, "source_layer": 21, "target_layer": 9}
    assert build_strategy("residual", {}, 4).values["source_layer"] == 3


@pytest.mark.parametrize(
    "params, message",
    [
        ({"alpha": float("nan")}, "alpha must be finite"),
        ({"alpha": "inf"}, "alpha must be finite"),
        ({"alpha": 1.5}, r"alpha=1.5 is out of range \[-1.0, 1.0\]"),
        ({"alpha": "strong"}, "alpha must be float"),
        ({"source_layer": 30}, r"source_layer=30 is out of range \[0, 29\]"),
        ({"target_layer": -1}, "target_layer=-1 is out of range"),
        ({"target_layer": 2.5}, "target_layer must be int"),
        ({"gamma": 1}, "unknown parameter"),
    ],
)
def test_residual_validation_messages(params, message):
    with pytest.raises(FeedbackError, match=message):
        build_strategy("residual", params, 30)


def test_residual_update_matches_hand_computation(tiny_lm, hook_count):
    """Prefill seeds mu and u from the prompt (position 0 skipped); the first decode step adds
    alpha * rms(x) * u to the target layer's input of the strategy's row, and nothing to others."""
    model, layers = tiny_lm.model, tiny_lm.layers
    alpha, src, tgt = 0.3, 2, 1
    strat = ResidualStrategy({"alpha": alpha, "source_layer": src, "target_layer": tgt}, len(layers))
    batch = BatchView("prefill", [0, 1], active=True)  # we drive the forwards ourselves
    seen_src: list[torch.Tensor] = []
    seen_tgt: list[torch.Tensor] = []
    strat.attach(model, layers, 1, batch)
    # Registered after the strategy's, so they see the tensors the strategy produced.
    h1 = layers[src].register_forward_hook(lambda m, a, out: seen_src.append(out.detach().clone()))
    h2 = layers[tgt].register_forward_pre_hook(
        lambda m, a, kw: seen_tgt.append((a[0] if a else kw["hidden_states"]).detach().clone()),
        with_kwargs=True,
    )
    try:
        from transformers import DynamicCache

        ids = torch.tensor([tiny_lm.encode("The quick brown fox jumps over the lazy dog")])
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, cache=cache)
            strat.end_forward()
            cache.batch_repeat_interleave(2)
            batch.phase = "decode"
            model(input_ids=torch.tensor([[42], [42]]), cache=cache)
            strat.end_forward()
    finally:
        h1.remove(), h2.remove(), strat.detach()
    assert hook_count(model) == 0
    prompt_states = seen_src[0][0, 1:].double()
    mu = prompt_states.mean(0)
    d = prompt_states[-1] - mu
    u = d / torch.sqrt(d.pow(2).mean() + 1e-6)
    x = seen_tgt[1]  # decode-step inputs of the target layer, rows [baseline, feedback]
    delta = (x[1, -1] - x[0, -1]).double()
    base = x[0, -1].double()
    expected = alpha * torch.sqrt(base.pow(2).mean() + 1e-6) * u
    assert torch.allclose(delta, expected, atol=1e-5)
    # the running mean now also holds the decode step's source state of the feedback row
    h_new = seen_src[1][1, -1].double()
    n = prompt_states.shape[0] + 1
    assert torch.allclose(strat.mean.double(), (prompt_states.sum(0) + h_new) / n, atol=1e-5)


def test_only_own_row_is_touched(tiny_lm):
    """Rows without the strategy produce bit-identical logits to each other and to a run alone."""
    rows = [RowSpec("a"), RowSpec("fb", "residual", {"alpha": 0.8}), RowSpec("c")]
    got: list[torch.Tensor] = []
    run_to_end(
        tiny_lm,
        RunConfig(prompt="hello there", model="tiny", max_new_tokens=10, rows=rows),
        observer=lambda s, live, lg: got.append(lg.clone()),
    )
    assert all(torch.equal(lg[0], lg[2]) for lg in got)
    assert any(not torch.equal(lg[0], lg[1]) for lg in got[1:])
