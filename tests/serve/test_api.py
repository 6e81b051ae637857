"""The HTTP API (feedback/serve/api/) against real servers on 127.0.0.1, driven with httpx."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import jsonschema_rs  # schemathesis' own validator (requirements-dev.txt)
import pytest

from feedback.core.budget import Budget
from feedback.core.engine import run_to_end
from feedback.core.records import MAX_PROMPT_CHARS
from feedback.serve.api import ApiSettings, GenerateIn, local_server, to_config
from feedback.serve.limits import SHARED_RUNS
from feedback.serve.pool import ModelPool

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def serve(lm, settings: ApiSettings, max_waiting: int | None = None):
    """The API mounted at /api exactly as app.py mounts it, served by uvicorn on a free port (its
    line holding at most `max_waiting` waiting requests; None: the served default)."""
    pool = ModelPool.serving(lm)
    if max_waiting is not None:
        pool.gate.max_waiting = max_waiting
    with local_server(pool, settings) as url:
        yield url, pool


@pytest.fixture(scope="module")
def api(embedded_lm):
    with serve(embedded_lm, ApiSettings()) as (url, pool):
        with httpx.Client(base_url=url + "/api", timeout=300) as client:
            yield client, pool


@pytest.fixture(scope="module")
def keyed(embedded_lm):
    with serve(embedded_lm, ApiSettings(keys=("k-one", "k-two"), max_body_bytes=4096), max_waiting=0) as (
        url,
        pool,
    ):
        yield url + "/api", pool


def _ndjson(response: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in response.iter_lines() if line]


def test_generate_returns_both_rows_exactly_as_the_engine_runs_them(api, embedded_lm):
    client, _ = api
    body = {"prompt": "What is the capital of France?", "max_new_tokens": 12, "params": {"alpha": 0.2}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert [row["name"] for row in data["rows"]] == ["baseline", "feedback"]
    assert data["rows"][1]["params"]["alpha"] == 0.2 and "Paris" in data["rows"][0]["text"]
    assert data["queued_seconds"] >= 0 and len(data["rows"][0]["steps"]) == len(data["rows"][0]["token_ids"])
    direct = run_to_end(embedded_lm, to_config(GenerateIn(**body), embedded_lm.name))
    assert [row["token_ids"] for row in data["rows"]] == [row.token_ids for row in direct.rows]


def test_explicit_rows_and_compact_results(api):
    client, _ = api
    r = client.post(
        "/generate",
        json={
            "prompt": "Name a fruit.",
            "max_new_tokens": 5,
            "steps": False,
            "sampling": {"temperature": 0.8, "top_p": 0.9, "top_k": 40},
            "seed": 7,
            "rows": [
                {"name": "plain"},
                {"name": "res", "strategy": "residual", "params": {"alpha": 0.1}},
                {"name": "cache", "strategy": "deep_cache"},
            ],
        },
    )
    assert r.status_code == 200, r.text
    rows = r.json()["rows"]
    assert [row["name"] for row in rows] == ["plain", "res", "cache"]
    assert all("steps" not in row and 1 <= len(row["token_ids"]) <= 5 for row in rows)


def test_inner_loop_and_restate_rows_and_inner_loop_perplexity(api):
    client, _ = api
    r = client.post(
        "/generate",
        json={
            "prompt": "What is the capital of France?",
            "max_new_tokens": 24,
            "reference": "Paris.",
            "rows": [
                {"name": "plain"},
                {"name": "loop", "strategy": "inner_loop", "params": {"mode": "euler"}},
                {"name": "restate", "strategy": "restate", "params": {"max_tokens": 8}},
            ],
        },
    )
    assert r.status_code == 200, r.text
    plain, loop, restate = r.json()["rows"]
    assert loop["metrics"]["extra_layer_passes"] == 2 * 11 and "extra_layer_passes" not in plain["metrics"]
    assert restate["text"].startswith("Key facts:") and "Answer:" in restate["text"]
    assert {s["part"] for s in restate["steps"]} >= {"restate", "transition"}
    assert restate["metrics"]["restatement_tokens"] <= 8 and restate["metrics"]["reference_ppl_with_strategy"]
    ppl = client.post(
        "/ppl",
        json={
            "text": "Rivers carry water to the sea, and the sea returns it as rain.",
            "strategy": "inner_loop",
            "bootstrap": 0,
        },
    )
    assert ppl.status_code == 200 and ppl.json()["mode"] == "parallel", ppl.text
    refused = client.post("/ppl", json={"text": "Some text to score here.", "strategy": "restate"})
    assert refused.status_code == 422 and "prompt-level" in refused.json()["error"]


def test_a_stack_row_its_schema_and_its_perplexity(api):
    client, _ = api
    schema = client.get("/strategies", params={"stack": "inner_loop+deep_cache"}).json()
    assert schema["stack"]["members"] == ["inner_loop", "deep_cache"] and "'+'" in schema["stacking"]
    assert "deep_cache.lam" in {p["name"] for p in schema["stack"]["params"]}
    r = client.post(
        "/generate",
        json={
            "prompt": "Name three rivers.",
            "max_new_tokens": 6,
            "rows": [
                {"name": "plain"},
                {
                    "name": "both",
                    "strategy": "inner_loop+deep_cache",
                    "params": {"inner_loop.mode": "euler", "deep_cache.lam": 0.1},
                },
            ],
        },
    )
    assert r.status_code == 200, r.text
    both = r.json()["rows"][1]
    assert both["params"]["inner_loop.mode"] == "euler" and both["metrics"]["extra_layer_passes"] == 2 * 11
    ppl = client.post(
        "/ppl",
        json={
            "text": "Rivers carry water to the sea, and the sea returns it as rain.",
            "strategy": "inner_loop+deep_cache",
            "bootstrap": 0,
        },
    )
    assert ppl.status_code == 200 and ppl.json()["mode"] == "parallel", ppl.text
    for body, message in [
        ({"strategy": "restate+deep_cache"}, "cannot be stacked"),
        ({"strategy": "inner_loop+deep_cache", "params": {"lam": 0.1}}, "<strategy>.<parameter>"),
    ]:
        refused = client.post("/generate", json={"prompt": "hi", **body})
        assert refused.status_code == 422 and message in refused.json()["error"], refused.text
    assert client.get("/strategies", params={"stack": "inner_loop+nope"}).status_code == 422


def test_stream_ndjson_carries_every_step_and_the_final_result(api):
    client, _ = api
    with client.stream(
        "POST", "/generate/stream", json={"prompt": "Count to five.", "max_new_tokens": 10}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        events = _ndjson(r)
    assert events[0]["event"] == "start" and events[0]["prompt_tokens"] > 0
    assert [e["rows"][0]["name"] for e in events[:1]] == ["baseline"]
    steps = [e for e in events if e["event"] == "step"]
    done = events[-1]
    assert done["event"] == "done" and [e["step"] for e in steps] == list(range(len(steps)))
    for row in done["result"]["rows"]:
        streamed = "".join(e["rows"][row["name"]]["text"] for e in steps if row["name"] in e["rows"])
        assert streamed == row["text"] and len(row["token_ids"]) <= 10
    assert {"confidence", "group_confidence", "top", "logprob"} <= set(steps[0]["rows"]["feedback"])
    refused = client.post("/generate/stream", json={"prompt": "hi", "strategy": "nope"})
    assert (
        refused.status_code == 422 and "unknown strategy" in refused.json()["error"]
    )  # before any stream starts


def test_a_long_prompt_streams_its_prefill_progress_before_the_steps(api, monkeypatch):
    import feedback.core.engine as engine

    monkeypatch.setattr(engine, "PREFILL_CHUNK", 8)  # a short prompt read in several chunks
    client, _ = api
    with client.stream(
        "POST", "/generate/stream", json={"prompt": "Count to five, slowly, one by one.", "max_new_tokens": 2}
    ) as r:
        events = _ndjson(r)
    kinds = [e["event"] for e in events]
    prefill = [e for e in events if e["event"] == "prefill"]
    assert (
        kinds[0] == "start"
        and kinds[1 : 1 + len(prefill)] == ["prefill"] * len(prefill)
        and len(prefill) >= 2
    )
    assert [e["chunk"] for e in prefill] == list(range(1, len(prefill) + 1))
    assert prefill[-1]["tokens"] == prefill[-1]["total"] == events[0]["prompt_tokens"]


def test_stream_as_server_sent_events(api):
    client, _ = api
    with client.stream(
        "POST",
        "/generate/stream",
        json={"prompt": "Hi", "max_new_tokens": 3},
        headers={"Accept": "text/event-stream"},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    blocks = [b for b in text.split("\n\n") if b.strip()]
    kinds = [b.splitlines()[0] for b in blocks]
    assert kinds[0] == "event: start" and kinds[-1] == "event: done" and "event: step" in kinds
    assert all(b.splitlines()[1].startswith("data: {") for b in blocks)
    json.loads(blocks[-1].splitlines()[1][len("data: ") :])


def test_a_client_that_disconnects_stops_the_run(api, embedded_lm, hook_count):
    client, pool = api
    body = {"prompt": "Write a very long story about a lighthouse keeper.", "max_new_tokens": 1000}
    started = time.time()
    with client.stream("POST", "/generate/stream", json=body) as r:
        lines = r.iter_lines()
        for _ in range(4):  # start + three steps, then hang up
            next(lines)
    # A full run would take ~100 s; the server notices the hang-up and frees the model within a step or two.
    deadline = time.time() + 15
    while pool.gate.status()["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert pool.gate.status()["running"] == 0 and time.time() - started < 15
    assert hook_count(embedded_lm.model) == 0
    assert client.post("/generate", json={"prompt": "Hi", "max_new_tokens": 2}).status_code == 200


def test_a_generate_client_that_gives_up_stops_the_run(api, embedded_lm, hook_count):
    client, pool = api
    body = {"prompt": "Write a very long story about a lighthouse keeper.", "max_new_tokens": 1000}
    started = time.time()
    with pytest.raises(httpx.ReadTimeout):
        client.post("/generate", json=body, timeout=2)
    deadline = time.time() + 15
    while pool.gate.status()["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert pool.gate.status()["running"] == 0 and time.time() - started < 17
    assert hook_count(embedded_lm.model) == 0


def test_ppl_baseline_and_feedback_with_token_detail(api):
    client, _ = api
    text = "The quick brown fox jumps over the lazy dog. " * 6
    base = client.post("/ppl", json={"text": text})
    assert base.status_code == 200, base.text
    assert base.json()["baseline_ppl"] > 1 and "feedback_ppl" not in base.json()
    fb = client.post(
        "/ppl", json={"text": text, "strategy": "deep_cache", "token_detail": True, "bootstrap": 200}
    )
    data = fb.json()
    assert fb.status_code == 200 and data["baseline_ppl"] == pytest.approx(base.json()["baseline_ppl"])
    lo, hi = data["ci95"]
    assert lo <= data["delta_pct"] <= hi and data["mode"] == "parallel"
    assert len(data["token_detail"]["tokens"]) == len(data["token_detail"]["feedback_nll"]) == data["tokens"]
    bad = client.post("/ppl", json={"text": text, "strategy": "residual", "mode": "parallel"})
    assert bad.status_code == 422 and "recurrent" in bad.json()["error"]


def test_calibrate_reports_every_measure_per_row_and_refuses_what_it_cannot_do(api):
    client, _ = api
    body = {
        "questions": [
            {"question": "What is 2 + 2?", "answer": 4},
            {"question": "Name a colour.", "answer": "red"},
        ],
        "samples": 1,
        "max_new_tokens": 2,
        "window": 2,
        "etas": [90],
    }
    r = client.post("/calibrate", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert (
        set(data["sides"]) == {"baseline", "feedback"} and "traces" not in data and data["split"]["test"] == 1
    )
    side = data["sides"]["feedback"]
    assert set(side["measures"]) == {"mean", "tail", "bottom10_group", "lowest_group"}
    assert side["traces"] == {"dev": 1, "test": 1} and side["thresholds"][0]["eta"] == 90
    for change, message in [
        ({"questions": body["questions"][:1]}, "questions"),
        ({"etas": [0]}, "etas.0"),
        ({"samples": 16, "max_new_tokens": 512}, "FEEDBACK_BUDGET_DECODED_TOKENS"),
        ({"strategy": "nope"}, "unknown strategy 'nope'"),
        ({"answer_regex": "(x"}, "does not compile"),
        ({"questions": [{"question": " ", "answer": 1}] * 2}, "questions.0.question"),
    ]:
        r = client.post("/calibrate", json=body | change)
        assert r.status_code == 422 and message in r.json()["error"], r.text


def test_health_models_strategies_and_openapi(api):
    client, _ = api
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["capacity"] == SHARED_RUNS
    assert health["models_loaded"] == ["embedded"] and health["room_mb"] > 0
    models = client.get("/models").json()
    assert models["default"] == "embedded" and models["models"][0]["layers"] == 30
    strategies = {s["name"]: s for s in client.get("/strategies").json()["strategies"]}
    assert {"residual", "soft_token", "deep_cache", "anchor", "inner_loop", "restate"} <= set(strategies)
    alpha = {p["name"]: p for p in strategies["residual"]["params"]}["alpha"]
    assert alpha["type"] == "float" and alpha["minimum"] == -1.0 and alpha["maximum"] == 1.0
    schema = client.get("/openapi.json").json()
    assert schema["servers"] == [{"url": "/api"}]
    assert {
        "/generate",
        "/generate/stream",
        "/continue",
        "/branch",
        "/ppl",
        "/calibrate",
        "/health",
        "/models",
        "/strategies",
    } <= set(schema["paths"])
    assert client.get("/docs").status_code == 200


@pytest.mark.parametrize(
    "body, status, message",
    [
        ("{not json", 400, "not valid JSON"),
        ('{"prompt": "hi", "sampling": {"temperature": NaN}}', 422, "sampling.temperature"),
        (json.dumps({"prompt": ""}), 422, "prompt"),
        (json.dumps({"prompt": "hi", "max_new_tokens": 5000}), 422, "less than or equal to 1024"),
        (json.dumps({"prompt": "hi", "strategy": "nope"}), 422, "unknown strategy 'nope'"),
        (json.dumps({"prompt": "hi", "params": {"alpha": 9}}), 422, "out of range"),
        (json.dumps({"prompt": "hi", "model": "evil/model"}), 422, "not in the allowlist"),
        (json.dumps({"prompt": "hi", "surprise": 1}), 422, "Extra inputs are not permitted"),
        (
            json.dumps({"prompt": "hi", "rows": [{"name": "a"}, {"name": "a"}]}),
            422,
            "row names must be unique",
        ),
        (json.dumps({"prompt": "x" * (MAX_PROMPT_CHARS + 1)}), 422, "at most 100000 characters"),
        (json.dumps({"prompt": "word " * 9000}), 422, "exceeds the model context"),
        (json.dumps([1, 2]), 422, "invalid request"),
        (json.dumps({"prompt": "hi", "rows": [{"name": "a", "top_p": 0}]}), 422, "rows.0.top_p"),
        (json.dumps({"prompt": "hi", "rows": [{"name": "a", "seed": -1}]}), 422, "rows.0.seed"),
    ],
)
def test_bad_requests_get_a_clear_json_error_and_the_server_keeps_serving(api, body, status, message):
    client, _ = api
    r = client.post("/generate", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status and message in r.json()["error"], r.text
    assert client.get("/health").status_code == 200


VARIANT_ROWS = [
    {"name": "plain", "prompt": "What is the capital of France?"},
    {
        "name": "strong",
        "strategy": "residual",
        "params": {"alpha": 0.2},
        "prompt": "What is the capital of France? Answer precisely, in one sentence.",
    },
    {
        "name": "restate",
        "strategy": "anchor",
        "params": {"alpha": 0.2},
        "prompt": "Question: what is the capital of France? Restate it, then answer.",
    },
]


def test_prompt_variants_with_quality_metrics_then_a_next_turn_and_a_branch(api, embedded_lm):
    client, _ = api
    body = {
        "rows": VARIANT_ROWS,
        "max_new_tokens": 10,
        "quality": True,
        "key_facts": ["Paris"],
        "reference": "The capital of France is Paris.",
    }
    first = client.post("/generate", json=body)
    assert first.status_code == 200, first.text
    run1 = first.json()
    direct = run_to_end(embedded_lm, to_config(GenerateIn(**body), embedded_lm.name))
    for got, want in zip(run1["rows"], direct.rows):
        assert got["token_ids"] == want.token_ids
        assert got["metrics"]["self_ppl"] == pytest.approx(want.metrics["self_ppl"], rel=1e-5)
        assert {"prompt_ppl", "reference_ppl", "distinct_1", "repeat_3gram_rate", "key_fact_recall"} <= set(
            got["metrics"]
        )

    # the next turn, by id and by sending the (compact) result back: the same run either way
    by_id = client.post(
        "/continue", json={"run_id": run1["run_id"], "message": "And of Italy?", "steps": False}
    )
    compact = {k: v for k, v in run1.items() if k != "rows"} | {
        "rows": [{k: v for k, v in row.items() if k != "steps"} for row in run1["rows"]]
    }
    by_body = client.post("/continue", json={"run": compact, "message": "And of Italy?", "steps": False})
    assert by_id.status_code == by_body.status_code == 200, by_id.text + by_body.text
    turn2 = by_id.json()
    assert [r["token_ids"] for r in turn2["rows"]] == [r["token_ids"] for r in by_body.json()["rows"]]
    for row, answer in zip(turn2["config"]["rows"], run1["rows"]):
        assert row["messages"][-1] == {"role": "assistant", "content": answer["text"]}
    assert turn2["run_id"] != run1["run_id"]

    # a branch from an alternative token, streamed
    step, alt = 2, run1["rows"][1]["steps"][2]["top"][1]["token_id"]
    with client.stream(
        "POST",
        "/branch",
        params={"format": "ndjson"},
        json={"run_id": run1["run_id"], "row": "strong", "step": step, "token_id": alt},
    ) as r:
        assert r.status_code == 200, r.read()
        events = _ndjson(r)
    branched = events[-1]["result"]
    assert events[-1]["event"] == "done"
    clicked = run1["rows"][1]["token_ids"][:step]
    for new in branched["rows"]:  # every row goes on from the clicked row's text and the chosen token
        assert new["token_ids"][: step + 1] == clicked + [alt]
        assert [s["forced"] for s in new["steps"][: step + 2]] == [True] * (step + 1) + [False]
        assert [s["chosen"] for s in new["steps"][: step + 2]] == [False] * step + [True, False]
    matching = client.post(
        "/branch",
        json={
            "run_id": run1["run_id"],
            "row": "strong",
            "step": step,
            "token_id": alt,
            "matching_only": True,
            "steps": False,
        },
    ).json()
    for old, new in zip(
        run1["rows"], matching["rows"]
    ):  # rows that had said something else stay as they were
        assert (
            new["token_ids"] == old["token_ids"]
            if old["token_ids"][:step] != clicked
            else new["token_ids"][step] == alt
        )
    text = client.post(
        "/branch",
        json={
            "run_id": run1["run_id"],
            "row": "plain",
            "step": 0,
            "token_text": " Paris",
            "all_rows": False,
            "steps": False,
        },
    )
    assert text.status_code == 200, text.text
    rows = text.json()["rows"]
    assert (
        rows[0]["token_ids"][0] == embedded_lm.tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    )
    assert rows[1]["token_ids"] == run1["rows"][1]["token_ids"]  # not branched: decoded afresh, same tokens


def _saved(**config) -> dict:
    return {
        "config": {"prompt": "hi", "max_new_tokens": 8, "rows": [{"name": "b"}]} | config,
        "rows": [{"name": "b", "strategy": None, "params": {}, "token_ids": [1, 2, 3], "text": "abc"}],
    }


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/generate", {"prompt": "hi", "rows": [{"name": "a", "prompt": ""}]}, "rows.0.prompt"),
        ("/generate", {"rows": [{"name": "a"}]}, "prompt is empty"),
        (
            "/generate",
            {"prompt": "hi", "rows": [{"name": "a", "messages": [{"role": "wizard", "content": "x"}]}]},
            "rows.0.messages.0.role",
        ),
        (
            "/generate",
            {"prompt": "hi", "rows": [{"name": "a", "prefix": [1] * 20}], "max_new_tokens": 8},
            "row a: prefix has 20 tokens but max_new_tokens is 8",
        ),
        (
            "/generate",
            {"prompt": "hi", "rows": [{"name": "a", "prefix": [10**7]}]},
            "row a: prefix token id 10000000 is outside the vocabulary",
        ),
        ("/generate", {"rows": [{"name": "a", "prompt": "word " * 9000}]}, "row a: prompt is"),
        (
            "/generate",
            {"prompt": "hi", "rows": [{"name": f"r{i}"} for i in range(9)]},
            "rows: List should have at most 8",
        ),
        ("/generate", {"prompt": "hi", "key_facts": [""]}, "key_facts.0"),
        ("/continue", {"run_id": "nope", "message": "more"}, "run_id: String should match pattern"),
        ("/continue", {"message": "more"}, "give either run"),
        ("/continue", {"run": _saved(), "run_id": "0123abcd", "message": "more"}, "give either run"),
        ("/continue", {"run": _saved(chat_template=False), "message": "more"}, "needs the chat template"),
        ("/continue", {"run": _saved(model="evil/model"), "message": "more"}, "not in the allowlist"),
        ("/continue", {"run": {"config": {}, "rows": []}, "message": "more"}, "run.config.rows"),
        ("/branch", {"run": _saved(), "row": "zz", "step": 1, "token_id": 5}, "unknown row 'zz'"),
        (
            "/branch",
            {"run": _saved(), "row": "b", "step": 3, "token_id": 5},
            "step 3 is outside row b's answer",
        ),
        ("/branch", {"run": _saved(), "row": "b", "step": 1}, "give either token_id or token_text"),
        ("/branch", {"run": _saved(), "row": "b", "step": 1, "token_id": 10**7}, "outside the vocabulary"),
    ],
)
def test_bad_rows_and_follow_ups_are_refused_with_a_clear_error(api, path, body, message):
    client, _ = api
    r = client.post(path, json=body)
    assert r.status_code == 422 and message in r.json()["error"], r.text
    assert client.get("/health").status_code == 200


def _body_schema(client: httpx.Client, path: str) -> jsonschema_rs.Draft202012Validator:
    """The published schema of a POST route's body, read as schemathesis reads it."""
    doc = client.get("/openapi.json").json()
    body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema_rs.Draft202012Validator(body | {"components": doc["components"]})


