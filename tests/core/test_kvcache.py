"""The preallocated KV cache and grouped attention: the same numbers as transformers' dynamic cache
and eager attention, no head copies, and a run that cannot fit its cache refused before any work."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.models.llama.modeling_llama import eager_attention_forward

from feedback.core import gemv
from feedback.core.engine import start_run
from feedback.core.kvcache import (
    GROUPED,
    PreallocatedLayer,
    _eager_grouped,
    compiled_attention,
    grouped_attention,
    run_cache,
)
from feedback.core.records import RowSpec, RunConfig
from feedback.errors import FeedbackError
from feedback.serve.batch import run_batch


@pytest.mark.parametrize("queries", [1, 7])
def test_grouped_attention_is_eager_attention(queries):
    """With SDPA's boolean mask (True: attended): one query a row takes the eager product (and gives
    its weights), several take the fused kernel; both equal transformers' eager attention."""
    torch.manual_seed(0)
    b, h, kv, t, d = 3, 9, 3, 11, 16
    module = nn.Module()
    module.num_key_value_groups = h // kv
    module.training = False
    q, k, v = torch.randn(b, h, queries, d), torch.randn(b, kv, t, d), torch.randn(b, kv, t, d)
    keep = torch.ones(b, 1, queries, t, dtype=torch.bool)
    keep[0, :, :, :4] = False  # a left-padded row
    keep[:, :, :, t - queries :] &= torch.ones(queries, queries, dtype=torch.bool).tril()
    additive = torch.zeros(b, 1, queries, t).masked_fill(~keep, torch.finfo(torch.float32).min)
    want, want_w = eager_attention_forward(module, q, k, v, additive, scaling=d**-0.5)
    got, got_w = grouped_attention(module, q, k, v, keep, scaling=d**-0.5)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    # neither the fused kernel nor the compiled decode kernel builds the weights (nothing here reads
    # them); the eager product, where there is no compiled kernel, does
    assert got_w is None or (queries == 1 and not gemv.available())
    eager, eager_w = _eager_grouped(module, q, k, v, keep, scaling=d**-0.5)
    if queries == 1:
        assert torch.allclose(eager, want, atol=1e-5) and torch.allclose(eager_w, want_w, atol=1e-6)


needs_kernel = pytest.mark.skipif(not gemv.available(), reason=f"no compiled kernel here: {gemv.why_not()}")


def _module(heads: int, kv: int) -> nn.Module:
    module = nn.Module()
    module.num_key_value_groups, module.training = heads // kv, False
    return module


