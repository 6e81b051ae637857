"""Sweep tab: ΔPPL over a grid of one or two strategy parameters, drawn as a heatmap while it runs;
and its Tune companion (`ui.sweep.tune`): a search of the strategy's parameters with a small trial
budget. The work goes through `ModelRunner`; this module formats numbers. Every best point is judged
against the baseline (`feedback.eval.verdict`: a real improvement, within noise, or no better); when
a Sweep or a Tune has one that beats the baseline (a Tune's also not worse on test), the tab keeps it
(strategy and every parameter, `ui.sweep.best`) and "Send best to Compare" puts it into a Compare
column (the Compare tab the page's layout gives it, `ui.page.handoff`); otherwise the status line
says that no point beats the baseline and the button stays off.

Both handlers take their controls' values by name (the strategy controls as `<strategy>_<param>`),
the names API clients may pass them by; every number is checked against the `Bound` its box shows."""

from __future__ import annotations

import math
from dataclasses import dataclass

import gradio as gr

from feedback.errors import FeedbackError
from feedback.eval.figures import sweep_heatmap
from feedback.eval.perplexity import Estimate, PPLConfig, estimate
from feedback.eval.sweep import best_point, parse_grid, run_sweep, to_csv
from feedback.eval.verdict import ci_text, not_recommended, verdict
from feedback.serve.gpu_time import GpuWork
from feedback.serve.limits import MAX_TOKENS_PER_DOC, SERVED_MAX_POINTS
from feedback.serve.pool import ModelPool
from ui.page import render
from ui.page.controls import bound_number, build_strategy_panel, chosen, run_controls, to_components
from ui.page.exports import export_file, stamp
from ui.page.handoff import COMPARE_TAB, CompareTarget
from ui.page.runner import GpuTask, ModelRunner, Outcome, TabWork, by_name, cancellable_by_clients, reporting
from ui.page.scoring import (
    LESS_TEXT,
    JobClock,
    check_budget,
    doc_limits,
    measure,
    scoring_gpu_work,
    token_counts,
)
from ui.page.settings import DEFAULT_COLUMNS, MIN_COLUMNS, column_key
from ui.page.stop_signal import StopSignal
from ui.page.text_inputs import delta_legend, load_named, mode_inputs, scoring_config, source_inputs
from ui.sweep import tune
from ui.sweep.best import (
    SEND_LABEL,
    Judged,
    kept_best,
    offer,
    recommend,
    take_reports,
    target_column,
    unique_name,
)
from ui.sweep.tune import TUNE, TuneWork, searchable

TAB = "sweep"
# The first Run, as the page opens (the Tune's too: it shares the text): builtin:dev, its first 10
# documents cut to 128 tokens each. 10 documents, so the CI resamples documents (from fewer it covers
# these texts only); 128 tokens, so the default 12-point grid scores 15,041 token-forwards (a tenth of
# the scoring budget; about a minute on the 2-core dev CPU) and the default Tune, with its test, asks
# for under ZeroGPU's default 120 s (limits.GPU_DURATION_CAP_S). The cut bounds both whatever
# CPython's topics (read at run time) hold; uncut, 4 documents (149,604) fit the budget with 0.3 % to
# spare and took 928 s on that CPU.
SWEEP_SOURCE, SWEEP_DOCS, SWEEP_TOKENS_PER_DOC = "builtin:dev", 10, 128


def sweep_best(best: dict, names: list[str]) -> Judged:
    """A Sweep's lowest-ΔPPL point in words with the verdict on it, and why it is no recommendation
    (None when it is one: it beats the baseline)."""
    judged = verdict(best["delta_pct"], [best["ci95_low"], best["ci95_high"]])
    point = ", ".join(f"{k}={best[k]}" for k in names)
    label = "best" if judged.beats_baseline else "the lowest ΔPPL"
    return Judged(
        f"{label} (strength-0 points left out): {point}, ΔPPL {best['delta_pct']:+.3f} % "
        f"{ci_text(best['ci95_low'], best['ci95_high'])} ({judged.text})",
        not_recommended(judged),
        judged.text,
    )


@dataclass
class SweepTask(GpuTask):
    """A Sweep on the GPU: the rate, each point's row and progress, then `Finished`."""

    model: str
    gpu: GpuWork
    docs: list
    strategy: str
    grid: dict
    base: PPLConfig
    fixed: dict
    est: Estimate

    def run(self, lm, stop: StopSignal):
        def sweep(report, halt):
            report(measure(self.est, lm, halt))
            return run_sweep(
                lm,
                self.docs,
                self.strategy,
                self.grid,
                self.base,
                self.fixed,
                on_point=lambda row, i, n: report(row),
                stop=halt,
                progress=report,
            )

        yield from reporting(sweep, stop)


