"""History tab: this browser's Compare runs — list, reload into Compare with every setting, export."""
from __future__ import annotations

import gradio as gr

from feedback.errors import FeedbackError
from ui import history, render
from ui.compare_tab import CompareTab
from ui.exports import export_file, stamp

TAB = "history"


def _entries(hist) -> list[dict]:
    try:
        runs, skipped = history.valid(hist)
    except FeedbackError as exc:
        raise gr.Error(str(exc), print_exception=False) from None
    if skipped:
        gr.Warning(f"{skipped} entr{'y' if skipped == 1 else 'ies'} of this browser's history could not be read "
                   "and were skipped")
    return runs


def _run_ids(ids) -> list[str]:
    """The chosen runs' ids (the picker sends a list of them; none chosen: an empty list)."""
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise gr.Error(f"runs must be a list of run ids, got {str(ids)[:80]!r}", print_exception=False)
    return ids


class HistoryTab:
    def __init__(self, compare: CompareTab):
        self.compare = compare

    def view(self, hist: list | None):
        """The table of runs, the run picker, and how many are kept."""
        runs = _entries(hist)
        choices = [(history.label(e), e["id"]) for e in runs]
        note = (f"{len(runs)} run(s) stored in this browser. It keeps the last {history.MAX_RUNS} runs (at most "
                f"{history.MAX_BYTES // 1_000_000} MB); older ones are dropped first — export what you want to keep.")
        table, ids, shown = self.view_outputs
        return {table: history.table(runs), ids: gr.update(choices=choices, value=[]), shown: note}

    def reload(self, hist: list | None, ids: list[str] | None, view: str) -> dict:
        """Put a stored run back into Compare: its prompt, model, columns with their strategies,
        parameters and overrides, sampling, DeepConf and evaluation settings, and its outputs
        (conversations included), exactly as the run had them; Continue and branches go on from it."""
        ids = _run_ids(ids)
        entries = history.select(_entries(hist), ids[:1] if ids else None)
        if not ids or not entries:
            raise gr.Error("choose a run to reload", print_exception=False)
        try:
            out = self.compare.restore(entries[0]["result"], view)
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:  # FeedbackError too
            raise gr.Error(f"this run cannot be restored: {exc}", print_exception=False) from None
        return out | {self.compare.ui.run.status: render.status_html(
            f"Reloaded run {entries[0]['id']} from History: every control is as that run had it."),
            self.tabs: gr.update(selected="compare")}

    def export_json(self, hist: list | None, ids: list[str] | None) -> str:
        """Selected runs (all when none is selected) as a JSON list of RunResult objects."""
        return self._export(hist, ids, "json")

    def export_comparator(self, hist: list | None, ids: list[str] | None) -> str:
        """Selected runs (all when none is selected) in LLM Comparator's JSON format: column 1
        against each other column, with our metrics as per-model fields."""
        return self._export(hist, ids, "comparator")

    def export_csv(self, hist: list | None, ids: list[str] | None) -> str:
        """Selected runs (all when none is selected) as per-token CSV rows with each run's settings."""
        return self._export(hist, ids, "csv")

    def _export(self, hist, ids, kind: str) -> str:
        entries = history.select(_entries(hist), _run_ids(ids))
        if not entries:
            raise gr.Error("no runs in this browser's history yet", print_exception=False)
        name = entries[0]["id"] if len(entries) == 1 else f"{len(entries)}-runs"
        if kind == "comparator":
            return export_file(f"feedback-lens-{name}-{stamp()}.llm-comparator.json", history.to_llm_comparator(entries))
        text = history.to_json(entries) if kind == "json" else history.to_csv(entries)
        return export_file(f"feedback-lens-{name}-{stamp()}.{kind}", text)

    def build(self, hist: gr.BrowserState, tabs: gr.Tabs) -> None:
        self.tabs = tabs
        with gr.Tab("History", id=TAB) as tab:
            note = gr.Markdown(elem_id="history-note")
            table = gr.Dataframe(headers=history.TABLE_HEADERS, interactive=False, wrap=True, elem_id="history-table")
            ids = gr.Dropdown([], multiselect=True, label="Runs (reload takes the first; export takes all chosen, "
                                                          "or every run when none is chosen)",
                              allow_custom_value=True, elem_id="history-runs")
            with gr.Row():
                reload_btn = gr.Button("Reload into Compare", elem_id="history-reload")
                json_btn = gr.Button("Export JSON", elem_id="history-json")
                csv_btn = gr.Button("Export CSV", elem_id="history-csv")
                comparator_btn = gr.Button("Export for LLM Comparator", elem_id="history-comparator")
            export = gr.File(label="Export", interactive=False, elem_id="history-file")
        c = self.compare
        restore_outputs = [*c.restore_outputs(), tabs]
        self.view_outputs = [table, ids, note]
        # Only opening this tab reads the history: it is up to 3 MB, sent from the browser with each
        # event that takes it, so switching between the other tabs must not carry it.
        tab.select(self.view, hist, self.view_outputs, api_name="history", show_progress="hidden")
        json_btn.click(self.export_json, [hist, ids], export, api_name="export_json")
        csv_btn.click(self.export_csv, [hist, ids], export, api_name="export_csv")
        comparator_btn.click(self.export_comparator, [hist, ids], export, api_name="export_llm_comparator")
        reload_btn.click(self.reload, [hist, ids, c.ui.out.view], restore_outputs, api_name="reload",
                         show_progress="hidden")
