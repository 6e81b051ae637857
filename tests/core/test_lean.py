"""The lean Llama layer computes exactly what transformers' layer computes, in fewer ops."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import DynamicCache, LlamaForCausalLM, Qwen2ForCausalLM

from feedback.core import gemv, kvcache, lean, linear
from tests.tiny_families import FAMILIES

VOCAB = 300  # small: the head is not what is tested


# the fp32 kernels a loaded model's layers can take here; the lean layer is exact on each
KERNELS = [k for k in ("gemv", "onednn") if linear.available() and (k != "gemv" or gemv.available())]


def _pair(bias: bool, kernel: str = "onednn", **sizes) -> tuple[nn.Module, nn.Module]:
    """Two copies of one random Llama, the second with lean layers (`kernel` on both, as loaded)."""
    torch.manual_seed(0)
    config = FAMILIES["llama"](vocab_size=VOCAB, attention_bias=bias, mlp_bias=bias)
    for name, value in sizes.items():
        setattr(config, name, value)
    plain = LlamaForCausalLM(config).eval()
    torch.manual_seed(0)
    fused = LlamaForCausalLM(config).eval()
    assert lean.lean_layers(fused.model.layers) == 4
    assert lean.lean_stack(fused)
    for model in (plain, fused):
        if linear.wanted(torch.device("cpu")):
            linear.use_kernels(model, kernel)
    return plain, fused


def _logits(
    model: nn.Module, ids: torch.Tensor, steps: int, engine_cache: bool = False
) -> list[torch.Tensor]:
    """A padded batch's prefill and `steps` greedy decode steps on a cache (transformers' own, or
    the engine's: preallocated, with grouped attention): every forward's logits."""
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second row left-padded, as the engine batches rows of unlike length
    out = []
    if engine_cache:
        model.config._attn_implementation = kvcache.GROUPED
    with torch.inference_mode():
        if engine_cache:
            cache = kvcache.PreallocatedCache(model.config.num_hidden_layers, ids.shape[1] + steps)
        else:
            cache = DynamicCache(config=model.config)
        result = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        out.append(result.logits)
        for _ in range(steps):
            tok = result.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
            result = model(input_ids=tok, attention_mask=mask, cache=cache, use_cache=True)
            out.append(result.logits)
    return out


@pytest.mark.parametrize("engine_cache", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias", [False, True])
def test_lean_layers_give_bit_identical_logits_in_prefill_and_decode(bias, kernel, engine_cache):
    """On the engine's cache a lean decode step rotates and stores its token in one compiled call
    (`kvcache.rope_append`) where the kernel is built; transformers' layer does it op by op."""
    plain, fused = _pair(bias, kernel)
    ids = torch.randint(0, VOCAB, (2, 12))
    got = _logits(fused, ids, 6, engine_cache)
    for a, b in zip(_logits(plain, ids, 6, engine_cache), got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not gemv.available(), reason=f"no compiled kernel here: {gemv.why_not()}")
@pytest.mark.parametrize("rows_of_cos", [1, 3])
def test_rope_append_is_the_rotation_and_the_cache_update_bit_for_bit(rows_of_cos):
    torch.manual_seed(rows_of_cos)
    b, h, kv, d, filled = 3, 9, 3, 64, 5
    qkv = torch.randn(b, 1, (h + 2 * kv) * d) * 4
    cos, sin = torch.randn(rows_of_cos, 1, d), torch.randn(rows_of_cos, 1, d)
    caches = [kvcache.PreallocatedCache(2, 8) for _ in range(2)]
    for cache in caches:  # a prefill's keys and values first, as the engine's caches hold
        cache.update(torch.ones(b, kv, filled, d), torch.ones(b, kv, filled, d), 1)
    q = kvcache.rope_append(caches[0], 1, qkv, cos, sin, (h, kv, d))
    want_q, want_k, want_v = (
        t.view(b, 1, -1, d).transpose(1, 2) for t in qkv.split([h * d, kv * d, kv * d], -1)
    )
    want_q, want_k = (lean._rotate(t, cos.unsqueeze(1), sin.unsqueeze(1)) for t in (want_q, want_k))
    keys, values = caches[1].update(want_k, want_v, 1)
    assert torch.equal(q, want_q)
    assert torch.equal(caches[0].layers[1].keys, keys) and torch.equal(caches[0].layers[1].values, values)
    assert caches[0].get_seq_length(1) == filled + 1
    # what it does not serve is left alone: two tokens a row, or another cache
    assert kvcache.rope_append(caches[0], 1, qkv.repeat(1, 2, 1), cos, sin, (h, kv, d)) is None
    assert kvcache.rope_append(DynamicCache(), 1, qkv, cos, sin, (h, kv, d)) is None
    assert caches[0].get_seq_length(1) == filled + 1


