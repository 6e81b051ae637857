"""Every door refuses a value over its limit, naming the field: the library's validate(), the HTTP
API, the command line and the batch runner. Each door holds the limit it serves — the library's,
declared beside its config, or a served cap from feedback/serve/limits.py — and the values here are
read from those declarations, so a door whose limit drifted from its declaration fails. Nothing is
decoded: every refusal comes before any work (the HTTP API's before the model is even loaded)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from feedback.core.records import (
    DEEPCONF_K,
    DEEPCONF_WINDOW,
    MAX_KEY_FACTS,
    MAX_NEW_TOKENS_CAP,
    MAX_PROMPT_CHARS,
    MAX_ROWS,
    SEED,
    DeepConfConfig,
    RowResult,
    RowSpec,
    RunConfig,
    RunResult,
)
from feedback.core.sampling import TEMPERATURE, TOP_P, SamplingConfig
from feedback.errors import FeedbackError
from feedback.eval.deepthink import MAX_TRACES, DeepThinkConfig
from feedback.eval.perplexity import BOOTSTRAP, PPLConfig
from feedback.serve import limits
from feedback.serve.api import ApiSettings, local_server
from feedback.serve.batch import run_batch
from feedback.serve.pool import ModelPool


@dataclass(frozen=True)
class Limit:
    """A field's last allowed value (`at`) and the first refused one (`over`) at one door."""

    at: Any
    over: Any


def _next(bound, step=1) -> Limit:
    return Limit(bound.hi, bound.hi + step)


# The library's limits: what validate() allows, and so the command line and the batch runner.
LIBRARY = {
    "max_new_tokens": Limit(MAX_NEW_TOKENS_CAP, MAX_NEW_TOKENS_CAP + 1),
    "deepconf_k": _next(DEEPCONF_K),
    "deepconf_window": _next(DEEPCONF_WINDOW),
    "temperature": _next(TEMPERATURE),
    "top_p": _next(TOP_P, 0.5),
    "seed": Limit(SEED.lo, SEED.lo - 1),
    "prompt_chars": Limit(MAX_PROMPT_CHARS, MAX_PROMPT_CHARS + 1),
    "rows": Limit(MAX_ROWS, MAX_ROWS + 1),
    "key_facts": Limit(MAX_KEY_FACTS, MAX_KEY_FACTS + 1),
    "bootstrap": _next(BOOTSTRAP),
    "traces": Limit(MAX_TRACES, MAX_TRACES + 1),
}
# The HTTP API's: the served caps where it has its own, the library's elsewhere (it has no Deep Think).
API = {
    **{k: v for k, v in LIBRARY.items() if k != "traces"},
    "max_new_tokens": _next(limits.MAX_NEW_TOKENS),
    "rows": Limit(limits.SERVED_MAX_ROWS, limits.SERVED_MAX_ROWS + 1),
    "bootstrap": _next(limits.PPL_BOOTSTRAP),
}

# How the library's refusal names each field (the command line and batch runner pass it on).
NAMED = {
    "max_new_tokens": "max_new_tokens",
    "deepconf_k": "DeepConf k",
    "deepconf_window": "DeepConf window",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "prompt_chars": "prompt is limited",
    "rows": "rows",
    "key_facts": "key_facts",
    "bootstrap": "bootstrap",
    "traces": "traces",
}


def _rows(n: int) -> list[RowSpec]:
    return [RowSpec(f"r{i}") for i in range(n)]


VALIDATE: dict[str, Callable[[Any], object]] = {
    "max_new_tokens": lambda v: RunConfig("hi", max_new_tokens=v).validate(),
    "deepconf_k": lambda v: DeepConfConfig(k=v).validate(),
    "deepconf_window": lambda v: DeepConfConfig(window=v).validate(),
    "temperature": lambda v: SamplingConfig(temperature=v).validate(),
    "top_p": lambda v: SamplingConfig(top_p=v).validate(),
    "seed": lambda v: RunConfig("hi", seed=v).validate(),
    "prompt_chars": lambda v: RunConfig("x" * v).validate(),
    "rows": lambda v: RunConfig("hi", rows=_rows(v)).validate(),
    "key_facts": lambda v: RunConfig("hi", key_facts=["fact"] * v).validate(),
    "bootstrap": lambda v: PPLConfig(bootstrap=v).validate(1024),
    "traces": lambda v: DeepThinkConfig("q", traces=v).validate(30),
}


