"""oneDNN's fp32 linear on CPU: the same products as PyTorch's own kernel to float rounding, in
every batch shape the engine uses, and only where it applies."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from feedback.core import linear

pytestmark = pytest.mark.skipif(not linear.available(), reason="this torch has no oneDNN linear")


def test_the_loaded_model_uses_it_and_agrees_with_aten(embedded_lm):
    layers = [m for m in embedded_lm.model.modules() if isinstance(m, nn.Linear)]
    assert layers and all(type(m) is linear.OneDnnLinear for m in layers)
    torch.manual_seed(0)
    for module in (embedded_lm.model.lm_head, embedded_lm.layers[0].mlp.down_proj):
        for shape in ((1, 1), (2, 1), (4, 1), (16, 1), (1, 512), (3, 7)):  # decode steps, a prefill chunk
            x = torch.randn(*shape, module.in_features)
            with torch.inference_mode():
                got, want = module(x), nn.functional.linear(x, module.weight, module.bias)
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_a_row_is_the_same_in_any_batch():
    """Each row's product is computed alone from the same weights: one row in a batch of 2 or 16
    agrees with the row alone to float rounding."""
    torch.manual_seed(1)
    module = nn.Linear(576, 1536, bias=False)
    linear.use_onednn(module)
    x = torch.randn(16, 576)
    with torch.inference_mode():
        alone = module(x[:1])
        for n in (2, 16):
            assert (module(x[:n])[:1] - alone).abs().max().item() < 1e-5


def test_only_plain_fp32_cpu_linears_change_and_autograd_keeps_aten():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.ReLU())

    class Custom(nn.Linear):
        pass

    model.append(Custom(8, 8))
    assert linear.use_onednn(model) == 1
    assert [type(m).__name__ for m in model] == ["OneDnnLinear", "Linear", "ReLU", "Custom"]
    assert not any(p.requires_grad for p in model.parameters())
    x = torch.randn(2, 8, requires_grad=True)
    y = model[0](x)  # a gradient asked for: PyTorch's own kernel, which has a backward
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_feedback_linear_aten_keeps_pytorch_kernel():
    cpu = torch.device("cpu")
    assert linear.wanted(cpu, False) is False and linear.wanted(cpu, True) is True  # a caller's choice wins
    code = (
        "import feedback, torch; from feedback.core import linear; "
        "print(linear.wanted(torch.device('cpu')), linear.wanted(torch.device('meta')))"
    )
    env = {**os.environ, linear.LINEAR_ENV: "aten"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["False", "False"]
    env[linear.LINEAR_ENV] = ""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_int8_weights_keep_the_products_close_and_the_head_in_fp32():
    """Per-channel int8 weights on bf16 activations: each product within a few tenths of a percent
    of fp32's; the output head and every non-linear part left as they were."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).eval()
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, 5, layer.in_features)
    with torch.inference_mode():
        want = layer(x)
    assert linear.quantize_int8(model) == 2 * 7  # q, k, v, o, gate, up, down per layer
    q = model.model.layers[0].mlp.down_proj
    assert isinstance(q, linear.Int8WeightLinear) and q.qweight.dtype == torch.int8
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32
    with torch.inference_mode():
        got = q(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got - want).norm() / want.norm()).item() < 0.01


def test_load_in_8bit_on_cpu_is_a_labelled_fast_mode():
    from feedback.core.model import load_model

    lm = load_model("embedded", load_in_8bit=True)
    assert lm.precision.startswith("fast, not bit-exact: int8 weights")
    assert isinstance(lm.layers[0].self_attn.q_proj, linear.Int8WeightLinear) and lm.vocab_size == 49152
    from feedback.core.engine import run_to_end
    from feedback.core.records import RowSpec, RunConfig

    result = run_to_end(
        lm,
        RunConfig(
            prompt="What is the capital of France?",
            max_new_tokens=8,
            rows=[RowSpec("b"), RowSpec("f", "residual", {})],
        ),
    )
    assert "Paris" in result.rows[0].text
    with pytest.raises(Exception, match="float32"):
        load_model("embedded", load_in_8bit=True, dtype="bfloat16")
