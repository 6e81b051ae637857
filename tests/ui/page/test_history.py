"""History entries and exports (JSON of RunResults, CSV of per-token rows with the run's settings)."""

from __future__ import annotations

import csv
import io
import json
import re
from types import SimpleNamespace

import pytest

from feedback.core.records import Alternative, RowResult, RowSpec, RunConfig, RunResult, StepRecord
from ui.page import history

HOSTILE = 'say "hi",\n<b>bold</b> & <script>alert("x")</script>'
TURNS = [{"role": "user", "content": 'earlier "q"'}, {"role": "assistant", "content": "earlier a\n2"}]


def _result(run_id: str, text: str = 'a "quoted", comma\nline') -> dict:
    steps = [
        StepRecord(
            i,
            10 + i,
            text if i == 0 else "x",
            -0.5,
            0.6,
            3.0 + i,
            1.2,
            3.0,
            [Alternative(10 + i, "x", 0.6), Alternative(99, ",|:", 0.1)],
            12.0,
        )
        for i in range(3)
    ]
    rows = [
        RowResult("baseline", None, {}, [10, 11, 12], "base text " * 20, "max_tokens", 2, steps),
        RowResult(
            "feedback",
            "residual",
            {"alpha": 0.1},
            [10, 11, 12],
            "feedback text",
            "max_tokens",
            2,
            steps,
            {"self_ppl": 1.5, "distinct_1": 1.0},
        ),
    ]
    config = RunConfig(prompt="p" * 100, seed=7).to_dict()
    data = RunResult(config, rows, first_divergence_step=None).to_dict()
    return data | {"run_id": run_id}


def _steps(ids: list[int], first: str = "x") -> list[StepRecord]:
    return [
        StepRecord(i, t, first if i == 0 else "x", -0.5, 0.6, 3.0, 1.2, 3.0, [], 12.0)
        for i, t in enumerate(ids)
    ]


def _three(run_id: str = "t", prompt: str = "run prompt") -> dict:
    """Three columns: a baseline, a strategy with its own (hostile) prompt, and one continuing a
    conversation under its own system prompt; per-row metrics of every kind (numbers, None, NaN and
    inf, booleans, lists of key facts, a metric named like a reserved field)."""
    specs = [
        RowSpec("baseline"),
        RowSpec("own", "residual", {"alpha": 0.2}, prompt="own " + HOSTILE),
        RowSpec("chat", "anchor", {"beta": 1, "mode": "soft"}, system_prompt="be <brief>", messages=TURNS),
    ]
    config = RunConfig(prompt=prompt, rows=specs, key_facts=["x"]).to_dict()
    rows = [
        RowResult(
            "baseline",
            None,
            {},
            [1, 2, 3],
            "base " + HOSTILE,
            "eos",
            2,
            _steps([1, 2, 3], HOSTILE),
            {
                "length": 3,
                "distinct_1": 1.0,
                "self_ppl": 2.5,
                "key_facts_found": ["x"],
                "key_fact_recall": 1.0,
                "reference_ppl_with_strategy": False,
                "mean": None,
            },
        ),
        RowResult(
            "own",
            "residual",
            {"alpha": 0.2},
            [1, 9],
            "own out",
            "max_tokens",
            1,
            _steps([1, 9]),
            {
                "length": 2,
                "distinct_1": 0.5,
                "self_ppl": float("nan"),
                "key_facts_found": [],
                "key_fact_recall": 0.0,
                "reference_ppl_with_strategy": True,
                "mean": 3.25,
            },
        ),
        RowResult(
            "chat",
            "anchor",
            {"beta": 1, "mode": "soft"},
            [7, 2, 3],
            "chat out",
            "eos",
            2,
            _steps([7, 2, 3]),
            {"length": 3, "tokens": 3, "self_ppl": float("inf"), "column": "weird"},
        ),
    ]
    return RunResult(config, rows).to_dict() | {"run_id": run_id}


def test_add_run_newest_first_capped_and_deduplicated():
    hist: list = []
    for i in range(history.MAX_RUNS + 3):
        hist = history.add_run(hist, _result(f"r{i}"))
    assert len(hist) == history.MAX_RUNS and hist[0]["id"] == f"r{history.MAX_RUNS + 2}"
    assert history.add_run(hist, _result(hist[0]["id"])) == hist


def test_add_run_rates_a_new_run_with_the_verdicts_given_but_never_re_rates_a_stored_one():
    hist = history.add_run([], _result("a"), {"baseline": "better", "ghost": "tie", "feedback": "great"})
    assert hist[0]["ratings"] == {
        "baseline": {"verdict": "better", "note": ""}
    }  # its columns, known verdicts
    noted = history.rate(hist, "a", "baseline", "better", "clearer")
    # stored already: kept as it is, so a note added since stays
    assert history.add_run(noted, _result("a"), {"baseline": "worse", "feedback": "tie"}) == noted
    assert "ratings" not in history.add_run([], _result("b"), {})[0]


def test_add_run_respects_the_byte_cap(monkeypatch):
    monkeypatch.setattr(
        history, "MAX_BYTES", len(json.dumps([{"id": "r0", "created": "x", "result": _result("r0")}])) + 50
    )
    hist = history.add_run([], _result("r0"))
    hist = history.add_run(hist, _result("r1"))
    assert [e["id"] for e in hist] == ["r1"]


def test_table_shows_outputs_and_select():
    hist = history.add_run(history.add_run([], _result("a")), _result("b"))
    rows = history.table(hist)
    assert len(rows) == 2 and len(rows[0]) == len(history.TABLE_HEADERS)
    by = dict(zip(history.TABLE_HEADERS, rows[0]))
    assert by["id"] == "b" and by["columns"] == "baseline: no feedback | feedback: residual alpha=0.1"
    assert by["differ at"] == "—" and by["tokens"] == "3 / 3" and by["stop"] == "max_tokens / max_tokens"
    assert by["other columns' output"] == "feedback: feedback text" and by["first column output"].endswith(
        "…"
    )
    assert len(by["prompt"]) == history.OUTPUT_PREVIEW
    assert len(by["first column output"]) == history.OUTPUT_PREVIEW
    assert [e["id"] for e in history.select(hist, ["a"])] == ["a"]
    assert len(history.select(hist, [])) == 2


