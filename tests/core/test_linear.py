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
    # every linear layer a step calls (a lean layer's q/k/v and gate/up parts are folded into one)
    layers = [
        m for m in embedded_lm.model.modules() if isinstance(m, nn.Linear) and not getattr(m, "folded", 0)
    ]
    assert layers and all(type(m) is linear.OneDnnLinear for m in layers) and embedded_lm.kernels is None
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


def _tiny_llama(hidden: int = 64) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("bits, tolerance", [(8, 0.01), (4, 0.12)])
def test_quantised_weights_keep_the_products_close_and_the_head_int8(bits, tolerance):
    """Per-channel int8 (or 4-bit in groups of 32) weights on bf16 activations: each product within
    `tolerance` of fp32's (relative norm); every linear layer changed, the output head to int8."""
    model = _tiny_llama()
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, 5, layer.in_features)
    with torch.inference_mode():
        want = layer(x)
    assert linear.quantize(model, bits) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer; the head
    q = model.model.layers[0].mlp.down_proj
    assert type(q) is (linear.Int8WeightLinear if bits == 8 else linear.Int4WeightLinear)
    assert type(model.lm_head) is linear.Int8WeightLinear and model.get_output_embeddings() is model.lm_head
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the input table stays as it was
    with torch.inference_mode():
        got = q(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got - want).norm() / want.norm()).item() < tolerance


def test_4bit_codes_of_q4_1_blocks_come_back_as_they_were():
    """Weights that are 32-input blocks of 4-bit codes with a scale and a minimum (GGUF's Q4_1, as the
    embedded model ships) are stored without loss but the bf16 rounding of the scales and offsets."""
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (48, 4, 32)).float()
    codes[..., 0], codes[..., 1] = 0, 15  # each block spans its whole range, as a quantiser leaves it
    scales = (torch.rand(48, 4, 1) * 0.02 + 0.001).bfloat16().float()
    low = (torch.randn(48, 4, 1) * 0.05).bfloat16().float()
    source = nn.Linear(128, 48, bias=False)
    source.weight.data = (codes * scales + low).reshape(48, 128)
    q = linear.Int4WeightLinear(source)
    x = torch.randn(2, 128).bfloat16().float()
    with torch.inference_mode():
        got = q(x)
    want = x @ source.weight.T
    assert ((got - want).norm() / want.norm()).item() < 0.01
    odd = _tiny_llama(hidden=48)  # 48 inputs: not a multiple of 32, so int8 instead
    linear.quantize(odd, 4)
    assert type(odd.model.layers[0].self_attn.q_proj) is linear.Int8WeightLinear
    assert type(odd.model.layers[0].mlp.down_proj) is linear.Int4WeightLinear  # 128 inputs


@pytest.mark.parametrize("bits", [8, 4])
def test_load_in_8_or_4_bit_on_cpu_is_a_labelled_fast_mode(bits):
    from feedback.core.model import load_model

    lm = load_model("embedded", **{f"load_in_{bits}bit": True})
    assert lm.precision.startswith(f"fast, not bit-exact: int{bits} weights")
    kind = linear.Int8WeightLinear if bits == 8 else linear.Int4WeightLinear
    layer = lm.layers[0]
    assert type(layer.qkv) is kind and type(layer.mlp.down_proj) is kind and layer.self_attn.q_proj is None
    assert type(lm.model.get_output_embeddings()) is linear.Int8WeightLinear and lm.vocab_size == 49152
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
        load_model("embedded", dtype="bfloat16", **{f"load_in_{bits}bit": True})


def test_the_kernel_measured_faster_is_chosen_for_each_shape_and_row_count(monkeypatch):
    """A kernel that takes longer is never chosen: here one that sleeps 1 ms a call at 1 and 2 rows
    against one that does not (wall clock, so the sleep counts), and the other way at 4 and 8."""
    import time

    def slow_below_4(x, weight, bias):
        if x.shape[0] < 4:
            time.sleep(0.001)
        return nn.functional.linear(x, weight, bias)

    def slow_from_4(x, weight, bias):
        if x.shape[0] >= 4:
            time.sleep(0.001)
        return nn.functional.linear(x, weight, bias)

    monkeypatch.setattr(linear, "KERNELS", {"a": slow_below_4, "b": slow_from_4})
    modules = [nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(8, 16, bias=False)]
    choice = linear.measure_kernels(modules, clock=time.perf_counter)
    assert set(choice) == {"16x8+bias", "8x16"}  # one measurement per distinct shape
    for table in choice.values():
        assert [table[str(r)]["kernel"] for r in linear.ROWS] == ["b", "b", "a", "a"]
        assert all(s["a"] > 0 and s["b"] > 0 for s in (table[str(r)]["seconds"] for r in linear.ROWS))