# (route, body, whether the published schema allows it, the answer's status, what the answer names)
DOOR = [
    # a JSON value of another type is refused, not converted
    ("/generate", {"prompt": "hi", "rows": [{"name": "a", "seed": False}]}, False, 422, "rows.0.seed"),
    ("/generate", {"prompt": "hi", "max_new_tokens": "2"}, False, 422, "max_new_tokens"),
    ("/generate", {"prompt": "hi", "steps": 0}, False, 422, "steps"),
    ("/generate", {"prompt": "hi", "sampling": {"top_p": True}}, False, 422, "sampling.top_p"),
    ("/calibrate", {"traces": 0}, False, 422, "traces"),
    ("/ppl", {"text": "Some text to score.", "token_detail": "yes"}, False, 422, "token_detail"),
    # 2.0 is an integer, as JSON Schema counts one
    ("/generate", {"prompt": "hi", "max_new_tokens": 2.0, "steps": False}, True, 200, ""),
    # a prompt, unless every row brings its own; blank as the library counts it (\x1c is whitespace to Python)
    ("/generate", {"prompt": "", "rows": [{"name": "a"}]}, False, 422, "prompt is empty"),
    ("/generate", {"prompt": " \x1c", "max_new_tokens": 2}, False, 422, "prompt is empty"),
    (
        "/generate",
        {"prompt": "", "rows": [{"name": "a", "prompt": "Hi"}], "max_new_tokens": 2, "steps": False},
        True,
        200,
        "",
    ),
    ("/generate", {"prompt": "hi", "rows": [{"name": "a", "prompt": "\u3000"}]}, False, 422, "rows.0.prompt"),
    ("/generate", {"prompt": "hi", "key_facts": [" "]}, False, 422, "key_facts.0"),
    # a strategy name in the grammar, even where it goes unused (beside explicit rows)
    (
        "/generate",
        {"prompt": "hi", "strategy": "", "rows": [{"name": "a"}]},
        False,
        422,
        "strategy: unknown strategy ''",
    ),
    ("/generate", {"prompt": "hi", "strategy": "restate+deep_cache"}, False, 422, "cannot be stacked"),
    ("/calibrate", {"strategy": "residual+"}, False, 422, "strategy: a stack joins strategy names"),
    (
        "/ppl",
        {"text": "Some text to score.", "strategy": "deep_cache + deep_cache"},
        False,
        422,
        "strategy: a stack names each strategy once",
    ),
    # what no JSON schema can state, the library refuses (422 without details)
    ("/generate", {"prompt": "hi", "params": {"nope": 1}}, True, 422, "unknown parameter(s) nope"),
    ("/ppl", {"text": "a"}, True, 422, "at least 2 tokens"),
    # temperature: 0 or at least 0.01; seeds up to 2**53, which a JSON number holds exactly
    ("/generate", {"prompt": "hi", "sampling": {"temperature": 0.005}}, False, 422, "sampling.temperature"),
    (
        "/generate",
        {"prompt": "hi", "rows": [{"name": "a", "temperature": 1e-9}]},
        False,
        422,
        "rows.0.temperature",
    ),
    ("/generate", {"prompt": "hi", "seed": 2**53 + 1}, False, 422, "seed"),
    # a run id is what this server gives; a well-formed one it does not hold (any more) is not found
    ("/continue", {"run_id": "0", "message": "more"}, False, 422, "run_id"),
    ("/continue", {"run_id": "0123abcd", "message": "more"}, True, 404, "no recent run '0123abcd'"),
    ("/continue", {"message": "more"}, False, 422, "give either run"),
    ("/continue", {"run_id": "0123abcd", "message": "\n"}, False, 422, "message"),
    (
        "/branch",
        {"run_id": "0123abcd", "row": "a", "step": 0},
        False,
        422,
        "give either token_id or token_text",
    ),
]


