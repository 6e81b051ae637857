"""The app's named API endpoints, called with gradio_client against the app running in-process."""
from __future__ import annotations

import csv
import io
import time

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError


@pytest.fixture()
def client(app_url):
    return Client(app_url, verbose=False)


def test_every_handler_has_a_named_endpoint(client):
    names = set(client.view_api(return_format="dict", print_info=False)["named_endpoints"])
    assert {"/compare", "/calibrate", "/stop", "/memory", "/rerender", "/select_model", "/history", "/export_json",
            "/export_csv", "/reload", "/perplexity", "/stop_perplexity", "/sweep", "/stop_sweep", "/deepthink",
            "/stop_deepthink"} <= names


def test_compare_streams_both_rows_with_records(client):
    job = client.submit("What is the capital of France?", max_new_tokens=24, residual_alpha=0.3, api_name="/compare")
    updates = list(job)
    assert len(updates) >= 2  # streamed, not one final answer
    base_head, base_html, base_stats, fb_head, fb_html, fb_stats, conf_plot, mem_plot, status, run = job.outputs()[-1]
    assert "fl-tok" in base_html and "fl-tok" in fb_html and "Paris" in base_html
    assert "### Baseline" in base_head and "residual" in fb_head and "alpha=0.3" in fb_head
    assert "tokens" in base_stats and "Done in" in status and "UI build" not in status
    assert conf_plot["type"] == "plotly" and "group conf" in conf_plot["plot"]
    rows = run["rows"]
    assert [r["name"] for r in rows] == ["baseline", "feedback"]
    assert rows[1]["params"]["alpha"] == 0.3
    for row in rows:
        assert row["text"] and len(row["steps"]) == len(row["token_ids"]) <= 24
        step = row["steps"][0]
        assert {"token_id", "text", "logprob", "confidence", "entropy", "group_confidence", "top"} <= set(step)
        assert len(step["top"]) == 5
    assert run["ui_seconds"] >= 0 and run["wall_seconds"] > 0


def test_bad_input_is_a_clear_error_and_the_app_keeps_serving(client):
    for kwargs, message in [
        (dict(prompt="   "), "prompt is empty"),
        (dict(prompt="hi", max_new_tokens=10**7), "greater than maximum value 1024"),
        (dict(prompt="hi", top_p=0.0), "top_p must be > 0"),
        (dict(prompt="hi", temperature=-1), "less than minimum value 0"),
        (dict(prompt="hi", model="evil/model"), "not in the list of choices"),
        (dict(prompt="hi", residual_alpha=5.0), "greater than maximum value 1.0"),  # said, not clamped to 1
        (dict(prompt="hi", strategy="nope"), "nope is not in the list of choices"),
    ]:
        with pytest.raises(AppError, match=message):
            client.predict(api_name="/compare", **kwargs)
    ok = client.predict("Say hi.", max_new_tokens=4, api_name="/compare")
    assert ok[-1]["rows"][0]["token_ids"]


def test_stop_ends_the_run_within_a_step(client):
    job = client.submit("Write a very long story about a lighthouse keeper.", max_new_tokens=600,
                        api_name="/compare")
    t0 = time.time()
    while not job.outputs() and time.time() - t0 < 60:
        time.sleep(0.05)
    assert client.predict(api_name="/stop") == "Stopping…"
    run = job.result()[-1]
    assert all(r["stop_reason"] == "stopped" for r in run["rows"])
    assert all(len(r["token_ids"]) < 600 for r in run["rows"])
    assert client.predict(api_name="/stop") == "Nothing is running."


def test_memory_and_history_exports(client):
    fig = client.predict(api_name="/memory")  # the sample list itself is session state, not output
    assert fig["type"] == "plotly" and "RSS (MB)" in fig["plot"] and "seconds since" in fig["plot"]
    run = client.predict("Name a fruit.", max_new_tokens=6, api_name="/compare")[-1]
    hist = [{"id": run["run_id"], "created": "now", "result": run}]
    path = client.predict(hist, [], api_name="/export_csv")
    assert path.endswith(".csv") and run["run_id"] in path
    rows = list(csv.reader(io.StringIO(open(path, encoding="utf-8").read())))
    assert rows[0][:3] == ["run_id", "created", "prompt"] and rows[1][2] == "Name a fruit."
    assert len(rows) == 1 + sum(len(r["steps"]) for r in run["rows"])
    path = client.predict(hist, [run["run_id"]], api_name="/export_json")
    assert '"first_divergence_step"' in open(path, encoding="utf-8").read()


def test_reload_restores_the_prompt_and_every_setting(client):
    run = client.predict("Name a planet.", max_new_tokens=6, temperature=0.5, seed=7, strategy="soft_token",
                         soft_token_beta=0.25, window=12, api_name="/compare")[-1]
    hist = [{"id": run["run_id"], "created": "now", "result": run}]
    out = client.predict(hist, [run["run_id"]], "plain", api_name="/reload")
    prompt, chat, model, temperature, top_p, top_k, min_p, rep, max_new, seed, k, window, *_ = out
    assert (prompt, chat, temperature, max_new, seed, k, window) == ("Name a planet.", True, 0.5, 6, 7, 20, 12)
    assert "soft_token" in out and 0.25 in out  # the strategy and its parameter come back too
    assert any(isinstance(v, str) and run["rows"][0]["text"].strip()[:5] in v and "fl-tok" not in v for v in out)
    with pytest.raises(AppError, match="choose a run to reload"):
        client.predict([], [], "plain", api_name="/reload")
    with pytest.raises(AppError, match="choose a run to reload"):
        client.predict([{"broken": True}], ["x"], "plain", api_name="/reload")
