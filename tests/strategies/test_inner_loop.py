"""inner_loop: decoding with its own per-pass KV caches equals one parallel pass over the same text,
the model's cache gets no duplicate entries, K = 0 is the plain model, and the cost is reported."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from feedback.core.engine import hooked_forward, run_to_end, start_run
from feedback.core.records import RowSpec, RunConfig
from feedback.errors import FeedbackError
from feedback.eval.perplexity import PPLConfig, token_nlls
from feedback.strategies import BatchView, Phase, build_strategy, get_strategy

LOOP = {"start_layer": 1, "end_layer": 2, "loops": 2, "beta": 0.8}


@pytest.mark.parametrize("mode", ["loop", "euler"])
def test_generation_with_the_cache_agrees_with_parallel_scoring(tiny_lm, mode):
    """The looped row decodes beside a row with a longer prompt (so its prompt is left-padded);
    each chosen token's log-probability equals what one parallel pass over prompt + answer gives."""
    params = LOOP | {"mode": mode}
    cfg = RunConfig(
        prompt="the river runs to the sea",
        model="tiny",
        max_new_tokens=12,
        chat_template=False,
        rows=[
            RowSpec("long", prompt="a much longer prompt that pads the other rows of the batch"),
            RowSpec("loop", "inner_loop", params),
        ],
    )
    run = start_run(tiny_lm, cfg)
    for _ in run:
        pass
    row, prompt = run.result.rows[1], run.rows[1].prompt_ids
    _, nll = token_nlls(tiny_lm, prompt + row.token_ids, PPLConfig("inner_loop", params, mode="parallel"))
    scored = -nll[len(prompt) - 1 :]
    assert np.max(np.abs(scored - np.array([s.logprob for s in row.steps]))) <= 1e-4


def test_the_model_cache_gets_no_duplicate_entries(tiny_lm):
    strategy = build_strategy("inner_loop", LOOP, tiny_lm.num_layers)
    batch = BatchView(Phase.PREFILL, [0])
    cache = DynamicCache(config=tiny_lm.model.config)
    ids = torch.tensor([tiny_lm.tokenizer("one two three four")["input_ids"]])
    strategy.attach(tiny_lm.model, tiny_lm.layers, 0, batch)
    try:
        with torch.inference_mode():
            hooked_forward(tiny_lm, batch, [strategy], input_ids=ids, cache=cache, use_cache=True)
            batch.phase = Phase.DECODE
            for token in (5, 6, 7):
                hooked_forward(
                    tiny_lm, batch, [strategy], input_ids=torch.tensor([[token]]), cache=cache, use_cache=True
                )
    finally:
        strategy.detach()
    n = ids.shape[1] + 3
    assert cache.get_seq_length() == n  # every layer, the looped ones included, once per token
    assert all(cache.layers[i].keys.shape[-2] == n for i in range(tiny_lm.num_layers))
    assert len(strategy.caches) == LOOP["loops"]  # one of its own per extra pass, as long as the text
    assert all(c.layers[1].keys.shape[-2] == n and c.layers[0].keys is None for c in strategy.caches)


def test_no_loops_is_the_plain_model_and_the_cost_is_reported(tiny_lm):
    seen = []
    rows = [
        RowSpec("b"),
        RowSpec("k0", "inner_loop", LOOP | {"loops": 0}),
        RowSpec("loop", "inner_loop", LOOP),
        RowSpec("euler", "inner_loop", LOOP | {"mode": "euler"}),
    ]
    res = run_to_end(
        tiny_lm,
        RunConfig(prompt="hello world", model="tiny", max_new_tokens=6, rows=rows),
        observer=lambda s, live, lg: seen.append(lg.clone()),
    )
    assert all(torch.equal(lg[0], lg[1]) for lg in seen)
    assert "extra_layer_passes" not in res.rows[1].metrics
    assert res.rows[2].metrics["extra_layer_passes"] == 2 * 2  # K passes over a 2-layer block
    assert res.rows[3].metrics["extra_layer_passes"] == 3 * 2  # K + 1 sub-steps of each of 2 layers


def test_bad_block_refused():
    with pytest.raises(FeedbackError, match="start_layer 20 is after end_layer 10"):
        get_strategy("inner_loop")({"start_layer": 20, "end_layer": 10}, 30)
    with pytest.raises(FeedbackError, match="mode='spin' must be one of"):
        get_strategy("inner_loop")({"mode": "spin"}, 30)


def test_a_model_with_layers_whose_state_it_cannot_keep_is_refused_before_the_run(embedded_lm, hook_count):
    """A layer kind other than full or sliding-window attention (here Llama 4's chunked attention)
    is refused by name when the run is built: no hook, no forward."""
    from transformers import LlamaForCausalLM

    from feedback.core.model import LoadedModel
    from tests.tiny_families import config

    cfg = config("llama", embedded_lm.tokenizer)
    cfg.layer_types = ["full_attention", "chunked_attention"] * 2
    lm = LoadedModel(
        LlamaForCausalLM(cfg).eval(), embedded_lm.tokenizer, "chunked", "float32", torch.device("cpu")
    )
    run_cfg = RunConfig(
        prompt="hi",
        model="chunked",
        max_new_tokens=2,
        rows=[RowSpec("b"), RowSpec("loop", "inner_loop", LOOP)],
    )
    with pytest.raises(
        FeedbackError, match="this model has chunked_attention layers, whose state it cannot keep"
    ):
        start_run(lm, run_cfg)
    assert hook_count(lm.model) == 0
