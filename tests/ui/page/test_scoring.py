"""What every corpus job's status line says (ui/page/scoring.py: the Perplexity tab's, the Sweep's and the
Tune's): the estimate before it starts, then where it stands within a point and the time left."""

from __future__ import annotations

import types

import torch

from feedback.eval.perplexity import PPLConfig, ScoringProgress, estimate
from ui.page.scoring import JobClock, part_text, scored_text

CFG = PPLConfig("residual", {}, "jacobi", passes=3, window=16, stride=8)


def unmeasured_model():
    """A model no rate has been measured for (the clock only looks its rate up)."""
    return types.SimpleNamespace(model=torch.nn.Module())


def test_the_estimate_says_tokens_times_points_times_passes_and_then_the_time():
    est = estimate([40, 10], CFG, points=6)
    assert part_text(est) == (
        f"2 documents, 48 tokens, fed as {est.window_tokens} window tokens × (baseline + 6 "
        f"points × 3 passes) = {est.forwards:,} token-forwards"
    )
    assert "× (baseline + feedback × 3 passes)" in part_text(estimate([40], CFG), noun="")
    assert "× baseline only" in part_text(estimate([40], PPLConfig()))
    clock = JobClock(unmeasured_model(), ("", "points", est))
    assert clock.estimate_text().endswith("the time follows once this model's speed is measured.")
    assert clock.where_text(0.0) == "measuring this model's speed"
    assert clock.take(est.at(est.forwards / 40.0), 1.0)  # the rate, measured as the job starts
    assert clock.estimate_text().endswith(
        f"about 40 s at {est.forwards / 40.0:,.0f} token-forwards/s measured on this model."
    )
    assert clock.where_text(1.0) == "starting"


def test_progress_within_a_point_counts_down_the_time_left():
    est = estimate([40, 10], CFG, points=6)
    clock = JobClock(unmeasured_model(), ("", "points", est))
    at = ScoringProgress(
        document=1,
        documents=2,
        tokens=20,
        total=48,
        forwards=est.forwards // 4,
        point=2,
        points=6,
        stage="point",
    )
    assert clock.take(at, 10.0) and not clock.take({"a": "row"}, 10.0)
    assert clock.where_text(10.0) == "point 2 of 6: 20 of 48 tokens scored (document 1 of 2); about 30 s left"
    assert clock.where_text(14.0).endswith("about 26 s left")  # no new report yet: it counts down
    assert (
        scored_text(ScoringProgress(1, 3, 5, 9, 0, 3, 0, "trial"))
        == "trial 3: 5 of 9 tokens scored (document 1 of 3)"
    )
    assert scored_text(ScoringProgress(2, 3, 5, 9, 0, 1, 1, "test")).startswith("test: 5 of 9")


def test_a_tune_estimates_its_search_then_its_test():
    search, test = estimate([40, 10], CFG, points=4), estimate([30], CFG)
    clock = JobClock(unmeasured_model(), ("search: ", "trials", search), ("test once: ", "", test))
    assert clock.forwards == search.forwards + test.forwards
    assert (
        "search: 2 documents" in clock.estimate_text()
        and "; then test once: 1 document, 29 tokens" in clock.estimate_text()
    )
    assert (
        JobClock(unmeasured_model(), ("search: ", "trials", search), ("test once: ", "", None)).forwards
        == search.forwards
    )  # no test set: no test part
