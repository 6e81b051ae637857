"""The app's named API endpoints, called with gradio_client against the app running in-process."""

from __future__ import annotations

import csv
import io
import time

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from ui.compare import stream


@pytest.fixture()
def client(app_url):
    return Client(app_url, verbose=False)


def test_every_handler_has_a_named_endpoint(client):
    names = set(client.view_api(return_format="dict", print_info=False)["named_endpoints"])
    assert {
        "/compare",
        "/continue",
        "/branch",
        "/link",
        "/new_conversation",
        "/calibrate",
        "/stop",
        "/memory",
        "/select_model",
        "/history",
        "/export_json",
        "/export_csv",
        "/export_llm_comparator",
        "/reload",
        "/perplexity",
        "/stop_perplexity",
        "/sweep",
        "/stop_sweep",
        "/deepthink",
        "/stop_deepthink",
    } <= names


def columns_of(outputs: tuple) -> list[dict]:
    """Compare's columns from its outputs as the API returns them (the board's document, the metrics
    table, both charts, the status and the run): each column's heading and its text."""
    events = stream.parse(outputs[0])
    heads = events[0][1]["columns"]
    return [
        head | {"text": "".join(e[4] for e in events if e[0] == "t" and e[1] == i)}
        for i, head in enumerate(heads)
    ]


def metrics_of(outputs: tuple) -> str:
    return outputs[1]


def test_compare_streams_both_rows_with_records(client):
    job = client.submit(
        "What is the capital of France?", max_new_tokens=24, c2_residual_alpha=0.3, api_name="/compare"
    )
    updates = list(job)
    assert len(updates) >= 2  # streamed, not one final answer
    out = job.outputs()[-1]
    (base, fb), (conf_plot, status, run) = columns_of(out), (out[-4], out[-2], out[-1])
    assert "Paris" in base["text"] and [base["text"], fb["text"]] == [r["text"] for r in run["rows"]]
    assert base["name"] == "Baseline" and fb["strategy"] == "residual" and "alpha=0.3" in fb["params"]
    metrics = metrics_of(out)
    assert (
        '<th scope="col">' in metrics
        and "tokens" in metrics
        and "self-PPL" in metrics
        and "Done in" in status
    )
    assert conf_plot["type"] == "plotly" and "group conf" in conf_plot["plot"]
    rows = run["rows"]
    assert [r["name"] for r in rows] == ["Baseline", "Feedback"]
    assert rows[1]["params"]["alpha"] == 0.3
    for row in rows:
        assert row["text"] and len(row["steps"]) == len(row["token_ids"]) <= 24
        step = row["steps"][0]
        assert {"token_id", "text", "logprob", "confidence", "entropy", "group_confidence", "top"} <= set(
            step
        )
        assert len(step["top"]) == 5 and {"self_ppl", "prompt_ppl", "distinct_1"} <= set(row["metrics"])
    assert run["ui_seconds"] >= 0 and run["wall_seconds"] > 0


def test_three_columns_with_their_own_prompts_then_continue_and_branch(client):
    """A prompt-engineering session through the API: three prompt variants, a follow-up turn in
    every column, a branch from an alternative token; every call one engine run."""
    out = client.predict(
        "What is the capital of France?",
        columns=3,
        max_new_tokens=12,
        c2_strategy="none",
        c2_name="Precise",
        c2_prompt="What is the capital of France? Answer in one precise sentence.",
        c3_name="Anchor",
        c3_strategy="anchor",
        c3_prompt="Capital of France?",
        key_facts="Paris",
        api_name="/compare",
    )
    cols, run = columns_of(out), out[-1]
    assert [r["name"] for r in run["rows"]] == ["Baseline", "Precise", "Anchor"]
    assert [r["prompt"] for r in run["config"]["rows"]] == [
        None,
        "What is the capital of France? Answer in one precise sentence.",
        "Capital of France?",
    ]
    assert "prompt modified" in cols[1]["badges"] and "prompt modified" not in cols[0]["badges"]
    assert "key facts" in metrics_of(out) and [c["text"] for c in cols] == [r["text"] for r in run["rows"]]
    follow = client.predict("And of Italy?", api_name="/continue")[-1]
    assert [r["name"] for r in follow["rows"]] == ["Baseline", "Precise", "Anchor"]
    history = follow["config"]["rows"][1]["messages"]
    assert (
        history[0]["content"].startswith("What is the capital of France? Answer")
        and history[1]["content"] == run["rows"][1]["text"]
    )  # each column's own previous answer
    alt = follow["rows"][2]["steps"][1]["top"][1]["token_id"]
    request = f'{{"row": "Anchor", "step": 1, "token_id": {alt}}}'
    branched = client.predict(request, True, api_name="/branch")[-1]
    steps = branched["rows"][2]["steps"]
    assert (
        steps[1]["token_id"] == alt and steps[1]["forced"] and steps[0]["forced"] and not steps[2]["forced"]
    )
    assert branched["rows"][0]["steps"][1]["token_id"] == alt  # every column forced at the same step
    with pytest.raises(AppError, match="unknown row"):
        client.predict('{"row": "Nope", "step": 1, "token_id": 5}', True, api_name="/branch")