@pytest.mark.parametrize("case", sorted(LIBRARY))
def test_the_library_allows_its_limit_and_refuses_the_next_value(case):
    limit = LIBRARY[case]
    VALIDATE[case](limit.at)
    with pytest.raises(FeedbackError, match=NAMED[case]):
        VALIDATE[case](limit.over)


# ---- the HTTP API: a 422 naming the field, before the model is loaded ----
# (route, body with the value, the field as the error names it, where the schema declares the bound)
API_REQUESTS: dict[str, tuple[str, Callable[[Any], dict], str, tuple[str, str, str]]] = {
    "max_new_tokens": (
        "/generate",
        lambda v: {"prompt": "hi", "max_new_tokens": v},
        "max_new_tokens",
        ("GenerateIn", "max_new_tokens", "maximum"),
    ),
    "deepconf_k": (
        "/generate",
        lambda v: {"prompt": "hi", "deepconf": {"k": v}},
        "deepconf.k",
        ("DeepConfIn", "k", "maximum"),
    ),
    "deepconf_window": (
        "/generate",
        lambda v: {"prompt": "hi", "deepconf": {"window": v}},
        "deepconf.window",
        ("DeepConfIn", "window", "maximum"),
    ),
    "temperature": (
        "/generate",
        lambda v: {"prompt": "hi", "sampling": {"temperature": v}},
        "sampling.temperature",
        ("SamplingIn", "temperature", "maximum"),
    ),
    "top_p": (
        "/generate",
        lambda v: {"prompt": "hi", "sampling": {"top_p": v}},
        "sampling.top_p",
        ("SamplingIn", "top_p", "maximum"),
    ),
    "seed": ("/generate", lambda v: {"prompt": "hi", "seed": v}, "seed", ("GenerateIn", "seed", "minimum")),
    "prompt_chars": (
        "/generate",
        lambda v: {"prompt": "x" * v},
        "prompt",
        ("GenerateIn", "prompt", "maxLength"),
    ),
    "rows": (
        "/generate",
        lambda v: {"prompt": "hi", "rows": [{"name": f"r{i}"} for i in range(v)]},
        "rows",
        ("GenerateIn", "rows", "maxItems"),
    ),
    "key_facts": (
        "/generate",
        lambda v: {"prompt": "hi", "key_facts": ["fact"] * v},
        "key_facts",
        ("GenerateIn", "key_facts", "maxItems"),
    ),
    "bootstrap": (
        "/ppl",
        lambda v: {"text": "Some text to score.", "bootstrap": v},
        "bootstrap",
        ("PPLIn", "bootstrap", "maximum"),
    ),
}


@pytest.fixture(scope="module")
def api():
    """One API server for the module, on a pool whose model is never loaded: every refusal here
    must come first."""
    pool = ModelPool(["embedded"])
    with local_server(pool, ApiSettings()) as url, httpx.Client(base_url=url + "/api", timeout=60) as client:
        yield client, client.get("/openapi.json").json()
    assert pool.loaded() == {}


def _declared(schema: dict, model: str, field: str, key: str):
    """The bound `key` of a body field in the OpenAPI schema (a nullable field's lies in its anyOf)."""
    prop = schema["components"]["schemas"][model]["properties"][field]
    return next(p[key] for p in [prop, *prop.get("anyOf", [])] if key in p)


def test_every_case_reaches_every_door_that_has_the_field():
    assert set(API) == set(API_REQUESTS) and set(LIBRARY) == set(VALIDATE) == set(NAMED) == set(CLI) == set(
        BATCH
    )


@pytest.mark.parametrize("case", sorted(API))
def test_the_http_api_declares_its_limit_and_refuses_the_next_value(api, case):
    client, schema = api
    route, body, field, (model, name, key) = API_REQUESTS[case]
    limit = API[case]
    assert _declared(schema, model, name, key) == limit.at
    r = client.post(route, json=body(limit.over))
    assert r.status_code == 422, r.text
    assert field in [d["field"] for d in r.json()["details"]] and f"{field}: " in r.json()["error"]


