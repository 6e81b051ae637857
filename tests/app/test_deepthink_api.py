"""Deep Think tab and the Compare tab's Calibrate action, through their API endpoints."""
from __future__ import annotations

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError


@pytest.fixture()
def client(app_url):
    return Client(app_url, verbose=False)


def test_deepthink_endpoint_reports_both_sides(client):
    job = client.submit("What is 2 + 3? Answer with a number.", "deep_cache", 2, 2, "custom", 50, 4, 16, 0.8, 0.95,
                        0, "", False, False, api_name="/deepthink")
    summary, votes, base_curves, fb_curves, table, report, warm_hist = job.result()
    assert "### Baseline" in summary and "### Feedback" in summary and "tokens spent" in summary
    assert set(report["sides"]) == {"baseline", "feedback"} and report["config"]["eta"] == 50
    assert len(table["data"]) == 8  # (2 warm-up + 2 online) traces x 2 sides
    assert '"threshold"' in base_curves["plot"] and "bar" in votes["plot"]
    assert "baseline s = " in warm_hist["plot"] and "feedback s = " in warm_hist["plot"]


@pytest.mark.parametrize("args, message", [
    (("", "residual", 2, 2, "custom", 50, 4, 16, 0.8, 0.95, 0, "", False, False), "prompt is empty"),
    (("q", "residual", 2, 2, "custom", 50, 4, 16, 0.8, 0.95, 0, "(bad", False, False), "does not compile"),
])
def test_deepthink_bad_input(client, args, message):
    with pytest.raises(AppError, match=message):
        client.predict(*args, api_name="/deepthink")


def test_calibrate_sets_a_fixed_threshold(client):
    mode, threshold, plot, note = client.predict(
        "Name a colour.", True, "residual", 0.8, 0.95, 0, 4, 20, 16, "DeepConf-high (keep 90%)", 50, 3,
        api_name="/calibrate")
    assert mode == "fixed" and isinstance(threshold, float) and f"{threshold:.3f}" in note
    assert "histogram" in plot["plot"]
    with pytest.raises(AppError, match="temperature above 0"):
        client.predict("Name a colour.", True, "residual", 0.0, 0.95, 0, 4, 20, 16, "DeepConf-high (keep 90%)", 50,
                       3, api_name="/calibrate")
