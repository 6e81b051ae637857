"""The strategy base class and the plumbing every strategy shares: parameters parsed from strings,
the Param schema, attach/detach bookkeeping, BatchView, the tensor helpers, and re-running a layer
from its real call (its signature, a row's cut of its arguments, a KV cache like the model's)."""

from __future__ import annotations

import math

import pytest
import torch

from feedback.errors import FeedbackError
from feedback.strategies import BatchView, Phase, build_strategy
from feedback.strategies.base import (
    LayerCall,
    RunningMean,
    _batch_row,
    _call_arguments,
    cache_like,
    causal_mean,
    layer_signature,
    rms,
    unit,
)
from feedback.strategies.residual import ResidualStrategy


def test_values_parse_from_cli_strings():
    s = build_strategy("residual", {"alpha": "0.1", "source_layer": "20", "target_layer": "5"}, 30)
    assert s.values == {"alpha": 0.1, "source_layer": 20, "target_layer": 5}


def test_schema_lists_every_parameter_with_bounds():
    schema = ResidualStrategy.schema(30)
    params = {p["name"]: p for p in schema["params"]}
    assert set(params) == {"alpha", "source_layer", "target_layer"}
    assert params["source_layer"]["maximum"] == 29 and params["source_layer"]["default"] == 21
    assert params["alpha"]["minimum"] == -1.0 and params["alpha"]["type"] == "float"


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


def test_batch_view_finds_a_row_and_its_first_real_token():
    """Prefill: a row is found at its prompt's batch row and its padding is skipped chunk by chunk;
    decode: at its place among the live rows; outside its own forward, nowhere."""
    view = BatchView("prefill", [4, 7], offset=0, pads={0: 0, 1: 3}, groups={4: 0, 7: 1}, active=False)
    assert view.phase is Phase.PREFILL and view.index_of(7) is None  # not this run's forward
    view.active = True
    assert view.index_of(7) == 1 and view.index_of(4) == 0
    assert view.real_start(1) == 3 and view.real_start(0) == 0
    view.offset = 2  # the second chunk starts at padded position 2: one pad left in it
    assert view.real_start(1) == 1
    view.offset = 8
    assert view.real_start(1) == 0
    view.phase = Phase.DECODE
    assert view.index_of(7) == 1 and view.index_of(9) is None and view.real_start(1) == 0


def test_rms_helper():
    x = torch.tensor([[3.0, 4.0]])
    assert rms(x, eps=0).item() == pytest.approx(math.sqrt(12.5))


def test_unit_has_rms_one_and_no_direction_for_zero():
    d = torch.tensor([[3.0, -4.0], [0.0, 0.0]])
    out = unit(d)
    assert rms(out[:1], eps=0).item() == pytest.approx(1.0, rel=1e-5)
    assert torch.equal(out[1], torch.zeros(2))


def test_running_mean_chunk_by_chunk_equals_the_causal_mean():
    torch.manual_seed(0)
    states = torch.randn(7, 5, dtype=torch.float64)
    running = RunningMean()
    assert running.add(states[:0]) is None and running.count == 0  # an empty chunk adds nothing
    for chunk in (states[:3], states[3:4], states[4:]):
        last = running.add(chunk)
    assert running.count == 7
    assert torch.allclose(last, causal_mean(states)[-1]) and torch.allclose(
        causal_mean(states)[2], states[:3].mean(0)
    )


class _NoCacheLayer(torch.nn.Module):
    def forward(self, hidden_states, attention_mask=None):
        return hidden_states


def test_a_layer_taking_no_kv_cache_cannot_be_rerun_and_says_why():
    with pytest.raises(FeedbackError, match="_NoCacheLayer.forward takes no KV-cache argument"):
        layer_signature(_NoCacheLayer())


def test_a_layer_call_names_positional_arguments_and_swaps_the_cache():
    """GPT-2's blocks take their cache and mask positionally: the call keeps them, by name."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    block = GPT2Block(GPT2Config(n_embd=16, n_head=2))
    sig = layer_signature(block)
    assert (sig.states, sig.cache) == ("hidden_states", "cache")
    mask, model_cache, own = torch.zeros(1, 1, 3, 3), object(), object()
    named = _call_arguments(sig, (torch.zeros(1, 3, 16), model_cache, mask), {"use_cache": True})
    assert named.pop("hidden_states").shape == (1, 3, 16)
    call = LayerCall(block, sig, named)
    assert call.cache is model_cache and call.arguments["attention_mask"] is mask
    bound = call.bound(torch.ones(1, 3, 16), own)
    assert bound["cache"] is own and bound["attention_mask"] is mask and bound["use_cache"] is True
    assert call.bound(torch.ones(1, 3, 16), None)["use_cache"] is False


def test_a_row_of_a_batch_x_heads_argument_is_its_block_of_heads():
    alibi = torch.arange(3 * 4).float().reshape(3 * 4, 1, 1)  # BLOOM's ALiBi: [batch x heads, 1, T]
    assert _batch_row(alibi, 1, 3, head_major=True).flatten().tolist() == [4, 5, 6, 7]
    assert _batch_row(torch.zeros(3, 5), 2, 3).shape == (1, 5)
    assert _batch_row(torch.zeros(1, 5), 0, 3).shape == (1, 5)  # broadcast over rows: kept whole


def test_a_cache_like_the_models_keeps_as_many_keys_per_layer():
    from transformers import DynamicCache, MistralConfig
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    model_cache = DynamicCache(config=MistralConfig(num_hidden_layers=2, sliding_window=16))
    own = cache_like(model_cache)
    assert own is not model_cache and all(type(layer) is DynamicSlidingWindowLayer for layer in own.layers)
    assert {layer.sliding_window for layer in own.layers} == {16}
    assert all(type(layer) is DynamicLayer for layer in cache_like(DynamicCache(config=None)).layers)
    assert cache_like(None) is None
