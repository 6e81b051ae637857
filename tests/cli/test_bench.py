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