def test_a_measured_linear_calls_its_choice_per_row_count_and_keeps_the_products():
    torch.manual_seed(2)
    module = nn.Linear(64, 32)
    choice = {
        "64x32+bias": {
            str(r): {"kernel": k} for r, k in zip(linear.ROWS, ["onednn", "onednn", "aten", "aten"])
        }
    }
    assert linear.use_measured(module, choice) == choice
    assert type(module) is linear.MeasuredLinear and not module.weight.requires_grad
    assert module.kernels == (linear._onednn, linear._onednn, linear._aten, linear._aten)
    for rows in (1, 2, 3, 8, 40):
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            got, want = module(x), nn.functional.linear(x, module.weight, module.bias)
        assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_the_choice_is_measured_once_per_machine_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("FEEDBACK_CACHE", str(tmp_path))
    measured = []
    real = linear.measure_kernels

    def counting(modules, clock=None):
        measured.append([linear.shape_key(m) for m in modules])
        return real(modules)

    monkeypatch.setattr(linear, "measure_kernels", counting)
    first = linear.chosen_kernels([nn.Linear(8, 4)])
    again = linear.chosen_kernels([nn.Linear(8, 4), nn.Linear(4, 8)])  # only the new shape measured
    assert measured == [["8x4+bias"], ["4x8+bias"]] and again["8x4+bias"] == first["8x4+bias"]
    (path,) = (tmp_path / "kernels").iterdir()
    assert path.name == f"{linear.machine_key()}.json" and str(torch.get_num_threads()) in path.name
    assert linear.kernel_summary(again).count("x") >= 2


def test_feedback_linear_refuses_an_unknown_choice(monkeypatch):
    from feedback.errors import FeedbackError

    monkeypatch.setenv(linear.LINEAR_ENV, "fastest")
    with pytest.raises(FeedbackError, match="FEEDBACK_LINEAR must be one of onednn, measure, aten"):
        linear.setting()
    monkeypatch.setenv(linear.LINEAR_ENV, "oneDNN")
    assert linear.setting() == "onednn"
    with pytest.raises(FeedbackError, match="linear_kernel must be one of onednn, measure, aten; got 'mkl'"):
        linear.setting("mkl")  # a load_model argument, named as such


def test_a_model_loaded_with_measured_kernels_calls_its_cached_choice(embedded_lm, tmp_path, monkeypatch):
    """FEEDBACK_LINEAR=measure (or linear_kernel="measure"): every fp32 linear layer a
    `MeasuredLinear` calling, per row count, the kernel this machine's measurement chose."""
    from feedback.core.model import load_model
    from tests.tiny_families import write_folder

    monkeypatch.setenv("FEEDBACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(linear.LINEAR_ENV, "measure")
    lm = load_model(f"random:{write_folder('llama', embedded_lm.tokenizer, tmp_path / 'llama')}")
    layers = [m for m in lm.model.modules() if isinstance(m, nn.Linear) and not getattr(m, "folded", 0)]
    assert layers and all(type(m) is linear.MeasuredLinear for m in layers)
    assert set(lm.kernels) == {linear.shape_key(m) for m in layers}
    for module in layers:
        table = lm.kernels[linear.shape_key(module)]
        assert module.kernels == tuple(linear.KERNELS[table[str(r)]["kernel"]] for r in linear.ROWS)
    assert (tmp_path / "cache" / "kernels" / f"{linear.machine_key()}.json").exists()
    monkeypatch.setenv(linear.LINEAR_ENV, "")
    again = load_model(f"random:{tmp_path / 'llama'}", linear_kernel="measure")  # the argument, cached
    assert again.kernels == lm.kernels