def test_table_describes_every_column_of_a_three_column_run():
    by = dict(zip(history.TABLE_HEADERS, history.table(history.add_run([], _three()))[0]))
    assert by["columns"] == (
        "baseline: no feedback | own: residual alpha=0.2 (own prompt) | "
        "chat: anchor beta=1, mode=soft (+2 earlier turns)"
    )
    assert by["prompt"] == "run prompt" and by["first column output"] == " ".join(("base " + HOSTILE).split())
    assert by["other columns' output"] == "own: own out | chat: chat out"
    assert (by["tokens"], by["differ at"], by["stop"]) == ("3 / 2 / 3", "1 / 0", "eos / max_tokens / eos")


def test_table_lists_a_few_columns_and_counts_the_rest():
    data = _result("w")
    data["rows"] = [dict(data["rows"][1], name=f"c{i}", text=f"out {i}") for i in range(6)]
    by = dict(zip(history.TABLE_HEADERS, history.table(history.add_run([], data))[0]))
    assert by["columns"].count("residual alpha=0.1") == history.TABLE_OTHERS_SHOWN + 1
    assert by["columns"].endswith(" | +2 more") and by["other columns' output"].endswith(
        "c3: out 3 | +2 more"
    )
    assert by["tokens"] == " / ".join(["3"] * 6) and by["differ at"] == " / ".join(["—"] * 5)


def test_a_run_of_one_column_has_no_other_outputs():
    data = _result("solo")
    data["rows"] = data["rows"][:1]
    by = dict(zip(history.TABLE_HEADERS, history.table(history.add_run([], data))[0]))
    assert (by["other columns' output"], by["differ at"], by["tokens"]) == ("—", "—", "3")


def test_label_shows_the_run_prompt_or_the_first_columns_own_prompt():
    assert history.label(history.add_run([], _three("t"))[0]) == "t · run prompt"
    data = _three("u", prompt=" ")
    data["config"]["rows"][0]["prompt"] = "first own\nprompt " + "z" * 60
    label = history.label(history.add_run([], data)[0])
    assert label == "u · " + ("first own prompt " + "z" * 60)[: history.LABEL_PREVIEW - 1] + "…"


def test_csv_has_one_row_per_token_with_settings_and_survives_hostile_text():
    hist = history.add_run([], _result("a"))
    parsed = list(csv.reader(io.StringIO(history.to_csv(hist))))
    assert parsed[0] == history.CSV_COLUMNS
    assert len(parsed) == 1 + 2 * 3
    row = dict(zip(history.CSV_COLUMNS, parsed[1]))
    assert row["text"] == 'a "quoted", comma\nline' and row["prompt"] == "p" * 100 and row["seed"] == "7"
    assert row["temperature"] == "0.0" and row["deepconf_window"] == "32" and row["model"] == "embedded"
    fb = dict(zip(history.CSV_COLUMNS, parsed[4]))
    assert fb["strategy"] == "residual" and json.loads(fb["params"]) == {"alpha": 0.1}
    assert fb["row_prompt"] == "p" * 100 and json.loads(fb["row_metrics"]) == {
        "self_ppl": 1.5,
        "distinct_1": 1.0,
    }
    assert row["forced"] == "0"
    top = json.loads(row["top5"])  # ':' and '|' inside tokens cannot break the field
    assert top == [{"token_id": 10, "text": "x", "prob": 0.6}, {"token_id": 99, "text": ",|:", "prob": 0.1}]


def test_every_setting_of_compares_table_is_a_csv_column():
    """History's CSV takes the run's and each row's settings from Compare's settings table
    (`ui.page.settings`), so a setting added there is exported with no second list to edit. A shared
    setting no config holds is read from another (early stop's mode from the threshold, the number of
    columns from the rows)."""
    from ui.page.settings import COLUMN, SHARED

    header = next(csv.reader(io.StringIO(history.to_csv(history.add_run([], _result("a"))))))
    shared = {s.name: s.path for s in SHARED}
    assert {name for name, path in shared.items() if path is None} == {"threshold_mode", "columns"}
    for name, path in shared.items():
        if path is not None:
            assert path.removeprefix("sampling.").replace(".", "_") in header, (
                f"{name} is not in History's CSV"
            )
    for s in COLUMN:
        if getattr(s, "overrides", None):
            assert f"row_{s.path}" in header, f"the column setting {s.name} is not in History's CSV"


def test_csv_gives_each_row_its_own_prompt_and_marks_forced_tokens():
    data = _result("a")
    data["config"]["rows"] = [
        {"name": "baseline", "prompt": None},
        {"name": "feedback", "prompt": "variant B"},
    ]
    data["rows"][1]["steps"][0]["forced"] = True
    parsed = [
        dict(zip(history.CSV_COLUMNS, line))
        for line in csv.reader(io.StringIO(history.to_csv(history.add_run([], data))))
    ][1:]
    assert [p["row_prompt"] for p in parsed] == ["p" * 100] * 3 + ["variant B"] * 3
    assert [p["forced"] for p in parsed] == ["0"] * 3 + ["1", "0", "0"]


