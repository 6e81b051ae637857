"""The compiled few-row fp32 kernel: products equal to a float64 reference within fp32 rounding, a
row's result the same bit for bit alone, in any batch and at any thread count, and a machine that
cannot build it told why, with the engine on oneDNN instead."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from feedback.core import gemv, linear

needs_gemv = pytest.mark.skipif(not gemv.available(), reason=f"gemv cannot run here: {gemv.why_not()}")


@needs_gemv
@pytest.mark.parametrize("inputs, outputs", [(576, 960), (1536, 576), (64, 129), (37, 5), (8, 3), (1, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_products_match_a_float64_reference(inputs, outputs, bias):
    """Shapes of the embedded model, and widths that are not multiples of the kernel's 32-input
    step (the tail summed in order), with and without a bias."""
    torch.manual_seed(inputs + outputs)
    layer = nn.Linear(inputs, outputs, bias=bias)
    for rows in (1, 2, 3, 5):
        x = torch.randn(rows, inputs)
        got = gemv.product(x, layer.weight.detach(), None if layer.bias is None else layer.bias.detach())
        want = nn.functional.linear(
            x.double(), layer.weight.double(), None if not bias else layer.bias.double()
        )
        scale = (x.double().abs() @ layer.weight.double().abs().T).max().item()
        assert got.dtype == torch.float32 and got.shape == (rows, outputs)
        assert (got.double() - want).abs().max().item() <= 4 * inputs * 2**-24 * scale


@needs_gemv
def test_a_row_is_bit_identical_alone_in_any_batch_and_at_any_thread_count():
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 200), torch.randn(300)  # 200 inputs: six 32-steps and a tail of 8
    x = torch.randn(17, 200)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [gemv.product(x[i : i + 1], weight, bias) for i in range(17)]
        for n in range(1, 18):
            batch = gemv.product(x[:n], weight, bias)
            assert all(torch.equal(batch[i : i + 1], alone[i]) for i in range(n))
        torch.set_num_threads(2)
        big = torch.randn(2048, 200)  # enough outputs that the threads split them
        one = gemv.product(x[:3], big, None)
        torch.set_num_threads(1)
        assert torch.equal(one, gemv.product(x[:3], big, None))
    finally:
        torch.set_num_threads(threads)


@needs_gemv
def test_inputs_with_leading_dimensions_and_strides():
    torch.manual_seed(1)
    weight = torch.randn(48, 40)
    x = torch.randn(40, 3, 2).permute(2, 1, 0)  # [2, 3, 40], not contiguous
    got = gemv.product(x, weight, None)
    assert got.shape == (2, 3, 48)
    assert torch.allclose(got, x @ weight.T, atol=1e-5)
    assert gemv.usable(weight, None) and not gemv.usable(weight.T, None)
    assert not gemv.usable(weight.bfloat16(), None) and not gemv.usable(weight, torch.ones(96)[::2])


def test_a_machine_that_cannot_build_it_is_told_why_and_keeps_onednn(tmp_path, monkeypatch):
    from feedback.errors import FeedbackError

    monkeypatch.setattr(gemv, "_unsupported", lambda: "")  # as if on x86-64 with AVX2, here or not
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    lib, why = gemv.find(tmp_path)
    assert lib is None and why == "false failed: no message"
    assert not list(tmp_path.iterdir())  # nothing half-written left behind
    monkeypatch.setenv("CC", "no-such-compiler")
    assert gemv.find(tmp_path) == (None, "no C compiler found (set CC, or install gcc)")

    monkeypatch.setattr(gemv, "_loaded", lambda: (None, why))  # this process, as on such a machine
    layer = nn.Linear(64, 32)
    assert linear.use_kernels(layer, "auto") is None and type(layer) is linear.OneDnnLinear
    assert linear.kernel_summary(None, "auto") == "onednn (gemv: false failed: no message)"
    assert gemv.describe() == "oneDNN (gemv: false failed: no message)"  # as prepare and doctor say it
    with pytest.raises(FeedbackError, match="linear_kernel gemv cannot run here: false failed"):
        linear.use_kernels(nn.Linear(64, 32), "gemv")


def test_a_cpu_without_avx2_is_not_asked_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    monkeypatch.setattr(gemv.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(gemv.sys, "platform", "linux")
    assert gemv.find(tmp_path) == (None, "it needs a CPU with AVX2 and FMA (PyTorch finds DEFAULT)")
    assert not list(tmp_path.iterdir())


@needs_gemv
def test_it_is_built_once_into_its_folder(tmp_path):
    lib, why = gemv.find(tmp_path / "kernels")
    assert lib is not None and why == ""
    (built,) = (tmp_path / "kernels").iterdir()
    assert built.name == f"decode-{gemv.source_key()}.so"
    stamp = built.stat().st_mtime_ns
    assert gemv.find(tmp_path / "kernels")[0] is not None and built.stat().st_mtime_ns == stamp  # found