def test_the_parts_stay_as_views_of_the_fused_weights_or_go():
    _, fused = _pair(bias=True)
    layer = fused.model.layers[0]
    assert isinstance(layer, lean.LeanLlamaLayer) and layer.qkv_sizes == (64, 32, 32)
    q, k = layer.self_attn.q_proj, layer.self_attn.k_proj
    # no second copy: the q and k weights are the fused tensor's first rows
    assert q.weight.data_ptr() == layer.qkv.weight.data_ptr()
    assert k.weight.data_ptr() == layer.qkv.weight[64:].data_ptr()
    assert torch.equal(layer.qkv.bias[64:96], k.bias)
    torch.manual_seed(0)
    dropped = LlamaForCausalLM(FAMILIES["llama"](vocab_size=VOCAB)).eval()
    lean.lean_layers(dropped.model.layers, keep_parts=False)
    attn, mlp = dropped.model.layers[0].self_attn, dropped.model.layers[0].mlp
    assert attn.q_proj is None and mlp.up_proj is None and attn.o_proj is not None
    assert dropped.model.layers[0].gate_up.weight.shape == (256, 64)


def test_hooks_on_a_lean_layer_see_and_change_its_output_as_before():
    """Strategies hook the decoder layer module: a forward hook that doubles layer 1's output changes
    the logits the same way on both."""
    plain, fused = _pair(bias=False)
    ids = torch.randint(0, VOCAB, (2, 8))
    for model in (plain, fused):
        model.model.layers[1].register_forward_hook(lambda mod, args, out: out * 2)
    assert torch.equal(_logits(plain, ids, 2)[-1], _logits(fused, ids, 2)[-1])


def test_other_families_and_training_layers_are_left_alone():
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(FAMILIES["qwen2"](vocab_size=VOCAB)).eval()
    assert lean.lean_layers(qwen.model.layers) == 0
    assert not lean.lean_stack(qwen) and type(qwen.model) is not lean.LeanLlamaModel
    llama = LlamaForCausalLM(FAMILIES["llama"](vocab_size=VOCAB))  # training mode: dropout is live there
    assert lean.lean_layers(llama.model.layers) == 0


def test_load_model_uses_lean_layers_unless_turned_off(monkeypatch, tiny_lm, tmp_path):
    from feedback.core.model import load_model

    tiny_lm.model.config.save_pretrained(tmp_path)
    tiny_lm.tokenizer.save_pretrained(tmp_path)
    assert type(load_model(f"random:{tmp_path}").layers[0]) is lean.LeanLlamaLayer
    monkeypatch.setenv(lean.LEAN_ENV, "0")
    assert type(load_model(f"random:{tmp_path}").layers[0]).__name__ == "LlamaDecoderLayer"


def test_the_real_model_decodes_bit_identically_with_and_without_lean_layers(monkeypatch):
    """Through the engine, a baseline row and a row whose strategy re-runs layers (inner_loop). Both
    on the same products (the measured choice may differ between the two models' shapes, and it is
    the layers that are compared)."""
    from feedback.core.engine import run_to_end
    from feedback.core.model import load_model
    from feedback.core.records import RowSpec, RunConfig

    kernel = "gemv" if gemv.available() else "onednn"
    lean_lm = load_model("embedded", dtype="float32", linear_kernel=kernel)
    monkeypatch.setenv(lean.LEAN_ENV, "0")
    plain = load_model("embedded", dtype="float32", linear_kernel=kernel)
    assert type(lean_lm.layers[0]) is lean.LeanLlamaLayer and type(plain.layers[0]) is not lean.LeanLlamaLayer
    config = RunConfig(
        prompt="Name three rivers.", max_new_tokens=12, rows=[RowSpec("b"), RowSpec("f", "inner_loop")]
    )
    seen: dict[int, list] = {0: [], 1: []}
    for i, lm in enumerate((lean_lm, plain)):
        run_to_end(lm, config, observer=lambda step, live, logits, i=i: seen[i].append(logits.clone()))
    assert len(seen[0]) == len(seen[1]) > 1
    assert all(torch.equal(a, b) for a, b in zip(seen[0], seen[1], strict=True))