# ---- the command line: exit status 2 and one line naming the field ----
CLI: dict[str, Callable[[Any], list[str]]] = {
    "max_new_tokens": lambda v: ["generate", "--prompt", "hi", "--max-new-tokens", str(v)],
    "deepconf_k": lambda v: ["generate", "--prompt", "hi", "--k", str(v)],
    "deepconf_window": lambda v: ["generate", "--prompt", "hi", "--window", str(v)],
    "temperature": lambda v: ["generate", "--prompt", "hi", "--temperature", str(v)],
    "top_p": lambda v: ["generate", "--prompt", "hi", "--top-p", str(v)],
    "seed": lambda v: ["generate", "--prompt", "hi", "--seed", str(v)],
    "prompt_chars": lambda v: ["generate", "--prompt", "x" * v],
    "rows": lambda v: ["generate", "--prompt", "hi", *[a for i in range(v) for a in ("--row", f"r{i}")]],
    "key_facts": lambda v: ["generate", "--prompt", "hi", *["--key-fact", "fact"] * v],
    "bootstrap": lambda v: ["ppl", "--max-docs", "1", "--bootstrap", str(v)],
    "traces": lambda v: ["deepthink", "--prompt", "q", "--traces", str(v)],
}
CLI_LOADS_FIRST = {"bootstrap", "traces"}  # these commands load the model before they validate


@pytest.mark.parametrize("case", sorted(CLI))
def test_the_command_line_refuses_the_next_value_in_one_line(case, capsys, monkeypatch):
    from feedback import cli
    from feedback.cli import common

    if case not in CLI_LOADS_FIRST:

        def no_model(*_args, **_kwargs):
            raise AssertionError("the model was loaded before the value was refused")

        monkeypatch.setattr(common, "load", no_model)
    try:
        code = cli.main(CLI[case](LIBRARY[case].over))
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Warning" not in line]
    assert code == 2 and len(lines) == 1 and NAMED[case] in lines[0], lines


# ---- the batch runner: the line is recorded as failed, naming the field ----
BATCH: dict[str, Callable[[Any], dict]] = {
    "max_new_tokens": lambda v: {"prompt": "hi", "max_new_tokens": v},
    "deepconf_k": lambda v: {"mode": "deepthink", "prompt": "q", "k": v},
    "deepconf_window": lambda v: {"mode": "deepthink", "prompt": "q", "window": v},
    "temperature": lambda v: {"prompt": "hi", "temperature": v},
    "top_p": lambda v: {"prompt": "hi", "top_p": v},
    "seed": lambda v: {"prompt": "hi", "seed": v},
    "prompt_chars": lambda v: {"prompt": "x" * v},
    "rows": lambda v: {"prompt": "hi", "rows": [{"name": f"r{i}"} for i in range(v)]},
    "key_facts": lambda v: {"prompt": "hi", "key_facts": ["fact"] * v},
    "bootstrap": lambda v: {
        "mode": "ppl",
        "prompt": "Some text to score.",
        "strategy": "deep_cache",
        "bootstrap": v,
    },
    "traces": lambda v: {"mode": "deepthink", "prompt": "q", "traces": v},
}


@pytest.fixture(scope="module")
def batch_records(tiny_lm, tmp_path_factory) -> dict[str, dict]:
    """One batch run over a line per case, each carrying the first refused value."""
    folder = tmp_path_factory.mktemp("limits")
    tasks, out = folder / "tasks.jsonl", folder / "out.jsonl"
    tasks.write_text(
        "".join(json.dumps({"id": case, **BATCH[case](LIBRARY[case].over)}) + "\n" for case in BATCH)
    )
    summary = run_batch(tiny_lm, tasks, out, retries=0, warn=lambda _: None)
    assert summary["error"] == len(BATCH), summary
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.parametrize("case", sorted(BATCH))
def test_the_batch_runner_records_the_line_as_failed_naming_the_field(batch_records, case):
    record = batch_records[case]
    assert record["status"] == "error" and NAMED[case] in record["error"], record
    assert "result" not in record


# ---- a saved run that comes back (History, /api/continue and /api/branch, the command line) ----
VOCAB = 100  # the vocabulary the saved runs below are checked against (ids 0-99)


