"""History entries and exports (JSON of RunResults, CSV of per-token rows)."""
from __future__ import annotations

import csv
import io
import json

from feedback.records import Alternative, RowResult, RunResult, StepRecord
from ui import history


def _result(run_id: str, text: str = 'a "quoted", comma\nline') -> dict:
    steps = [StepRecord(i, 10 + i, text if i == 0 else "x", -0.5, 0.6, 3.0 + i, 1.2, 3.0, 
                        [Alternative(10 + i, "x", 0.6), Alternative(99, ",|:", 0.1)], 12.0) for i in range(3)]
    rows = [RowResult("baseline", None, {}, [10, 11, 12], "t", "max_tokens", 2, steps),
            RowResult("feedback", "residual", {"alpha": 0.1}, [10, 11, 12], "t", "max_tokens", 2, steps)]
    data = RunResult({"prompt": "p" * 100}, rows, first_divergence_step=None).to_dict()
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


def test_table_and_select():
    hist = history.add_run(history.add_run([], _result("a")), _result("b"))
    rows = history.table(hist)
    assert len(rows) == 2 and len(rows[0]) == len(history.TABLE_HEADERS)
    assert rows[0][0] == "b" and rows[0][3] == "residual alpha=0.1" and rows[0][5] == "—"
    assert len(rows[0][2]) == 60
    assert [e["id"] for e in history.select(hist, ["a"])] == ["a"]
    assert len(history.select(hist, [])) == 2


def test_csv_has_one_row_per_token_and_survives_hostile_text():
    hist = history.add_run([], _result("a"))
    parsed = list(csv.reader(io.StringIO(history.to_csv(hist))))
    assert parsed[0] == history.CSV_COLUMNS
    assert len(parsed) == 1 + 2 * 3
    assert parsed[1][5] == 'a "quoted", comma\nline'
    assert parsed[1][11] == "x:0.6000|,|::0.1000"


def test_json_export_round_trips_to_run_results():
    hist = history.add_run([], _result("a"))
    data = json.loads(history.to_json(hist))
    result = RunResult.from_dict(data[0])
    assert data[0]["id"] == "a" and result.rows[1].params == {"alpha": 0.1}
    assert result.rows[0].steps[0].top[1].text == ",|:"