@pytest.mark.parametrize("path, body, allowed, status, named", DOOR)
def test_the_door_refuses_what_the_published_schema_forbids(api, path, body, allowed, status, named):
    client, _ = api
    assert _body_schema(client, path).is_valid(body) is allowed
    r = client.post(path, json=body)
    assert r.status_code == status and named in r.json().get("error", ""), r.text
    if allowed:  # a body the schema allows is never refused by the bodies themselves (422 with details)
        assert not r.json().get("details"), r.text


def test_a_stack_outside_the_grammar_is_refused_as_the_schema_says(api):
    client, _ = api
    doc = client.get("/openapi.json").json()
    param = next(p for p in doc["paths"]["/strategies"]["get"]["parameters"] if p["name"] == "stack")
    schema = jsonschema_rs.Draft202012Validator(param["schema"])
    assert not schema.is_valid("") and schema.is_valid(" inner_loop + deep_cache")
    r = client.get("/strategies", params={"stack": ""})
    assert r.status_code == 422 and r.json()["details"][0]["field"] == "stack", r.text
    assert client.get("/strategies", params={"stack": " inner_loop + deep_cache"}).status_code == 200


def test_keys_are_required_everywhere_but_health_and_the_schema(keyed):
    url, _ = keyed
    assert httpx.get(f"{url}/health").status_code == 200
    # the schema and its docs page describe the API and hold no data: open, as the README says
    assert httpx.get(f"{url}/openapi.json").status_code == 200 and httpx.get(f"{url}/docs").status_code == 200
    # the key is checked before the body is read: a malformed body without a key is 401, not 400
    r = httpx.post(f"{url}/generate", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 401
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic k-one"}):
        r = httpx.get(f"{url}/models", headers=headers)
        assert (
            r.status_code == 401
            and r.headers["www-authenticate"] == "Bearer"
            and "API key" in r.json()["error"]
        )
        r = httpx.post(f"{url}/generate/stream", json={"prompt": "hi", "max_new_tokens": 2}, headers=headers)
        assert r.status_code == 401
    assert httpx.get(f"{url}/models", headers={"Authorization": "Bearer k-two"}).status_code == 200
    r = httpx.post(
        f"{url}/generate",
        json={"prompt": "hi", "max_new_tokens": 2},
        headers={"Authorization": "Bearer k-one"},
    )
    assert r.status_code == 200


def test_oversize_bodies_are_refused_declared_or_chunked(keyed):
    url, _ = keyed
    auth = {"Authorization": "Bearer k-one"}
    big = json.dumps({"prompt": "y" * 5000}).encode()
    r = httpx.post(f"{url}/generate", content=big, headers=auth | {"Content-Type": "application/json"})
    assert r.status_code == 413 and "larger than 4096 bytes" in r.json()["error"]
    chunks = (big[i : i + 1000] for i in range(0, len(big), 1000))  # no Content-Length: chunked transfer
    r = httpx.post(f"{url}/generate", content=chunks, headers=auth | {"Content-Type": "application/json"})
    assert r.status_code == 413


def test_the_api_waits_its_turn_behind_the_page_and_answers_503_when_the_line_is_full(keyed):
    url, pool = keyed  # max_waiting=0: no request may queue
    auth = {"Authorization": "Bearer k-one"}
    body = {"prompt": "hi", "max_new_tokens": 2}
    with pool.gate.slot("ui"):  # a page run holds the model
        r = httpx.post(f"{url}/generate", json=body, headers=auth)
        assert r.status_code == 503 and r.headers["retry-after"] and "busy" in r.json()["error"]
        assert httpx.post(f"{url}/generate/stream", json=body, headers=auth).status_code == 503
        assert httpx.get(f"{url}/health").json()["running"] == 1
    assert httpx.post(f"{url}/generate", json=body, headers=auth).status_code == 200


def test_mounted_beside_the_gradio_app(app_url):
    base = app_url.rstrip("/")
    assert httpx.get(f"{base}/api/health").json()["status"] == "ok"
    r = httpx.post(f"{base}/api/generate", json={"prompt": "Say hi.", "max_new_tokens": 3}, timeout=120)
    assert r.status_code == 200 and len(r.json()["rows"]) == 2
    assert httpx.get(base).status_code == 200  # the page is still served


def test_schemathesis_with_every_check_finds_the_schema_and_the_server_agree(tiny_lm, tmp_path):
    """Every schemathesis check on every operation: no server error, answers as declared, and the
    server refuses what the published schema forbids and takes what it allows — but for what no JSON
    schema can state, which tests/serve/schemathesis.toml names route by route (a 422 from the
    library, never one with `details` from the request bodies: tests/serve/schemathesis_checks.py)."""
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which("schemathesis")
    assert exe, "schemathesis is in requirements-dev.txt"
    # Small budgets: the fuzzer is after input handling, not minutes-long runs (over-budget requests
    # are refused with 422, which is itself under test).
    fuzz = ApiSettings(
        keys=("fuzz-key",), wait_s=60, budget=Budget(scored_tokens=20_000, decoded_tokens=64, memory_mb=512)
    )
    # Schemathesis' coverage phase enumerates boundary cases of every field: ~600 per generation body
    # (~30 s of its own CPU per route). Those routes get the examples and fuzzing phases here (the
    # sampling fields they share are fuzzed value by value in test_sampling's hypothesis tests, their
    # door's refusals by test_the_door_refuses_what_the_published_schema_forbids), the others all phases.
    # 20 examples a route, as every check makes requests of its own: ~25 s on the 2-core dev machine.
    generation = "/(generate|generate/stream|continue|branch|calibrate)$"
    passes = [
        ("--exclude-path-regex", generation),
        ("--include-path-regex", generation, "--phases", "examples,fuzzing"),
    ]
    here = Path(__file__).parent
    env = os.environ | {"SCHEMATHESIS_HOOKS": str(here / "schemathesis_checks.py")}
    with serve(tiny_lm, fuzz) as (url, _):
        for i, extra in enumerate(passes):
            run = subprocess.run(
                [
                    exe,
                    "--config-file",
                    str(here / "schemathesis.toml"),
                    "run",
                    f"{url}/api/openapi.json",
                    "--checks",
                    "all",
                    "--max-examples",
                    "20",
                    "--header",
                    "Authorization: Bearer fuzz-key",
                    "--seed",
                    "1",
                    "--workers",
                    "1",
                    "--request-timeout",
                    "120",
                    "--no-color",
                    "--generation-database",
                    "none",
                    "--suppress-health-check",
                    "all",
                    "--report",
                    "junit",
                    "--report-dir",
                    str(tmp_path / str(i)),
                    *extra,
                ],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=1200,
            )
            assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
            assert "passed" in run.stdout and " 0 generated" not in run.stdout, run.stdout[-2000:]


def test_the_page_waits_in_the_same_line_as_the_api(app_url):
    """Work that holds the model alone (an API perplexity request) makes the page's run wait in the
    one line; when its client hangs up, the page's run goes."""
    from gradio_client import Client

    base = app_url.rstrip("/")
    body = {"text": LONG_TEXT, "strategy": "deep_cache", "bootstrap": 0}
    hung_up = threading.Event()

    def hold() -> None:
        with contextlib.suppress(httpx.ReadTimeout):
            httpx.post(f"{base}/api/ppl", json=body, timeout=8)
        hung_up.set()

    holder = threading.Thread(target=hold)
    holder.start()
    deadline = time.time() + 30
    while httpx.get(f"{base}/api/health").json()["running"] != 1 and time.time() < deadline:
        time.sleep(0.05)
    job = Client(app_url, verbose=False).submit("Say hi.", max_new_tokens=3, api_name="/compare")
    while httpx.get(f"{base}/api/health").json()["waiting"] != 1 and time.time() < deadline:
        time.sleep(0.05)
    health = httpx.get(f"{base}/api/health").json()
    assert (health["running"], health["waiting"]) == (1, 1) and not job.done() and not hung_up.is_set()
    *_, status, run = job.result(timeout=120)  # after the hang-up ends the perplexity job
    holder.join()
    assert "Done" in status and run["rows"][0]["token_ids"]


def test_the_page_run_decodes_beside_an_api_stream(app_url):
    """Two people at once: while an API stream decodes a long answer, a page run (through
    gradio_client, as the page's own handler) starts beside it, streams and finishes; the API
    stream goes on."""
    from gradio_client import Client

    base = app_url.rstrip("/")
    body = {"prompt": "Write a very long story about a lighthouse keeper.", "max_new_tokens": 1000}
    with httpx.stream("POST", f"{base}/api/generate/stream", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(lines), next(lines)  # the API run decodes
        *_, status, run = (
            Client(app_url, verbose=False)
            .submit("Say hi.", max_new_tokens=3, api_name="/compare")
            .result(timeout=120)
        )
        assert "Done" in status and run["rows"][0]["token_ids"]
        assert json.loads(next(lines))["event"] == "step"  # still streaming after the page's run ended
        health = httpx.get(f"{base}/api/health").json()
        assert health["running"] == 1 and health["decoding"]["embedded"]["shared_runs"] == 1


def _wait_free(pool, within_s: float) -> float:
    t0 = time.time()
    while pool.gate.status()["running"] or pool.gate.status()["waiting"]:
        assert time.time() - t0 < within_s, pool.gate.status()
        time.sleep(0.05)
    return time.time() - t0


LONG_TEXT = " ".join(
    f"Line {i}: rivers carry water to the sea, and the sea gives it back as rain." for i in range(900)
)


def test_a_ppl_client_that_hangs_up_frees_the_model_within_a_window(api):
    """~20,000 tokens in parallel mode would take minutes; the hang-up stops it after the window in hand."""
    client, pool = api
    with pytest.raises(httpx.ReadTimeout):
        client.post("/ppl", json={"text": LONG_TEXT, "strategy": "deep_cache", "bootstrap": 0}, timeout=3)
    assert _wait_free(pool, 15) < 12


def test_a_waiter_whose_client_left_gives_up_its_place_at_once(api):
    client, pool = api
    held = pool.gate.acquire("ui", label="a page run")
    try:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/generate", json={"prompt": "Hi", "max_new_tokens": 2}, timeout=1)
        t0 = time.time()
        while pool.gate.status()["waiting"] and time.time() - t0 < 5:
            time.sleep(0.05)
        assert (
            pool.gate.status()["waiting"] == 0 and time.time() - t0 < 2
        )  # not when its turn would have come
    finally:
        pool.gate.release(held)


def test_work_over_the_budget_is_refused_before_it_starts(api, embedded_lm):
    client, pool = api
    t0 = time.time()
    r = client.post("/ppl", json={"text": LONG_TEXT * 2, "strategy": "residual", "mode": "jacobi"})
    assert (
        r.status_code == 422 and "FEEDBACK_BUDGET_SCORED_TOKENS" in r.json()["error"] and time.time() - t0 < 5
    )
    with serve(embedded_lm, ApiSettings(budget=Budget(memory_mb=300))) as (
        url,
        _,
    ):  # a long prompt's cache does not fit
        r = httpx.post(
            f"{url}/api/generate", json={"prompt": "word " * 6000, "max_new_tokens": 8}, timeout=60
        )
    error = r.json()["error"]
    assert r.status_code == 422 and "MB of memory" in error and "FEEDBACK_BUDGET_MEMORY_MB" in error


def test_a_long_prompt_is_prefilled_in_chunks_and_a_hang_up_stops_it(api, embedded_lm, hook_count):
    client, pool = api
    t0 = time.time()
    with pytest.raises(httpx.ReadTimeout):
        client.post("/generate", json={"prompt": "word " * 6000, "max_new_tokens": 8}, timeout=1)
    freed = _wait_free(pool, 15)
    assert freed < 5, freed  # within a chunk or two of the 12 the prompt needs
    assert hook_count(embedded_lm.model) == 0 and time.time() - t0 < 10


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, 0.005])
def test_tiny_temperatures_are_refused_never_a_server_error(api, temperature):
    client, _ = api
    r = client.post(
        "/generate", json={"prompt": "Hi", "max_new_tokens": 2, "sampling": {"temperature": temperature}}
    )
    assert r.status_code == 422 and "0 (greedy) or at least 0.01" in r.json()["error"]