@pytest.mark.parametrize("hidden", [64, 576, 2048])
def test_the_inline_norm_is_transformers_norm_bit_for_bit(hidden):
    """The compiled norm (a decode step's rows) and torch's own RMS norm (a prefill's) stand in for
    the norm's operations in fp32: the same bits for one row, two, 200, values small and large."""
    if gemv.available():  # the compiled norm gave PyTorch's bits here, so decode steps take it
        assert lean._norm_lanes(hidden, 1e-5) in (8, 16)
    torch.manual_seed(hidden)
    norm = llama_norm(hidden)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
    for shape in ((1, 1, hidden), (2, 1, hidden), (1, 200, hidden)):
        for scale in (1e-3, 1.0, 1e3):
            x = torch.randn(shape) * scale
            assert torch.equal(lean._norm(norm, x), norm(x))


def llama_norm(hidden: int) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(hidden, eps=1e-5)


@pytest.mark.parametrize("part", ["self_attn.o_proj", "mlp.down_proj", "post_attention_layernorm"])
def test_a_hook_on_a_part_of_a_layer_still_sees_every_decode_step(part):
    """The compiled decode step would skip the part's module call, so a hook there keeps that half
    of the layer op by op: the hook sees the prefill and each step, and the logits stay exact."""
    plain, fused = _pair(bias=False, kernel=KERNELS[0]) if KERNELS else _pair(bias=False)
    seen: list[tuple[int, ...]] = []
    for model in (plain, fused):
        model.model.layers[2].get_submodule(part).register_forward_hook(
            lambda mod, args, out: seen.append(tuple(out.shape))
        )
    ids = torch.randint(0, VOCAB, (2, 8))
    got = _logits(fused, ids, 3, engine_cache=True)
    assert seen == [(2, 8, 64), (2, 1, 64), (2, 1, 64), (2, 1, 64)]
    assert all(torch.equal(a, b) for a, b in zip(_logits(plain, ids, 3, engine_cache=True), got, strict=True))


def _calls(monkeypatch) -> list[int]:
    """The layers each compiled decode call runs, as they happen."""
    calls: list[int] = []
    run = lean._run

    def counted(step, entries, *args, **kwargs):
        calls.append(kwargs.get("count") or len(entries))
        return run(step, entries, *args, **kwargs)

    monkeypatch.setattr(lean, "_run", counted)
    return calls


@pytest.mark.skipif(not gemv.available(), reason=f"no compiled kernel here: {gemv.why_not()}")
def test_a_decode_step_runs_its_layers_in_one_call_around_a_hooked_layer(monkeypatch):
    """Nothing watching: one call a step for the 4 layers and the final norm. A hook on layer 1 (a
    strategy's): layer 0 in a call, layer 1 called as a module (its own call inside, its hook after
    it), layers 2 and 3 in a call; the hook changes the logits as on transformers' model."""
    plain, fused = _pair(bias=True, kernel="gemv")
    assert type(fused.model) is lean.LeanLlamaModel
    calls = _calls(monkeypatch)
    ids = torch.randint(0, VOCAB, (2, 10))
    want = _logits(plain, ids, 3, engine_cache=True)
    assert calls == []  # transformers' own model takes none
    got = _logits(fused, ids, 3, engine_cache=True)
    assert calls == [4, 4, 4] and all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    calls.clear()
    for model in (plain, fused):
        model.model.layers[1].register_forward_hook(lambda mod, args, out: out * 2)
    want = _logits(plain, ids, 3, engine_cache=True)
    got = _logits(fused, ids, 3, engine_cache=True)
    assert calls == [1, 1, 2] * 3 and all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


@pytest.mark.skipif(not gemv.available(), reason=f"no compiled kernel here: {gemv.why_not()}")
@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantised_decode_step_runs_in_compiled_calls_with_the_op_by_op_bits(monkeypatch, bits):
    """The quantised modes' decode steps take the compiled calls too, quant.c's products inside,
    and give the bits of the same layers run op by op on the same kernels."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(FAMILIES["llama"](vocab_size=VOCAB)).eval()
    lean.lean_layers(model.model.layers, keep_parts=False)
    assert lean.lean_stack(model)
    linear.quantize(model, bits)
    # a decoder this small takes the compiled products untimed, up to the most rows
    assert linear.use_step_kernels(list(model.model.layers.modules()), step_seconds=None)
    assert all(linear.compiled_rows(m) == linear.GEMV_MAX_ROWS for m in (model.model.layers[0].qkv,))
    calls = _calls(monkeypatch)
    ids = torch.randint(0, VOCAB, (2, 8))
    got = _logits(model, ids, 3, engine_cache=True)
    assert calls == [4, 4, 4]
    monkeypatch.setattr(lean.LeanLlamaModel, "_decode_stack", lambda *args: None)
    monkeypatch.setattr(lean.LeanLlamaLayer, "_decode", lambda *args: (None, False))
    want = _logits(model, ids, 3, engine_cache=True)
    assert calls == [4, 4, 4] and all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("engine_cache", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
def test_an_intermediate_size_off_the_vector_width_stays_exact_for_several_rows(kernel, engine_cache):
    """PyTorch's SiLU takes a tensor's values past the last multiple of its vector block (32 with
    AVX-512) in a scalar loop that rounds some values differently, counting positions in the
    whole [rows, intermediate] tensor: the lean layer (op by op or compiled) splits where
    transformers' separate gate product does."""
    plain, fused = _pair(False, kernel, intermediate_size=104)
    ids = torch.randint(0, VOCAB, (2, 9))
    got = _logits(fused, ids, 5, engine_cache)
    assert all(torch.equal(a, b) for a, b in zip(_logits(plain, ids, 5, engine_cache), got, strict=True))


