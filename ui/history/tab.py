"""History tab: this browser's Compare runs — list, search, name, rate, delete (and undo), reload into
Compare with every setting, export.

The history lives in the browser (`gr.BrowserState`) and is sent only with this tab's own events:
opening the tab, an edit (name, rating, delete, undo), a reload, an export. Opening the tab keeps a
light overview of the runs on the server (`history.overview`: table rows, search text, column
names), so searching and choosing a run, which happen often, send no history at all. An edit
writes the new history back to the browser and redraws the table from it.

Until the runs the browser holds are drawn, the table says so ("Loading your runs…"), never "no
runs": the table is drawn when the page loads, and a run recorded since (or an older page's table)
is told apart in the page itself, from the run ids the table was drawn from (`STALE_JS`).
"""

from __future__ import annotations

import json
from html import escape

import gradio as gr

from feedback.errors import FeedbackError
from feedback.serve.limits import NAME_MAX_CHARS
from ui.page import history, notice, render
from ui.page.exports import export_file, stamp
from ui.page.handoff import COMPARE_TAB, CompareTarget

TAB = "history"
SEARCH_MAX_CHARS = 200
LOADING = "Loading your runs…"
EMPTY = "no runs yet"
LOADING_TABLE = render.data_table(history.TABLE_HEADERS, [], "fl-history", empty=LOADING)

# In the page, with no server round trip: the table (and the note that counts its runs) stay when
# they were drawn from the runs this browser holds, else they say the runs are loading (until the
# server's table comes). The page holds the history already; only its run ids are compared (a name
# or rating changed in Compare shows when the server's table comes, a moment later).
STALE_JS = f"""(hist, table, note) => {{
  const ids = Array.isArray(hist) ? hist.map((e) => (e && typeof e.id === "string") ? e.id : null) : [];
  const held = JSON.stringify(ids);
  const drawn = new DOMParser().parseFromString(table || "", "text/html").querySelector("[data-runs]");
  return drawn && drawn.dataset.runs === held ? [table, note] : [{json.dumps(LOADING_TABLE)}, ""];
}}"""


def _entries(hist) -> list[dict]:
    try:
        runs, skipped = history.valid(hist)
    except FeedbackError as exc:
        raise notice.refusal(exc) from None
    if skipped:
        notice.warning(
            f"{skipped} entr{'y' if skipped == 1 else 'ies'} of this browser's history could not be read "
            "and were skipped"
        )
    return runs


def _run_ids(ids) -> list[str]:
    """The chosen runs' ids (the picker sends a list of them; none chosen: an empty list)."""
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise notice.refusal(f"runs must be a list of run ids, got {str(ids)[:80]!r}")
    return ids


def _first(ids, what: str) -> str:
    """The run an edit acts on: the first chosen, as Reload takes it."""
    ids = _run_ids(ids)
    if not ids:
        raise FeedbackError(f"choose a run to {what}")
    return ids[0]


def _item(catalog, ids) -> dict | None:
    """The overview of the first chosen run, None when none is chosen or it is not listed."""
    ids = ids if isinstance(ids, list) else []
    return next((c for c in catalog or [] if ids and c["id"] == ids[0]), None)


def _drawn_from(table: str, catalog: list[dict]) -> str:
    """The table, marked with the ids of the runs it was drawn from (every stored run, matching the
    search or not) for `STALE_JS` to compare with the history the page holds."""
    ids = json.dumps([c["id"] for c in catalog], separators=(",", ":"), ensure_ascii=False)
    return f'<div data-runs="{escape(ids, quote=True)}">{table}</div>'


def _note(total: int, shown: int, query: str | None) -> str:
    note = (
        f"{total} run(s) stored in this browser. It keeps the last {history.MAX_RUNS} runs (at most "
        f"{history.MAX_BYTES // 1_000_000} MB); older ones are dropped first — export what you want to keep."
    )
    return f"{shown} of {total} run(s) match the search. " + note if (query or "").strip() else note


def _plural(n: int) -> str:
    return f"{n} run{'s' if n != 1 else ''}"


