"""`bench` (feedback/cli/bench.py): every ratio in its JSON (the measurements: feedback/bench.py)."""

from __future__ import annotations

import json

import pytest

from tests.cli.helpers import in_process


@pytest.mark.slow
def test_bench_json_reports_every_ratio():
    # --quick: every measurement, the scaling and Deep Think ones on small shapes named by those shapes
    out = in_process("bench", "--tokens", "4", "--repeats", "2", "--api", "--quick", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for key in (
        "baseline_vs_generate",
        "side_by_side_overhead",
        "feedback_row_overhead",
        "cold_start_s",
        "roofline_fraction",
        "api_stream_vs_engine",
        "api_generate_vs_engine",
        "mixed_prompts_overhead",
        "rows4_vs_forward4",
        "quality_overhead",
        "rows16_ctx128_vs_row1",
        "rows8_ctx16_vs_row1",
        "deepthink8_speedup",
        "raw_batch2_vs_batch1",
        "two_rows_vs_two_generations",
        "prefill_256_vs_sdpa",
        "prefill_256_rows4_vs_row1",
        "quality_overhead_256",
    ):
        assert isinstance(data[key], float) and data[key] > 0
        if key != "cold_start_s" and key != "roofline_fraction":  # every ratio: its lowest and highest round
            low, high = data["spread"][key]
            assert low <= data[key] <= high
    # which fp32 linear kernel this machine's measurement chose, shape by shape (or the one set)
    assert data["cpu"] and (
        "576x49152" in data["linear_kernels"] or data["linear_kernels"] in ("onednn", "aten")
    )
    assert (
        data["timing"].startswith("CPU time")
        and data["rounds"] == 2
        and len(data["load_average"]["before"]) == 3
    )
    assert data["same_tokens_as_generate"] is True and data["api_same_tokens"] is True
    assert (
        data["attention"] == "feedback_grouped" and data["batch_invariance"]["identical_rows_bitwise_equal"]
    )
    assert (
        data["deepthink_shape"] == [8, 32] and "rows16_ctx1024_vs_row1" not in data
    )  # never read as the full shape
    assert "prefill_4k_vs_sdpa" not in data and "quality_overhead_4k" not in data
    # concurrency, --quick: 4 clients of 4 tokens
    conc = data["concurrency"]
    assert conc["clients"] == 4 and conc["tokens"] == 4 and conc["tokens_equal_solo"] == [True] * 4
    assert conc["shared_4x4_together_vs_one_by_one"] > 0 and "shared_8x64_together_vs_one_by_one" not in conc


def test_concurrency_reports_shared_against_one_by_one_and_solo_tokens(embedded_lm):
    # tiny scale: 2 clients of 8 tokens, one round; the ratios are reported, never asserted against
    # their targets (timings on a shared machine)
    from feedback.bench import _concurrency_text, concurrency

    data = concurrency(embedded_lm, clients=2, tokens=8, rounds=1, stagger_s=0.2)
    assert data["clients"] == 2 and data["tokens"] == 8 and data["rounds"] == 1 and data["cpu"]
    assert data["tokens_equal_solo"] == [True, True]  # every request's rows: its solo run's tokens
    assert data["tokens_equal_solo_one_by_one"] == [True, True]
    required = ("shared_2x8_together_vs_one_by_one", "shared_2x8_staggered_vs_one_by_one")
    # time to first step is there when a request was sent while the other one decoded
    optional = ("ttft_mid_run_2x8_vs_solo", "ttft_mid_run_2x8_one_by_one_vs_solo")
    for key in required + tuple(k for k in optional if k in data):
        assert isinstance(data[key], float) and data[key] > 0
        low, high = data["spread"][key]
        assert low <= data[key] <= high
        assert data["sides_ms"][key]["a"] > 0 and data["sides_ms"][key]["b"] > 0
    assert data["generated_tokens"]["together"] > 0 and data["most_rows_together"]["together"] >= 2
    text = _concurrency_text(data)
    assert "tokens equal solo: 2/2 (shared), 2/2 (one by one)  ok" in text
    assert "shared_2x8_together_vs_one_by_one" in text and "(not the target's shape: no target)" in text


def test_a_step_reads_one_of_an_int4_layers_two_layouts():
    """The roofline's bytes: of an int4 layer's two layouts (PyTorch's packed one, the compiled
    kernel's), the one its one-row product reads; the int8 head's codes and scales; the untied input
    table left out (a step reads one row of it)."""
    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from feedback.bench import weight_bytes
    from feedback.core import linear

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    linear.quantize(model, 4)
    four = [m for m in model.modules() if isinstance(m, linear.Int4WeightLinear)]
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    norms += sum(b.numel() * 4 for b in model.model.rotary_emb.buffers())  # (its frequencies)
    head = model.lm_head.qweight.numel() + model.lm_head.scales.numel() * 2

    def size(*tensors: torch.Tensor) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    packed = sum(size(m.packed_weight, m.scales) for m in four)
    compiled = sum(size(m.codes, m.group_scales, m.group_offsets) for m in four)
    lm = SimpleNamespace(model=model)
    assert weight_bytes(lm) == packed + norms + head
    for m in four:
        m.compiled_rows = 1
    assert weight_bytes(lm) == compiled + norms + head and compiled != packed