def test_csv_of_three_columns_gives_each_its_prompt_system_prompt_and_turns():
    data = _three()
    data["config"]["system_prompt"] = "run system"
    parsed = [
        dict(zip(history.CSV_COLUMNS, line))
        for line in csv.reader(io.StringIO(history.to_csv(history.add_run([], data))))
    ][1:]
    assert [p["row"] for p in parsed] == ["baseline"] * 3 + ["own"] * 2 + ["chat"] * 3
    assert [p["row_prompt"] for p in parsed] == ["run prompt"] * 3 + ["own " + HOSTILE] * 2 + [
        "run prompt"
    ] * 3
    assert [p["row_system_prompt"] for p in parsed] == ["run system"] * 5 + ["be <brief>"] * 3
    assert [p["row_messages"] for p in parsed[:5]] == [""] * 5 and json.loads(
        parsed[5]["row_messages"]
    ) == TURNS
    assert parsed[0]["text"] == HOSTILE and json.loads(parsed[3]["row_metrics"])["key_facts_found"] == []
    assert json.loads(parsed[5]["params"]) == {"beta": 1, "mode": "soft"}


def test_csv_gives_each_row_the_temperature_it_sampled_at():
    """A column's own temperature, else the run's; a stored value that is no number is not taken."""
    data = _three()
    data["config"]["sampling"]["temperature"] = 0.7
    data["config"]["rows"][1]["temperature"] = 0.0
    data["config"]["rows"][2]["temperature"] = {"not": "a number"}
    parsed = [
        dict(zip(history.CSV_COLUMNS, line))
        for line in csv.reader(io.StringIO(history.to_csv(history.add_run([], data))))
    ][1:]
    assert history.ROW_SETTING_COLUMNS == [
        "row_prompt",
        "row_system_prompt",
        "row_temperature",
        "row_top_p",
        "row_seed",
    ]
    assert [p["row_temperature"] for p in parsed] == ["0.7"] * 3 + ["0.0"] * 2 + ["0.7"] * 3
    assert [p["temperature"] for p in parsed] == ["0.7"] * 8  # the run's, as before


def test_json_export_of_three_columns_round_trips():
    result = RunResult.from_dict(json.loads(history.to_json(history.add_run([], _three())))[0])
    assert [r.name for r in result.rows] == ["baseline", "own", "chat"] and result.rows[
        0
    ].text == "base " + HOSTILE
    assert (
        result.config["rows"][1]["prompt"] == "own " + HOSTILE
        and result.config["rows"][2]["messages"] == TURNS
    )
    assert result.rows[0].metrics["key_facts_found"] == ["x"]


def test_json_export_round_trips_to_run_results():
    hist = history.add_run([], _result("a"))
    data = json.loads(history.to_json(hist))
    result = RunResult.from_dict(data[0])
    assert data[0]["id"] == "a" and result.rows[1].params == {"alpha": 0.1}
    assert result.rows[0].steps[0].top[1].text == ",|:"


@pytest.mark.parametrize(
    "bad",
    [
        "not a list",
        42,
        [None],
        [1, 2],
        [{"id": 3}],
        [{"id": "x", "created": "t", "result": {}}],
        [{"id": "x", "created": "t", "result": {"config": {"prompt": 5}, "rows": []}}],
        [
            {
                "id": "x",
                "created": "t",
                "result": {
                    "config": {"prompt": "p", "sampling": {}, "deepconf": {}},
                    "rows": [{"name": "b", "token_ids": "nope", "steps": []}],
                },
            }
        ],
    ],
)
def test_malformed_history_entries_are_skipped_and_counted(bad):
    good = history.add_run([], _result("a"))
    runs, skipped = history.valid(good + (bad if isinstance(bad, list) else []))
    assert [e["id"] for e in runs] == ["a"] and skipped == (len(bad) if isinstance(bad, list) else 0)
    runs, skipped = history.valid(bad)
    assert runs == [] and skipped >= 1
    assert history.valid(None) == ([], 0)
    assert [e["id"] for e in history.add_run(bad, _result("z"))] == [
        "z"
    ]  # a corrupt store heals on the next run


# What LLM Comparator reads (PAIR-code/llm-comparator: README "JSON Data Format"; client/lib/types.ts
# DataResponse, Example, FieldType; client/services/state_service.ts loadData, which reads every declared
# custom field of every example; client/components/example_table.ts, which throws unless a per-model
# field has exactly 2 values). The browser's JSON.parse rejects NaN and Infinity.
COMPARATOR_FIELD_TYPES = {
    "number",
    "string",
    "category",
    "text",
    "url",
    "image_path",
    "image_byte",
    "per_model_boolean",
    "per_model_number",
    "per_model_category",
    "per_model_text",
    "per_rating_string",
    "per_rating_per_model_category",
    "base",
}
EXAMPLE_KEYS = {
    "input_text",
    "tags",
    "output_text_a",
    "output_text_b",
    "score",
    "individual_rater_scores",
    "custom_fields",
}


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _value_ok(kind: str, v) -> bool:
    if v is None:
        return True
    if kind.endswith("number"):
        return _is_num(v)
    if kind.endswith("boolean"):
        return isinstance(v, bool)
    return isinstance(v, str)


def _strict_load(text: str) -> dict:
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON a browser can parse")

    return json.loads(text, parse_constant=refuse)


def _check_llm_comparator(doc: dict) -> None:
    assert isinstance(doc["metadata"]["source_path"], str)
    schema = doc["metadata"]["custom_fields_schema"]
    assert len({f["name"] for f in schema}) == len(schema)
    assert all(isinstance(f["name"], str) and f["type"] in COMPARATOR_FIELD_TYPES for f in schema)
    assert len(doc["models"]) == 2 and all(isinstance(m["name"], str) and m["name"] for m in doc["models"])
    for ex in doc["examples"]:
        assert EXAMPLE_KEYS <= set(ex) and isinstance(ex["individual_rater_scores"], list)
        assert all(isinstance(ex[k], str) for k in ("input_text", "output_text_a", "output_text_b"))
        assert isinstance(ex["tags"], list) and all(isinstance(t, str) for t in ex["tags"])
        assert ex["score"] is None or _is_num(ex["score"])
        for f in schema:
            value = ex["custom_fields"][f["name"]]
            if f["type"].startswith("per_model_"):
                assert isinstance(value, list) and len(value) == 2, f
                assert all(_value_ok(f["type"], v) for v in value), (f, value)
            else:
                assert _value_ok(f["type"], value), (f, value)


