"""The columns' token events: what the page's board (`board.js`) draws, as compact, append-only text.

One document per run: one JSON array per line, each line one event, only ever appended to while the
run streams. Gradio sends a value that begins with the one before as just its new part, so an
update carries the new events (about 100 bytes a token), and the board reads the lines after the
last one it read: it appends, it never draws a column again. A document is whole: it begins with
the run (its columns) and holds everything the board shows of it, so a page that draws it from the
start (a tab shown again, a run reloaded from History) shows the same.

Events (`kind`, then its fields):
- `run`: {id, columns: [{name, strategy, params, color, badges, turns}], fresh: [column, …],
  memory: [series key, …]}. `fresh`: the columns this run decodes (a re-run decodes one; the others
  are replayed from the run before and draw no chart points).
- `v`: token id, its text: an alternative's text, sent the first time the document names that id.
- `t`: column, step, token id, text, confidence, group confidence, probability, entropy,
  [alternative ids], [their probabilities], flags (FORCED, CHOSEN, RESTATE, TRANSITION).
- `end`: column, stop reason, stop step, tokens kept (the board drops any it drew past them: a
  Stop keeps what the page showed).
- `md`: column, its answer as HTML formatted from Markdown (once the column has ended).
- `diff`: column, its words against column 1's as HTML (once the run has ended).
- `m`: seconds since the run began, then a value per `memory` series (the memory chart's new point).
- `done`: the server's clock (epoch seconds) when the run's last update was made.
"""

from __future__ import annotations

import json
import time

from feedback.core.records import RowResult, RowSpec, RunConfig, StepRecord
from ui.page import charts, render
from ui.page.settings import badges

FORCED, CHOSEN, RESTATE, TRANSITION = 1, 2, 4, 8
TOP = 5  # alternatives a token's card lists


def flags(step: StepRecord) -> int:
    return (
        (FORCED if step.forced else 0)
        | (CHOSEN if step.chosen else 0)
        | (RESTATE if step.part == "restate" else 0)
        | (TRANSITION if step.part == "transition" else 0)
    )


def _turns(spec: RowSpec, prompt: str) -> list[list]:
    """A column's conversation bubbles, [role, text, current]: its earlier turns and the question
    it answers now; none for a single turn on the shared prompt (no bubble for a plain question)."""
    messages, own = spec.messages or [], spec.prompt is not None
    if not messages and not own:
        return []
    return [[m.get("role", ""), str(m.get("content", "")), False] for m in messages] + [
        ["user", spec.prompt if own else prompt, True]
    ]


def _first_user_turn(messages: list[dict] | None) -> str | None:
    return next((m["content"] for m in messages or [] if m.get("role") == "user"), None)


def modified(spec: RowSpec, first: RowSpec | None = None) -> list[str]:
    """What a column overrides of the run's shared input (for its heading's badges). In a
    conversation every column's history differs (their own answers); its prompt counts as modified
    when it began from another question than column 1 (`first`)."""
    prompt = spec.prompt is not None or (
        first is not None
        and spec.messages is not None
        and _first_user_turn(spec.messages) != _first_user_turn(first.messages)
    )
    return [
        what
        for what, changed in (("prompt", prompt), ("system prompt", spec.system_prompt is not None))
        if changed
    ]


def column_head(index: int, spec: RowSpec, cfg: RunConfig) -> dict:
    """What the board shows above a column: its colour, name, strategy and parameters, badges for
    what it overrides and its own settings, and its conversation so far."""
    tags = [f"{what} modified" for what in modified(spec, cfg.rows[0])] + badges(spec)
    return {
        "name": spec.name,
        "strategy": spec.strategy,
        "params": render.params_text(spec.params),
        "color": charts.row_color(index),
        "badges": tags,
        "turns": _turns(spec, cfg.prompt),
    }


class BoardDoc:
    """One run's document, built up event by event; `text` is what the page is sent."""

    def __init__(self, run_id: str, cfg: RunConfig, fresh: list[int], memory_keys: list[str] | None = None):
        self.run_id, self.seen = run_id, set()
        self.memory_keys = memory_keys or []
        self.text = ""
        self.shown = [0] * len(cfg.rows)  # tokens of each column in the document
        self._add(
            "run",
            {
                "id": run_id,
                "columns": [column_head(i, s, cfg) for i, s in enumerate(cfg.rows)],
                "fresh": fresh,
                "memory": self.memory_keys,
            },
        )

    def _add(self, *event) -> None:
        self.text += json.dumps(event, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n"

    def tokens(self, column: int, steps: list[StepRecord]) -> None:
        """Column `column`'s new tokens (and the alternatives' texts the document has not named yet)."""
        for s in steps:
            top = s.top[:TOP]
            for a in top:
                if a.token_id not in self.seen:
                    self.seen.add(a.token_id)
                    self._add("v", int(a.token_id), a.text)
            self._add(
                "t",
                column,
                int(s.step),
                int(s.token_id),
                s.text,
                _num(s.confidence, 3),
                _num(s.group_confidence, 3),
                _num(s.prob, 4),
                _num(s.entropy, 3),
                [int(a.token_id) for a in top],
                [_num(a.prob, 4) for a in top],
                flags(s),
            )
        self.shown[column] += len(steps)

    def end(self, column: int, row: RowResult) -> None:
        self._add("end", column, row.stop_reason, row.stop_step, len(row.steps))
        self.shown[column] = min(self.shown[column], len(row.steps))

    def markdown(self, column: int, row: RowResult) -> None:
        self._add("md", column, render.markdown_html(row.steps))

    def diff(self, column: int, html: str) -> None:
        self._add("diff", column, html)

    def memory(self, sample: dict) -> None:
        self._add("m", sample.get("t"), *[sample.get(k) for k in self.memory_keys])

    def done(self) -> None:
        self._add("done", round(time.time(), 3))

    def replay(self, column: int, row: RowResult) -> None:
        """A finished column whole: its tokens, its end and its formatted answer."""
        self.tokens(column, row.steps)
        self.end(column, row)
        self.markdown(column, row)


def _num(x: float, digits: int) -> float | None:
    """A number rounded for the page; None for NaN or infinity (JSON has neither)."""
    return round(float(x), digits) if x == x and abs(x) != float("inf") else None


def diffs(rows: list[RowResult]) -> list[str]:
    """Each column's word diff against column 1 (column 1's own: its plain text)."""
    return [render.diff_html(rows[0].steps, row.steps) for row in rows]


def finished_doc(run_id: str, cfg: RunConfig, rows: list[RowResult]) -> BoardDoc:
    """A finished run's whole document (a reload from History, a new page's first draw)."""
    doc = BoardDoc(run_id, cfg, fresh=[])
    for i, row in enumerate(rows):
        doc.replay(i, row)
    for i, html in enumerate(diffs(rows)):
        doc.diff(i, html)
    return doc


def empty_doc(cfg: RunConfig | None = None) -> str:
    """A board with no answers: the columns of `cfg` (or none), nothing in them."""
    if cfg is None:
        return ""
    return BoardDoc("empty", cfg, fresh=[]).text


def parse(text: str) -> list[list]:
    """The events of a document (for tests and program clients)."""
    return [json.loads(line) for line in text.splitlines() if line]