def test_a_model_failing_mid_run_is_a_one_line_500_and_a_known_misfit_a_422_before_it_runs(embedded_lm):
    """A layer that fails mid-run (as a shape mismatch does, with torch's many-line message) is one
    line in a 500, or in the stream's error event; a strategy the model cannot serve exactly is
    refused with 422, naming why, before anything runs. The server keeps serving."""
    from transformers import LlamaForCausalLM

    from feedback.core.model import LoadedModel
    from tests.tiny_families import config

    cfg = config("llama", embedded_lm.tokenizer)
    cfg.layer_types = ["full_attention", "chunked_attention"] * 2  # a kind inner_loop cannot keep a cache for
    lm = LoadedModel(
        LlamaForCausalLM(cfg).eval(),
        embedded_lm.tokenizer,
        "tiny",
        "float32",
        embedded_lm.device,
        eos_token_ids=[embedded_lm.tokenizer.eos_token_id],
    )
    failing = {"on": False}

    def crash(module, args, output):
        if failing["on"]:
            raise RuntimeError(
                "The size of tensor a (74) must match the size of tensor b (37)\n" + "  frame\n" * 50
            )

    lm.layers[1].register_forward_hook(crash)
    with serve(lm, ApiSettings()) as (url, _), httpx.Client(base_url=url + "/api", timeout=120) as client:
        body = {"prompt": "hi", "max_new_tokens": 3}
        misfit = client.post("/generate", json=body | {"strategy": "inner_loop"})
        assert misfit.status_code == 422 and "chunked_attention layers" in misfit.json()["error"]
        lm.model.config.layer_types = None  # a plain Llama again, for the runs below
        failing["on"] = True
        r = client.post("/generate", json=body)
        assert r.status_code == 500 and r.json()["error"] == (
            "generation failed: RuntimeError: The size of tensor a (74) must match the size of tensor b (37)"
        )
        with client.stream("POST", "/generate/stream", json=body) as s:
            last = _ndjson(s)[-1]
        assert last["event"] == "error" and last["status"] == 500 and "\n" not in last["error"]
        failing["on"] = False
        assert client.post("/generate", json=body).status_code == 200