def test_llm_comparator_export_loads_as_upstream_reads_it():
    hist = history.add_run(history.add_run(history.add_run([], _result("a")), _result("b")), _three("t"))
    doc = _strict_load(history.to_llm_comparator(hist))
    _check_llm_comparator(doc)
    assert len(doc["examples"]) == 2 + 1 + 1  # N - 1 pairs per run of N columns
    assert [m["name"] for m in doc["models"]] == list(history.COMPARATOR_MODELS)  # the pairs' names differ
    assert [ex["custom_fields"]["pair"] for ex in doc["examples"]] == [
        "baseline vs own",
        "baseline vs chat",
        "baseline vs feedback",
        "baseline vs feedback",
    ]
    assert all(ex["score"] is None and ex["individual_rater_scores"] == [] for ex in doc["examples"])


def test_llm_comparator_pairs_the_first_column_with_each_other_one():
    doc = _strict_load(history.to_llm_comparator(history.add_run([], _three("t"))))
    types = {f["name"]: f["type"] for f in doc["metadata"]["custom_fields_schema"]}
    assert {
        k: types[k]
        for k in (
            "run_id",
            "pair",
            "first_divergence_step",
            "own_prompt",
            "generated_tokens",
            "distinct_1",
            "self_ppl",
            "mean",
            "key_facts_found",
            "reference_ppl_with_strategy",
            "param alpha",
            "param mode",
            "metric column",
            "tokens",
        )
    } == {
        "run_id": "string",
        "pair": "category",
        "first_divergence_step": "number",
        "own_prompt": "per_model_boolean",
        "generated_tokens": "per_model_number",
        "distinct_1": "per_model_number",
        "self_ppl": "per_model_number",
        "mean": "per_model_number",
        "key_facts_found": "per_model_text",
        "reference_ppl_with_strategy": "per_model_boolean",
        "param alpha": "per_model_number",
        "param mode": "per_model_category",
        "metric column": "per_model_category",
        "tokens": "per_model_number",
    }
    own, chat = doc["examples"]
    assert own["input_text"] == "A (baseline) saw:\nrun prompt\n\nB (own) saw:\nown " + HOSTILE
    assert (own["output_text_a"], own["output_text_b"], own["tags"]) == (
        "base " + HOSTILE,
        "own out",
        ["residual"],
    )
    cf = own["custom_fields"]
    assert (cf["run_id"], cf["first_divergence_step"], cf["column"], cf["own_prompt"]) == (
        "t",
        1,
        ["baseline", "own"],
        [False, True],
    )
    assert cf["feedback"] == ["no feedback", "residual alpha=0.2"] and cf["strategy"] == ["none", "residual"]
    assert cf["distinct_1"] == [1.0, 0.5] and cf["self_ppl"] == [2.5, None] and cf["mean"] == [None, 3.25]
    assert cf["key_facts_found"] == ["x", ""] and cf["reference_ppl_with_strategy"] == [False, True]
    assert (
        cf["param alpha"] == [None, 0.2] and cf["generated_tokens"] == [3, 2] and cf["tokens"] == [None, None]
    )
    assert chat["input_text"] == (
        "A (baseline) saw:\nrun prompt\n\nB (chat) saw:\n[system]\nbe <brief>\n\n"
        '[user]\nearlier "q"\n\n[assistant]\nearlier a\n2\n\n[user]\nrun prompt'
    )
    cf = chat["custom_fields"]
    assert (
        cf["self_ppl"] == [2.5, None] and cf["tokens"] == [None, 3] and cf["metric column"] == [None, "weird"]
    )
    assert (
        cf["param beta"] == [None, 1]
        and cf["param mode"] == [None, "soft"]
        and cf["first_divergence_step"] == 0
    )
    assert cf["stop_reason"] == ["eos", "eos"] and chat["tags"] == ["anchor"]


def test_llm_comparator_names_models_after_columns_when_every_pair_shares_them():
    doc = _strict_load(
        history.to_llm_comparator(history.add_run(history.add_run([], _result("a")), _result("b")))
    )
    _check_llm_comparator(doc)
    assert [m["name"] for m in doc["models"]] == ["baseline", "feedback"]
    ex = doc["examples"][0]
    assert ex["input_text"] == "p" * 100 and ex["custom_fields"]["first_divergence_step"] is None
    assert ex["output_text_a"] == "base text " * 20 and ex["custom_fields"]["self_ppl"] == [None, 1.5]


def test_llm_comparator_conversation_shared_by_both_columns_is_shown_once():
    data = _result("c")
    data["config"]["system_prompt"] = "sys"
    data["config"]["rows"] = [{"name": n, "messages": TURNS} for n in ("baseline", "feedback")]
    ex = _strict_load(history.to_llm_comparator(history.add_run([], data)))["examples"][0]
    assert ex["input_text"] == (
        '[system]\nsys\n\n[user]\nearlier "q"\n\n[assistant]\nearlier a\n2\n\n[user]\n' + "p" * 100
    )


def test_llm_comparator_run_of_one_column_gives_no_example():
    data = _result("solo")
    data["rows"] = data["rows"][:1]
    doc = _strict_load(history.to_llm_comparator(history.add_run([], data)))
    _check_llm_comparator(doc)
    assert doc["examples"] == [] and "solo" in doc["metadata"]["source_path"]


