"""This browser's run history: compact entries, a table summary, JSON, CSV and LLM Comparator exports,
and what a person does with stored runs: name them, search them, delete them (and undo that), rate
their columns (better / worse / tie, with a note).

The history lives in the browser (local storage) and comes back with every request, so nothing in
it is trusted: entries that do not have the shape of a stored run are skipped and counted, and a
name or rating that this page could not have written is dropped as the entry is read. The editing
functions (`rename`, `rate`, `delete`, `undelete`) are pure: they take the stored history and return
a new one for the page to store, runs still packed (each one a JSON text: see `to_text`).
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
import uuid

from feedback.core.records import first_divergence
from feedback.errors import FeedbackError
from feedback.serve.limits import HISTORY_MAX_BYTES, NAME_MAX_CHARS
from ui.page.settings import OVERRIDES, SHARED

MAX_RUNS = 30
MAX_BYTES = (
    HISTORY_MAX_BYTES  # well under browsers' ~5 MB of local storage; the page server's body limit allows it
)
OUTPUT_PREVIEW = 80

# The run's value of each setting every column shares, from Compare's settings table (`SHARED`):
# one CSV column per setting a RunConfig holds, named by its path ("sampling.top_p" is `top_p`,
# "deepconf.k" `deepconf_k`). A setting no config holds is another's reading: early stop's mode is
# `deepconf_threshold` set or empty, the number of columns the run's rows.
RUN_SETTINGS = tuple((s.path.removeprefix("sampling.").replace(".", "_"), s.path) for s in SHARED if s.path)
RUN_SETTING_COLUMNS = [name for name, _ in RUN_SETTINGS]
# A row's value of each setting a column may have of its own (prompt, system prompt, temperature):
# its own, else the run's.
ROW_SETTING_COLUMNS = [f"row_{name}" for name, _ in OVERRIDES]
CSV_COLUMNS = [
    "run_id",
    "created",
    *RUN_SETTING_COLUMNS,
    "run_name",
    "row",
    "strategy",
    "params",
    *ROW_SETTING_COLUMNS,
    "row_messages",
    "row_metrics",
    "rating",
    "rating_note",
    "step",
    "token_id",
    "forced",
    "text",
    "logprob",
    "prob",
    "confidence",
    "entropy",
    "group_confidence",
    "top5",
]
TABLE_HEADERS = [
    "name",
    "id",
    "time",
    "prompt",
    "columns",
    "first column output",
    "other columns' output",
    "tokens",
    "differ at",
    "stop",
    "ratings",
]
TABLE_OTHERS_SHOWN = (
    3  # other columns listed per table cell (the UI's runs have at most 3); the rest are counted
)
LABEL_PREVIEW = 40
NOTE_PREVIEW = 40  # of a rating's note in the table; the exports carry it whole
BRANCH_PREVIEW = 24  # of the chosen token(s) in a branch's label
VERDICTS = ("better", "worse", "tie")
NOTE_MAX_CHARS = 500
# Names and notes may take a full history a little past MAX_BYTES (a browser holds ~5 MB and the
# page server's body limit has room), rather than refusing them whenever History is full; the next
# recorded run trims it back.
EDIT_SLACK_BYTES = 100_000


# A stored run keeps every token record, packed: one list per field instead of one object per
# token, probabilities and confidences to 4 decimals (cards show 1 decimal of a percent), the
# chosen token's probability left to exp(logprob): 2.9x smaller than the plain JSON (a 4-column,
# 64-token run), so History holds more runs and what the page sends when History is read stays small.
PACKED = "packed"
# Each stored run is then one JSON text rather than nested lists. Once an event has written the
# page's BrowserState, Gradio's page copies its value on every status update of every event (a
# click, a streamed token, the memory poll), one number or string at a time (Svelte's
# $state.snapshot, a structuredClone per leaf). Measured in headless Chromium on 2 cores, a History
# open took 5-15 s with 8 runs (0.9 MB) and 20 s or more with 26 (2.9 MB); with each run one text,
# about 1 s either way. It costs ~6% more storage (its quotes escaped); runs stored as lists are still read.
_FLOATS = {"logprob": 5, "confidence": 4, "entropy": 4, "group_confidence": 4, "time_ms": 1}


def _pack_steps(steps: list[dict]) -> dict:
    packed: dict = {
        PACKED: 1,
        "step": [s["step"] for s in steps],
        "token_id": [s["token_id"] for s in steps],
        "text": [s["text"] for s in steps],
    }
    for name, digits in _FLOATS.items():
        packed[name] = [round(float(s[name]), digits) for s in steps]
    packed["top"] = [
        [[a["token_id"], a["text"], round(float(a["prob"]), 4)] for a in s.get("top") or []] for s in steps
    ]
    packed["forced"] = [i for i, s in enumerate(steps) if s.get("forced")]
    packed["chosen"] = [i for i, s in enumerate(steps) if s.get("chosen")]
    if any(s.get("part") for s in steps):
        packed["part"] = [s.get("part") for s in steps]
    return packed


def _unpack_steps(packed: dict) -> list[dict]:
    n = len(packed["token_id"])
    forced, chosen = set(packed.get("forced") or []), set(packed.get("chosen") or [])
    parts = packed.get("part") or [None] * n
    return [
        {
            "step": packed["step"][i],
            "token_id": packed["token_id"][i],
            "text": packed["text"][i],
            **{name: packed[name][i] for name in _FLOATS},
            "prob": math.exp(packed["logprob"][i]),
            "top": [{"token_id": t, "text": x, "prob": p} for t, x, p in packed["top"][i]],
            "forced": i in forced,
            "chosen": i in chosen,
            "part": parts[i],
        }
        for i in range(n)
    ]


def pack(result: dict) -> dict:
    """A RunResult dict as History stores it (its rows' steps packed)."""
    rows = [
        r | {"steps": _pack_steps(r["steps"])} if isinstance(r.get("steps"), list) else r
        for r in result["rows"]
    ]
    return result | {"rows": rows}


def to_text(result: dict | str) -> str:
    """A packed run as History stores it: compact JSON text (kept as it is when already text)."""
    return (
        result if isinstance(result, str) else json.dumps(result, separators=(",", ":"), ensure_ascii=False)
    )


def unpack(result: dict | str) -> dict:
    """A stored run (its text, or the packed dict stored before) as the RunResult dict it was (steps
    as records again); anything malformed raises KeyError, TypeError, IndexError, ValueError or
    RecursionError."""
    if isinstance(result, str):
        result = json.loads(result)
    rows = [
        r | {"steps": _unpack_steps(r["steps"])} if isinstance(r.get("steps"), dict) else r
        for r in result["rows"]
    ]
    return result | {"rows": rows}


def _readable(entry) -> dict | None:
    """A stored entry with its run unpacked, or None when it is not one this page could have stored."""
    if not (
        isinstance(entry, dict)
        and isinstance(entry.get("id"), str)
        and isinstance(entry.get("created"), str)
        and isinstance(entry.get("result"), (str, dict))
    ):
        return None
    try:
        result = unpack(entry["result"])
    except (KeyError, TypeError, IndexError, ValueError, AttributeError, OverflowError, RecursionError):
        return None
    if not _is_run(result):
        return None
    # only the keys this page writes, so nothing else a browser sends reaches a table or an export
    return {"id": entry["id"], "created": entry["created"], "result": result, **_read_meta(entry, result)}


def _read_meta(entry: dict, result: dict) -> dict:
    """The entry's name and ratings, those this page could have written (others dropped, the run kept)."""
    meta: dict = {}
    try:
        if name := _check_name(entry.get("name")):
            meta["name"] = name
    except FeedbackError:
        pass
    if ratings := _read_ratings(entry.get("ratings"), [r["name"] for r in result["rows"]]):
        meta["ratings"] = ratings
    return meta


def _read_ratings(ratings, columns: list[str]) -> dict:
    """The well-formed ratings of the run's own columns, in column order."""
    if not isinstance(ratings, dict):
        return {}
    good = {}
    for column in columns:
        rating = ratings.get(column)
        try:
            if isinstance(rating, dict):
                good[column] = _check_rating(rating.get("verdict"), rating.get("note"))
        except FeedbackError:
            pass
    return good


def _stored(history) -> list[dict]:
    """The readable entries as this page stores them (runs packed, as text: one stored as lists
    before is written back as text), for an edit to write back. A history larger than a browser
    could have stored is refused, as by `valid`."""
    _check_size(history)
    if not isinstance(history, list):
        return []
    read = [(e, _readable(e)) for e in history]
    return [r | {"result": to_text(e["result"])} for e, r in read if r is not None]


def _unpacked(entries: list[dict]) -> list[dict]:
    """Entries (stored or already read) with their runs as RunResult dicts."""
    return [e | {"result": unpack(e["result"])} for e in entries]


def _is_run(result) -> bool:
    try:
        cfg = result["config"]
        return (
            isinstance(cfg["prompt"], str)
            and isinstance(cfg["sampling"], dict)
            and isinstance(cfg["deepconf"], dict)
            and isinstance(result["rows"], list)
            and len(result["rows"]) >= 1
            and all(
                isinstance(r["name"], str)
                and isinstance(r["token_ids"], list)
                and isinstance(r["steps"], list)
                for r in result["rows"]
            )
        )
    except (KeyError, TypeError):
        return False


def _check_size(history) -> None:
    """A history larger than a browser could have stored did not come from this page: refused whole."""
    if history and len(json.dumps(history, default=str)) > 2 * MAX_BYTES:
        raise FeedbackError(
            f"a run history is at most {MAX_BYTES // 1_000_000} MB (this page stores no more); "
            "this one is larger"
        )


def valid(history) -> tuple[list[dict], int]:
    """(the well-formed entries, how many were skipped). A history larger than a browser could
    have stored is refused whole: it did not come from this page."""
    _check_size(history)
    if not isinstance(history, list):
        return [], 0 if history in (None, "", {}) else 1
    good = [e for e in map(_readable, history) if e is not None]
    return good, len(history) - len(good)


def add_run(history: list[dict] | None, result: dict, verdicts: dict[str, str] | None = None) -> list[dict]:
    """A new history with `result` (a RunResult dict) first, its columns rated `verdicts` ({column:
    verdict}, those of its own columns with a known verdict), oldest runs dropped past the caps.
    A result already present (same `run_id`) is neither added twice nor rated again (a note added
    to a rating since stays)."""
    try:  # the stored (packed) entries kept as they are; each is read once, to check it
        runs = _stored(history)
    except FeedbackError:  # a store too large to be this page's: start again rather than fail the run
        runs = []
    return _with_run(runs, result, verdicts)


def _with_run(runs: list[dict], result: dict, verdicts: dict[str, str] | None) -> list[dict]:
    """`add_run` on entries already read (`_stored`)."""
    run_id = result.get("run_id") or uuid.uuid4().hex[:8]
    if any(e["id"] == run_id for e in runs):
        return runs
    entry = {"id": run_id, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "result": to_text(pack(result))}
    given = {c: {"verdict": v} for c, v in (verdicts or {}).items()}
    if ratings := _read_ratings(given, [r["name"] for r in result["rows"]]):
        entry["ratings"] = ratings
    return _capped([entry, *runs])


def _capped(runs: list[dict], max_bytes: int | None = None) -> list[dict]:
    """At most MAX_RUNS runs and `max_bytes` (MAX_BYTES) of JSON, the oldest (last) dropped first."""
    runs = runs[:MAX_RUNS]
    while len(runs) > 1 and len(json.dumps(runs)) > (MAX_BYTES if max_bytes is None else max_bytes):
        runs.pop()
    return runs


# --- names, ratings, deletion -----------------------------------------------------------------------


def _check_name(name) -> str:
    """A run's name on one line ("" for none); refused unless text of at most NAME_MAX_CHARS characters."""
    if name is None:
        return ""
    if not isinstance(name, str):
        raise FeedbackError(f"name must be text, got {type(name).__name__}")
    name = " ".join(name.split())  # one line, so a table row and a picker label stay one line
    if len(name) > NAME_MAX_CHARS:
        raise FeedbackError(f"name: a run's name is at most {NAME_MAX_CHARS} characters, got {len(name)}")
    return name


def _check_rating(verdict, note) -> dict:
    """{"verdict", "note"}, refused unless the verdict is one of VERDICTS and the note text of at most
    NOTE_MAX_CHARS characters (None: no note)."""
    if not isinstance(verdict, str) or verdict not in VERDICTS:
        raise FeedbackError(f"verdict must be one of {', '.join(VERDICTS)}, got {str(verdict)[:40]!r}")
    note = "" if note is None else note
    if not isinstance(note, str):
        raise FeedbackError(f"note must be text, got {type(note).__name__}")
    if len(note.strip()) > NOTE_MAX_CHARS:
        raise FeedbackError(
            f"note: a rating's note is at most {NOTE_MAX_CHARS} characters, got {len(note.strip())}"
        )
    return {"verdict": verdict, "note": note.strip()}


def _find(runs: list[dict], run_id) -> int:
    for i, e in enumerate(runs):
        if e["id"] == run_id:
            return i
    raise FeedbackError(f"run_id: no run {str(run_id)[:NAME_MAX_CHARS]!r} in this browser's history")


def _edited(runs: list[dict], index: int, entry: dict) -> list[dict]:
    """`runs` with entry `index` replaced, refused when that takes History past what the page stores."""
    runs = [*runs[:index], entry, *runs[index + 1 :]]
    if len(json.dumps(runs)) > MAX_BYTES + EDIT_SLACK_BYTES:
        raise FeedbackError(
            "this browser's History is full: delete or export runs before naming or rating more"
        )
    return runs


def rename(history, run_id: str, name: str | None) -> list[dict]:
    """A new history in which run `run_id` is called `name` (whitespace folded to one line, at most
    NAME_MAX_CHARS characters; empty: no name, so a branch shows its own label again)."""
    name = _check_name(name)
    runs = _stored(history)
    i = _find(runs, run_id)
    entry = {k: v for k, v in runs[i].items() if k != "name"}
    return _edited(runs, i, entry | {"name": name} if name else entry)


def rate(history, run_id: str, column: str, verdict: str, note: str | None = "") -> list[dict]:
    """A new history in which column `column` of run `run_id` is rated `verdict` ("better", "worse"
    or "tie") with `note` (at most NOTE_MAX_CHARS characters), replacing that column's rating.
    Refused, naming the field, for an unknown run or column, another verdict or a note too long."""
    return _rated(_stored(history), run_id, column, _check_rating(verdict, note))


def rate_shown(history, result: dict, verdicts: dict[str, str], column: str, verdict: str) -> list[dict]:
    """`rate` for the run a page shows (`result`, a RunResult dict), which is added first, rated
    `verdicts` as in `add_run`, when the history does not hold it yet (its own record may still be
    on its way to the page); the history is read once."""
    rating = _check_rating(verdict, "")
    return _rated(_with_run(_stored(history), result, verdicts), result.get("run_id"), column, rating)


def _rated(runs: list[dict], run_id: str, column: str, rating: dict) -> list[dict]:
    """`rate` on entries already read (`_stored`), with a checked rating."""
    i = _find(runs, run_id)
    columns = [r["name"] for r in unpack(runs[i]["result"])["rows"]]
    if not isinstance(column, str) or column not in columns:
        raise FeedbackError(
            f"column: run {run_id} has no column {str(column)[:NAME_MAX_CHARS]!r} "
            f"(it has {', '.join(columns)})"
        )
    ratings = runs[i].get("ratings", {}) | {column: rating}
    return _edited(runs, i, runs[i] | {"ratings": {c: ratings[c] for c in columns if c in ratings}})


def delete(history, run_ids: list[str]) -> tuple[list[dict], list[tuple[int, dict]]]:
    """(a new history without these runs, the removed entries with their places, for `undelete`).
    Refused when none of them is stored."""
    ids = {i for i in run_ids or [] if isinstance(i, str)}
    runs = _stored(history)
    removed = [(i, e) for i, e in enumerate(runs) if e["id"] in ids]
    if not removed:
        raise FeedbackError("run_ids: none of these runs is in this browser's history")
    return [e for e in runs if e["id"] not in ids], removed


def undelete(history, removed: list[tuple[int, dict]]) -> list[dict]:
    """A new history with what `delete` removed back in its places; a run stored again since is not
    doubled, and the caps hold (runs recorded since come first, so the oldest go)."""
    runs = _stored(history)
    for index, entry in sorted(removed, key=lambda pair: pair[0]):
        if all(e["id"] != entry["id"] for e in runs):
            runs.insert(index, entry)
    return _capped(runs, MAX_BYTES + EDIT_SLACK_BYTES)


def _preview(text, limit: int = OUTPUT_PREVIEW) -> str:
    """One line of at most `limit` characters, so a long or multi-line text keeps a table row short."""
    text = " ".join(str(text or "").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _specs(result: dict) -> dict[str, dict]:
    """The run's row specs (`config["rows"]`) by row name. Stored history is untrusted, so specs
    that are not dicts with a name are ignored rather than failing the whole table or export."""
    rows = result["config"].get("rows")
    return (
        {r["name"]: r for r in rows if isinstance(r, dict) and isinstance(r.get("name"), str)}
        if isinstance(rows, list)
        else {}
    )


def _own_prompt(spec: dict) -> str | None:
    """The row's own prompt, or None when it used the run's prompt."""
    prompt = spec.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _seen_system(config: dict, spec: dict) -> str:
    """The system prompt a row saw: its own when set, else the run's ("" for none)."""
    own = spec.get("system_prompt")
    return own if isinstance(own, str) else config.get("system_prompt") or ""


def _at(config: dict, path: str):
    """The value at a dotted path ("sampling.temperature") of a stored config; None where it has none."""
    value = config
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _run_value(config: dict, path: str):
    """The run's value of a shared setting (its dotted path in the stored config) as a CSV field:
    "" for none, a list (key facts) as JSON."""
    value = _at(config, path)
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    return "" if value is None else value


def _seen(config: dict, spec: dict, name: str, shared: str):
    """A row's value of a setting it may have of its own (`name` in its spec, `shared` the run's
    dotted path): its own when set, else the run's ("" when neither has one)."""
    own = spec.get(name)
    if own is not None and not isinstance(own, (dict, list, bool)):
        return own
    value = _at(config, shared)
    return "" if value is None else value


def _turns(spec: dict) -> list[dict]:
    """The row's earlier conversation turns that have the {role, content} shape (others dropped)."""
    turns = spec.get("messages")
    return (
        [
            m
            for m in turns
            if isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        ]
        if isinstance(turns, list)
        else []
    )


def run_prompt(result: dict) -> str:
    """The prompt that names a run: the run's prompt, or when that is empty (every row has its own)
    the first row's own prompt."""
    prompt = result["config"]["prompt"]
    if prompt.strip():
        return prompt
    return _own_prompt(_specs(result).get(result["rows"][0]["name"], {})) or prompt


def label(entry: dict) -> str:
    """The run picker's label, "id · prompt preview", or "id · name · prompt preview" for a named or
    branched run (entry assumed valid; stored or read)."""
    parts = [entry["id"], title(entry), _preview(run_prompt(unpack(entry["result"])), LABEL_PREVIEW)]
    return " · ".join(p for p in parts if p)


def branch_label(entry: dict) -> str:
    """ "branch at step 27: ' resulting'" for a run that came from a branch (the step and the text of
    the token(s) a person chose, from the first column that took them), else "" (entry assumed valid)."""
    for row in unpack(entry["result"])["rows"]:
        chosen = [s for s in row["steps"] if s.get("chosen")]
        if chosen:
            text = "".join(str(s["text"]) for s in chosen)
            text = text if len(text) <= BRANCH_PREVIEW else text[: BRANCH_PREVIEW - 1] + "…"
            return f"branch at step {chosen[0]['step']}: {text!r}"  # repr: a leading space or a newline shows
    return ""


def title(entry: dict) -> str:
    """What names a run in the table and the picker: the name a person gave it, the branch label, or
    both ("name (branch at …)"), "" for neither."""
    name, branch = entry.get("name") or "", branch_label(entry)
    return f"{name} ({branch})" if name and branch else name or branch


def search_text(entry: dict) -> str:
    """What a search looks in, folded to one case-less line: the run's id, name and branch label, its
    prompt and the columns' own prompts, the column names and their outputs (entry assumed valid)."""
    res = unpack(entry["result"])
    own = [p for spec in _specs(res).values() if (p := _own_prompt(spec)) is not None]
    parts = [
        entry["id"],
        title(entry),
        res["config"]["prompt"],
        *own,
        *(f"{r['name']} {r.get('text', '')}" for r in res["rows"]),
    ]
    return _folded(" ".join(str(p) for p in parts))


def _folded(text) -> str:
    return " ".join(str(text or "").split()).casefold()


def matches(text: str, query: str | None) -> bool:
    """Whether `search_text`'s `text` holds `query` (any case, any run of whitespace as one space;
    an empty query matches every run)."""
    return _folded(query) in text


def search(entries: list[dict], query: str | None) -> list[dict]:
    """The entries whose name, prompt, column names or outputs hold `query` (see `matches`)."""
    return [e for e in entries if matches(search_text(e), query)]


def _params(row: dict) -> dict:
    params = row.get("params")
    return params if isinstance(params, dict) else {}


def _strategy_label(row: dict) -> str:
    """ "residual alpha=0.1", or "no feedback" for a row without a strategy."""
    if not row.get("strategy"):
        return "no feedback"
    return " ".join([str(row["strategy"]), ", ".join(f"{k}={v}" for k, v in _params(row).items())]).strip()


def _column_label(row: dict, spec: dict) -> str:
    """ "name: strategy params", marked when the column did not see the run's prompt as is."""
    marks = [" (own prompt)"] if _own_prompt(spec) is not None else []
    if turns := _turns(spec):
        marks.append(f" (+{len(turns)} earlier turn{'s' if len(turns) != 1 else ''})")
    return f"{row['name']}: {_strategy_label(row)}" + "".join(marks)


def _listed(items: list[str], shown: int = TABLE_OTHERS_SHOWN) -> str:
    """Items joined for one table cell, at most `shown` of them and a count of the rest, so a library
    run of 64 columns keeps its row readable."""
    if not items:
        return "—"
    more = len(items) - shown
    return " | ".join(items[:shown]) + (f" | +{more} more" if more > 0 else "")


def _divergences(rows: list[dict]) -> list[int | None]:
    """First divergence of every column after the first from the first (the reference column)."""
    return [first_divergence(rows[0]["token_ids"], r["token_ids"]) for r in rows[1:]]


def table(history: list[dict]) -> list[list]:
    """One row per run for the History tab's table (entries assumed valid), for runs of any number
    of columns: its name (or branch label), every column described, the first column's output, the
    others' outputs, per column the token count, where it first differs from the first column and
    why it stopped, and the columns' ratings."""
    return [table_row(e) for e in _unpacked(history)]


def table_row(entry: dict) -> list:
    """The table's row of one valid entry (see `table`)."""
    res = unpack(entry["result"])
    rows, specs = res["rows"], _specs(res)
    columns = _listed([_column_label(r, specs.get(r["name"], {})) for r in rows], TABLE_OTHERS_SHOWN + 1)
    others = [f"{r['name']}: {_preview(r.get('text', ''))}" for r in rows[1:]]
    div = " / ".join("—" if d is None else str(d) for d in _divergences(rows)) or "—"
    return [
        title(entry),
        entry["id"],
        entry["created"],
        _preview(run_prompt(res)),
        columns,
        _preview(rows[0].get("text", "")),
        _listed(others),
        " / ".join(str(len(r["token_ids"])) for r in rows),
        div,
        " / ".join(str(r.get("stop_reason")) for r in rows),
        ratings_text(entry),
    ]


def ratings_text(entry: dict) -> str:
    """The run's ratings in one table cell, "baseline: better | feedback: worse (too terse)", the
    notes shortened; "—" for none."""
    return _listed(
        [
            f"{c}: {r['verdict']}" + (f" ({_preview(r['note'], NOTE_PREVIEW)})" if r["note"] else "")
            for c, r in (entry.get("ratings") or {}).items()
        ],
        TABLE_OTHERS_SHOWN + 1,
    )


def overview(entries: list[dict]) -> list[dict]:
    """What the History tab keeps of each valid entry between requests, so a search or a change of
    the chosen run needs no second copy of the history from the browser: its id, picker label, table
    row, search text, column names, name and ratings."""
    return [
        {
            "id": e["id"],
            "label": label(e),
            "row": table_row(e),
            "text": search_text(e),
            "columns": [r["name"] for r in e["result"]["rows"]],
            "name": e.get("name", ""),
            "ratings": e.get("ratings", {}),
        }
        for e in _unpacked(entries)
    ]


def select(history: list[dict], ids: list[str] | None) -> list[dict]:
    """Entries with these ids (all entries when no id is given)."""
    return [e for e in history if not ids or e["id"] in ids]


def to_json(entries: list[dict]) -> str:
    """The selected runs as a JSON list of RunResult dicts (each with its history id, time, name —
    null for none — and ratings by column name), the form `RunResult.from_dict` reads back (it
    ignores the extra keys), whatever the number of columns."""
    return json.dumps(
        [
            {
                "id": e["id"],
                "created": e["created"],
                "name": e.get("name"),
                "ratings": e.get("ratings", {}),
                **e["result"],
            }
            for e in _unpacked(entries)
        ],
        indent=1,
    )


def to_csv(entries: list[dict]) -> str:
    """One line per generated token of every row of every selected run, each with the run's
    settings (`RUN_SETTING_COLUMNS`, from Compare's settings table) and name, the prompt, system
    prompt, temperature, top-p and seed the row ran with (its own or the run's: `ROW_SETTING_COLUMNS`),
    its earlier turns (JSON, empty when none), its metrics (JSON) and its rating and note (empty when
    unrated); the top-5 alternatives as a JSON list (so ':' and '|' in tokens are safe)."""
    entries = _unpacked(entries)
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(CSV_COLUMNS)
    for e in entries:
        res = e["result"]
        cfg = res["config"]
        run = [e["id"], e["created"], *(_run_value(cfg, path) for _, path in RUN_SETTINGS), e.get("name", "")]
        specs = _specs(res)
        ratings = e.get("ratings", {})
        for row in res["rows"]:
            params = json.dumps(row.get("params", {}), sort_keys=True)
            spec = specs.get(row["name"], {})
            seen = [_seen(cfg, spec, name, shared) for name, shared in OVERRIDES]
            turns = _turns(spec)
            turns = json.dumps(turns, ensure_ascii=False) if turns else ""
            metrics = json.dumps(row.get("metrics", {}), sort_keys=True, ensure_ascii=False)
            rating = ratings.get(row["name"], {})
            for st in row["steps"]:
                top = json.dumps(
                    [
                        {"token_id": a["token_id"], "text": a["text"], "prob": round(a["prob"], 6)}
                        for a in st.get("top", [])
                    ],
                    ensure_ascii=False,
                )
                writer.writerow(
                    [
                        *run,
                        row["name"],
                        row.get("strategy") or "",
                        params,
                        *seen,
                        turns,
                        metrics,
                        rating.get("verdict", ""),
                        rating.get("note", ""),
                        st["step"],
                        st["token_id"],
                        int(bool(st.get("forced"))),
                        st["text"],
                        f"{st['logprob']:.6f}",
                        f"{st['prob']:.6f}",
                        f"{st['confidence']:.6f}",
                        f"{st['entropy']:.6f}",
                        f"{st['group_confidence']:.6f}",
                        top,
                    ]
                )
    return buf.getvalue()


# --- LLM Comparator export ------------------------------------------------------------------------
# The JSON that Google PAIR's LLM Comparator (https://github.com/PAIR-code/llm-comparator) loads, as its
# README ("JSON Data Format") and client/lib/types.ts (DataResponse, Example, CustomFieldSchema,
# FieldType) define it and client/services/state_service.ts (loadData) reads it:
#   {"metadata": {"source_path": str, "custom_fields_schema": [{"name", "type"}]},
#    "models": [{"name"}, {"name"}],
#    "examples": [{"input_text", "tags", "output_text_a", "output_text_b", "score",
#                  "individual_rater_scores", "rationale_list", "custom_fields"}]}
# The loader reads every declared custom field from every example, and the table throws unless a
# per-model field holds exactly two values, so each example carries every field ([null, null] when a
# column lacks it). JSON.parse rejects NaN and Infinity: non-finite numbers are written as null.

COMPARATOR_MODELS = (
    "reference column",
    "other column",
)  # model names when the selection's column names differ
COMPARATOR_RUN_FIELDS = [
    ("run_id", "string"),
    ("created", "string"),
    ("run_name", "string"),
    ("pair", "category"),
    ("language_model", "category"),
    ("first_divergence_step", "number"),
]
COMPARATOR_COLUMN_FIELDS = {
    "column": "per_model_category",
    "feedback": "per_model_category",
    "strategy": "per_model_category",
    "own_prompt": "per_model_boolean",
    "stop_reason": "per_model_category",
    "generated_tokens": "per_model_number",
    "rating": "per_model_category",
}
_RESERVED = {name for name, _ in COMPARATOR_RUN_FIELDS} | set(COMPARATOR_COLUMN_FIELDS)


def _pairs(entries: list[dict]) -> list[tuple[dict, dict, dict]]:
    """(entry, first row, other row) for every run and every column after its first: LLM Comparator
    compares two models, so a run of N columns gives N - 1 pairs against its reference column."""
    return [(e, e["result"]["rows"][0], other) for e in entries for other in e["result"]["rows"][1:]]


def _seen_input(config: dict, spec: dict) -> str:
    """The input as a column saw it: its own prompt or the run's; with its system prompt and earlier
    turns, when it had any, as "[role]" blocks so the conversation reads in order."""
    prompt = _own_prompt(spec)
    prompt = config["prompt"] if prompt is None else prompt
    system, turns = _seen_system(config, spec), _turns(spec)
    if not system and not turns:
        return prompt
    blocks = [f"[system]\n{system}"] if system else []
    blocks += [f"[{m['role']}]\n{m['content']}" for m in turns]
    return "\n\n".join([*blocks, f"[user]\n{prompt}"])


def _pair_input(config: dict, specs: dict, a: dict, b: dict) -> str:
    """One input text for the pair: the shared input, or both (labelled A and B) when the two columns
    saw different ones, since LLM Comparator shows a single input per example."""
    seen_a = _seen_input(config, specs.get(a["name"], {}))
    seen_b = _seen_input(config, specs.get(b["name"], {}))
    if seen_a == seen_b:
        return seen_a
    return f"A ({a['name']}) saw:\n{seen_a}\n\nB ({b['name']}) saw:\n{seen_b}"


def _column_values(row: dict, spec: dict, rating: dict | None) -> dict:
    """A column's per-model values by field name: what it is, how it ended, a person's verdict on it,
    its parameters (as "param <name>") and its metrics (a metric whose name is taken is written as
    "metric <name>")."""
    values = {
        "column": row["name"],
        "feedback": _strategy_label(row),
        "strategy": row.get("strategy") or "none",
        "own_prompt": _own_prompt(spec) is not None,
        "stop_reason": row.get("stop_reason"),
        "generated_tokens": len(row["token_ids"]),
        "rating": (rating or {}).get("verdict"),
    }
    values |= {f"param {k}": v for k, v in _params(row).items()}
    metrics = row.get("metrics")
    for k, v in metrics.items() if isinstance(metrics, dict) else ():
        values[f"metric {k}" if k in _RESERVED else str(k)] = v
    return values


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _per_model_type(values: list) -> str:
    """The LLM Comparator type of a per-model field from all its values in the export: numbers get
    histograms and sorting, booleans and strings bar charts; anything else (e.g. the list of key facts
    found) is shown as text. A field that is null everywhere is numeric (no chart data, no error)."""
    present = [v for v in values if v is not None]
    if all(isinstance(v, bool) for v in present) and present:
        return "per_model_boolean"
    if all(_is_number(v) for v in present):
        return "per_model_number"
    if all(isinstance(v, str) for v in present):
        return "per_model_category"
    return "per_model_text"


def _typed(value, kind: str):
    """A value as the field's type reads it: finite numbers (null otherwise), booleans, strings;
    text fields get lists of strings one per line and other values as JSON."""
    if value is None:
        return None
    if kind in ("per_model_number", "number"):
        return value if _is_number(value) and math.isfinite(value) else None
    if kind == "per_model_boolean" or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def _column_schema(columns: list[dict]) -> list[tuple[str, str]]:
    """(name, type) of every per-model field any column of the export has, in first-seen order: the
    fixed fields with their own types, parameters and metrics typed from their values."""
    names = list(dict.fromkeys(k for values in columns for k in values))
    return [
        (n, COMPARATOR_COLUMN_FIELDS.get(n) or _per_model_type([values.get(n) for values in columns]))
        for n in names
    ]


def _model_names(pairs: list[tuple[dict, dict, dict]]) -> list[str]:
    """The two model names: the columns' own names when every pair has the same two (e.g. baseline
    and feedback), else the neutral COMPARATOR_MODELS; each example's "column" field and "pair" then
    say which columns it compares."""
    names = {(a["name"], b["name"]) for _, a, b in pairs}
    return list(names.pop()) if len(names) == 1 else list(COMPARATOR_MODELS)


def to_llm_comparator(entries: list[dict]) -> str:
    """The selected runs as an LLM Comparator file (see the section comment for the format and source).

    The tool compares two models, so a run of N columns gives N - 1 examples: its first column (the
    reference, model A) against each other column j = 2..N (model B); a run of one column gives none.
    Models are named after the columns when every pair in the selection has the same two names, else
    "reference column" / "other column", with the column names in each example's `column` field and
    its `pair` field ("first vs other").

    `input_text` is the input as the columns saw it (own prompt, system prompt and earlier turns as
    "[role]" blocks; both inputs, labelled, when the two columns saw different ones). The only tag is
    column B's strategy name ("no feedback" for none), so the tool's by-category panel slices by it.

    `score` comes from a person's ratings of the two columns (`rate`), as the format's score is a
    preference (positive: A better): +1 when A is better or B worse, -1 when B is better or A worse,
    0 for a tie (both rated better, or both worse, is a tie too: see `_pair_score`); each rating is
    one of `individual_rater_scores`, its note the rationale. A pair neither of whose columns is
    rated has score null (the tool shows "Null" and counts it as unknown in win rates, where 0 would
    claim a tie) and no rater scores. `rationale_list` (the tool's clustered rationale bullets) is empty.

    Custom fields: run_id, created and run_name (string), pair and language_model (category), the pair's
    first_divergence_step (number, null when the two outputs are identical); per model: column,
    feedback ("strategy params"), strategy, stop_reason and rating (category), own_prompt (boolean),
    generated_tokens, every parameter as "param <name>" and every metric of RowResult.metrics, typed
    from their values (numbers as per_model_number, etc.; see `_per_model_type`)."""
    entries = _unpacked(entries)
    pairs = _pairs(entries)
    columns = [
        tuple(
            _column_values(r, _specs(e["result"]).get(r["name"], {}), e.get("ratings", {}).get(r["name"]))
            for r in (a, b)
        )
        for e, a, b in pairs
    ]
    per_model = _column_schema([values for pair in columns for values in pair])
    schema = [{"name": n, "type": t} for n, t in [*COMPARATOR_RUN_FIELDS, *per_model]]
    doc = {
        "metadata": {
            "source_path": "Feedback Lens history: runs " + ", ".join(e["id"] for e in entries),
            "custom_fields_schema": schema,
        },
        "models": [{"name": n} for n in _model_names(pairs)],
        "examples": [_example(pair, values, per_model) for pair, values in zip(pairs, columns)],
    }
    return json.dumps(doc, indent=1, allow_nan=False)


def _example(
    pair: tuple[dict, dict, dict], values: tuple[dict, dict], per_model: list[tuple[str, str]]
) -> dict:
    """One LLM Comparator example: a run's first column (A) against one other column (B), with the run's
    fields and every per-model field of the export (null where a column lacks it)."""
    e, a, b = pair
    cfg = e["result"]["config"]
    raters = _raters(e.get("ratings", {}), a, b)
    fields = {
        "run_id": e["id"],
        "created": e["created"],
        "run_name": e.get("name"),
        "pair": f"{a['name']} vs {b['name']}",
        "language_model": str(cfg.get("model", "")),
        "first_divergence_step": _typed(first_divergence(a["token_ids"], b["token_ids"]), "number"),
    }
    fields |= {n: [_typed(v.get(n), t) for v in values] for n, t in per_model}
    return {
        "input_text": _pair_input(cfg, _specs(e["result"]), a, b),
        "tags": [str(b.get("strategy") or "no feedback")],
        "output_text_a": str(a.get("text", "")),
        "output_text_b": str(b.get("text", "")),
        "score": _pair_score(raters),
        "individual_rater_scores": raters,
        "rationale_list": [],
        "custom_fields": fields,
    }


# A rating's vote for column A: positive when A is better. A rating of column B votes the other way.
_VOTE = {"better": 1, "worse": -1, "tie": 0}


def _raters(ratings: dict, a: dict, b: dict) -> list[dict]:
    """The pair's ratings as LLM Comparator's individual ratings (client/lib/types.ts IndividualRating):
    each its vote for A as the score, "A (name) better" as the label, its note as the rationale. Not
    flipped: A and B are the columns as the person saw them."""
    out = []
    for side, row, sign in (("A", a, 1), ("B", b, -1)):
        if rating := ratings.get(row["name"]):
            out.append(
                {
                    "index": len(out),
                    "score": sign * _VOTE[rating["verdict"]],
                    "rating_label": f"{side} ({row['name']}) {rating['verdict']}",
                    "is_flipped": False,
                    "rationale": rating["note"],
                    "custom_fields": {},
                }
            )
    return out


def _pair_score(raters: list[dict]) -> int | None:
    """+1, 0 or -1: the sum of the two votes for A, held to one vote (A better and B worse say the
    same thing once; both better or both worse cancel to a tie); None when neither column is rated."""
    return max(-1, min(1, sum(r["score"] for r in raters))) if raters else None