class SweepWork(TabWork):
    label = "a Sweep"

    def __init__(
        self, tab: SweepTab, lm, docs, strategy: str, grid: dict, base: PPLConfig, fixed: dict, est: Estimate
    ):
        super().__init__(tab.run, tab.stop, tab.status)
        self.outputs, self.lm, self.docs, self.strategy, self.grid, self.base, self.fixed = (
            tab.outputs,
            lm,
            docs,
            strategy,
            grid,
            base,
            fixed,
        )
        self.names = list(grid)
        self.total = math.prod(len(v) for v in grid.values())
        self.rows: list[dict] = []
        self.clock = JobClock(lm, ("", "points", est))
        self.task = SweepTask(
            lm.name,
            scoring_gpu_work(est, fewer=f"fewer grid points or {LESS_TEXT}"),
            docs,
            strategy,
            grid,
            base,
            fixed,
            est,
        )

    def starting(self) -> dict:
        # the last job's best point goes: the button sends what the status line reports
        return (
            self.busy()
            | self.say(f"Starting. {self.clock.estimate_text()}")
            | to_components(self.outputs, offer(None))
        )

    def _heatmap(self, title: str):
        x, y = self.names[0], self.names[1] if len(self.names) > 1 else None
        return sweep_heatmap(self.rows, x, y, title)

    def progress(self, items: list, elapsed: float) -> dict:
        out = self.busy()
        if take_reports(self, items, elapsed):
            out |= to_components(
                self.outputs,
                {
                    "heatmap": self._heatmap(
                        f"{self.strategy}: ΔPPL % vs baseline ({len(self.rows)} of {self.total} points)"
                    )
                },
            )
        return out | self.say(
            f"Sweeping… {len(self.rows)} of {self.total} points done; "
            f"{self.clock.where_text(elapsed)} ({elapsed:.0f} s). {self.clock.estimate_text()}"
        )

    def _best(self, best: dict | None) -> tuple[str, dict | None]:
        """The status line's words on the lowest-ΔPPL point and what the tab keeps to send (see
        `recommend`)."""
        if best is None:
            return "every point has strength 0 (the baseline itself), so there is no best setting", None
        # the grid's values over the fixed ones: the whole point
        return recommend(
            sweep_best(best, self.names),
            lambda judged: kept_best(
                "Sweep",
                self.strategy,
                {**self.fixed, **{k: best[k] for k in self.names}},
                self.lm.num_layers,
                best["delta_pct"],
                judged,
            ),
        )

    def finish(self, outcome: Outcome) -> dict:
        if not self.rows:
            return self.ended_early(
                outcome, "Stopped before the first point.", "Left the line; nothing was measured."
            )
        csv_path = export_file(f"sweep-{self.strategy}-{stamp()}.csv", to_csv(self.rows, self.names))
        best_text, kept = self._best(best_point(self.rows, self.strategy, self.fixed))
        head = (
            f"Done: {self.total} points"
            if outcome.kind == "done"
            else f"Stopped after {len(self.rows)} of {self.total} points"
        )
        view = {"heatmap": self._heatmap(f"{self.strategy}: ΔPPL % vs baseline"), "csv": csv_path} | offer(
            kept
        )
        return (
            self.idle()
            | self.say(f"{head}; {best_text}.", "stopped" if outcome.kind == "stopped" else "info")
            | to_components(self.outputs, view)
        )