def _realistic(run_id: str, columns: int = 4, tokens: int = 64) -> dict:
    """A run shaped like a real one: every token with its five alternatives and full-precision floats."""
    import math
    import random

    rnd = random.Random(run_id)

    def step(i: int) -> StepRecord:
        lp = -rnd.random() * 3
        top = [Alternative(rnd.randrange(49152), f" tok{rnd.randrange(999)}", rnd.random()) for _ in range(5)]
        return StepRecord(
            i,
            top[0].token_id,
            top[0].text,
            lp,
            math.exp(lp),
            rnd.random() * 9,
            rnd.random() * 4,
            rnd.random() * 9,
            top,
            rnd.random() * 100,
            forced=i == 3,
        )

    rows = []
    for c in range(columns):
        steps = [step(i) for i in range(tokens)]
        rows.append(
            RowResult(
                f"col{c}",
                None,
                {},
                [s.token_id for s in steps],
                "".join(s.text for s in steps),
                "max_tokens",
                tokens - 1,
                steps,
                {"self_ppl": 1.5},
            )
        )
    config = RunConfig(
        prompt="Why is the sky blue?", rows=[RowSpec(f"col{c}") for c in range(columns)]
    ).to_dict()
    return RunResult(config, rows).to_dict() | {"run_id": run_id}


def test_history_packs_token_records_and_reads_them_back():
    """Stored runs are packed (a list per field, 4 decimals): several times smaller, read back as
    the RunResult they were, within the rounding."""
    data = _realistic("r1")
    stored = history.add_run([], data)
    assert len(json.dumps(stored)) < len(json.dumps(data)) / 2.5  # measured: 2.9x smaller
    (entry,), skipped = history.valid(stored)
    assert skipped == 0 and entry["id"] == "r1"
    back = RunResult.from_dict(entry["result"])
    orig = RunResult.from_dict(data)
    for r0, r1 in zip(orig.rows, back.rows):
        assert r1.token_ids == r0.token_ids and r1.text == r0.text and r1.metrics == r0.metrics
        for a, b in zip(r0.steps, r1.steps):
            assert (b.step, b.token_id, b.text, b.forced) == (a.step, a.token_id, a.text, a.forced)
            assert abs(b.logprob - a.logprob) < 1e-5 and abs(b.prob - a.prob) < 1e-4
            assert (
                abs(b.confidence - a.confidence) < 1e-4
                and abs(b.group_confidence - a.group_confidence) < 1e-4
            )
            assert [(x.token_id, x.text) for x in b.top] == [(x.token_id, x.text) for x in a.top]
            assert all(abs(x.prob - y.prob) < 1e-4 for x, y in zip(a.top, b.top))
    assert history.to_json(stored) == history.to_json([entry])  # exports read stored entries as they are


def test_history_keeps_thirty_four_column_runs():
    hist: list = []
    for n in range(history.MAX_RUNS):
        hist = history.add_run(hist, _realistic(f"r{n}", 4, 24))
    assert len(hist) == history.MAX_RUNS and len(json.dumps(hist)) <= history.MAX_BYTES


def test_a_malformed_packed_run_is_skipped_not_an_error():
    stored = history.add_run([], _realistic("ok"))
    result = json.loads(stored[0]["result"])
    result["rows"][0]["steps"]["logprob"] = result["rows"][0]["steps"]["logprob"][:2]
    broken = [
        dict(stored[0], id=f"bad{i}", result=r)
        for i, r in enumerate(
            [json.dumps(result), "{not json", "[" * 100_000 + "]" * 100_000, json.dumps("text"), 7]
        )
    ]
    runs, skipped = history.valid([*broken, *stored])
    assert [e["id"] for e in runs] == ["ok"] and skipped == len(broken)


def _leaves(value) -> int:
    """How many numbers and strings a value holds: what Gradio's page copies one by one (see
    history.PACKED)."""
    if isinstance(value, dict):
        return sum(map(_leaves, value.values()))
    return sum(map(_leaves, value)) if isinstance(value, list) else 1


def test_each_stored_run_is_one_text_so_the_page_copies_history_cheaply():
    hist: list = []
    for n in range(5):
        hist = history.add_run(hist, _realistic(f"r{n}", 4, 64))
    hist = history.rate(history.rename(hist, "r1", "mine"), "r1", "col2", "better", "crisp")
    assert all(isinstance(e["result"], str) for e in hist)
    assert _leaves(hist) < 50  # measured: 18; the same runs as nested lists: 31,283
    assert _leaves(json.loads(hist[0]["result"])) > 4 * 64 * 20  # what each run's text holds (6,254)


def test_runs_stored_before_as_lists_are_read_and_an_edit_writes_them_as_text():
    new = history.add_run([], _result("new"))
    old = [
        dict(e, result=json.loads(e["result"])) for e in history.add_run([], _result("old"))
    ]  # the old form
    hist = [*new, *old]
    (a, b), skipped = history.valid(hist)
    assert skipped == 0 and a["result"] == b["result"] | {"run_id": "new"}  # both read as the same run
    renamed = history.rename(hist, "old", "kept")
    assert [type(e["result"]) for e in renamed] == [str, str] and _by_id(renamed, "old")["name"] == "kept"
    before, after = (json.loads(history.to_json(h))[1] for h in (hist, renamed))
    assert after == before | {"name": "kept"}  # the run itself unchanged by the rewrite


# ---- names, search, deletion, branch labels, ratings ----------------------------------------------


def _two() -> list:
    return history.add_run(history.add_run([], _result("a")), _result("b"))


def _by_id(hist: list, run_id: str) -> dict:
    return next(e for e in history.valid(hist)[0] if e["id"] == run_id)


def _row(hist: list, run_id: str) -> dict:
    return dict(zip(history.TABLE_HEADERS, next(r for r in history.table(hist) if r[1] == run_id)))


