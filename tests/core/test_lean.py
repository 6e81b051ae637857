"""The lean Llama layer computes exactly what transformers' layer computes, in fewer ops."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import DynamicCache, LlamaForCausalLM, Qwen2ForCausalLM

from feedback.core import gemv, lean, linear
from tests.tiny_families import FAMILIES

VOCAB = 300  # small: the head is not what is tested


# the fp32 kernels a loaded model's layers can take here; the lean layer is exact on each
KERNELS = [k for k in ("gemv", "onednn") if linear.available() and (k != "gemv" or gemv.available())]


def _pair(bias: bool, kernel: str = "onednn") -> tuple[nn.Module, nn.Module]:
    """Two copies of one random Llama, the second with lean layers (`kernel` on both, as loaded)."""
    torch.manual_seed(0)
    config = FAMILIES["llama"](vocab_size=VOCAB, attention_bias=bias, mlp_bias=bias)
    plain = LlamaForCausalLM(config).eval()
    torch.manual_seed(0)
    fused = LlamaForCausalLM(config).eval()
    assert lean.lean_layers(fused.model.layers) == 4
    for model in (plain, fused):
        if linear.wanted(torch.device("cpu")):
            linear.use_kernels(model, kernel)
    return plain, fused


def _logits(model: nn.Module, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """A padded batch's prefill and `steps` greedy decode steps on a cache: every forward's logits."""
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second row left-padded, as the engine batches rows of unlike length
    out = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        result = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        out.append(result.logits)
        for _ in range(steps):
            tok = result.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
            result = model(input_ids=tok, attention_mask=mask, cache=cache, use_cache=True)
            out.append(result.logits)
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias", [False, True])
def test_lean_layers_give_bit_identical_logits_in_prefill_and_decode(bias, kernel):
    plain, fused = _pair(bias, kernel)
    ids = torch.randint(0, VOCAB, (2, 12))
    for a, b in zip(_logits(plain, ids, 6), _logits(fused, ids, 6), strict=True):
        assert torch.equal(a, b)


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
    llama = LlamaForCausalLM(FAMILIES["llama"](vocab_size=VOCAB))  # training mode: dropout is live there
    assert lean.lean_layers(llama.model.layers) == 0


def test_load_model_uses_lean_layers_unless_turned_off(monkeypatch, tiny_lm, tmp_path):
    from feedback.core.model import load_model

    tiny_lm.model.config.save_pretrained(tmp_path)
    tiny_lm.tokenizer.save_pretrained(tmp_path)
    assert type(load_model(f"random:{tmp_path}").layers[0]) is lean.LeanLlamaLayer
    monkeypatch.setenv(lean.LEAN_ENV, "0")
    assert type(load_model(f"random:{tmp_path}").layers[0]).__name__ == "LlamaDecoderLayer"


def test_the_real_model_decodes_bit_identically_with_and_without_lean_layers(monkeypatch, embedded_lm):
    """Through the engine, a baseline row and a row whose strategy re-runs layers (inner_loop)."""
    from feedback.core.engine import run_to_end
    from feedback.core.model import load_model
    from feedback.core.records import RowSpec, RunConfig

    monkeypatch.setenv(lean.LEAN_ENV, "0")
    plain = load_model("embedded", dtype="float32")
    assert (
        type(embedded_lm.layers[0]) is lean.LeanLlamaLayer
        and type(plain.layers[0]) is not lean.LeanLlamaLayer
    )
    config = RunConfig(
        prompt="Name three rivers.", max_new_tokens=12, rows=[RowSpec("b"), RowSpec("f", "inner_loop")]
    )
    seen: dict[int, list] = {0: [], 1: []}
    for i, lm in enumerate((embedded_lm, plain)):
        run_to_end(lm, config, observer=lambda step, live, logits, i=i: seen[i].append(logits.clone()))
    assert len(seen[0]) == len(seen[1]) > 1
    assert all(torch.equal(a, b) for a, b in zip(seen[0], seen[1], strict=True))
