"""This browser's run history: compact entries, a table summary, JSON and CSV exports.

The history lives in the browser (local storage) and comes back with every request, so nothing in
it is trusted: entries that do not have the shape of a stored run are skipped and counted.
"""
from __future__ import annotations

import csv
import io
import json
import time
import uuid

from feedback.errors import FeedbackError

MAX_RUNS = 30
MAX_BYTES = 3_000_000  # keep localStorage well under browsers' ~5 MB quota
OUTPUT_PREVIEW = 80

CSV_COLUMNS = ["run_id", "created", "prompt", "system_prompt", "model", "chat_template", "temperature", "top_p",
               "top_k", "min_p", "repetition_penalty", "seed", "max_new_tokens", "deepconf_k", "deepconf_window",
               "threshold", "row", "strategy", "params", "row_prompt", "row_metrics", "step", "token_id", "forced",
               "text", "logprob", "prob", "confidence", "entropy", "group_confidence", "top5"]
TABLE_HEADERS = ["id", "time", "prompt", "feedback", "baseline output", "feedback output", "tokens", "differ at",
                 "stop"]


def _is_run(result) -> bool:
    try:
        cfg = result["config"]
        return (isinstance(cfg["prompt"], str) and isinstance(cfg["sampling"], dict) and isinstance(cfg["deepconf"], dict)
                and isinstance(result["rows"], list) and len(result["rows"]) >= 1
                and all(isinstance(r["name"], str) and isinstance(r["token_ids"], list) and isinstance(r["steps"], list)
                        for r in result["rows"]))
    except (KeyError, TypeError):
        return False


def valid(history) -> tuple[list[dict], int]:
    """(the well-formed entries, how many were skipped). A history larger than a browser could
    have stored is refused whole: it did not come from this page."""
    if history and len(json.dumps(history, default=str)) > 2 * MAX_BYTES:
        raise FeedbackError(f"a run history is at most {MAX_BYTES // 1_000_000} MB (this page stores no more); "
                            "this one is larger")
    if not isinstance(history, list):
        return [], 0 if history in (None, "", {}) else 1
    good = [e for e in history if isinstance(e, dict) and isinstance(e.get("id"), str)
            and isinstance(e.get("created"), str) and _is_run(e.get("result"))]
    return good, len(history) - len(good)


def add_run(history: list[dict] | None, result: dict) -> list[dict]:
    """A new history with `result` (a RunResult dict) first, oldest runs dropped past the caps.
    A result already present (same `run_id`) is not added twice."""
    try:
        runs, _ = valid(history)
    except FeedbackError:  # a store too large to be this page's: start again rather than fail the run
        runs = []
    run_id = result.get("run_id") or uuid.uuid4().hex[:8]
    if any(e["id"] == run_id for e in runs):
        return runs
    entry = {"id": run_id, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "result": result}
    runs = [entry, *runs][:MAX_RUNS]
    while len(runs) > 1 and len(json.dumps(runs)) > MAX_BYTES:
        runs.pop()
    return runs


def _preview(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= OUTPUT_PREVIEW else text[:OUTPUT_PREVIEW - 1] + "…"


def table(history: list[dict]) -> list[list]:
    """One row per run for the History tab's table (entries assumed valid)."""
    out = []
    for e in history:
        res = e["result"]
        rows = res["rows"]
        fb = next((r for r in rows if r.get("strategy")), None)
        label = f"{fb['strategy']} " + ", ".join(f"{k}={v}" for k, v in fb.get("params", {}).items()) if fb else "—"
        div = res.get("first_divergence_step")
        out.append([e["id"], e["created"], _preview(res["config"]["prompt"]), label,
                    _preview(rows[0].get("text", "")), _preview(fb.get("text", "")) if fb else "—",
                    " / ".join(str(len(r["token_ids"])) for r in rows), "—" if div is None else div,
                    " / ".join(str(r.get("stop_reason")) for r in rows)])
    return out


def select(history: list[dict], ids: list[str] | None) -> list[dict]:
    """Entries with these ids (all entries when no id is given)."""
    return [e for e in history if not ids or e["id"] in ids]


def to_json(entries: list[dict]) -> str:
    return json.dumps([{"id": e["id"], "created": e["created"], **e["result"]} for e in entries], indent=1)


def to_csv(entries: list[dict]) -> str:
    """One line per generated token of every row of every selected run, each with the run's
    prompt and settings, the row's own prompt and its metrics (JSON); the top-5 alternatives as a
    JSON list (so ':' and '|' in tokens are safe)."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(CSV_COLUMNS)
    for e in entries:
        res = e["result"]
        cfg = res["config"]
        s, dc = cfg["sampling"], cfg["deepconf"]
        run = [e["id"], e["created"], cfg["prompt"], cfg.get("system_prompt") or "", cfg.get("model", ""),
               cfg.get("chat_template", ""), s.get("temperature"), s.get("top_p"), s.get("top_k"), s.get("min_p"),
               s.get("repetition_penalty"), cfg.get("seed"), cfg.get("max_new_tokens"), dc.get("k"),
               dc.get("window"), "" if dc.get("threshold") is None else dc["threshold"]]
        specs = {r.get("name"): r for r in cfg.get("rows", []) if isinstance(r, dict)}
        for row in res["rows"]:
            params = json.dumps(row.get("params", {}), sort_keys=True)
            own = specs.get(row["name"], {}).get("prompt")
            metrics = json.dumps(row.get("metrics", {}), sort_keys=True, ensure_ascii=False)
            for st in row["steps"]:
                top = json.dumps([{"token_id": a["token_id"], "text": a["text"], "prob": round(a["prob"], 6)}
                                  for a in st.get("top", [])], ensure_ascii=False)
                writer.writerow([*run, row["name"], row.get("strategy") or "", params,
                                 cfg["prompt"] if own is None else own, metrics, st["step"], st["token_id"],
                                 int(bool(st.get("forced"))), st["text"], f"{st['logprob']:.6f}", f"{st['prob']:.6f}", f"{st['confidence']:.6f}",
                                 f"{st['entropy']:.6f}", f"{st['group_confidence']:.6f}", top])
    return buf.getvalue()