def test_rename_names_a_run_on_one_line_and_keeps_it_packed():
    hist = _two()
    named = history.rename(hist, "a", "  planet\n <b>run</b> ")
    assert (
        "name" not in hist[1] and named[1]["name"] == "planet <b>run</b>"
    )  # the given history is not changed
    stored = json.loads(named[1]["result"])
    assert stored["rows"][0]["steps"][history.PACKED] == 1  # written back as stored: still packed
    assert _row(named, "a")["name"] == "planet <b>run</b>" and _row(named, "b")["name"] == ""
    assert history.label(named[1]).startswith("a · planet <b>run</b> · ")
    assert "name" not in history.rename(named, "a", " ")[1]  # empty: no name
    assert history.rename(hist, "a", "n" * history.NAME_MAX_CHARS)[1]["name"] == "n" * history.NAME_MAX_CHARS


@pytest.mark.parametrize(
    "run_id, name, field",
    [
        ("a", "n" * (history.NAME_MAX_CHARS + 1), "name"),
        ("a", 5, "name"),
        ("zz", "fine", "run_id"),
    ],
)
def test_rename_refuses_a_long_name_or_an_unknown_run(run_id, name, field):
    with pytest.raises(history.FeedbackError, match=f"^{field}"):
        history.rename(_two(), run_id, name)


def test_a_stored_name_or_rating_this_page_could_not_write_is_dropped_the_run_kept():
    hist = history.rate(history.rename(_two(), "a", "ok"), "a", "baseline", "better", "fine")
    bad = json.loads(json.dumps(hist))
    bad[1]["name"] = "n" * 500
    bad[1]["ratings"] |= {
        "feedback": {"verdict": "best", "note": ""},
        "ghost": {"verdict": "tie", "note": ""},
    }
    bad[1]["extra"] = "<script>"
    bad[0]["ratings"] = "not a dict"
    runs, skipped = history.valid(bad)
    assert skipped == 0 and [set(e) for e in runs] == [
        {"id", "created", "result"},
        {"id", "created", "result", "ratings"},
    ]
    assert runs[1]["ratings"] == {"baseline": {"verdict": "better", "note": "fine"}}
    assert history.rename(bad, "b", "x")[1] == {
        k: v for k, v in bad[1].items() if k not in ("name", "extra")
    } | {
        "ratings": {"baseline": {"verdict": "better", "note": "fine"}}
    }  # an edit writes back only what is good


def test_search_finds_runs_by_name_prompt_column_or_output_in_any_case():
    hist = history.rename(history.add_run(_two(), _three("t", prompt="Name a PLANET")), "a", "My Favourite")
    runs, _ = history.valid(hist)
    found = lambda query: [e["id"] for e in history.search(runs, query)]  # noqa: E731
    assert found("") == found(None) == ["t", "b", "a"]
    assert found("favourite") == ["a"] and found("name a  planet") == ["t"]  # any case, any whitespace
    assert found("CHAT") == ["t"] and found("own out") == ["t"] and found("feedback text") == ["b", "a"]
    assert found('OWN say "hi"') == ["t"]  # a column's own prompt
    assert found("nowhere") == []


def test_delete_removes_the_chosen_runs_and_undelete_puts_them_back_in_place():
    hist = history.add_run(_two(), _result("c"))
    kept, removed = history.delete(hist, ["b", "nope"])
    assert [e["id"] for e in kept] == ["c", "a"] and [(i, e["id"]) for i, e in removed] == [(1, "b")]
    assert [e["id"] for e in history.undelete(kept, removed)] == ["c", "b", "a"]
    again = history.add_run(kept, _result("b"))  # recorded again since: not doubled
    assert [e["id"] for e in history.undelete(again, removed)] == ["b", "c", "a"]
    with pytest.raises(history.FeedbackError, match="^run_ids"):
        history.delete(hist, ["nope"])


def _branched(run_id: str = "br") -> dict:
    """Column 2 replayed step 0 and took a person's token at step 1; column 1 was left as it was."""
    data = _result(run_id)
    data["rows"][1]["steps"] = [dict(s) for s in data["rows"][1]["steps"]]
    data["rows"][1]["steps"][0] |= {"forced": True}
    data["rows"][1]["steps"][1] |= {"forced": True, "chosen": True, "text": " resulting"}
    return data


def test_a_branched_run_is_labelled_with_its_step_and_token_and_a_name_extends_it():
    hist = history.add_run(history.add_run([], _result("plain")), _branched())
    assert history.branch_label(hist[0]) == "branch at step 1: ' resulting'"
    assert history.branch_label(hist[1]) == ""
    assert _row(hist, "br")["name"] == "branch at step 1: ' resulting'" and _row(hist, "plain")["name"] == ""
    named = history.rename(hist, "br", "mine")
    assert _row(named, "br")["name"] == "mine (branch at step 1: ' resulting')"
    assert [e["id"] for e in history.search(history.valid(named)[0], "branch at step 1")] == ["br"]


def test_rate_stores_a_verdict_and_note_per_column_and_the_table_shows_them():
    hist = _two()
    rated = history.rate(hist, "a", "feedback", "worse", "  rambles " + "x" * 60)
    rated = history.rate(rated, "a", "baseline", "better")
    assert "ratings" not in hist[1]  # pure: the given history is not changed
    assert list(rated[1]["ratings"]) == ["baseline", "feedback"]  # in column order
    assert rated[1]["ratings"]["feedback"]["note"] == "rambles " + "x" * 60
    cell = _row(rated, "a")["ratings"]
    assert cell.startswith("baseline: better | feedback: worse (rambles x") and cell.endswith("…)")
    assert _row(rated, "b")["ratings"] == "—"
    assert history.rate(rated, "a", "baseline", "tie", None)[1]["ratings"]["baseline"] == {
        "verdict": "tie",
        "note": "",
    }


