"""Deep Think tab and the Compare tab's Calibrate action, through their API endpoints."""

from __future__ import annotations

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError


@pytest.fixture()
def client(app_url):
    return Client(app_url, verbose=False)


def test_deepthink_endpoint_reports_both_sides(client):
    job = client.submit(
        "What is 2 + 3? Answer with a number.",
        "5",
        "deep_cache",
        2,
        2,
        "custom",
        50,
        4,
        16,
        0.8,
        0.95,
        0,
        "",
        False,
        False,
        api_name="/deepthink",
    )
    summary, votes, base_curves, fb_curves, table, report, warm_hist, status = job.result()
    assert "### Baseline" in summary and "### Feedback" in summary and "tokens spent" in summary
    assert "majority vote" in summary and "tail-weighted vote" in summary and "Done" in status
    assert set(report["sides"]) == {"baseline", "feedback"} and report["config"]["eta"] == 50
    assert report["config"]["expected"] == "5"
    assert len(table["data"]) == 8  # (2 warm-up + 2 online) traces x 2 sides
    assert all(
        row[7] in ("✓", "✗") for row in table["data"]
    )  # every trace marked against the expected answer
    texts = {t["name"]: t["text"] for side in report["sides"].values() for t in side["traces"]}
    assert all(row[8] == texts[row[2]] for row in table["data"])  # whole texts, not cut
    assert "threshold" in base_curves["plot"] and "bar" in votes["plot"]
    assert "baseline s = " in warm_hist["plot"] and "feedback s = " in warm_hist["plot"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ("", "", "residual", 2, 2, "custom", 50, 4, 16, 0.8, 0.95, 0, "", False, False),
            "the question is empty",
        ),
        (
            ("q", "", "residual", 2, 2, "custom", 50, 4, 16, 0.8, 0.95, 0, "(bad", False, False),
            "does not compile",
        ),
        (
            ("q", "", "residual", 40, 2, "custom", 50, 4, 16, 0.8, 0.95, 0, "", False, False),
            "traces per side must be between 1 and 16, got 40",
        ),
    ],
)
def test_deepthink_bad_input(client, args, message):
    with pytest.raises(AppError, match=message):
        client.predict(*args, api_name="/deepthink")


def test_calibrate_sets_a_fixed_threshold_and_samples_when_compare_is_greedy(client):
    calibrate = dict(
        prompt="Name a colour.",
        chat_template=True,
        model="embedded",
        seed=0,
        window=4,
        k=20,
        max_new_tokens=16,
        eta_preset="DeepConf-high (keep 90%)",
        eta=50,
        warmup=3,
        api_name="/calibrate",
    )
    mode, threshold, plot, note, status = client.predict(temperature=0.8, top_p=0.95, **calibrate)
    assert mode == "fixed" and threshold == round(threshold, 2) and f"{threshold:.2f}" in note
    plot = plot.get("value", plot)  # an update that also makes the (hidden until now) chart visible
    assert "histogram" in plot["plot"] and "sampled at temperature" not in note
    mode, threshold, plot, note, status = client.predict(temperature=0.0, top_p=1.0, **calibrate)
    assert mode == "fixed" and "sampled at temperature 0.7" in note and "Calibrated" in status