@needs_kernel
@pytest.mark.parametrize("d", [8, 64, 80])
@pytest.mark.parametrize("t", [1, 13, 300])
def test_the_compiled_decode_attention_is_eager_attention(d, t):
    """Head sizes past and short of its 32-wide blocks, positions past and short of its 8-wide exp,
    a left-padded row, queries and keys read through strides (a transposed projection, a cache view)."""
    torch.manual_seed(d + t)
    b, h, kv = 3, 9, 3
    q = torch.randn(b, 1, h, d).transpose(1, 2)  # as a projection's output is viewed into heads
    k, v = (torch.randn(b, kv, t + 5, d)[:, :, :t] * 3 for _ in range(2))  # a filled part of a buffer
    keep = torch.ones(b, 1, 1, t, dtype=torch.bool)
    keep[1, ..., : t // 2] = False
    additive = torch.zeros(b, 1, 1, t).masked_fill(~keep, torch.finfo(torch.float32).min)
    want, _ = eager_attention_forward(_module(h, kv), q, k, v, additive, scaling=d**-0.5)
    for mask in (keep, None):
        got = compiled_attention(q, k, v, mask, d**-0.5)
        ref = (
            want
            if mask is not None
            else eager_attention_forward(_module(h, kv), q, k, v, None, scaling=d**-0.5)[0]
        )
        assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_rows_compiled_attention_is_the_same_alone_in_a_batch_padded_and_at_any_thread_count():
    torch.manual_seed(3)
    h, kv, d, t = 9, 3, 64, 40
    q, k, v = torch.randn(1, h, 1, d), torch.randn(1, kv, t, d), torch.randn(1, kv, t, d)
    alone = compiled_attention(q, k, v, None, 0.125)
    pad = 7  # the row behind 7 hidden positions, between two other rows of the batch
    kb, vb = (
        torch.cat([torch.randn(3, kv, pad + t, d)[:1], x, torch.randn(1, kv, pad + t, d)])
        for x in (nn.functional.pad(k, (0, 0, pad, 0)), nn.functional.pad(v, (0, 0, pad, 0)))
    )
    qb = torch.cat([torch.randn(1, h, 1, d), q, torch.randn(1, h, 1, d)])
    keep = torch.ones(3, 1, 1, pad + t, dtype=torch.bool)
    keep[1, ..., :pad] = False
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(compiled_attention(qb, kb, vb, keep, 0.125)[1:2], alone)
    finally:
        torch.set_num_threads(before)


def test_the_compiled_attention_leaves_what_it_does_not_serve_to_the_eager_product():
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    assert compiled_attention(q.double(), k.double(), v.double(), None, 1.0) is None
    assert compiled_attention(q, k, v, torch.zeros(1, 1, 1, 5), 1.0) is None  # an additive mask
    assert compiled_attention(torch.randn(1, 4, 2, 8), k, v, None, 1.0) is None  # two queries
    if not gemv.available():
        assert compiled_attention(q, k, v, None, 1.0) is None


def test_no_mask_means_causal_order_alone_on_both_paths():
    """SDPA's mask is None where causal order is the whole mask (no padding, no cached prefix): the
    fused kernel runs causal, and the eager product (taken with dropout while training) builds the
    same mask."""
    torch.manual_seed(1)
    b, h, kv, t, d = 2, 4, 2, 6, 8
    module = nn.Module()
    module.num_key_value_groups = h // kv
    q, k, v = torch.randn(b, h, t, d), torch.randn(b, kv, t, d), torch.randn(b, kv, t, d)
    causal = torch.zeros(1, 1, t, t).masked_fill(
        ~torch.ones(t, t, dtype=torch.bool).tril(), torch.finfo(torch.float32).min
    )
    want, _ = eager_attention_forward(module, q, k, v, causal, scaling=d**-0.5)
    module.training = False
    fused, _ = grouped_attention(module, q, k, v, None, scaling=d**-0.5)
    eager, _ = _eager_grouped(module, q, k, v, None, scaling=d**-0.5)
    assert torch.allclose(fused, want, atol=1e-5) and torch.allclose(eager, want, atol=1e-6)


def test_preallocated_layer_behaves_as_the_dynamic_one():
    torch.manual_seed(0)
    pre, dyn = PreallocatedLayer(capacity=6), DynamicLayer()
    for n in (4, 1, 1, 3):  # the last write grows past the capacity
        k, v = torch.randn(2, 3, n, 8), torch.randn(2, 3, n, 8)
        got, want = pre.update(k, v), dyn.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert pre.get_seq_length() == dyn.get_seq_length() == 9
    buffer = pre._k.data_ptr()
    pre.update(torch.zeros(2, 3, 1, 8), torch.zeros(2, 3, 1, 8))
    assert pre._k.data_ptr() == buffer  # a step writes in place: no copy of the cache
    pre.crop(-1)
    for layer in (pre, dyn):
        layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(pre.keys, dyn.keys) and torch.equal(pre.values, dyn.values)
    pre.batch_repeat_interleave(3)
    assert pre.keys.shape == (3, 3, 9, 8) and torch.equal(pre.keys[2], dyn.keys[0])


def test_the_engine_runs_on_the_preallocated_cache_with_grouped_attention(embedded_lm, tiny_lm):
    assert embedded_lm.model.config._attn_implementation == GROUPED  # llama on CPU
    assert isinstance(run_cache(tiny_lm.model.config, 8), type(run_cache(embedded_lm.model.config, 8)))
    assert isinstance(run_cache(_sliding_config(), 8), DynamicCache)  # other layer kinds keep their own


def _sliding_config():
    from transformers import MistralConfig

    cfg = MistralConfig(num_hidden_layers=2, sliding_window=4)
    cfg.layer_types = ["sliding_attention", "full_attention"]
    return cfg


def test_a_run_whose_cache_cannot_fit_is_refused_before_any_work(tiny_lm, monkeypatch, tmp_path, hook_count):
    monkeypatch.setenv("FEEDBACK_MEMORY_CAP_MB", "0.01")
    cfg = RunConfig(prompt="hello there", model="tiny", max_new_tokens=64, rows=[RowSpec("a"), RowSpec("b")])
    with pytest.raises(
        FeedbackError,
        match=r"key/value cache \(\d+ prompt \+ 64 new tokens, 2 rows\); the memory cap "
        r"is 0 MB \(FEEDBACK_MEMORY_CAP_MB",
    ):
        start_run(tiny_lm, cfg)
    assert hook_count(tiny_lm.model) == 0
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    tasks.write_text(json.dumps({"id": "big", "prompt": "hello there", "max_new_tokens": 64}) + "\n")
    run_batch(tiny_lm, tasks, out, retries=0)
    record = json.loads(out.read_text().splitlines()[0])
    assert record["status"] == "error" and "memory cap" in record["error"]
    monkeypatch.setenv("FEEDBACK_MEMORY_CAP_MB", "lots")
    with pytest.raises(FeedbackError, match="must be a number of MB"):
        start_run(tiny_lm, cfg)
