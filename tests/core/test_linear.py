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
    code = ("import feedback, torch; from feedback.core import linear; "
            "print(linear.wanted(torch.device('cpu')), linear.wanted(torch.device('meta')))")
    env = {**os.environ, linear.LINEAR_ENV: "aten"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["False", "False"]
    env[linear.LINEAR_ENV] = ""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["True", "False"]
