"""Perplexity and Sweep tabs through their API endpoints on the running app."""

from __future__ import annotations

import time

import httpx
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

TEXT = (
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\nprint(add(3, 4))\n"
    "The function add returns the sum of its two arguments. " * 2
)


@pytest.fixture()
def client(app_url):
    return Client(app_url, verbose=False)


def test_perplexity_on_pasted_text(client):
    summary, coloured, fig, table, result, status = client.predict(
        "pasted text", TEXT, None, "deep_cache", "auto", 3, 5, deep_cache_lam=0.2, api_name="/perplexity"
    )
    assert "Baseline PPL" in summary and "Feedback PPL" in summary and "95% CI" in summary
    assert result["mode"] == "parallel" and result["config"]["params"]["lam"] == 0.2
    assert result["ci95"][0] <= result["delta_pct"] <= result["ci95"][1]
    # every scored token, plus the first one shown unscored
    assert coloured.count('class="fl-tok"') == result["tokens"] and coloured.count("fl-tok fl-first") == 1
    assert "NLL baseline" in coloured and "not scored" in coloured
    assert fig["type"] == "plotly" and table["data"][0][0] == "pasted text" and "Done" in status


def test_perplexity_on_an_uploaded_jsonl_with_a_bad_line(client, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(
        '{"text": "First document about rivers and seas."}\nnot json\n'
        '{"text": "Second document about clouds and rain."}\n'
    )
    summary, coloured, fig, table, result, status = client.predict(
        "uploaded file", "", handle_file(str(path)), "residual", "jacobi", 2, 5, api_name="/perplexity"
    )
    assert result["documents"] == 2 and result["mode"] == "jacobi" and result["approximate"] is True
    assert "approximate, 2 passes" in summary and len(table["data"]) == 2 and coloured == ""


@pytest.mark.parametrize(
    "args, message",
    [
        (("pasted text", "   ", None, "deep_cache", "auto", 3, 5), "paste some text"),
        (("uploaded file", "", None, "deep_cache", "auto", 3, 5), "upload a .txt or .jsonl"),
        (("pasted text", TEXT, None, "residual", "parallel", 3, 5), "recurrent"),
    ],
)
def test_perplexity_bad_input(client, args, message):
    with pytest.raises(AppError, match=message):
        client.predict(*args, api_name="/perplexity")


def test_oversized_upload_is_refused(client, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("x" * 5_000_001)
    with pytest.raises(AppError, match="uploads are limited to 5 MB"):
        client.predict(
            "uploaded file", "", handle_file(str(big)), "deep_cache", "auto", 3, 5, api_name="/perplexity"
        )


def test_sweep_streams_a_heatmap_and_a_csv(client):
    job = client.submit(
        "pasted text", TEXT, None, "deep_cache", "lam=0,0.2", "theta=10,40", "auto", 3, 5, api_name="/sweep"
    )
    updates = list(job)
    assert len(updates) >= 4  # one per point, then the final one
    heat, status, csv_path = job.outputs()[-1]
    assert (
        "Done: 4 points" in status and '"heatmap"' in heat["plot"] and "strength-0 points left out" in status
    )
    # the no-op points are never "best" (nor the lowest, when no point beats the baseline)
    assert "strength-0 points left out): lam=0.2," in status and "lam=0.0," not in status
    assert open(csv_path, encoding="utf-8").read().startswith("lam,theta,delta_pct")
    assert csv_path.endswith(".csv") and "sweep-deep_cache-" in csv_path
    with pytest.raises(AppError, match="unknown parameter"):
        client.predict("pasted text", TEXT, None, "deep_cache", "zeta=1", "", "auto", 3, 5, api_name="/sweep")
    with pytest.raises(AppError, match="the page runs at most 24"):
        client.predict(
            "pasted text",
            TEXT,
            None,
            "deep_cache",
            "lam=0,0.1,0.2,0.3,0.4",
            "theta=1,2,3,4,5",
            "auto",
            3,
            5,
            api_name="/sweep",
        )


def test_a_cancelled_perplexity_request_frees_the_model_line_within_seconds(client, app_url):
    """A Gradio client cancels a long Perplexity run: the line must not stay busy after it."""
    health = f"{app_url.rstrip('/')}/api/health"
    job = client.submit("builtin:dev", "", None, "deep_cache", "auto", 3, 20, api_name="/perplexity")
    t0 = time.monotonic()
    while httpx.get(health).json()["running"] == 0:
        assert time.monotonic() - t0 < 60
        time.sleep(0.1)
    job.cancel()
    t0 = time.monotonic()
    while httpx.get(health).json()["running"]:
        assert time.monotonic() - t0 < 10, httpx.get(health).json()
        time.sleep(0.1)
