"""Perplexity and Sweep tabs: does feedback lower perplexity on *my* text, and at which setting?

Handlers call `feedback.perplexity` / `feedback.sweep`; this module only turns their numbers into
Markdown, HTML and figures.
"""
from __future__ import annotations

import math
import queue
import tempfile
import threading
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Callable, Iterator

import gradio as gr

from feedback import corpus
from feedback.errors import FeedbackError
from feedback.model import ModelPool
from feedback.perplexity import PPLConfig, evaluate, surprise_diff
from feedback.strategies import REGISTRY
from feedback.sweep import parse_grid, run_sweep, to_csv
from ui import charts
from ui.controls import build_strategy_controls, parse_number, with_named_params

UPLOAD_MAX_BYTES = 5_000_000
TEXT_MAX_CHARS = corpus.SERVED_TEXT_MAX_CHARS
SOURCES = ["pasted text", "uploaded file", "builtin:dev", "builtin:test"]


def _mode(mode: str) -> str | None:
    return None if mode == "auto" else mode


def load_documents(source: str, text: str | None, upload: str | None, max_docs: int) -> list[corpus.Document]:
    """The documents a Perplexity/Sweep request asks for, with size limits and clear errors."""
    if source == "pasted text":
        if not text or not text.strip():
            raise FeedbackError("paste some text first (or choose another source)")
        if len(text) > TEXT_MAX_CHARS:
            raise FeedbackError(f"pasted text is limited to {TEXT_MAX_CHARS} characters, got {len(text)}")
        return [corpus.Document("pasted text", text)]
    if source == "uploaded file":
        if not upload:
            raise FeedbackError("upload a .txt or .jsonl file first")
        path = Path(upload)
        if path.stat().st_size > UPLOAD_MAX_BYTES:
            raise FeedbackError(f"uploads are limited to {UPLOAD_MAX_BYTES // 1_000_000} MB; "
                                f"this file is {path.stat().st_size / 1e6:.1f} MB")
        if path.suffix not in (".txt", ".jsonl"):
            raise FeedbackError("upload a .txt file or a .jsonl file with a 'text' field")
        warnings: list[str] = []
        docs = corpus.load(str(path), warnings.append)
        if warnings:
            gr.Warning(f"{len(warnings)} line(s) skipped: " + "; ".join(w.split(": ", 1)[1] for w in warnings[:3]))
        return docs[:max_docs]
    if source in ("builtin:dev", "builtin:test"):
        return corpus.load(source)[:max_docs]
    raise FeedbackError(f"unknown source {source!r}")


def summary_markdown(res: dict) -> str:
    """Both perplexities, ΔPPL with its CI, and how they were computed."""
    mode = res["mode"] + (f" (approximate, {res['passes']} passes)" if res.get("approximate") else "")
    lines = [f"**Baseline PPL** {res['baseline_ppl']:.3f}"]
    if "feedback_ppl" in res:
        lo, hi = res["ci95"]
        verdict = ("lower than baseline (CI excludes 0)" if hi < 0 else
                   "higher than baseline (CI excludes 0)" if lo > 0 else "no clear difference (CI includes 0)")
        lines += [f"**Feedback PPL** {res['feedback_ppl']:.3f}",
                  f"**ΔPPL** {res['delta_pct']:+.3f} %, 95% CI [{lo:+.3f}, {hi:+.3f}] % — {verdict}"]
    lines.append(f"{res['documents']} document(s), {res['tokens']} tokens · mode {mode} · "
                 f"{res['wall_seconds']:.1f} s" + (f" · CI by resampling {res['ci_method']}" if "ci_method" in res else ""))
    return "  \n".join(lines)


def surprise_html(detail: dict) -> str:
    """The text coloured by per-token NLL difference: blue = feedback less surprised, red = more."""
    if "feedback_nll" not in detail:
        return ""
    diffs = [f - b for f, b in zip(detail["feedback_nll"], detail["baseline_nll"])]
    bound = max(1e-6, max(abs(d) for d in diffs))
    spans = []
    for tok, d, b, f in zip(detail["tokens"], diffs, detail["baseline_nll"], detail["feedback_nll"]):
        alpha = min(1.0, abs(d) / bound) * 0.6
        color = f"rgba(31,119,180,{alpha:.2f})" if d < 0 else f"rgba(214,39,40,{alpha:.2f})"
        title = f"NLL baseline {b:.3f} · feedback {f:.3f} · Δ {d:+.3f}"
        spans.append(f'<span class="fl-tok" style="background-color: {color}" title="{escape(title, quote=True)}">'
                     f"{escape(tok, quote=True)}</span>")
    return f'<div class="fl-text">{"".join(spans)}</div>'


