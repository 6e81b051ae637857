"""Sweep tab: ΔPPL over a grid of one or two strategy parameters, drawn as a heatmap while it runs.
The work goes through `ModelRunner`; this module formats numbers."""
from __future__ import annotations

import math
import threading

import gradio as gr

from feedback.errors import FeedbackError
from feedback.figures import sweep_heatmap
from feedback.model import ModelPool
from feedback.perplexity import PPLConfig, document_ids, scoring_work
from feedback.sweep import SERVED_MAX_POINTS, best_point, parse_grid, run_sweep, to_csv
from ui.controls import build_strategy_panel, parse_number, run_controls
from ui.exports import export_file, stamp
from ui.lab import SERVED_MAX_DOCS, delta_legend, load_documents, mode_inputs, mode_of, source_inputs
from ui.runner import ModelRunner, Outcome, TabWork, cancellable_by_clients, reporting

TAB = "sweep"


class SweepWork(TabWork):
    label = "a Sweep"

    def __init__(self, tab: "SweepTab", lm, docs, strategy: str, grid: dict, base: PPLConfig, fixed: dict):
        super().__init__(tab.run, tab.stop, tab.status)
        self.tab, self.lm, self.docs, self.strategy, self.grid, self.base, self.fixed = (
            tab, lm, docs, strategy, grid, base, fixed)
        self.names = list(grid)
        self.total = math.prod(len(v) for v in grid.values())
        self.rows: list[dict] = []
        self.where = "starting"
        self.gpu_seconds = 60 + 10 * self.total

    def run(self, stop: threading.Event):
        yield from reporting(lambda report, halt: run_sweep(
            self.lm, self.docs, self.strategy, self.grid, self.base, self.fixed,
            on_point=lambda row, i, n: report(row), stop=halt,
            progress=lambda p, n, d, m: report(f"point {p} of {n}: document {d} of {m} done")), stop)

    def _heatmap(self, title: str):
        x, y = self.names[0], self.names[1] if len(self.names) > 1 else None
        return sweep_heatmap(self.rows, x, y, title)

    def progress(self, items: list, elapsed: float) -> dict:
        out = self.busy()
        new_point = False
        for item in items:
            if isinstance(item, dict):
                self.rows.append(item)
                new_point = True
            elif isinstance(item, str):
                self.where = item
        if new_point:
            out[self.tab.heatmap] = self._heatmap(f"{self.strategy}: ΔPPL % vs baseline "
                                                  f"({len(self.rows)} of {self.total} points)")
        return out | self.say(f"Sweeping… {len(self.rows)} of {self.total} points done; {self.where} "
                              f"({elapsed:.0f} s)")

    def finish(self, outcome: Outcome) -> dict:
        if not self.rows:
            return self.ended_early(outcome, "Stopped before the first point.", "Left the line; nothing was measured.")
        csv_path = export_file(f"sweep-{self.strategy}-{stamp()}.csv", to_csv(self.rows, self.names))
        best = best_point(self.rows, self.strategy, self.fixed)
        if best is None:
            best_text = "every point has strength 0 (the baseline itself), so there is no best setting"
        else:
            best_text = ("best (strength-0 points left out): " + ", ".join(f"{k}={best[k]}" for k in self.names) +
                         f", ΔPPL {best['delta_pct']:+.3f} % [{best['ci95_low']:+.3f}, {best['ci95_high']:+.3f}]")
        head = (f"Done: {self.total} points" if outcome.kind == "done" else
                f"Stopped after {len(self.rows)} of {self.total} points")
        return self.idle() | self.say(f"{head}; {best_text}.", "stopped" if outcome.kind == "stopped" else "info") | {
            self.tab.heatmap: self._heatmap(f"{self.strategy}: ΔPPL % vs baseline"), self.tab.csv: csv_path}


class SweepTab:
    def __init__(self, pool: ModelPool, runner: ModelRunner):
        self.pool, self.runner = pool, runner

    def prepare(self, source, text, upload, strategy, grid_x, grid_y, mode, passes, max_docs,
                *param_values) -> SweepWork:
        """Live ΔPPL heatmap over a grid of one or two parameters (baseline computed once)."""
        lm = self.pool.get()
        grid = parse_grid([g for g in (grid_x, grid_y) if g and g.strip()], strategy, lm.num_layers)
        points = math.prod(len(v) for v in grid.values())
        if points > SERVED_MAX_POINTS:
            raise FeedbackError(f"the grid has {points} points; the page runs at most {SERVED_MAX_POINTS} "
                                "(use `python -m feedback sweep` for larger grids)")
        fixed = {k: v for k, v in self.panel.params_for(strategy, list(param_values)).items() if k not in grid}
        base = PPLConfig(strategy, fixed, mode_of(mode), parse_number(passes, "passes", integer=True, lo=2, hi=32),
                         bootstrap=1000)
        base.validate(lm.context_length)
        docs = load_documents(source, text, upload,
                              parse_number(max_docs, "max documents", integer=True, lo=1, hi=SERVED_MAX_DOCS))
        self.runner.budget.check_scoring(*scoring_work([len(ids) for ids in document_ids(lm, docs, base)], base,
                                                       points))
        return SweepWork(self, lm, docs, strategy, grid, base, fixed)

    def stop_run(self, request: gr.Request = None) -> str:
        return self.runner.stop(TAB, request)

    def build(self, num_layers: int) -> None:
        with gr.Tab("Sweep", id=TAB):
            gr.Markdown(f"ΔPPL % over a grid of one or two parameters, e.g. `lam=0,0.02,0.05` and "
                        f"`gate=-1,0.75,0.9` (at most {SERVED_MAX_POINTS} points here; the command line "
                        f"`python -m feedback sweep` takes more). Other parameters come from the controls below. "
                        "Tune on `builtin:dev`; confirm on `builtin:test`.")
            source, text, upload, max_docs = source_inputs("sweep")
            with gr.Row():
                grid_x = gr.Textbox("lam=0,0.02,0.05,0.1", label="grid x (NAME=V1,V2,...)", elem_id="sweep-grid-x")
                grid_y = gr.Textbox("gate=-1,0.75,0.9", label="grid y (optional)", elem_id="sweep-grid-y")
            with gr.Row(equal_height=False):
                with gr.Column(min_width=280):
                    self.panel = build_strategy_panel(num_layers, "deep_cache", prefix="sweep", context="perplexity")
                with gr.Column(min_width=280):
                    mode, passes = mode_inputs("sweep")
            self.run, self.stop, self.status = run_controls("sweep", "Run sweep")
            gr.HTML(delta_legend())
            self.heatmap = gr.Plot(show_label=False, elem_id="sweep-plot")
            self.csv = gr.File(label="sweep.csv (the points measured)", interactive=False, elem_id="sweep-csv")
            stop_ack = gr.Textbox(visible=False)
            cancel_trigger = gr.Button(visible=False)  # for program clients' Job.cancel()
        handler = self.runner.wrap(TAB, self.prepare, self.panel.api_names)
        running = self.run.click(handler, [source, text, upload, self.panel.strategy, grid_x, grid_y, mode, passes, max_docs,
                                     *self.panel.components],
                           [self.heatmap, self.status, self.csv, self.run, self.stop], api_name="sweep",
                           concurrency_limit=None, show_progress="hidden")
        self.stop.click(self.stop_run, None, stop_ack, api_name="stop_sweep", concurrency_limit=None,
                        show_progress="hidden")
        cancellable_by_clients(cancel_trigger, running)