def test_a_copied_link_restores_the_same_run(client):
    from ui.compare import link

    data = client.predict(
        "Say hi.",
        "",
        True,
        "embedded",
        0.0,
        1.0,
        0,
        0.0,
        1.0,
        5,
        0,
        20,
        32,
        "off",
        4.5,
        "",
        "",
        3,
        c3_name="Third",
        c3_strategy="deep_cache",
        api_name="/link",
    )
    cfg = link.decode(data)
    assert [r.name for r in cfg.rows] == ["Baseline", "Feedback", "Third"] and cfg.rows[
        2
    ].strategy == "deep_cache"
    with pytest.raises(AppError, match="column names must be different"):
        client.predict(
            "Say hi.",
            "",
            True,
            "embedded",
            0.0,
            1.0,
            0,
            0.0,
            1.0,
            5,
            0,
            20,
            32,
            "off",
            4.5,
            "",
            "",
            2,
            c2_name="Baseline",
            api_name="/link",
        )


def test_bad_input_is_a_clear_error_and_the_app_keeps_serving(client):
    for kwargs, message in [
        (dict(prompt="   "), "prompt is empty"),
        (dict(prompt="hi", max_new_tokens=10**7), "max new tokens must be between 1 and 1024, got 10000000"),
        (dict(prompt="hi", max_new_tokens="abc"), "max new tokens must be a number, got 'abc'"),
        (dict(prompt="hi", top_p=0.0), "top_p must be > 0"),
        (dict(prompt="hi", temperature=-1), "temperature must be between 0 and 10, got -1"),
        (dict(prompt="hi", temperature="NaN"), "temperature must be finite, got 'NaN'"),
        (dict(prompt="hi", seed=-5), "seed must be at least 0, got -5"),
        (dict(prompt="hi", model="evil/model"), "Model must be one of: embedded; got 'evil/model'"),
        # not clamped: refused by the strategy, naming the column and the parameter
        (
            dict(prompt="hi", c2_residual_alpha=5.0),
            r"row 'Feedback': parameter alpha=5.0 is out of range \[-1.0, 1.0\]",
        ),
        (
            dict(prompt="hi", c2_strategy="nope"),
            "column 2: Feedback strategy must be one of: none, .*; got 'nope'",
        ),
        (dict(prompt="hi", columns=5), "columns must be between 2 and 4, got 5"),
        (dict(prompt={"nested": [1]}), r"Prompt must be text, got \{'nested': \[1\]\}"),
        (dict(prompt="hi", chat_template="yes"), "Use the chat template must be true or false, got 'yes'"),
        (dict(prompt="hi", c2_temperature="warm"), "column 2: temperature must be a number"),
    ]:
        with pytest.raises(AppError, match=message):
            client.predict(api_name="/compare", **kwargs)
    ok = client.predict("Say hi.", max_new_tokens=4, api_name="/compare")
    assert ok[-1]["rows"][0]["token_ids"]


def test_stop_ends_the_run_within_a_step(client):
    job = client.submit(
        "Write a very long story about a lighthouse keeper.", max_new_tokens=600, api_name="/compare"
    )
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
    run = client.predict(
        "Name a planet.",
        max_new_tokens=6,
        temperature=0.5,
        seed=7,
        c2_strategy="soft_token",
        c2_soft_token_beta=0.25,
        window=12,
        columns=3,
        c3_prompt="Name a planet, briefly.",
        api_name="/compare",
    )[-1]
    hist = [{"id": run["run_id"], "created": "now", "result": run}]
    out = client.predict(hist, [run["run_id"]], "plain", api_name="/reload")
    prompt, system, chat, model, temperature, top_p, top_k, min_p, rep, max_new, seed, k, window, *_ = out
    assert (prompt, chat, temperature, max_new, seed, k, window) == (
        "Name a planet.",
        True,
        0.5,
        6,
        7,
        20,
        12,
    )
    assert "soft_token" in out and 0.25 in out  # the strategy and its parameter come back too
    assert 3 in out and "Name a planet, briefly." in out  # the third column and its own prompt
    (board,) = [
        v for v in out if isinstance(v, str) and v.startswith('["run"')
    ]  # the board draws the run whole
    assert "".join(e[4] for e in stream.parse(board) if e[0] == "t" and e[1] == 0) == run["rows"][0]["text"]
    with pytest.raises(AppError, match="choose a run to reload"):
        client.predict([], [], "plain", api_name="/reload")
    with pytest.raises(AppError, match="choose a run to reload"):
        client.predict([{"broken": True}], ["x"], "plain", api_name="/reload")


def test_a_column_stacks_two_strategies_and_reloads_as_a_stack(client):
    run = client.predict(
        "Name a river.",
        max_new_tokens=5,
        c2_strategy="inner_loop",
        c2_stack="deep_cache",
        c2_deep_cache_lam=0.15,
        c2_inner_loop_mode="euler",
        api_name="/compare",
    )[-1]
    stacked = run["rows"][1]
    assert stacked["strategy"] == "inner_loop+deep_cache" and stacked["params"]["deep_cache.lam"] == 0.15
    assert stacked["params"]["inner_loop.mode"] == "euler" and stacked["metrics"]["extra_layer_passes"] == 22
    hist = [{"id": run["run_id"], "created": "now", "result": run}]
    out = client.predict(hist, [run["run_id"]], "plain", api_name="/reload")
    assert "inner_loop" in out and 0.15 in out and "euler" in out  # the first strategy, both sets of controls
    assert any(
        isinstance(v, dict) and v.get("value") == "deep_cache" and v.get("visible") for v in out
    )  # stack with
    with pytest.raises(AppError, match="restate is prompt-level"):
        client.predict(
            "Name a river.",
            max_new_tokens=3,
            c2_strategy="restate",
            c2_stack="deep_cache",
            api_name="/compare",
        )
