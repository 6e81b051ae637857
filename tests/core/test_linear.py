"""The fp32 linear kernels on CPU (gemv, oneDNN): the same products as PyTorch's own kernel to float
rounding in every batch shape the engine uses, each layer's choice measured, and only where it applies."""

import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from feedback.core import gemv, linear

pytestmark = pytest.mark.skipif(not linear.available(), reason="this torch has no oneDNN linear")
needs_gemv = pytest.mark.skipif(not gemv.available(), reason=f"gemv cannot run here: {gemv.why_not()}")


def _called(model: nn.Module) -> list[nn.Linear]:
    """Every linear layer a step calls (a lean layer's q/k/v and gate/up parts are folded into one)."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and not getattr(m, "folded", 0)]


def test_the_loaded_model_uses_them_and_agrees_with_aten(embedded_lm):
    layers = _called(embedded_lm.model)
    kind = linear.GemvLinear if gemv.available() else linear.OneDnnLinear
    assert layers and all(type(m) in (kind, linear.OneDnnLinear) for m in layers)
    assert any(type(m) is kind for m in layers)
    assert (embedded_lm.kernels is not None) == gemv.available()
    torch.manual_seed(0)
    for module in (embedded_lm.model.lm_head, embedded_lm.layers[0].mlp.down_proj):
        for shape in ((1, 1), (2, 1), (4, 1), (16, 1), (1, 512), (3, 7)):  # decode steps, a prefill chunk
            x = torch.randn(*shape, module.in_features)
            with torch.inference_mode():
                got, want = module(x), nn.functional.linear(x, module.weight, module.bias)
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_a_row_is_the_same_in_any_batch():
    """oneDNN: one row in a batch of 2 or 16 agrees with the row alone to float rounding; gemv (up to
    its rows): bit for bit."""
    torch.manual_seed(1)
    x = torch.randn(16, 576)
    for choice in ("onednn", "gemv") if gemv.available() else ("onednn",):
        module = nn.Linear(576, 1536, bias=False)
        linear.use_kernels(module, choice)
        with torch.inference_mode():
            alone = module(x[:1])
            for n in (2, 3, 16):
                if choice == "gemv":
                    assert torch.equal(module(x[:n])[:1], alone)
                else:
                    assert (module(x[:n])[:1] - alone).abs().max().item() < 1e-5


def test_only_plain_fp32_cpu_linears_change_and_autograd_keeps_aten():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.ReLU())

    class Custom(nn.Linear):
        pass

    model.append(Custom(8, 8))
    assert linear.use_kernels(model, "onednn") is None
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


def test_gemv_takes_the_rows_up_to_where_it_stops_being_faster(monkeypatch):
    """Timed for real (wall clock, so a sleep counts): a gemv that sleeps 1 ms a call from 4 rows on
    against a oneDNN that sleeps at 1 and 2 rows only gives gemv 2 rows; faster only past 1 row, none."""

    def sleeping(at):
        def kernel(x, weight, bias):
            if x.shape[0] in at:
                time.sleep(0.001)
            return nn.functional.linear(x, weight, bias)

        return kernel

    monkeypatch.setattr(linear, "KERNELS", {"gemv": sleeping({4, 8, 16}), "onednn": sleeping({1, 2})})
    modules = [nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(8, 16, bias=False)]
    choice = linear.measure_kernels(modules, clock=time.perf_counter)
    assert set(choice) == {"16x8+bias", "8x16"}  # one measurement per distinct shape
    for table in choice.values():
        assert table["gemv_rows"] == 2 and set(table["seconds"]) == {str(r) for r in linear.ROWS}
        assert all(s["gemv"] > 0 and s["onednn"] > 0 for s in table["seconds"].values())
    seconds = {str(r): {"gemv": 2.0 if r == 1 else 1.0, "onednn": 1.5} for r in linear.ROWS}
    assert linear.gemv_rows(seconds) == 0  # slower at one row: never, though faster above


@needs_gemv
def test_a_gemv_linear_calls_gemv_up_to_its_rows_and_onednn_above(monkeypatch):
    torch.manual_seed(2)
    module = nn.Linear(64, 32)
    table = {"64x32+bias": {"gemv_rows": 4, "seconds": None}}
    assert linear.use_kernels(module, "auto", measured=table) == table
    assert type(module) is linear.GemvLinear and module.gemv_rows == 4 and not module.weight.requires_grad
    seen = []
    real = gemv.product
    monkeypatch.setattr(gemv, "product", lambda x, w, b: seen.append(x.shape) or real(x, w, b))
    for shape in ((1, 64), (2, 2, 64), (4, 64), (5, 64), (40, 64)):
        x = torch.randn(*shape)
        with torch.inference_mode():
            got, want = module(x), nn.functional.linear(x, module.weight, module.bias)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
    assert seen == [(1, 64), (2, 2, 64), (4, 64)]  # 5 and 40 rows went to oneDNN
    none = nn.Linear(64, 32)
    linear.use_kernels(none, "auto", measured={"64x32+bias": {"gemv_rows": 0, "seconds": None}})
    assert type(none) is linear.OneDnnLinear


@needs_gemv
def test_the_choice_is_measured_once_per_machine_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("FEEDBACK_CACHE", str(tmp_path))
    monkeypatch.setattr(linear, "SMALL_BYTES", 8 * 4 * 4 + 1)  # 8x4 (128 bytes) untimed, 16x4 and 4x16 timed
    measured = []
    real = linear.measure_kernels

    def counting(modules, clock=None):
        measured.append([linear.shape_key(m) for m in modules])
        return real(modules)

    monkeypatch.setattr(linear, "measure_kernels", counting)
    first = linear.chosen_kernels([nn.Linear(16, 4), nn.Linear(8, 4)])
    again = linear.chosen_kernels([nn.Linear(16, 4), nn.Linear(4, 16)])  # only the new shape measured
    assert measured == [["16x4+bias"], ["4x16+bias"]] and again["16x4+bias"] == first["16x4+bias"]
    assert first["8x4+bias"] == {"gemv_rows": linear.GEMV_MAX_ROWS, "seconds": None}  # small: untimed
    (path,) = (p for p in (tmp_path / "kernels").iterdir() if p.suffix == ".json")
    assert path.name == f"{linear.machine_key()}.json" and str(torch.get_num_threads()) in path.name
    assert gemv.source_key() in path.name  # a changed kernel is measured anew
    assert linear.kernel_summary(again).count("x") == 2


def test_feedback_linear_refuses_an_unknown_choice(monkeypatch):
    from feedback.errors import FeedbackError

    monkeypatch.setenv(linear.LINEAR_ENV, "fastest")
    with pytest.raises(FeedbackError, match="FEEDBACK_LINEAR must be one of auto, gemv, onednn, aten"):
        linear.setting()
    monkeypatch.setenv(linear.LINEAR_ENV, "oneDNN")
    assert linear.setting() == "onednn"
    monkeypatch.setenv(linear.LINEAR_ENV, "")
    assert linear.setting() == "auto"
    with pytest.raises(
        FeedbackError, match="linear_kernel must be one of auto, gemv, onednn, aten; got 'mkl'"
    ):
        linear.setting("mkl")  # a load_model argument, named as such


@needs_gemv
def test_a_model_loads_with_its_cached_choice_and_each_choice_applies(embedded_lm, tmp_path, monkeypatch):
    """The default (auto): the output head with this machine's measured rows, the decoder's products
    with the rows its decode step was measured faster with them (all gemv layers), both cached and
    read back on the next load; gemv: every layer to GEMV_MAX_ROWS untimed; onednn: no gemv."""
    from feedback.core.model import load_model
    from tests.tiny_families import write_folder

    monkeypatch.setenv("FEEDBACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(linear, "SMALL_BYTES", 0)  # time every layer of the tiny model
    folder = write_folder("llama", embedded_lm.tokenizer, tmp_path / "llama")
    lm = load_model(f"random:{folder}")
    layers = _called(lm.model)
    decoder = [m for m in _called(lm.model.model.layers)]
    head = lm.model.lm_head
    step_key = linear.step_key(decoder)
    assert set(lm.kernels) == {linear.shape_key(head), step_key, "weights ahead"}
    rows = lm.kernels[linear.shape_key(head)]["gemv_rows"]
    assert (
        type(head) is (linear.GemvLinear if rows else linear.OneDnnLinear)
        and getattr(head, "gemv_rows", 0) == rows
    )
    compiled = lm.kernels[step_key]["compiled_rows"]
    assert all(type(m) is linear.GemvLinear and m.gemv_rows == compiled for m in decoder)
    assert len(layers) == len(decoder) + 1
    for name in ("", "steps-", "ahead-"):
        assert (tmp_path / "cache" / "kernels" / f"{name}{linear.machine_key()}.json").exists()

    def no_more(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(linear, "measure_kernels", no_more)
    monkeypatch.setattr(linear, "measure_step_kernels", no_more)
    monkeypatch.setattr(linear, "measure_ahead", no_more)
    assert load_model(f"random:{folder}").kernels == lm.kernels
    every = load_model(f"random:{folder}", linear_kernel="gemv")
    assert {e["gemv_rows"] for k, e in every.kernels.items() if k != "weights ahead"} == {
        linear.GEMV_MAX_ROWS
    }
    assert all(type(m) is linear.GemvLinear for m in _called(every.model))
    plain = load_model(f"random:{folder}", linear_kernel="onednn")
    assert plain.kernels is None and all(type(m) is linear.OneDnnLinear for m in _called(plain.model))
    assert linear.kernel_summary(plain.kernels, plain.linear_kernel) == "onednn"
    # what the model was loaded with, not what FEEDBACK_LINEAR says now
    assert (
        linear.kernel_summary(None, load_model(f"random:{folder}", linear_kernel="aten").linear_kernel)
        == "aten"
    )


def _dequantised(q: linear.WeightOnlyLinear) -> torch.Tensor:
    """The weights a quantised layer's compiled kernel reads, as fp32 [out, in], from its buffers
    (int4: a group's byte j holds input j's code low and input j + 16's high)."""

    def bf16(bits: torch.Tensor) -> torch.Tensor:
        return bits.view(torch.bfloat16).float()

    if isinstance(q, linear.Int8WeightLinear):
        return q.qweight.float() * q.scales.float()[:, None]
    out, groups = q.out_features, q.in_features // linear.INT4_GROUP
    packed = q.codes.reshape(out, groups, linear.INT4_GROUP // 2).int()
    codes = torch.cat([packed & 15, packed >> 4], dim=-1).float()
    scales = bf16(q.group_scales[: out * groups]).reshape(out, groups, 1)
    offsets = bf16(q.group_offsets[: out * groups]).reshape(out, groups, 1)
    return ((codes - 8) * scales + offsets).reshape(out, -1)


@needs_gemv
@pytest.mark.parametrize("bits, inputs", [(8, 96), (8, 100), (4, 96)])
def test_the_compiled_quantised_product_keeps_the_modes_numerics(bits, inputs):
    """The decode rows' compiled product: bf16 inputs times the stored codes, a bf16 result plus the
    bias, so within a bf16 rounding of the exact product of the same numbers (inputs of every scale,
    a group's largest 10^4 times its smallest; int8 also with a partial last group), and within a
    rounding or two of PyTorch's packed kernel, which sums in another order (it is not compared at
    100 inputs: PyTorch's int8 kernel crashes on them)."""
    torch.manual_seed(0)
    source = nn.Linear(inputs, 80)
    q = (linear.Int8WeightLinear if bits == 8 else linear.Int4WeightLinear)(source)
    x = torch.randn(5, inputs) * torch.logspace(-3, 1, inputs)[torch.randperm(inputs)]
    q.compiled_rows = 8
    with torch.inference_mode():
        got = q(x).double() - q.bias.double()
    weights = _dequantised(q).double()
    exact = x.bfloat16().double() @ weights.T
    magnitude = x.bfloat16().double().abs() @ weights.abs().T
    assert ((got - exact).abs() <= exact.abs() * 2**-8 + magnitude * 2**-14).all()
    q.bias.data.zero_()
    with torch.inference_mode():
        unbiased = q(x)
    assert torch.equal(unbiased.bfloat16().float(), unbiased)  # a bf16 result, not an fp32 one
    if inputs % 32 == 0:
        with torch.inference_mode():
            packed = q.packed(x.to(torch.bfloat16)).double()
        assert ((got - packed).abs() <= packed.abs() * 2**-7 + magnitude * 2**-13).all()


@needs_gemv
@pytest.mark.parametrize("bits", [8, 4])
def test_a_compiled_quantised_row_is_the_same_alone_in_a_batch_and_at_any_thread_count(bits):
    """A NaN in one row makes that row's outputs NaN and leaves the others as they were."""
    torch.manual_seed(0)
    q = (linear.Int8WeightLinear if bits == 8 else linear.Int4WeightLinear)(nn.Linear(256, 1024))
    q.compiled_rows = 16
    x = torch.randn(5, 256)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        batch = q(x)
        alone = [q(x[i : i + 1])[0] for i in range(5)]
        torch.set_num_threads(2 if threads == 1 else 1)
        try:
            other = q(x)
        finally:
            torch.set_num_threads(threads)
        x[2, 7] = float("nan")
        poisoned = q(x)
    assert all(torch.equal(batch[i], alone[i]) for i in range(5)) and torch.equal(batch, other)
    assert poisoned[2].isnan().all() and torch.equal(poisoned[[0, 1, 3, 4]], batch[[0, 1, 3, 4]])


@needs_gemv
@pytest.mark.parametrize("bits, inputs", [(4, 160), (4, 1536), (8, 160), (8, 100), (8, 33)])
def test_the_quantised_products_256_and_512_bit_loops_give_the_same_bits(bits, inputs):
    """Two groups an instruction (512-bit) or one (256-bit): the same integer sums and the same float
    operations lane by lane, so the same bits, at 1 to 5 rows; odd numbers of groups (160 inputs: 5)
    and int8's partial last group included."""
    if not gemv.wide_usable():
        pytest.skip("this CPU has no AVX-512 BW and VNNI: only the 256-bit loops run here")
    torch.manual_seed(0)
    q = (linear.Int8WeightLinear if bits == 8 else linear.Int4WeightLinear)(nn.Linear(inputs, 208))
    q.compiled_rows = 16
    x = torch.randn(5, inputs) * torch.logspace(-3, 1, inputs)[torch.randperm(inputs)]
    was = gemv.set_wide()
    seen = {}
    try:
        for from_rows in (0, 1):  # never, from one row
            assert gemv.set_wide(from_rows) == from_rows
            with torch.inference_mode():
                seen[from_rows] = [q(x[:rows]) for rows in range(1, 6)]
    finally:
        gemv.set_wide(was)
    assert all(torch.equal(a, b) for a, b in zip(seen[0], seen[1], strict=True))


def test_the_decoder_takes_compiled_products_up_to_where_the_step_stops_being_faster(monkeypatch, tmp_path):
    """The step, timed with every product compiled against with none, at 1, 2, 4 rows: faster at 1
    and 2, slower at 4, so compiled up to 2 rows, 8 and 16 not timed; remembered, so a second load
    times nothing."""
    monkeypatch.setattr(linear, "cache_file", lambda name: tmp_path / f"{name}.json")
    monkeypatch.setattr(gemv, "available", lambda: True)
    products = [linear.Int8WeightLinear(nn.Linear(1024, 512, bias=False)) for _ in range(2)]
    timed: list[tuple[int, int]] = []

    def step_seconds(rows: int) -> float:
        compiled = products[0].compiled_rows
        timed.append((rows, compiled))
        assert all(p.compiled_rows == compiled for p in products)
        return {1: 1.0, 2: 2.0, 4: 4.0}[rows] * (
            0.8 if compiled and rows < 4 else 1.0 if not compiled else 1.2
        )

    table = linear.use_step_kernels([*products, nn.ReLU()], step_seconds)
    ((key, entry),) = table.items()
    assert key == "decoder int8 1024x512" and entry["compiled_rows"] == 2
    assert list(entry["seconds"]) == ["1", "2", "4"] and sorted({rows for rows, _ in timed}) == [1, 2, 4]
    assert all(p.compiled_rows == 2 for p in products)
    assert "decoder layers: compiled to 2 rows, PyTorch's kernels above" in linear.kernel_summary(table)
    timed.clear()
    fresh = [linear.Int8WeightLinear(nn.Linear(1024, 512, bias=False))]
    assert linear.use_step_kernels(fresh, step_seconds)[key]["compiled_rows"] == 2 and not timed
    assert fresh[0].compiled_rows == 2


@needs_gemv
def test_asking_for_weights_ahead_changes_no_result():
    torch.manual_seed(0)
    w, b, x = torch.randn(320, 1024), torch.randn(320), torch.randn(3, 1024)
    four = linear.Int4WeightLinear(nn.Linear(1024, 320))
    four.compiled_rows = 4
    seen = []
    try:
        for ahead in (0, linear.AHEAD_BYTES):
            gemv.set_ahead(ahead, ahead, ahead)
            seen.append((gemv.product(x, w, b), four(x)))
    finally:
        gemv.set_ahead(0, 0, 0)
    assert all(torch.equal(a, b) for a, b in zip(*seen, strict=True))


def test_the_products_ask_ahead_where_that_was_faster(monkeypatch, tmp_path):
    """Timed per loop: here asking ahead pays for gemv's one row and the quantised products, not for
    gemv's two rows; remembered, so the next load times nothing and sets the same."""
    monkeypatch.setattr(linear, "cache_file", lambda name: tmp_path / f"{name}.json")
    monkeypatch.setattr(gemv, "available", lambda: True)
    now, ahead, quantized_ahead, wide, settings = [0.0], [0], [0], [2], []

    def set_ahead(one, two, quantized=None) -> None:  # None: left as it is
        ahead[0] = ahead[0] if one is None else one
        quantized_ahead[0] = quantized_ahead[0] if quantized is None else quantized
        settings.append((one, two, quantized))

    def set_wide(from_rows=None):
        wide[0] = wide[0] if from_rows is None else from_rows
        return wide[0]

    def product(x, weight, bias):
        now[0] += {(1, 0): 2.0, (1, linear.AHEAD_BYTES): 1.0}.get((x.shape[0], ahead[0]), 3.0)

    def quantized_product(matrix, x, out_features):
        # ahead pays; 512-bit loops (where they run at these rows) cost a little at one row, pay at two
        rows, wide_loops = x.shape[0], 0 < wide[0] <= x.shape[0]
        costs = {(1, True): 0.1, (2, True): -0.5}
        now[0] += (1.0 if quantized_ahead[0] else 2.0) + costs.get((rows, wide_loops), 0)

    monkeypatch.setattr(gemv, "set_ahead", set_ahead)
    monkeypatch.setattr(gemv, "set_wide", set_wide)
    monkeypatch.setattr(gemv, "wide_usable", lambda: True)
    monkeypatch.setattr(gemv, "product", product)
    monkeypatch.setattr(gemv, "quantized_product", quantized_product)
    modules = [
        nn.Linear(1024, 512, bias=False),
        nn.Linear(512, 1024, bias=False),
        linear.Int8WeightLinear(nn.Linear(1024, 512, bias=False)),
    ]
    entry = linear.choose_ahead(modules, clock=lambda: now[0])
    want = (linear.AHEAD_BYTES, 0, linear.QUANTIZED_AHEAD_BYTES)
    assert (entry["one"], entry["two"], entry["quantized"]) == want and settings[-1] == want
    assert entry["wide_from"] == 2 and wide[0] == 2
    assert list(entry["seconds"]) == ["gemv 1", "gemv 2", "quantized 1", "512-bit 1", "512-bit 2"]
    assert linear.kernel_summary({"weights ahead": entry}) == (
        f"weights asked for {linear.AHEAD_BYTES} B ahead at one row, not ahead at two, "
        f"{linear.QUANTIZED_AHEAD_BYTES} B ahead by the quantised products (512-bit from 2 rows)"
    )
    fp32_only = linear.measure_ahead([torch.zeros(8, 8)], [], clock=lambda: now[0])
    assert linear.kernel_summary({"weights ahead": fp32_only}).endswith("not ahead at two")
    assert settings[-1] == (fp32_only["one"], 0, None)  # the quantised products' setting left as it was
    linear.measure_ahead([], modules[2:], clock=lambda: now[0])
    assert settings[-1] == (None, None, linear.QUANTIZED_AHEAD_BYTES)  # gemv's left as they were
    settings.clear()
    wide[0] = 0
    monkeypatch.setattr(linear, "measure_ahead", lambda *a: pytest.fail("measured again"))
    assert linear.choose_ahead(modules)["one"] == linear.AHEAD_BYTES and settings == [want] and wide[0] == 2
    assert linear.choose_ahead([nn.Linear(64, 64)]) is None  # small: stays in cache, nothing to choose
