"""History entries and exports (JSON of RunResults, CSV of per-token rows with the run's settings)."""
from __future__ import annotations

import csv
import io
import json

import pytest

from feedback.records import Alternative, RowResult, RunConfig, RunResult, StepRecord
from ui import history


def _result(run_id: str, text: str = 'a "quoted", comma\nline') -> dict:
    steps = [StepRecord(i, 10 + i, text if i == 0 else "x", -0.5, 0.6, 3.0 + i, 1.2, 3.0,
                        [Alternative(10 + i, "x", 0.6), Alternative(99, ",|:", 0.1)], 12.0) for i in range(3)]
    rows = [RowResult("baseline", None, {}, [10, 11, 12], "base text " * 20, "max_tokens", 2, steps),
            RowResult("feedback", "residual", {"alpha": 0.1}, [10, 11, 12], "feedback text", "max_tokens", 2, steps,
                      {"self_ppl": 1.5, "distinct_1": 1.0})]
    config = RunConfig(prompt="p" * 100, seed=7).to_dict()
    data = RunResult(config, rows, first_divergence_step=None).to_dict()
    return data | {"run_id": run_id}


def test_add_run_newest_first_capped_and_deduplicated():
    hist: list = []
    for i in range(history.MAX_RUNS + 3):
        hist = history.add_run(hist, _result(f"r{i}"))
    assert len(hist) == history.MAX_RUNS and hist[0]["id"] == f"r{history.MAX_RUNS + 2}"
    assert history.add_run(hist, _result(hist[0]["id"])) == hist


def test_add_run_respects_the_byte_cap(monkeypatch):
    monkeypatch.setattr(history, "MAX_BYTES", len(json.dumps([{"id": "r0", "created": "x", "result": _result("r0")}])) + 50)
    hist = history.add_run([], _result("r0"))
    hist = history.add_run(hist, _result("r1"))
    assert [e["id"] for e in hist] == ["r1"]


def test_table_shows_outputs_and_select():
    hist = history.add_run(history.add_run([], _result("a")), _result("b"))
    rows = history.table(hist)
    assert len(rows) == 2 and len(rows[0]) == len(history.TABLE_HEADERS)
    by = dict(zip(history.TABLE_HEADERS, rows[0]))
    assert by["id"] == "b" and by["feedback"] == "residual alpha=0.1" and by["differ at"] == "—"
    assert by["feedback output"] == "feedback text" and by["baseline output"].endswith("…")
    assert len(by["prompt"]) == history.OUTPUT_PREVIEW and len(by["baseline output"]) == history.OUTPUT_PREVIEW
    assert [e["id"] for e in history.select(hist, ["a"])] == ["a"]
    assert len(history.select(hist, [])) == 2


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
    assert fb["row_prompt"] == "p" * 100 and json.loads(fb["row_metrics"]) == {"self_ppl": 1.5, "distinct_1": 1.0}
    assert row["forced"] == "0"
    top = json.loads(row["top5"])  # ':' and '|' inside tokens cannot break the field
    assert top == [{"token_id": 10, "text": "x", "prob": 0.6}, {"token_id": 99, "text": ",|:", "prob": 0.1}]


def test_csv_gives_each_row_its_own_prompt_and_marks_forced_tokens():
    data = _result("a")
    data["config"]["rows"] = [{"name": "baseline", "prompt": None}, {"name": "feedback", "prompt": "variant B"}]
    data["rows"][1]["steps"][0]["forced"] = True
    parsed = [dict(zip(history.CSV_COLUMNS, line)) for line in csv.reader(io.StringIO(history.to_csv(
        history.add_run([], data))))][1:]
    assert [p["row_prompt"] for p in parsed] == ["p" * 100] * 3 + ["variant B"] * 3
    assert [p["forced"] for p in parsed] == ["0"] * 3 + ["1", "0", "0"]


def test_json_export_round_trips_to_run_results():
    hist = history.add_run([], _result("a"))
    data = json.loads(history.to_json(hist))
    result = RunResult.from_dict(data[0])
    assert data[0]["id"] == "a" and result.rows[1].params == {"alpha": 0.1}
    assert result.rows[0].steps[0].top[1].text == ",|:"


@pytest.mark.parametrize("bad", [
    "not a list", 42, [None], [1, 2], [{"id": 3}], [{"id": "x", "created": "t", "result": {}}],
    [{"id": "x", "created": "t", "result": {"config": {"prompt": 5}, "rows": []}}],
    [{"id": "x", "created": "t", "result": {"config": {"prompt": "p", "sampling": {}, "deepconf": {}},
                                           "rows": [{"name": "b", "token_ids": "nope", "steps": []}]}}],
])
def test_malformed_history_entries_are_skipped_and_counted(bad):
    good = history.add_run([], _result("a"))
    runs, skipped = history.valid(good + (bad if isinstance(bad, list) else []))
    assert [e["id"] for e in runs] == ["a"] and skipped == (len(bad) if isinstance(bad, list) else 0)
    runs, skipped = history.valid(bad)
    assert runs == [] and skipped >= 1
    assert history.valid(None) == ([], 0)
    assert [e["id"] for e in history.add_run(bad, _result("z"))] == ["z"]  # a corrupt store heals on the next run