def test_rate_shown_adds_the_run_on_the_page_when_absent_and_rates_it(monkeypatch):
    rated = history.rate_shown(_two(), _result("c"), {"baseline": "tie"}, "feedback", "worse")
    assert [e["id"] for e in rated] == ["c", "b", "a"]
    assert _by_id(rated, "c")["ratings"] == {
        "baseline": {"verdict": "tie", "note": ""},
        "feedback": {"verdict": "worse", "note": ""},
    }
    # held already: rated as `rate` rates it, the verdicts given with it not applied again
    noted = history.rate(rated, "c", "baseline", "tie", "close")
    again = history.rate_shown(noted, _result("c"), {"baseline": "better"}, "feedback", "better")
    assert _by_id(again, "c")["ratings"] == {
        "baseline": {"verdict": "tie", "note": "close"},
        "feedback": {"verdict": "better", "note": ""},
    }
    with pytest.raises(history.FeedbackError, match="^verdict"):
        history.rate_shown(_two(), _result("c"), {}, "feedback", "best")
    # a history larger than this page stores is refused, as by `rate` (not replaced by the one run)
    monkeypatch.setattr(history, "MAX_BYTES", 10)
    with pytest.raises(history.FeedbackError, match="run history is at most"):
        history.rate_shown(_two(), _result("c"), {}, "feedback", "worse")


@pytest.mark.parametrize(
    "args, field",
    [
        (("zz", "baseline", "better", ""), "run_id"),
        (("a", "ghost", "better", ""), "column"),
        (("a", "baseline", "best", ""), "verdict"),
        (("a", "baseline", None, ""), "verdict"),
        (("a", "baseline", "better", "n" * (history.NOTE_MAX_CHARS + 1)), "note"),
        (("a", "baseline", "better", ["a note"]), "note"),
    ],
)
def test_rate_refuses_naming_the_field(args, field):
    with pytest.raises(history.FeedbackError, match=f"^{field}"):
        history.rate(_two(), *args)


def test_an_edit_that_would_overfill_history_is_refused(monkeypatch):
    hist = _two()
    monkeypatch.setattr(history, "EDIT_SLACK_BYTES", 0)
    monkeypatch.setattr(history, "MAX_BYTES", len(json.dumps(hist)) + 10)
    with pytest.raises(history.FeedbackError, match="History is full"):
        history.rate(hist, "a", "baseline", "better", "n" * history.NOTE_MAX_CHARS)


def test_json_and_csv_exports_carry_names_and_ratings():
    hist = history.rate(history.rename(_two(), "a", "mine"), "a", "feedback", "better", 'says "why", briefly')
    data = json.loads(history.to_json(hist))
    assert [(d["id"], d["name"], d["ratings"]) for d in data] == [
        ("b", None, {}),
        ("a", "mine", {"feedback": {"verdict": "better", "note": 'says "why", briefly'}}),
    ]
    assert RunResult.from_dict(data[1]).rows[1].name == "feedback"  # the extra keys do not stop a read
    parsed = [dict(zip(history.CSV_COLUMNS, line)) for line in csv.reader(io.StringIO(history.to_csv(hist)))][
        1:
    ]
    a = [p for p in parsed if p["run_id"] == "a"]
    assert {p["run_name"] for p in a} == {"mine"} and {
        p["run_name"] for p in parsed if p["run_id"] == "b"
    } == {""}
    assert [(p["row"], p["rating"], p["rating_note"]) for p in a] == [("baseline", "", "")] * 3 + [
        ("feedback", "better", 'says "why", briefly')
    ] * 3


@pytest.mark.parametrize(
    "ratings, score",
    [
        ({}, None),
        ({"baseline": "better"}, 1),
        ({"feedback": "worse"}, 1),
        ({"feedback": "better"}, -1),
        ({"baseline": "worse"}, -1),
        ({"baseline": "tie"}, 0),
        ({"feedback": "tie"}, 0),
        ({"baseline": "better", "feedback": "worse"}, 1),
        ({"baseline": "better", "feedback": "better"}, 0),
        ({"baseline": "worse", "feedback": "tie"}, -1),
    ],
)
def test_llm_comparator_score_comes_from_the_pairs_ratings(ratings, score):
    hist = history.add_run([], _result("a"))
    for column, verdict in ratings.items():
        hist = history.rate(hist, "a", column, verdict, f"{column} note")
    doc = _strict_load(history.to_llm_comparator(hist))
    _check_llm_comparator(doc)
    (ex,) = doc["examples"]
    assert ex["score"] == score
    assert [(r["score"], r["rationale"]) for r in ex["individual_rater_scores"]] == [
        (history._VOTE[v] * (1 if c == "baseline" else -1), f"{c} note") for c, v in ratings.items()
    ]
    assert ex["custom_fields"]["rating"] == [ratings.get("baseline"), ratings.get("feedback")]


def test_llm_comparator_scores_each_pair_of_a_three_column_run_from_its_own_two_columns():
    hist = history.rate(
        history.rename(history.add_run([], _three("t")), "t", "three"), "t", "chat", "better", ""
    )
    doc = _strict_load(history.to_llm_comparator(hist))
    _check_llm_comparator(doc)
    assert [(ex["custom_fields"]["pair"], ex["score"]) for ex in doc["examples"]] == [
        ("baseline vs own", None),
        ("baseline vs chat", -1),
    ]
    rater = doc["examples"][1]["individual_rater_scores"][0]
    assert rater | {"score": 0} == {
        "index": 0,
        "score": 0,
        "rating_label": "B (chat) better",
        "is_flipped": False,
        "rationale": "",
        "custom_fields": {},
    }
    assert {ex["custom_fields"]["run_name"] for ex in doc["examples"]} == {"three"}


class _Compare:
    """Compare's side of a reload: the runs it was given to restore."""

    def __init__(self):
        self.ui = SimpleNamespace(run=SimpleNamespace(status="compare status"))
        self.restored: list[tuple[str, str]] = []

    def restore(self, result: dict, view: str) -> dict:
        self.restored.append((result["config"]["prompt"], view))
        return {}


