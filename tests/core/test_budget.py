"""Per-request budgets: settings, costs computed by hand, clear refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from feedback.core.budget import (
    EXACT_COST,
    PREFILL_CHUNK,
    Budget,
    generation_memory_mb,
    kv_bytes_per_token,
    scoring_cost,
)
from feedback.errors import FeedbackError
from feedback.eval.perplexity import PPLConfig, scoring_work


def test_settings_from_the_environment(monkeypatch):
    for var in (
        "FEEDBACK_BUDGET_SCORED_TOKENS",
        "FEEDBACK_BUDGET_DECODED_TOKENS",
        "FEEDBACK_BUDGET_MEMORY_MB",
    ):
        monkeypatch.delenv(var, raising=False)
    served = Budget.from_env()
    assert served.scored_tokens == 150_000 and served.decoded_tokens == 16_384 and served.memory_mb >= 512
    assert Budget.from_env(served=False) == Budget.unlimited()
    monkeypatch.setenv("FEEDBACK_BUDGET_SCORED_TOKENS", "1_000")
    monkeypatch.setenv("FEEDBACK_BUDGET_DECODED_TOKENS", "none")
    monkeypatch.setenv("FEEDBACK_BUDGET_MEMORY_MB", "0")
    assert Budget.from_env() == Budget(1000, None, None)
    assert (
        Budget.from_env(served=False).scored_tokens == 1000
    )  # set explicitly: the command line obeys it too
    for bad in ("lots", "-5", "1.5"):
        monkeypatch.setenv("FEEDBACK_BUDGET_SCORED_TOKENS", bad)
        with pytest.raises(FeedbackError, match="FEEDBACK_BUDGET_SCORED_TOKENS must"):
            Budget.from_env()


def test_scoring_cost_counts_every_pass():
    assert scoring_cost(1000, None, 3, 1) == 1000  # baseline only
    assert scoring_cost(1000, "parallel", 3, 1) == 2000
    assert scoring_cost(1000, "jacobi", 3, 1) == 4000
    assert scoring_cost(1000, "exact", 3, 1) == 1000 * (1 + EXACT_COST)
    assert scoring_cost(1000, "parallel", 3, 12) == 13_000  # a sweep: the baseline once, 12 points


def test_scoring_work_sums_the_windows():
    cfg = PPLConfig("deep_cache", window=100, stride=50).validate(8192)
    # 250 tokens in windows of 100 moving by 50: [0,100) [50,150) [100,200) [150,250) = 400 window tokens
    cost, how = scoring_work([250, 1, 60], cfg)  # a 1-token document is not scored; 60 fits one window
    assert cost == 2 * (400 + 60) and "460 window tokens" in how and "parallel" in how
    jacobi = PPLConfig("residual", window=100, stride=50, passes=4).validate(8192)
    assert scoring_work([100], jacobi)[0] == 100 * 5 and "4 passes" in scoring_work([100], jacobi)[1]


def test_refusals_name_the_budget_and_its_setting():
    b = Budget(scored_tokens=10, decoded_tokens=10, memory_mb=10)
    for check, var in [
        (b.check_scoring, "FEEDBACK_BUDGET_SCORED_TOKENS"),
        (b.check_decoding, "FEEDBACK_BUDGET_DECODED_TOKENS"),
        (b.check_memory, "FEEDBACK_BUDGET_MEMORY_MB"),
    ]:
        with pytest.raises(FeedbackError, match=var):
            check(11, "how it adds up")
        check(10, "at the limit is fine")
    Budget.unlimited().check_scoring(10**12, "anything")


def test_memory_estimate_by_hand():
    cfg = SimpleNamespace(
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_size=576
    )
    assert (
        kv_bytes_per_token(cfg, 4) == 30 * 2 * 3 * 64 * 4
    )  # 46,080 bytes a token a row (SmolLM2-135M, fp32)
    mb = generation_memory_mb(cfg, 4, rows=8, prompt_tokens=7000, new_tokens=1024)
    cache = 8 * 8024 * 46_080
    scratch = PREFILL_CHUNK * 8024 * 9 * 4
    assert mb == pytest.approx((cache + scratch) / 2**20) and 2_800 < mb < 3_000


def test_the_cap_never_starts_cuda_where_it_has_not_started(monkeypatch):
    """ZeroGPU's main process holds a model on "cuda" but must not start CUDA: with CUDA not yet
    started the cap asks nothing of it (the request's budget is the check there)."""
    import torch

    from feedback.core.budget import MEMORY_CAP_ENV, check_fits, memory_cap_mb

    monkeypatch.delenv(MEMORY_CAP_ENV, raising=False)
    if torch.cuda.is_initialized():
        pytest.skip("CUDA already started in this process")
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda *_: pytest.fail("CUDA was asked for its free memory")
    )
    assert memory_cap_mb(torch.device("cuda")) == float("inf")
    check_fits(10**9, "a huge run", torch.device("cuda"))  # not refused here