@pytest.mark.skipif(not gemv.available(), reason=f"no compiled kernel here: {gemv.why_not()}")
def test_the_compiled_silu_is_pytorchs_bit_for_bit():
    """On every length (the split between PyTorch's vector and scalar loops moves with it) and
    values of every scale, with infinities and zeros of both signs."""
    block = lean._silu_block()
    assert block in (16, 32)
    torch.manual_seed(0)
    for n in (1, 7, 16, 31, 33, 100, 1536, 4099):
        for scale in (1e-3, 1.0, 4.0, 30.0, 1e4):
            x = torch.randn(n) * scale
            special = torch.tensor([0.0, -0.0, float("inf"), float("-inf")])[: min(n, 4)]
            x[: len(special)], x[n - len(special) :] = special, special  # in either loop
            got = x.clone()
            gemv.library().feedback_silu(got.data_ptr(), n, block)
            assert torch.equal(got.view(torch.int32), nn.functional.silu(x).view(torch.int32)), (n, scale)


@pytest.mark.skipif(not gemv.available(), reason=f"no compiled kernel here: {gemv.why_not()}")
def test_the_one_call_step_follows_its_cache_when_rows_are_dropped_or_the_cache_is_new(monkeypatch):
    """The layers' entries are kept between a run's steps: a row dropped from the cache (its buffers
    replaced) and a new run's cache are each picked up, and the logits stay transformers'."""
    plain, fused = _pair(bias=False, kernel="gemv")
    calls = _calls(monkeypatch)
    ids = torch.randint(0, VOCAB, (2, 7))

    def run(model: nn.Module) -> list[torch.Tensor]:
        model.config._attn_implementation = kvcache.GROUPED
        out, mask = [], torch.ones_like(ids)
        with torch.inference_mode():
            cache = kvcache.PreallocatedCache(model.config.num_hidden_layers, 16)
            logits = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits
            for step in range(4):
                if step == 2:  # the first row ends: the cache keeps the second
                    cache.batch_select_indices(torch.tensor([1]))
                    logits, mask = logits[1:], mask[1:]
                tok = logits[:, -1].argmax(-1, keepdim=True)
                mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
                logits = model(input_ids=tok, attention_mask=mask, cache=cache, use_cache=True).logits
                out.append(logits)
        return out

    for _ in range(2):  # a second run: a new cache
        want, got = run(plain), run(fused)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert calls == [4] * 8


@pytest.mark.parametrize("via", ["argument", "config"])
def test_hidden_states_asked_for_are_transformers_on_the_lean_body(via):
    """A forward asked for every layer's hidden states records them (the lean body keeps transformers'
    recording; a decode step then runs layer by layer): the same tensors as transformers' own."""
    plain, fused = _pair(bias=False, kernel=KERNELS[0]) if KERNELS else _pair(bias=False)
    ids = torch.randint(0, VOCAB, (1, 6))
    got = []
    for model in (plain, fused):
        model.config._attn_implementation = kvcache.GROUPED
        ask = {"output_hidden_states": True} if via == "argument" else {}
        model.config.output_hidden_states = via == "config"
        with torch.inference_mode():
            cache = kvcache.PreallocatedCache(model.config.num_hidden_layers, 8)
            model(input_ids=ids, cache=cache, use_cache=True)
            got.append(model(input_ids=ids[:, :1], cache=cache, use_cache=True, **ask).hidden_states)
    assert got[1] is not None and len(got[1]) == 5
    assert all(torch.equal(a, b) for a, b in zip(*got, strict=True))
