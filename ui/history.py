"""This browser's run history: compact entries, a table summary, JSON and CSV exports."""
from __future__ import annotations

import csv
import io
import json
import time
import uuid

MAX_RUNS = 12
MAX_BYTES = 3_000_000  # keep localStorage well under browsers' ~5 MB quota

CSV_COLUMNS = ["run_id", "row", "strategy", "step", "token_id", "text", "logprob", "prob", "confidence",
               "entropy", "group_confidence", "top5"]


def add_run(history: list[dict] | None, result: dict) -> list[dict]:
    """A new history with `result` (a RunResult dict) first, oldest runs dropped past the caps.
    A result already present (same `run_id`) is not added twice."""
    run_id = result.get("run_id") or uuid.uuid4().hex[:8]
    if any(e["id"] == run_id for e in history or []):
        return list(history or [])
    entry = {"id": run_id, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "result": result}
    runs = [entry, *(history or [])][:MAX_RUNS]
    while len(runs) > 1 and len(json.dumps(runs)) > MAX_BYTES:
        runs.pop()
    return runs


def table(history: list[dict] | None) -> list[list]:
    """One row per run for the History tab's table."""
    out = []
    for e in history or []:
        res = e["result"]
        rows = res["rows"]
        fb = next((r for r in rows if r.get("strategy")), None)
        label = f"{fb['strategy']} " + ", ".join(f"{k}={v}" for k, v in fb["params"].items()) if fb else "—"
        div = res.get("first_divergence_step")
        out.append([e["id"], e["created"], res["config"]["prompt"][:60], label,
                    " / ".join(str(len(r["token_ids"])) for r in rows), "—" if div is None else div,
                    " / ".join(str(r.get("stop_reason")) for r in rows)])
    return out


TABLE_HEADERS = ["id", "time", "prompt", "feedback", "tokens", "diverges at", "stop"]


def select(history: list[dict] | None, ids: list[str] | None) -> list[dict]:
    """Entries with these ids (all entries when no id is given)."""
    runs = history or []
    return [e for e in runs if not ids or e["id"] in ids]


def to_json(entries: list[dict]) -> str:
    return json.dumps([{"id": e["id"], "created": e["created"], **e["result"]} for e in entries], indent=1)


def to_csv(entries: list[dict]) -> str:
    """Per-token rows of every row of every selected run."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(CSV_COLUMNS)
    for e in entries:
        for row in e["result"]["rows"]:
            for s in row["steps"]:
                top = "|".join(f"{a['text']}:{a['prob']:.4f}" for a in s.get("top", []))
                writer.writerow([e["id"], row["name"], row.get("strategy") or "", s["step"], s["token_id"], s["text"],
                                 f"{s['logprob']:.6f}", f"{s['prob']:.6f}", f"{s['confidence']:.6f}",
                                 f"{s['entropy']:.6f}", f"{s['group_confidence']:.6f}", top])
    return buf.getvalue()