def _tab(compare=None):
    """The History tab's handlers, with names standing in for its components."""
    from ui.history.tab import HistoryTab

    tab = HistoryTab(compare=compare)
    for part in (
        "table",
        "catalog",
        "ids",
        "note",
        "name",
        "column",
        "verdict",
        "rate_note",
        "status",
        "hist",
        "removed",
        "picked",
        "tabs",
    ):
        setattr(tab, part, part)
    return tab


def listed(out: dict) -> list[str]:
    """The run ids of the table's rows, in order."""
    return re.findall(r'<tr data-id="([^"]*)">', out["table"])


def test_history_tab_searches_picks_and_edits_by_run_id():
    tab, hist = _tab(), history.add_run(_two(), _three("t", prompt="Name a planet"))
    listing = tab.view(hist)
    assert listed(listing) == ["t", "b", "a"] and "3 run(s) stored" in listing["note"]
    assert listing["ids"]["value"] == []
    # the tab's listing may land after a run was picked: the pick stays (a gone run does not)
    assert tab.view(hist, "", ["t", "gone"])["ids"]["value"] == ["t"]
    found = tab.search("PLANET", listing["catalog"], ["a", "t"])
    assert listed(found) == ["t"] and found["ids"]["value"] == ["t"]  # the choice kept by id
    assert found["note"].startswith("1 of 3 run(s) match the search.")
    picked = tab.pick(["t"], "feedback", listing["catalog"], None)
    assert (
        picked["column"]["choices"] == ["baseline", "own", "chat"] and picked["column"]["value"] == "baseline"
    )
    assert tab.pick(["t", "a"], "own", listing["catalog"], "t") == {"picked": "t"}  # same run: typing stays
    with pytest.warns(UserWarning):
        assert "Not done: choose a run to name" in tab.rename(hist, [], "x", "")["status"]
    out = tab.rename(hist, ["t"], "<b>mine</b>", "planet")
    assert "&lt;b&gt;mine&lt;/b&gt;" in out["status"] and "<b>" not in out["status"]  # escaped where shown
    assert _by_id(out["hist"], "t")["name"] == "<b>mine</b>" and listed(out) == ["t"]
    out = tab.rate(out["hist"], ["t"], "own", "better", "crisp", "")
    assert tab.pick(["t"], "own", out["catalog"], None)["verdict"] == "better"
    out = tab.delete(out["hist"], ["t", "a"], "")
    assert "Deleted 2 runs: t, a." in out["status"] and [e["id"] for e in out["hist"]] == ["b"]
    back = tab.undo(out["hist"], out["removed"], "")
    assert [e["id"] for e in back["hist"]] == ["t", "b", "a"] and back["removed"] is None
    assert _by_id(back["hist"], "t")["ratings"] == {"own": {"verdict": "better", "note": "crisp"}}


def drawn_from(out: dict) -> list[str] | None:
    """The run ids the table says it was drawn from (what the page compares with the runs it holds)."""
    found = re.search(r'data-runs="([^"]*)"', out["table"])
    return json.loads(found.group(1).replace("&quot;", '"')) if found else None


def test_the_table_says_loading_until_drawn_then_no_runs_yet_or_no_match():
    from ui.history.tab import EMPTY, LOADING, LOADING_TABLE

    tab = _tab()
    assert LOADING in LOADING_TABLE and "no runs" not in LOADING_TABLE  # before the page's load draws it
    assert (
        drawn_from({"table": LOADING_TABLE}) is None
    )  # drawn from no runs at all: the page keeps saying loading
    empty = tab.view([])
    assert EMPTY in empty["table"] and LOADING not in empty["table"] and drawn_from(empty) == []
    listing = tab.view(history.add_run(_two(), _three("t", prompt="Name a planet")))
    assert listed(listing) == ["t", "b", "a"] and drawn_from(listing) == ["t", "b", "a"]
    none = tab.search("nowhere", listing["catalog"], [])
    assert listed(none) == [] and "no runs match the search" in none["table"] and EMPTY not in none["table"]
    assert drawn_from(none) == ["t", "b", "a"]  # every stored run, listed or not: the page holds them all


def test_undo_chooses_the_deleted_runs_again_and_reload_takes_the_first():
    compare = _Compare()
    tab = _tab(compare)
    hist = history.add_run(_two(), _three("t", prompt="Name a planet"))
    gone = tab.delete(hist, ["t", "a"], "")
    assert gone["ids"]["value"] == [] and [e["id"] for e in gone["hist"]] == ["b"]
    back = tab.undo(gone["hist"], gone["removed"], "")
    assert [e["id"] for e in back["hist"]] == ["t", "b", "a"] and drawn_from(back) == ["t", "b", "a"]
    assert back["ids"]["value"] == ["t", "a"] and "Restored 2 runs, chosen again." in back["status"]
    picked = tab.pick(
        back["ids"]["value"], None, back["catalog"], None
    )  # the picker's change fills the fields
    assert picked["picked"] == "t" and picked["column"]["choices"] == ["baseline", "own", "chat"]
    out = tab.reload(back["hist"], back["ids"]["value"], "plain")
    assert compare.restored == [("Name a planet", "plain")] and "Reloaded run t" in out["compare status"]
    assert out["tabs"]["selected"] == "compare"


def test_undo_keeps_the_order_the_runs_were_chosen_in_and_says_when_the_search_hides_them():
    tab = _tab(_Compare())
    hist = history.add_run(_two(), _three("t", prompt="Name a planet"))
    gone = tab.delete(hist, ["a", "t"], "")
    assert "Deleted 2 runs: a, t." in gone["status"]
    assert tab.undo(gone["hist"], gone["removed"], "")["ids"]["value"] == [
        "a",
        "t",
    ]  # Reload takes a, as before
    hidden = tab.undo(gone["hist"], gone["removed"], "nowhere")
    assert hidden["ids"]["value"] == [] and "do not match the search" in hidden["status"]
    assert [e["id"] for e in hidden["hist"]] == ["t", "b", "a"]