class SweepTab:
    def __init__(self, pool: ModelPool, runner: ModelRunner, compare: CompareTarget | None = None):
        """`compare`: the Compare tab a best point is sent to (without it, no send buttons)."""
        self.pool, self.runner, self.compare = pool, runner, compare

    def prepare(self, values: dict) -> SweepWork:
        """Live ΔPPL heatmap over a grid of one or two parameters (baseline computed once)."""
        lm = self.pool.get()
        strategy, params = chosen(values)
        axes = [
            (field, g)
            for field, g in (("grid x", values["grid_x"]), ("grid y", values["grid_y"]))
            if g and g.strip()
        ]
        grid = parse_grid([g for _, g in axes], strategy, lm.num_layers, [f for f, _ in axes] or ["grid x"])
        points = math.prod(len(v) for v in grid.values())
        if points > SERVED_MAX_POINTS:
            raise FeedbackError(
                f"the grid has {points} points; the page runs at most {SERVED_MAX_POINTS} "
                "(use `python -m feedback sweep` for larger grids)"
            )
        fixed = {k: v for k, v in params.items() if k not in grid}
        base = scoring_config(values, strategy, fixed, **doc_limits(values))
        base.validate(lm.context_length)
        docs = load_named(values)
        counts = token_counts(lm, docs, base)
        est = estimate(counts, base, points)
        check_budget(self.runner.budget, est, counts, base)
        return SweepWork(self, lm, docs, strategy, grid, base, fixed, est)

    def stop_run(self, request: gr.Request = None) -> str:
        return self.runner.stop(TAB, request)

    def prepare_tune(self, values: dict) -> TuneWork:
        """The Tune's run (`ui.sweep.tune.prepare`)."""
        return tune.prepare(self, values)

    def stop_tune(self, request: gr.Request = None) -> str:
        return self.runner.stop(TUNE, request)

    # ---- Send best to Compare ----
    def send_sweep_best(self, values: dict) -> dict:
        """The last Sweep's best point into a Compare column (see `send`)."""
        return self.send(
            values,
            self.status,
            "Not sent: there is no best point yet. Run the sweep (a stopped one "
            "has the best of the points it measured; points with strength 0, "
            "or that do not beat the baseline, are never sent).",
        )

    def send_tune_best(self, values: dict) -> dict:
        """The last Tune's best trial into a Compare column (see `send`)."""
        return self.send(
            values,
            self.tune_status,
            "Not sent: there is no best trial yet. A finished tune has one "
            "(a stopped one reports none; trials with strength 0, or that do "
            "not beat the baseline on dev and on test, are never sent).",
        )

    def send(self, values: dict, status, refusal: str) -> dict:
        """The kept best point (`values["best"]`) into the Compare column `target_column` picks, named
        "Sweep best" / "Tune best" (`unique_name`), with its strategy, parameters and heading, then the
        Compare tab shown; every other Compare setting stays. With no best point the tab's status
        line says why (`refusal`) and nothing else changes."""
        best = values["best"]
        if not best:
            return {status: render.status_html(refusal, "error")}
        column, name = self._place(best, values)
        judged = f" ({best['verdict']})" if best.get("verdict") else ""
        note = (
            f"Column {column + 1} ({name}) now has the {best['source']}'s best point: {best['strategy']}, "
            f"ΔPPL {best['delta_pct']:+.3f} % on the {best['source']}'s text{judged}. "
            "The other settings are as they were; press Generate to run it."
        )
        return self.compare.show_strategy(column, best["strategy"], best["params"], name) | {
            self.compare.ui.run.status: render.status_html(note),
            self.tabs: gr.update(selected=COMPARE_TAB),
        }

    def _place(self, best: dict, values: dict) -> tuple[int, str]:
        """(column, name) for a best point, from the Compare columns as they stand."""
        cols = range(len(self.compare.ui.cols))
        strategies = [values[column_key(i, "strategy")] for i in cols]
        # an empty name box is the slot's default name, as a run reads it
        names = [(values[column_key(i, "name")] or "").strip() or DEFAULT_COLUMNS[i][0] for i in cols]
        column = target_column(best["strategy"], strategies, int(values["columns"] or MIN_COLUMNS))
        return column, unique_name(f"{best['source']} best", names, column)

    def send_inputs(self) -> dict:
        """What placing a best point reads of Compare, by name: how many columns show, each column's
        strategy and name."""
        ui = self.compare.ui
        return {"columns": ui.settings["columns"]} | {
            column_key(col.index, name): col.inputs()[column_key(col.index, name)]
            for col in ui.cols
            for name in ("strategy", "name")
        }

    def send_outputs(self, status) -> list:
        """Everything `send` may update: each Compare column's name, strategy panel and heading, the
        Compare status line, the tabs and the sending tab's status line."""
        ui = self.compare.ui
        cols = [x for col in ui.cols for x in (col.settings["name"], *col.panel.outputs(), col.heading)]
        return [*cols, ui.run.status, self.tabs, status]

    def _wire_send(self, button: gr.Button, best: gr.State, status, send) -> None:
        inputs = {"best": best} | self.send_inputs()
        button.click(
            by_name(send, list(inputs)),
            inputs_kwargs=inputs,
            outputs=self.send_outputs(status),
            api_name=False,
            queue=False,
            show_progress="hidden",
        )

    def build(self, num_layers: int, tabs: gr.Tabs | None = None) -> None:
        """`tabs`: the page's tabs, which "Send best to Compare" switches to Compare."""
        self.tabs = tabs
        with gr.Tab("Sweep", id=TAB):
            gr.Markdown(
                f"ΔPPL % over a grid of one or two parameters, e.g. `lam=0,0.02,0.05` and "
                f"`gate=-1,0.75,0.9` (at most {SERVED_MAX_POINTS} points here; the command line "
                f"`python -m feedback sweep` takes more). Other parameters come from the controls below. "
                "Tune on `builtin:dev`; confirm on `builtin:test`. The best point is judged against the "
                "baseline (a real improvement when its 95% CI excludes 0; within noise; or no better); "
                "**Send best to Compare** puts one that beats the baseline into a Compare column to "
                "generate with it."
            )
            source, text, upload, max_docs = source_inputs("sweep", SWEEP_SOURCE, SWEEP_DOCS)
            with gr.Row():
                grid_x = gr.Textbox(
                    "lam=0,0.02,0.05,0.1", label="grid x (NAME=V1,V2,...)", elem_id="sweep-grid-x"
                )
                grid_y = gr.Textbox("gate=-1,0.75,0.9", label="grid y (optional)", elem_id="sweep-grid-y")
            with gr.Row(equal_height=False):
                with gr.Column(min_width=280):
                    self.panel = build_strategy_panel(
                        num_layers, "deep_cache", prefix="sweep", context="perplexity"
                    )
                with gr.Column(min_width=280):
                    mode, passes = mode_inputs("sweep")
                    # starts lower than the Perplexity tab's (the served cap): see SWEEP_TOKENS_PER_DOC
                    max_tokens = bound_number(
                        MAX_TOKENS_PER_DOC,
                        SWEEP_TOKENS_PER_DOC,
                        elem_id="sweep-max-tokens",
                        info=f"each document cut to its first N tokens ({MAX_TOKENS_PER_DOC.info})",
                    )
            self.run, self.stop, self.status = run_controls("sweep", "Run sweep")
            # on once there is a best point, kept in `best`
            self.send_button = gr.Button(SEND_LABEL, interactive=False, elem_id="sweep-send")
            self.best = gr.State(None)
            gr.HTML(delta_legend())
            self.heatmap = gr.Plot(show_label=False, elem_id="sweep-plot")
            self.csv = gr.File(
                label="sweep.csv (the points measured)", interactive=False, elem_id="sweep-csv"
            )
            search, trials, seed = tune.build_controls(self)
            stop_ack = gr.Textbox(visible=False)
            cancel_trigger = gr.Button(visible=False)  # for program clients' Job.cancel()
        self.outputs = {"heatmap": self.heatmap, "csv": self.csv, "best": self.best, "send": self.send_button}
        self.tune_outputs = {
            "table": self.tune_table,
            "plot": self.tune_plot,
            "files": self.tune_files,
            "best": self.tune_best,
            "send": self.tune_send,
        }
        texts = {"source": source, "text": text, "upload": upload, "strategy": self.panel.strategy}
        strategy_controls = self.panel.named_inputs()
        # In the order positional API clients pass them.
        inputs = {
            **texts,
            "grid_x": grid_x,
            "grid_y": grid_y,
            "mode": mode,
            "passes": passes,
            "max_docs": max_docs,
            "max_tokens_per_doc": max_tokens,
            **strategy_controls,
        }
        handler = self.runner.wrap(TAB, self.prepare, list(inputs), status=self.status)
        running = self.run.click(
            handler,
            inputs_kwargs=inputs,
            outputs=[self.heatmap, self.status, self.csv, self.run, self.stop, self.best, self.send_button],
            api_name="sweep",
            concurrency_limit=None,
            show_progress="hidden",
        )
        self.stop.click(
            self.stop_run,
            None,
            stop_ack,
            api_name="stop_sweep",
            concurrency_limit=None,
            show_progress="hidden",
        )
        gr.on(
            [self.panel.strategy.change, self.panel.stack.change],
            by_name(searchable, ["strategy", "stack"]),
            inputs_kwargs={"strategy": self.panel.strategy, "stack": self.panel.stack},
            outputs=search,
            api_name=False,
            queue=False,
            show_progress="hidden",
        )
        tune_inputs = {
            **texts,
            "search": search,
            "mode": mode,
            "passes": passes,
            "max_docs": max_docs,
            "max_tokens_per_doc": max_tokens,
            "trials": trials,
            "seed": seed,
            **strategy_controls,
        }
        tune_handler = self.runner.wrap(TUNE, self.prepare_tune, list(tune_inputs), status=self.tune_status)
        tuning = self.tune_run.click(
            tune_handler,
            inputs_kwargs=tune_inputs,
            outputs=[
                self.tune_table,
                self.tune_plot,
                self.tune_status,
                self.tune_files,
                self.tune_run,
                self.tune_stop,
                self.tune_best,
                self.tune_send,
            ],
            api_name="tune",
            concurrency_limit=None,
            show_progress="hidden",
        )
        self.tune_stop.click(
            self.stop_tune,
            None,
            stop_ack,
            api_name="stop_tune",
            concurrency_limit=None,
            show_progress="hidden",
        )
        cancellable_by_clients(cancel_trigger, running, tuning)
        if self.compare is not None and tabs is not None:
            self._wire_send(self.send_button, self.best, self.status, self.send_sweep_best)
            self._wire_send(self.tune_send, self.tune_best, self.tune_status, self.send_tune_best)
