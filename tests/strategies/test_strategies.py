"""Feedback strategies: the residual update against a hand computation, row isolation, hygiene."""
from __future__ import annotations

import math

import pytest
import torch

from feedback.core.engine import Engine
from feedback.core.records import RowSpec, RunConfig
from feedback.errors import FeedbackError
from feedback.strategies import REGISTRY, BatchView, build_strategy, get_strategy
from feedback.strategies.base import rms
from feedback.strategies.residual import ResidualStrategy


def test_registry_and_unknown_name():
    assert "residual" in REGISTRY
    with pytest.raises(FeedbackError, match="unknown strategy 'nope'; available: anchor, deep_cache, inner_loop, residual, restate, soft_token"):
        get_strategy("nope")


def test_residual_defaults_scale_with_depth():
    s = build_strategy("residual", {}, 30)
    assert s.values == {"alpha": 0.05, "source_layer": 21, "target_layer": 9}
    assert build_strategy("residual", {}, 4).values["source_layer"] == 3


@pytest.mark.parametrize("params, message", [
    ({"alpha": float("nan")}, "alpha must be finite"),
    ({"alpha": "inf"}, "alpha must be finite"),
    ({"alpha": 1.5}, r"alpha=1.5 is out of range \[-1.0, 1.0\]"),
    ({"alpha": "strong"}, "alpha must be float"),
    ({"source_layer": 30}, r"source_layer=30 is out of range \[0, 29\]"),
    ({"target_layer": -1}, "target_layer=-1 is out of range"),
    ({"target_layer": 2.5}, "target_layer must be int"),
    ({"gamma": 1}, "unknown parameter"),
])
def test_residual_validation_messages(params, message):
    with pytest.raises(FeedbackError, match=message):
        build_strategy("residual", params, 30)


def test_values_parse_from_cli_strings():
    s = build_strategy("residual", {"alpha": "0.1", "source_layer": "20", "target_layer": "5"}, 30)
    assert s.values == {"alpha": 0.1, "source_layer": 20, "target_layer": 5}


def test_schema_lists_every_parameter_with_bounds():
    schema = ResidualStrategy.schema(30)
    params = {p["name"]: p for p in schema["params"]}
    assert set(params) == {"alpha", "source_layer", "target_layer"}
    assert params["source_layer"]["maximum"] == 29 and params["source_layer"]["default"] == 21
    assert params["alpha"]["minimum"] == -1.0 and params["alpha"]["type"] == "float"


@pytest.mark.parametrize("layers", [4, 12, 30, 80])
def test_every_preset_is_valid_for_any_depth_and_explained(layers):
    from feedback.strategies import REGISTRY

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
    h2 = layers[tgt].register_forward_pre_hook(lambda m, a, kw: seen_tgt.append(
        (a[0] if a else kw["hidden_states"]).detach().clone()), with_kwargs=True)
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
    Engine(tiny_lm).run(RunConfig(prompt="hello there", model="tiny", max_new_tokens=10, rows=rows),
                        observer=lambda s, live, lg: got.append(lg.clone()))
    assert all(torch.equal(lg[0], lg[2]) for lg in got)
    assert any(not torch.equal(lg[0], lg[1]) for lg in got[1:])


def test_attach_twice_refused_and_detach_idempotent(tiny_lm, hook_count):
    strat = build_strategy("residual", {}, tiny_lm.num_layers)
    batch = BatchView("prefill", [0])
    strat.attach(tiny_lm.model, tiny_lm.layers, 0, batch)
    with pytest.raises(RuntimeError, match="already attached"):
        strat.attach(tiny_lm.model, tiny_lm.layers, 0, batch)
    assert strat.attached and hook_count(tiny_lm.model) == 2
    strat.detach()
    strat.detach()
    assert not strat.attached and hook_count(tiny_lm.model) == 0


def test_rms_helper():
    x = torch.tensor([[3.0, 4.0]])
    assert rms(x, eps=0).item() == pytest.approx(math.sqrt(12.5))