class HistoryTab:
    def __init__(self, compare: CompareTarget):
        self.compare = compare

    def view(self, hist: list | None, query: str | None = "", ids=None) -> dict:
        """The table of runs (those matching the search), the run picker, and how many are kept.
        Runs already chosen in the picker stay chosen: opening the tab draws this while a person may
        already have picked a run (and started rating it), and a reply that cleared the choice then
        lost it (a rating saved a moment later found no run chosen)."""
        return self._listing(history.overview(_entries(hist)), query, _run_ids(ids))

    def _listing(self, catalog: list[dict], query: str | None, chosen: list[str]) -> dict:
        """The runs of `catalog` that match `query`, in the table and the picker; chosen runs stay
        chosen (by id, not by row) while they are listed."""
        shown = [c for c in catalog if history.matches(c["text"], query)]
        listed = {c["id"] for c in shown}
        table = render.data_table(
            history.TABLE_HEADERS,
            [c["row"] for c in shown],
            "fl-history",
            [c["id"] for c in shown],
            "no runs match the search" if catalog else EMPTY,
        )
        return {
            self.table: _drawn_from(table, catalog),
            self.catalog: catalog,
            self.ids: gr.update(
                choices=[(c["label"], c["id"]) for c in shown], value=[i for i in chosen if i in listed]
            ),
            self.note: _note(len(catalog), len(shown), query),
        }

    def search(self, query: str | None, catalog: list[dict] | None, ids) -> dict:
        return self._listing(catalog or [], query, _run_ids(ids))

    def pick(self, ids, column: str | None, catalog: list[dict] | None, picked: str | None) -> dict:
        """When another run comes first among the chosen: its name, its columns to rate (the column
        rated last kept when this run has it) and that column's rating. An edit sends the choice back
        unchanged; leaving the fields alone then keeps what the person is typing there."""
        item = _item(catalog, ids)
        if (item and item["id"]) == picked:
            return {self.picked: picked}  # Gradio reads an empty dict as one value, not as no updates
        if item is None:
            return {
                self.name: "",
                self.column: gr.update(choices=[], value=None),
                self.verdict: None,
                self.rate_note: "",
                self.picked: None,
            }
        column = column if column in item["columns"] else item["columns"][0]
        return {
            self.name: item["name"],
            self.column: gr.update(choices=item["columns"], value=column),
            **self.rating_of(ids, column, catalog),
            self.picked: item["id"],
        }

    def rating_of(self, ids, column: str | None, catalog: list[dict] | None) -> dict:
        """The chosen run's rating of `column`, for the person to see or change."""
        rating = ((_item(catalog, ids) or {}).get("ratings") or {}).get(column) or {}
        return {self.verdict: rating.get("verdict"), self.rate_note: rating.get("note", "")}

    def rename(self, hist, ids, name: str | None, query: str | None) -> dict:
        try:
            run_id = _first(ids, "name")
            new = history.rename(hist, run_id, name)
        except FeedbackError as exc:
            return self._refused(exc)
        name = " ".join((name or "").split())
        return self._save(
            new, query, ids, f"Run {run_id} is named “{name}”." if name else f"Run {run_id} has no name now."
        )

    def rate(
        self, hist, ids, column: str | None, verdict: str | None, note: str | None, query: str | None
    ) -> dict:
        try:
            run_id = _first(ids, "rate")
            new = history.rate(hist, run_id, column, verdict, note)
        except FeedbackError as exc:
            return self._refused(exc)
        return self._save(new, query, ids, f"Rated column {column} of run {run_id}: {verdict}.")

    def delete(self, hist, ids, query: str | None) -> dict:
        """Delete the chosen runs; the status line says how many and which, and Undo brings them back."""
        try:
            chosen = _run_ids(ids)
            if not chosen:
                raise FeedbackError("choose the runs to delete")
            new, removed = history.delete(hist, chosen)
        except FeedbackError as exc:
            return self._refused(exc)
        removed.sort(key=lambda pair: chosen.index(pair[1]["id"]))  # as chosen, for Undo to choose them again
        which = ", ".join(e["id"] for _, e in removed)
        return self._save(
            new,
            query,
            [],
            f"Deleted {_plural(len(removed))}: {which}. Undo brings "
            f"{'it' if len(removed) == 1 else 'them'} back.",
        ) | {self.removed: removed}

    def undo(self, hist, removed, query: str | None) -> dict:
        """Put the deleted runs back in their places and choose them again, in the order they were
        chosen, so Reload, Name and Rate act on the run they acted on before the delete."""
        if not removed:
            return {self.status: render.status_html("Nothing to undo.")}
        try:
            new = history.undelete(hist, removed)
        except FeedbackError as exc:
            return self._refused(exc)
        out = self._save(new, query, [e["id"] for _, e in removed], "") | {self.removed: None}
        again = (
            "chosen again"
            if out[self.ids]["value"]
            else "not listed: they do not match the search (clear it to choose them)"
        )
        return out | {self.status: render.status_html(f"Restored {_plural(len(removed))}, {again}.")}

    def _save(self, new: list[dict], query: str | None, ids, message: str) -> dict:
        """Store the edited history in the browser and show it, the search and the chosen runs kept."""
        listing = self._listing(history.overview(history.valid(new)[0]), query, _run_ids(ids))
        return listing | {self.hist: new, self.status: render.status_html(message)}

    def _refused(self, exc: FeedbackError) -> dict:
        # on the page, a refusal stays in the status line after the toast fades (as on the model tabs)
        notice.warning(exc)
        return {self.status: render.status_html(f"Not done: {exc}", "error")}

    def reload(self, hist: list | None, ids: list[str] | None, view: str) -> dict:
        """Put a stored run back into Compare: its prompt, model, columns with their strategies,
        parameters and overrides, sampling, DeepConf and evaluation settings, and its outputs
        (conversations included), exactly as the run had them; Continue and branches go on from it."""
        ids = _run_ids(ids)
        entries = history.select(_entries(hist), ids[:1] if ids else None)
        if not ids or not entries:
            raise notice.refusal("choose a run to reload")
        try:
            out = self.compare.restore(entries[0]["result"], view)
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:  # FeedbackError too
            raise notice.refusal(f"this run cannot be restored: {exc}") from None
        return out | {
            self.compare.ui.run.status: render.status_html(
                f"Reloaded run {entries[0]['id']} from History: every control is as that run had it."
            ),
            self.tabs: gr.update(selected=COMPARE_TAB),
        }

    def export_json(self, hist: list | None, ids: list[str] | None, query: str | None = "") -> str:
        """Selected runs (all matching the search when none is selected) as a JSON list of RunResult
        objects, each with its name and ratings."""
        return self._export(hist, ids, query, "json")

    def export_comparator(self, hist: list | None, ids: list[str] | None, query: str | None = "") -> str:
        """Selected runs (all matching the search when none is selected) in LLM Comparator's JSON
        format: column 1 against each other column, with our metrics as per-model fields and the
        columns' ratings as each pair's score."""
        return self._export(hist, ids, query, "comparator")

    def export_csv(self, hist: list | None, ids: list[str] | None, query: str | None = "") -> str:
        """Selected runs (all matching the search when none is selected) as per-token CSV rows with
        each run's settings, name and ratings."""
        return self._export(hist, ids, query, "csv")

    def _export(self, hist, ids, query, kind: str) -> str:
        ids = _run_ids(ids)
        runs = _entries(hist)
        entries = history.select(runs, ids) if ids else history.search(runs, query)
        if not entries:
            why = (
                "no runs in this browser's history yet"
                if not runs
                else "none of the chosen runs is in this browser's history"
                if ids
                else "no run matches the search"
            )
            raise notice.refusal(why)
        name = entries[0]["id"] if len(entries) == 1 else f"{len(entries)}-runs"
        if kind == "comparator":
            return export_file(
                f"feedback-lens-{name}-{stamp()}.llm-comparator.json", history.to_llm_comparator(entries)
            )
        text = history.to_json(entries) if kind == "json" else history.to_csv(entries)
        return export_file(f"feedback-lens-{name}-{stamp()}.{kind}", text)

    def build(self, hist: gr.BrowserState, tabs: gr.Tabs) -> None:
        self.tabs, self.hist = tabs, hist
        with gr.Tab("History", id=TAB) as tab:
            self.note = gr.Markdown(elem_id="history-note")
            # value "": an API client may leave the query out (every run)
            query = gr.Textbox(
                "",
                label="Search",
                placeholder="a name, prompt, column name or output",
                lines=1,
                max_lines=1,
                max_length=SEARCH_MAX_CHARS,
                elem_id="history-search",
            )
            self.table = gr.HTML(LOADING_TABLE, elem_id="history-table")  # the page's load draws the runs
            self.ids = gr.Dropdown(
                [],
                multiselect=True,
                label="Runs (reload, name and rate take the first; "
                "delete takes all chosen; export takes all chosen, or every run listed when none "
                "is chosen)",
                allow_custom_value=True,
                elem_id="history-runs",
            )
            with gr.Row():
                reload_btn = gr.Button("Reload into Compare", elem_id="history-reload")
                json_btn = gr.Button("Export JSON", elem_id="history-json")
                csv_btn = gr.Button("Export CSV", elem_id="history-csv")
                comparator_btn = gr.Button("Export for LLM Comparator", elem_id="history-comparator")
                delete_btn = gr.Button("Delete chosen runs", variant="stop", elem_id="history-delete")
                undo_btn = gr.Button("Undo delete", elem_id="history-undo")
            self.status = gr.HTML(elem_id="history-status")
            with gr.Row(equal_height=True):
                self.name = gr.Textbox(
                    label="Name of the chosen run (empty: none)",
                    lines=1,
                    max_lines=1,
                    max_length=NAME_MAX_CHARS,
                    scale=3,
                    elem_id="history-name",
                )
                name_btn = gr.Button("Name run", scale=1, elem_id="history-name-save")
            with gr.Row(equal_height=True):
                self.column = gr.Dropdown([], label="Rate column", scale=1, elem_id="history-rate-column")
                self.verdict = gr.Radio(
                    list(history.VERDICTS), label="Verdict", scale=1, elem_id="history-verdict"
                )
                self.rate_note = gr.Textbox(
                    label="Note",
                    lines=1,
                    max_lines=3,
                    max_length=history.NOTE_MAX_CHARS,
                    scale=2,
                    elem_id="history-rate-note",
                )
                rate_btn = gr.Button("Save rating", scale=1, elem_id="history-rate")
            export = gr.File(label="Export", interactive=False, elem_id="history-file")
            self.catalog, self.removed, self.picked = gr.State([]), gr.State(None), gr.State(None)
        self._wire(tab, hist, query, [reload_btn, json_btn, csv_btn, comparator_btn], export)
        self._wire_edits(hist, query, name_btn, rate_btn, delete_btn, undo_btn)

    def _wire(self, tab, hist, query, buttons, export) -> None:
        reload_btn, json_btn, csv_btn, comparator_btn = buttons
        c = self.compare
        self.view_outputs = [self.table, self.ids, self.note, self.catalog]
        # Only opening this tab reads the history: it is up to 3 MB, sent from the browser with each
        # event that takes it, so switching between the other tabs must not carry it. First, in the
        # page (no round trip): a table drawn from other runs than those held says they are loading.
        # Only when the tab opens: run on every change of the history as well, it wrote back the table
        # it had read, and an edit made here (a rating) could lose its new table to the old one.
        tab.select(
            None,
            [hist, self.table, self.note],
            [self.table, self.note],
            js=STALE_JS,
            api_name=False,
            queue=False,
            show_progress="hidden",
        )
        # queue=False: one HTTP request, not the queue's join and event stream, whose status messages
        # each make Gradio's page copy every component's value (Compare's charts and tokens too):
        # measured with 26 runs stored, the table came in ~1.0 s instead of ~2.1 s
        tab.select(
            self.view,
            [hist, query, self.ids],
            self.view_outputs,
            api_name="history",
            show_progress="hidden",
            queue=False,
        )
        # change, not input: a paste or an autofill changes the query too (and nothing else sets it)
        query.change(
            self.search,
            [query, self.catalog, self.ids],
            self.view_outputs,
            api_name=False,
            trigger_mode="always_last",
            show_progress="hidden",
        )
        self.ids.change(
            self.pick,
            [self.ids, self.column, self.catalog, self.picked],
            [self.name, self.column, self.verdict, self.rate_note, self.picked],
            api_name=False,
            show_progress="hidden",
            queue=False,
        )  # light, and fired by every redraw of the picker
        self.column.input(
            self.rating_of,
            [self.ids, self.column, self.catalog],
            [self.verdict, self.rate_note],
            api_name=False,
            show_progress="hidden",
        )
        json_btn.click(self.export_json, [hist, self.ids, query], export, api_name="export_json")
        csv_btn.click(self.export_csv, [hist, self.ids, query], export, api_name="export_csv")
        comparator_btn.click(
            self.export_comparator, [hist, self.ids, query], export, api_name="export_llm_comparator"
        )
        reload_btn.click(
            self.reload,
            [hist, self.ids, c.ui.out.view],
            [*c.restore_outputs(), self.tabs],
            api_name="reload",
            show_progress="hidden",
        )

    def _wire_edits(self, hist, query, name_btn, rate_btn, delete_btn, undo_btn) -> None:
        edited = [hist, *self.view_outputs, self.status]
        quiet = dict(api_name=False, show_progress="hidden")
        for trigger in (name_btn.click, self.name.submit):
            trigger(self.rename, [hist, self.ids, self.name, query], edited, **quiet)
        rate_btn.click(
            self.rate, [hist, self.ids, self.column, self.verdict, self.rate_note, query], edited, **quiet
        )
        delete_btn.click(self.delete, [hist, self.ids, query], [*edited, self.removed], **quiet)
        undo_btn.click(self.undo, [hist, self.removed, query], [*edited, self.removed], **quiet)