def surprise_figure(detail: dict):
    """Per-token NLL difference (feedback - baseline) along the text."""
    if "feedback_nll" not in detail:
        return charts.bar_figure([], [], "token", "NLL")
    diffs = [f - b for f, b in zip(detail["feedback_nll"], detail["baseline_nll"])]
    labels = [f"{i}: {t!r}" for i, t in enumerate(detail["tokens"])]
    return charts.bar_figure(labels, diffs, "token", "NLL feedback − baseline (nats)")


@dataclass
class Finished:
    result: object


def in_background(work: Callable[[Callable], object]) -> Iterator:
    """Run `work(report)` on a thread and yield whatever it reports while it runs, then
    `Finished(result)`. Its errors are raised here, in the caller's thread."""
    items: queue.Queue = queue.Queue()
    outcome: list = []
    end = object()

    def run():
        try:
            outcome.append(Finished(work(items.put)))
        except BaseException as exc:  # re-raised below, in the generator's thread
            outcome.append(exc)
        finally:
            items.put(end)

    threading.Thread(target=run, daemon=True).start()
    while (item := items.get()) is not end:
        yield item
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    yield outcome[0]


class LabTabs:
    """The Perplexity and Sweep tabs, sharing the app's model pool."""

    def __init__(self, pool: ModelPool):
        self.pool = pool

    def perplexity(self, source, text, upload, strategy, mode, passes, max_docs, *param_values,
                   request: gr.Request = None):
        """Both perplexities of the chosen text, ΔPPL with a paired 95% CI, per-token detail."""
        skip = gr.skip()
        try:
            lm = self.pool.get()
            cfg = PPLConfig(strategy, self.ppl_controls.params_for(strategy, list(param_values)), _mode(mode),
                            parse_number(passes, "passes", integer=True, lo=2, hi=32), bootstrap=2000)
            max_n = parse_number(max_docs, "max documents", integer=True, lo=1, hi=1000)
            docs = load_documents(source, text, upload, max_n)
            cfg.validate(lm.context_length)
            pasted = source == "pasted text"
            for item in in_background(lambda report: evaluate(
                    lm, docs, cfg, progress=lambda i, n, name: report((i, n, name)), token_detail=pasted)):
                if isinstance(item, Finished):
                    res = item.result
                else:
                    done, total, name = item
                    yield f"Scoring… document {done} of {total} ({escape(name)})", skip, skip, skip, skip
            detail = surprise_diff(res) if pasted else None
        except FeedbackError as exc:
            raise gr.Error(str(exc)) from None
        table = [[d["name"], d["tokens"], round(d["baseline_ppl"], 3), round(d.get("feedback_ppl", math.nan), 3),
                  round(d.get("delta_pct", math.nan), 3)] for d in res["per_doc"]]
        fig = surprise_figure(detail) if detail else charts.bar_figure(
            [d["name"] for d in res["per_doc"]], [d.get("delta_pct", 0.0) for d in res["per_doc"]], "document",
            "ΔPPL % per document")
        yield summary_markdown(res), surprise_html(detail) if detail else "", fig, table, res

    def sweep(self, source, text, upload, strategy, grid_x, grid_y, mode, passes, max_docs, *param_values,
              request: gr.Request = None):
        """Live ΔPPL heatmap over a grid of one or two parameters (baseline computed once)."""
        try:
            lm = self.pool.get()
            items = [g for g in (grid_x, grid_y) if g and g.strip()]
            grid = parse_grid(items, strategy, lm.num_layers)
            fixed = {k: v for k, v in self.sweep_controls.params_for(strategy, list(param_values)).items()
                     if k not in grid}
            passes_n = parse_number(passes, "passes", integer=True, lo=2, hi=32)
            base = PPLConfig(strategy, fixed, _mode(mode), passes_n, bootstrap=1000)
            base.resolved_mode()
            max_n = parse_number(max_docs, "max documents", integer=True, lo=1, hi=1000)
            docs = load_documents(source, text, upload, max_n)
        except FeedbackError as exc:
            raise gr.Error(str(exc)) from None
        names = list(grid)
        total = math.prod(len(v) for v in grid.values())
        rows: list[dict] = []
        x, y = names[0], names[1] if len(names) > 1 else None
        try:
            for item in in_background(lambda report: run_sweep(lm, docs, strategy, grid, base, fixed,
                                                               lambda row, i, n: report(row))):
                if not isinstance(item, Finished):
                    rows.append(item)
                    title = f"{strategy}: ΔPPL % vs baseline ({len(rows)}/{total} points)"
                    yield charts.sweep_heatmap(rows, x, y, title), f"{len(rows)} / {total} points done", None
        except FeedbackError as exc:
            raise gr.Error(str(exc)) from None
        out = Path(tempfile.mkdtemp(prefix="feedback-lens-sweep-")) / "sweep.csv"
        out.write_text(to_csv(rows, names))
        best = min(rows, key=lambda r: r["delta_pct"])
        status = (f"Done: {total} points. Best " + ", ".join(f"{k}={best[k]}" for k in names) +
                  f": ΔPPL {best['delta_pct']:+.3f} % [{best['ci95_low']:+.3f}, {best['ci95_high']:+.3f}]")
        yield charts.sweep_heatmap(rows, x, y, f"{strategy}: ΔPPL % vs baseline"), status, str(out)

    def _source_inputs(self):
        with gr.Row():
            source = gr.Radio(SOURCES, value="pasted text", label="Text")
            max_docs = gr.Number(20, label="max documents", precision=0, minimum=1, maximum=1000)
        text = gr.Textbox(label="Text to score", lines=6, max_length=TEXT_MAX_CHARS)
        upload = gr.File(label=f"or a .txt / .jsonl file (≤ {UPLOAD_MAX_BYTES // 1_000_000} MB)",
                         file_types=[".txt", ".jsonl"], type="filepath")
        return source, text, upload, max_docs

    @staticmethod
    def _mode_inputs():
        mode = gr.Radio(["auto", "exact", "parallel", "jacobi"], value="auto", label="mode")
        passes = gr.Number(3, label="jacobi passes", precision=0, minimum=2, maximum=32)
        return mode, passes

    def build(self, num_layers: int) -> None:
        """Add both tabs to the Blocks being built."""
        strategies = list(REGISTRY)
        with gr.Tab("Perplexity", id="perplexity"):
            gr.Markdown("Teacher-forced perplexity of the same tokens with and without feedback. `exact` decodes "
                        "token by token; `parallel` is exact for non-recurrent strategies; `jacobi` approximates "
                        "recurrent ones with several passes. The CI is a paired bootstrap.")
            source, text, upload, max_docs = self._source_inputs()
            with gr.Row():
                strategy = gr.Dropdown(strategies, value="deep_cache", label="Feedback strategy")
                mode, passes = self._mode_inputs()
            self.ppl_controls = build_strategy_controls(num_layers, "deep_cache", prefix="ppl")
            run = gr.Button("Measure perplexity", variant="primary", elem_id="ppl-run")
            summary = gr.Markdown(elem_id="ppl-summary")
            coloured = gr.HTML(elem_id="ppl-text")
            fig = gr.Plot(show_label=False, elem_id="ppl-plot")
            table = gr.Dataframe(headers=["document", "tokens", "baseline PPL", "feedback PPL", "ΔPPL %"],
                                 interactive=False)
            with gr.Accordion("Result (JSON)", open=False):
                result = gr.JSON()
            self.ppl_controls.follow(strategy)
            run.click(with_named_params(self.perplexity, self.ppl_controls, self.pool.gate),
                      [source, text, upload, strategy, mode, passes, max_docs, *self.ppl_controls.components],
                      [summary, coloured, fig, table, result], api_name="perplexity", concurrency_id="model",
                      concurrency_limit=1)
        with gr.Tab("Sweep", id="sweep"):
            gr.Markdown("ΔPPL % over a grid of one or two parameters, e.g. `lam=0,0.02,0.05` and "
                        "`gate=-1,0.75,0.9`. Other parameters come from the controls below. Tune on "
                        "`builtin:dev`; confirm on `builtin:test`.")
            s_source, s_text, s_upload, s_max_docs = self._source_inputs()
            with gr.Row():
                s_strategy = gr.Dropdown(strategies, value="deep_cache", label="Feedback strategy")
                grid_x = gr.Textbox("lam=0,0.02,0.05,0.1", label="grid x (NAME=V1,V2,...)")
                grid_y = gr.Textbox("gate=-1,0.75,0.9", label="grid y (optional)")
            with gr.Row():
                s_mode, s_passes = self._mode_inputs()
            self.sweep_controls = build_strategy_controls(num_layers, "deep_cache", prefix="sweep")
            go = gr.Button("Run sweep", variant="primary", elem_id="sweep-run")
            status = gr.Markdown(elem_id="sweep-status")
            heat = gr.Plot(show_label=False, elem_id="sweep-plot")
            csv_file = gr.File(label="sweep.csv", interactive=False)
            self.sweep_controls.follow(s_strategy)
            go.click(with_named_params(self.sweep, self.sweep_controls, self.pool.gate),
                     [s_source, s_text, s_upload, s_strategy, grid_x, grid_y, s_mode, s_passes, s_max_docs,
                      *self.sweep_controls.components], [heat, status, csv_file], api_name="sweep",
                     concurrency_id="model", concurrency_limit=1)