def _saved_run(answer: dict | None = None, served_rows: int = 2, **config) -> RunResult:
    """A saved run of two rows, "a" and "b", each with a two-token answer; `answer` changes row b's."""

    cfg = RunConfig("hi", **{"max_new_tokens": 8, "rows": _rows(served_rows)} | config)
    rows = [RowResult(r.name, r.strategy, r.params, token_ids=[5, 9], text="ok") for r in cfg.rows]
    rows[-1] = RowResult(**{**vars(rows[-1]), **(answer or {})})
    return RunResult(config=cfg.to_dict(), rows=rows)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"token_ids": [5, VOCAB]}, "row 'r1': token_ids[1] = 100 is outside the vocabulary (0–99)"),
        (
            {"token_ids": [10**12, -1]},
            "row 'r1': token_ids[0] = 1000000000000 is outside the vocabulary (0–99)",
        ),
        ({"token_ids": [-1]}, "row 'r1': token_ids[0] = -1 is outside the vocabulary (0–99)"),
        (
            {"token_ids": [1e12]},
            "row 'r1': token_ids[0] must be a whole number in the vocabulary (0–99), got 1000000000000.0",
        ),
        (
            {"token_ids": [1, True]},
            "row 'r1': token_ids[1] must be a whole number in the vocabulary (0–99), got True",
        ),
        ({"token_ids": "5 9"}, "row 'r1': token_ids must be a list of token ids, got str"),
        ({"token_ids": [1] * 9}, "row 'r1': token_ids has 9 tokens but max_new_tokens is 8"),
        (
            {"text": "x" * (limits.ANSWER_MAX_CHARS + 1)},
            f"row 'r1': text is limited to {limits.ANSWER_MAX_CHARS:,} characters here, "
            f"got {limits.ANSWER_MAX_CHARS + 1:,}",
        ),
        ({"text": None}, "row 'r1': text must be text, got NoneType"),
        ({"steps": [None]}, "row 'r1': steps must hold one record per token (2) or none, got 1"),
        (
            {"name": "zz"},
            "rows: the run's answers are for ['r0', 'zz'] but its settings' rows are ['r0', 'r1']",
        ),
    ],
)
def test_a_saved_run_is_refused_naming_the_field_of_its_answer(change, field):
    with pytest.raises(FeedbackError) as refused:
        limits.check_saved_run(_saved_run(change), VOCAB)
    assert str(refused.value) == field


def test_a_saved_runs_settings_are_checked_as_a_new_requests_at_the_doors_limits():
    limits.check_saved_run(_saved_run(), VOCAB)  # as it is: accepted
    # the served caps (page, API), the door's own rows; the command line takes the library's limits
    with pytest.raises(FeedbackError, match="max new tokens must be between 1 and 1024, got 2000"):
        limits.check_saved_run(_saved_run(max_new_tokens=2000), VOCAB)
    assert limits.check_saved_run(_saved_run(max_new_tokens=2000), VOCAB, served=False).max_new_tokens == 2000
    with pytest.raises(FeedbackError, match="columns must be between 1 and 4, got 5"):
        limits.check_saved_run(_saved_run(served_rows=5), VOCAB, max_rows=4, rows_name="columns")
    with pytest.raises(FeedbackError, match="max_new_tokens must be an integer in"):
        limits.check_saved_run(_saved_run(max_new_tokens=MAX_NEW_TOKENS_CAP + 1), VOCAB, served=False)
    with pytest.raises(FeedbackError, match=r"row 'r1': .*alpha=1000000000.0 is out of range"):
        limits.check_saved_run(
            _saved_run(rows=[RowSpec("r0"), RowSpec("r1", "residual", {"alpha": 1e9})]), VOCAB, num_layers=4
        )
    # the answer's text is held to the served cap only: the library has none (Continue's own
    # limit on a conversation still holds there)
    long = _saved_run({"text": "x" * (limits.ANSWER_MAX_CHARS + 1)})
    assert limits.check_saved_run(long, VOCAB, served=False).prompt == "hi"


def test_runs_the_engine_gave_pass_as_they_come_back_turn_after_turn_and_branched(tiny_lm):
    """What a run can legitimately hold: answers of exactly max_new_tokens, a branch's forced
    tokens (replayed and chosen), a later turn's answer after its conversation, steps or none."""
    from feedback.core.engine import run_to_end
    from feedback.core.session import answers_only, branch, continue_run

    cfg = RunConfig(
        "Hi", model="tiny", max_new_tokens=6, rows=[RowSpec("a"), RowSpec("b", "residual", {"alpha": 0.1})]
    )
    first = run_to_end(tiny_lm, cfg)
    forced = branch(first, "b", 2, [7, 8, 9], matching_only=True)
    for result in (
        first,
        answers_only(first),
        run_to_end(tiny_lm, forced),
        run_to_end(tiny_lm, continue_run(first, "And then?")),
    ):
        assert (
            limits.check_saved_run(result, tiny_lm.vocab_size, tiny_lm.num_layers)
            == RunConfig.from_dict(result.config).validate()
        )
    assert (
        max(len(r.token_ids) for r in first.rows) == 6
    )  # the tiny model runs to the cap: the edge was checked
