"""Sweep tab: ΔPPL over a grid of one or two strategy parameters, drawn as a heatmap while it runs;
and its Tune companion: a search of the strategy's parameters (`feedback.eval.tune`) with a small trial
budget, each trial streamed into a table and the history chart. The work goes through
`ModelRunner`; this module formats numbers. Every best point is judged against the baseline
(`feedback.eval.verdict`: a real improvement, within noise, or no better); when a Sweep or a Tune
has one that beats the baseline (a Tune's also not worse on test), the tab keeps it (strategy and
every parameter) and "Send best to Compare" puts it into a Compare column; otherwise the status
line says that no point beats the baseline and the button stays off.

Both handlers take their controls' values by name (the strategy controls as `<strategy>_<param>`),
the names API clients may pass them by; every number is checked against the `Bound` its box shows."""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import gradio as gr

from feedback.core.records import SEED
from feedback.errors import FeedbackError
from feedback.eval import corpus
from feedback.eval.figures import format_params, history_figure, sweep_heatmap, table_row
from feedback.eval.perplexity import Estimate, PPLConfig, estimate
from feedback.eval.sweep import best_point, parse_grid, run_sweep, to_csv
from feedback.eval.tune import TuneSettings, jsonl_text, parse_fixed, run_tune, search_space
from feedback.eval.tune import prepare as tune_data
from feedback.eval.verdict import ci_text, not_recommended, verdict
from feedback.serve.gpu_time import GpuWork
from feedback.serve.limits import MAX_DOCS, MAX_TOKENS_PER_DOC, SERVED_MAX_POINTS, SERVED_MAX_TRIALS, TRIALS
from feedback.serve.pool import ModelPool
from feedback.strategies import get_strategy
from ui import render
from ui.compare.settings import DEFAULT_COLUMNS, MIN_COLUMNS, column_key
from ui.compare.tab import TAB as COMPARE_TAB
from ui.compare.tab import CompareTab
from ui.controls import bound_number, build_strategy_panel, chosen, chosen_name, run_controls, to_components
from ui.exports import export_file, stamp
from ui.perplexity_tab import (LESS_TEXT, JobClock, check_budget, doc_limits, measure,
                               scoring_gpu_work, token_counts)
from ui.runner import Finished, GpuTask, ModelRunner, Outcome, TabWork, by_name, cancellable_by_clients, reporting
from ui.stop_signal import StopSignal
from ui.text_inputs import delta_legend, load_named, mode_inputs, scoring_config, source_inputs

TAB = "sweep"
TUNE = "tune"  # the companion's own jobs, so each Stop ends its own run
TUNE_HEADERS = ["trial", "params", "ΔPPL % dev", "state"]
TUNE_STARTUP = 4  # random trials before TPE models the results (a page run is short)
FEEDBACK_COLUMN = 1  # Compare's column 2, the page's default feedback column (column 1 is the baseline)
SEND_LABEL = "Send best to Compare"
# The first Run, as the page opens (the Tune's too: it shares the text): builtin:dev, its first 10
# documents cut to 128 tokens each. 10 documents, so the CI resamples documents (from fewer it covers
# these texts only); 128 tokens, so the default 12-point grid scores 15,041 token-forwards (a tenth of
# the scoring budget; about a minute on the 2-core dev CPU) and the default Tune, with its test, asks
# for under ZeroGPU's default 120 s (limits.GPU_DURATION_CAP_S). The cut bounds both whatever
# CPython's topics (read at run time) hold; uncut, 4 documents (149,604) fit the budget with 0.3 % to
# spare and took 928 s on that CPU.
SWEEP_SOURCE, SWEEP_DOCS, SWEEP_TOKENS_PER_DOC = "builtin:dev", 10, 128


def tunable(strategy: str) -> list[str]:
    """The parameters the tuner can search for this strategy, in schema order."""
    try:
        return [p.name for p in get_strategy(strategy).params if p.tunable]
    except FeedbackError:  # none, or a name no strategy has
        return []


def searchable(values: dict) -> dict:
    """Tune's "search these" box for a newly chosen strategy or stack: its tunable parameters, all ticked."""
    names = tunable(chosen_name(values) or "")
    return gr.update(choices=names, value=names)


def take_reports(work, items: list, elapsed: float) -> bool:
    """A long job's reports, `elapsed` seconds into it: the measured rate and where the job stands
    go to `work.clock`, result rows (dicts) join `work.rows`, a `Finished` result becomes
    `work.result`. True when a new row came."""
    new = False
    for item in items:
        if work.clock.take(item, elapsed):
            continue
        if isinstance(item, dict):
            work.rows.append(item)
            new = True
        elif isinstance(item, Finished):
            work.result = item.result
    return new


def kept_best(source: str, strategy: str, params: dict, num_layers: int, delta_pct: float,
              judged: str = "") -> dict:
    """A job's best point as the tab keeps it for "Send best to Compare": the job that found it
    ("Sweep", "Tune"), the strategy, every parameter with defaults filled in (a Compare column takes
    a whole set: one left out would keep whatever the column had), its ΔPPL and the verdict on it
    (`feedback.eval.verdict`, in words). Only a point that beats the baseline is kept (`recommend`)."""
    return {"source": source, "strategy": strategy, "params": get_strategy(strategy).validate(params, num_layers),
            "delta_pct": delta_pct, "verdict": judged}


def offer(best: dict | None) -> dict:
    """The kept best point (by output name) and its send button, which is on only when there is one:
    a job whose best does not beat the baseline keeps none, so a harmful setting is never offered."""
    return {"best": best, "send": gr.update(interactive=best is not None)}


class Judged(NamedTuple):
    """A job's best point as the status line reports it (`sweep_best`, `tune_best`)."""

    text: str  # the point in words, each ΔPPL with the verdict on it
    why: str | None  # why it is no recommendation; None: it is one
    verdict: str  # the verdict on its ΔPPL (a Tune's on dev), for the note "Send best to Compare" writes


def sweep_best(best: dict, names: list[str]) -> Judged:
    """A Sweep's lowest-ΔPPL point in words with the verdict on it, and why it is no recommendation
    (None when it is one: it beats the baseline)."""
    judged = verdict(best["delta_pct"], [best["ci95_low"], best["ci95_high"]])
    point = ", ".join(f"{k}={best[k]}" for k in names)
    label = "best" if judged.beats_baseline else "the lowest ΔPPL"
    return Judged(f"{label} (strength-0 points left out): {point}, ΔPPL {best['delta_pct']:+.3f} % "
                  f"{ci_text(best['ci95_low'], best['ci95_high'])} ({judged.text})", not_recommended(judged),
                  judged.text)


def tune_best(best: dict, test: dict | None) -> Judged:
    """A Tune's best dev trial and its score on test (None: not scored) in words, each with its
    verdict, and why it is no recommendation (None when it is one: it beats the baseline on dev
    and is not worse on test)."""
    dev_ci = best["ci95"] or [None, None]
    dev = verdict(best["delta_pct"], dev_ci)
    label = "best on dev" if dev.beats_baseline else "the lowest dev ΔPPL"
    text = (f"{label}: trial {best['trial']} ({format_params(best['params'])}), ΔPPL {best['delta_pct']:+.3f} % "
            f"{ci_text(*dev_ci)} ({dev.text})")
    on_test = None
    if test is not None:
        on_test = verdict(test["delta_pct"], test["ci95"])
        text += (f"; on {test['data']} (scored once): ΔPPL {test['delta_pct']:+.3f} %, 95% CI "
                 f"{ci_text(*test['ci95'])} % ({on_test.text})")
    return Judged(text, not_recommended(dev, on_test, noun="trial"), dev.text)


def recommend(judged: Judged, keep: Callable[[str], dict]) -> tuple[str, dict | None]:
    """The status line's words on a job's best point and what the tab keeps of it: the point
    (`keep(verdict)`) when it is a recommendation, else nothing, the line saying why first."""
    if judged.why is None:
        return judged.text, keep(judged.verdict)
    return f"{judged.why}, so nothing is offered to Compare — {judged.text}", None


def target_column(strategy: str, strategies: list, shown: int) -> int:
    """The Compare column (0-based) a best point goes to: the first shown column already on its
    strategy (that column is the one meant to try it), else column 2, the page's feedback column."""
    return next((i for i, s in enumerate(strategies[:shown]) if s == strategy), FEEDBACK_COLUMN)


def unique_name(base: str, names: list[str], column: int) -> str:
    """`base` ("Sweep best"), numbered ("Sweep best 2") while another column has that name: a run
    refuses two columns of one name."""
    others = set(names[:column] + names[column + 1:])
    return next(name for k in itertools.count(1) if (name := base if k == 1 else f"{base} {k}") not in others)


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
            return run_sweep(lm, self.docs, self.strategy, self.grid, self.base, self.fixed,
                             on_point=lambda row, i, n: report(row), stop=halt, progress=report)

        yield from reporting(sweep, stop)


@dataclass
class TuneTask(GpuTask):
    """A Tune on the GPU: the rate, each trial's row and progress, then `Finished` with the search."""

    model: str
    gpu: GpuWork
    docs: list
    strategy: str
    base: PPLConfig
    fixed: dict
    settings: TuneSettings
    test_docs: list | None
    est: Estimate

    def run(self, lm, stop: StopSignal):
        def tune(report, halt):
            report(measure(self.est, lm, halt))
            return run_tune(lm, self.docs, self.strategy, self.base, self.fixed, self.settings,
                            test_docs=self.test_docs, on_trial=report, stop=halt, progress=report)

        yield from reporting(tune, stop)


class SweepWork(TabWork):
    label = "a Sweep"

    def __init__(self, tab: "SweepTab", lm, docs, strategy: str, grid: dict, base: PPLConfig, fixed: dict,
                 est: Estimate):
        super().__init__(tab.run, tab.stop, tab.status)
        self.outputs, self.lm, self.docs, self.strategy, self.grid, self.base, self.fixed = (
            tab.outputs, lm, docs, strategy, grid, base, fixed)
        self.names = list(grid)
        self.total = math.prod(len(v) for v in grid.values())
        self.rows: list[dict] = []
        self.clock = JobClock(lm, ("", "points", est))
        self.task = SweepTask(lm.name, scoring_gpu_work(est, fewer=f"fewer grid points or {LESS_TEXT}"), docs,
                              strategy, grid, base, fixed, est)

    def starting(self) -> dict:
        # the last job's best point goes: the button sends what the status line reports
        return (self.busy() | self.say(f"Starting. {self.clock.estimate_text()}")
                | to_components(self.outputs, offer(None)))

    def _heatmap(self, title: str):
        x, y = self.names[0], self.names[1] if len(self.names) > 1 else None
        return sweep_heatmap(self.rows, x, y, title)

    def progress(self, items: list, elapsed: float) -> dict:
        out = self.busy()
        if take_reports(self, items, elapsed):
            out |= to_components(self.outputs, {"heatmap": self._heatmap(
                f"{self.strategy}: ΔPPL % vs baseline ({len(self.rows)} of {self.total} points)")})
        return out | self.say(f"Sweeping… {len(self.rows)} of {self.total} points done; "
                              f"{self.clock.where_text(elapsed)} ({elapsed:.0f} s). {self.clock.estimate_text()}")

    def _best(self, best: dict | None) -> tuple[str, dict | None]:
        """The status line's words on the lowest-ΔPPL point and what the tab keeps to send (see `recommend`)."""
        if best is None:
            return "every point has strength 0 (the baseline itself), so there is no best setting", None
        # the grid's values over the fixed ones: the whole point
        return recommend(sweep_best(best, self.names), lambda judged: kept_best(
            "Sweep", self.strategy, {**self.fixed, **{k: best[k] for k in self.names}}, self.lm.num_layers,
            best["delta_pct"], judged))

    def finish(self, outcome: Outcome) -> dict:
        if not self.rows:
            return self.ended_early(outcome, "Stopped before the first point.", "Left the line; nothing was measured.")
        csv_path = export_file(f"sweep-{self.strategy}-{stamp()}.csv", to_csv(self.rows, self.names))
        best_text, kept = self._best(best_point(self.rows, self.strategy, self.fixed))
        head = (f"Done: {self.total} points" if outcome.kind == "done" else
                f"Stopped after {len(self.rows)} of {self.total} points")
        view = {"heatmap": self._heatmap(f"{self.strategy}: ΔPPL % vs baseline"), "csv": csv_path} | offer(kept)
        return (self.idle() | self.say(f"{head}; {best_text}.", "stopped" if outcome.kind == "stopped" else "info")
                | to_components(self.outputs, view))


class TuneWork(TabWork):
    label = "a Tune"

    def __init__(self, tab: "SweepTab", lm, docs, strategy: str, base: PPLConfig, fixed: dict, trials: int,
                 seed: int, test_docs, data: str, test: str, ests: tuple[Estimate, Estimate | None]):
        super().__init__(tab.tune_run, tab.tune_stop, tab.tune_status)
        self.outputs, self.lm, self.docs, self.strategy, self.base, self.fixed = (
            tab.tune_outputs, lm, docs, strategy, base, fixed)
        self.trials, self.seed, self.test_docs, self.data, self.test = trials, seed, test_docs, data, test
        self.rows: list[dict] = []
        self.result: dict | None = None
        # at most: a pruned trial scores only the first third of the documents
        self.clock = JobClock(lm, ("search, every trial in full: ", "trials", ests[0]),
                              (f"{test} once: ", "", ests[1]))
        settings = TuneSettings(trials=trials, seed=seed, startup_trials=TUNE_STARTUP, max_trials=SERVED_MAX_TRIALS,
                                data=data, test=test)
        self.task = TuneTask(lm.name, scoring_gpu_work(*ests, fewer=f"fewer {TRIALS.name} or {LESS_TEXT}"), docs,
                             strategy, base, fixed, settings, test_docs, ests[0])

    def starting(self) -> dict:
        return (self.busy() | self.say(f"Starting. {self.clock.estimate_text()}")
                | to_components(self.outputs, offer(None)))

    def _trials_view(self) -> dict:
        """The trials so far: the table and the history chart."""
        return {"table": [table_row(r) for r in self.rows],
                "plot": history_figure(self.rows, f"{self.strategy}: ΔPPL % vs baseline per trial "
                                                  f"({len(self.rows)} of {self.trials})")}

    def progress(self, items: list, elapsed: float) -> dict:
        out = self.busy()
        if take_reports(self, items, elapsed):
            out |= to_components(self.outputs, self._trials_view())
        return out | self.say(f"Tuning… {len(self.rows)} of {self.trials} trials done; "
                              f"{self.clock.where_text(elapsed)} ({elapsed:.0f} s). {self.clock.estimate_text()}")

    def _best(self, best: dict, test: dict | None) -> tuple[str, dict | None]:
        """The status line's words on the best dev trial and its test score, and what the tab keeps to
        send: a trial that does not beat the baseline on dev, or is worse on test, is no
        recommendation (see `recommend`)."""
        return recommend(tune_best(best, test), lambda judged: kept_best(
            "Tune", self.strategy, best["strategy_params"], self.lm.num_layers, best["delta_pct"], judged))

    def finish(self, outcome: Outcome) -> dict:
        if not self.rows:
            return self.ended_early(outcome, "Stopped before the first trial.", "Left the line; nothing was measured.")
        res = self.result or {}
        best, test = res.get("best"), res.get("test")
        pruned = sum(r["state"] == "pruned" for r in self.rows)
        failed = sum(r["state"] == "failed" for r in self.rows)
        refused = f", {failed} refused by the strategy" if failed else ""
        head = {"done": f"Done: {len(self.rows)} trials ({pruned} pruned{refused})",
                "stopped": f"Stopped after {len(self.rows)} of {self.trials} trials"}.get(
            outcome.kind, f"Failed after {len(self.rows)} trials: {outcome.message}")
        kept = None  # only the best a status reports, and only a recommendation
        if outcome.kind != "done":
            best_text = "no best point is reported for an unfinished search"
        elif best is None:
            best_text = "no trial completed with the strategy switched on"
        else:
            best_text, kept = self._best(best, test)
        files = None
        if res:
            files = [export_file(f"tune-{self.strategy}-trials-{stamp()}.jsonl", jsonl_text(res["header"], self.rows)),
                     export_file(f"tune-{self.strategy}-best-{stamp()}.json",
                                 json.dumps({k: res.get(k) for k in ("header", "best", "test")}, indent=2))]
        kind = {"done": "info", "stopped": "stopped"}.get(outcome.kind, "error")
        return (self.idle() | self.say(f"{head}; {best_text}.", kind)
                | to_components(self.outputs, self._trials_view() | {"files": files} | offer(kept)))


class SweepTab:
    def __init__(self, pool: ModelPool, runner: ModelRunner, compare: CompareTab | None = None):
        """`compare`: the Compare tab a best point is sent to (without it, no send buttons)."""
        self.pool, self.runner, self.compare = pool, runner, compare

    def prepare(self, values: dict) -> SweepWork:
        """Live ΔPPL heatmap over a grid of one or two parameters (baseline computed once)."""
        lm = self.pool.get()
        strategy, params = chosen(values)
        axes = [(field, g) for field, g in (("grid x", values["grid_x"]), ("grid y", values["grid_y"]))
                if g and g.strip()]
        grid = parse_grid([g for _, g in axes], strategy, lm.num_layers, [f for f, _ in axes] or ["grid x"])
        points = math.prod(len(v) for v in grid.values())
        if points > SERVED_MAX_POINTS:
            raise FeedbackError(f"the grid has {points} points; the page runs at most {SERVED_MAX_POINTS} "
                                "(use `python -m feedback sweep` for larger grids)")
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
        """Search the ticked parameters for the lowest ΔPPL (the others keep the values above); on
        builtin:dev, the best point is then scored once on builtin:test."""
        lm = self.pool.get()
        (strategy, params), source = chosen(values), values["source"]
        trials, seed = TRIALS.check(values["trials"]), SEED.check(values["seed"])
        searched = [n for n in (values["search"] or []) if n in tunable(strategy)]
        if not searched:
            raise FeedbackError("tick at least one parameter to search")
        fixed = {k: v for k, v in params.items() if k not in searched}
        fixed = parse_fixed(fixed, strategy, lm.num_layers)
        search_space(strategy, lm.num_layers, fixed)
        base = scoring_config(values, strategy, fixed, **doc_limits(values))
        base.validate(lm.context_length)
        docs = load_named(values)
        test_docs = None
        if source == "builtin:dev":  # the best point is then confirmed once on as many test documents
            test_docs = corpus.load("builtin:test")[:MAX_DOCS.check(values["max_docs"])]
        ests = self._tune_estimates(lm, docs, test_docs, strategy, base, fixed, trials)
        return TuneWork(self, lm, docs, strategy, base, fixed, trials, seed, test_docs, source,
                        "builtin:test" if test_docs is not None else "", ests)

    def _tune_estimates(self, lm, docs, test_docs, strategy: str, base: PPLConfig, fixed: dict,
                        trials: int) -> tuple[Estimate, Estimate | None]:
        """What a search will score at most (every trial in full) and its test once, each refused
        over the budget naming the fields that would make it fit."""
        data = tune_data(lm, docs, test_docs, strategy, base, fixed)  # the documents the library will score
        counts = [len(ids) for _, ids in data.items]
        dev = estimate(counts, data.cfg, trials)
        check_budget(self.runner.budget, dev, counts, data.cfg)
        if test_docs is None:
            return dev, None
        test_counts = token_counts(lm, data.test_docs, data.cfg)
        test = estimate(test_counts, data.cfg)
        check_budget(self.runner.budget, test, test_counts, data.cfg)
        return dev, test

    def stop_tune(self, request: gr.Request = None) -> str:
        return self.runner.stop(TUNE, request)

    # ---- Send best to Compare ----
    def send_sweep_best(self, values: dict) -> dict:
        """The last Sweep's best point into a Compare column (see `send`)."""
        return self.send(values, self.status, "Not sent: there is no best point yet. Run the sweep (a stopped one "
                                              "has the best of the points it measured; points with strength 0, "
                                              "or that do not beat the baseline, are never sent).")

    def send_tune_best(self, values: dict) -> dict:
        """The last Tune's best trial into a Compare column (see `send`)."""
        return self.send(values, self.tune_status, "Not sent: there is no best trial yet. A finished tune has one "
                                                   "(a stopped one reports none; trials with strength 0, or that do "
                                                   "not beat the baseline on dev and on test, are never sent).")

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
        note = (f"Column {column + 1} ({name}) now has the {best['source']}'s best point: {best['strategy']}, "
                f"ΔPPL {best['delta_pct']:+.3f} % on the {best['source']}'s text{judged}. The other settings are as "
                "they were; press Generate to run it.")
        return self.compare.show_strategy(column, best["strategy"], best["params"], name) | {
            self.compare.ui.run.status: render.status_html(note), self.tabs: gr.update(selected=COMPARE_TAB)}

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
            for col in ui.cols for name in ("strategy", "name")}

    def send_outputs(self, status) -> list:
        """Everything `send` may update: each Compare column's name, strategy panel and heading, the
        Compare status line, the tabs and the sending tab's status line."""
        ui = self.compare.ui
        cols = [x for col in ui.cols for x in (col.settings["name"], *col.panel.outputs(), col.heading)]
        return [*cols, ui.run.status, self.tabs, status]

    def _wire_send(self, button: gr.Button, best: gr.State, status, send) -> None:
        inputs = {"best": best} | self.send_inputs()
        button.click(by_name(send, list(inputs)), inputs_kwargs=inputs, outputs=self.send_outputs(status),
                     api_name=False, queue=False, show_progress="hidden")

    def build(self, num_layers: int, tabs: gr.Tabs | None = None) -> None:
        """`tabs`: the page's tabs, which "Send best to Compare" switches to Compare."""
        self.tabs = tabs
        with gr.Tab("Sweep", id=TAB):
            gr.Markdown(f"ΔPPL % over a grid of one or two parameters, e.g. `lam=0,0.02,0.05` and "
                        f"`gate=-1,0.75,0.9` (at most {SERVED_MAX_POINTS} points here; the command line "
                        f"`python -m feedback sweep` takes more). Other parameters come from the controls below. "
                        "Tune on `builtin:dev`; confirm on `builtin:test`. The best point is judged against the "
                        "baseline (a real improvement when its 95% CI excludes 0; within noise; or no better); "
                        "**Send best to Compare** puts one that beats the baseline into a Compare column to "
                        "generate with it.")
            source, text, upload, max_docs = source_inputs("sweep", SWEEP_SOURCE, SWEEP_DOCS)
            with gr.Row():
                grid_x = gr.Textbox("lam=0,0.02,0.05,0.1", label="grid x (NAME=V1,V2,...)", elem_id="sweep-grid-x")
                grid_y = gr.Textbox("gate=-1,0.75,0.9", label="grid y (optional)", elem_id="sweep-grid-y")
            with gr.Row(equal_height=False):
                with gr.Column(min_width=280):
                    self.panel = build_strategy_panel(num_layers, "deep_cache", prefix="sweep", context="perplexity")
                with gr.Column(min_width=280):
                    mode, passes = mode_inputs("sweep")
                    # starts lower than the Perplexity tab's (the served cap): see SWEEP_TOKENS_PER_DOC
                    max_tokens = bound_number(
                        MAX_TOKENS_PER_DOC, SWEEP_TOKENS_PER_DOC, elem_id="sweep-max-tokens",
                        info=f"each document cut to its first N tokens ({MAX_TOKENS_PER_DOC.info})")
            self.run, self.stop, self.status = run_controls("sweep", "Run sweep")
            # on once there is a best point, kept in `best`
            self.send_button = gr.Button(SEND_LABEL, interactive=False, elem_id="sweep-send")
            self.best = gr.State(None)
            gr.HTML(delta_legend())
            self.heatmap = gr.Plot(show_label=False, elem_id="sweep-plot")
            self.csv = gr.File(label="sweep.csv (the points measured)", interactive=False, elem_id="sweep-csv")
            with gr.Accordion("Tune: search the parameters instead of a grid", open=False, elem_id="tune"):
                gr.Markdown(
                    f"Searches the ticked parameters (Optuna TPE; layers over every layer, the others over each "
                    f"parameter's search range) for the lowest ΔPPL on the text above, at most {SERVED_MAX_TRIALS} "
                    "trials here (`python -m feedback tune` takes more, logs every trial and resumes). Unticked "
                    "parameters keep the values above. A trial scores the first third of the documents first and "
                    "is pruned there when even the favourable end of its 95% CI is worse than the median finished "
                    "trial. On `builtin:dev`, the best point is then scored once on `builtin:test`; it is offered "
                    "to Compare only if it beats the baseline on dev and is no worse on test.")
                with gr.Row():
                    names = tunable("deep_cache")
                    search = gr.CheckboxGroup(names, value=names, label="search these", elem_id="tune-search")
                    trials = bound_number(TRIALS, 12, elem_id="tune-trials")
                    seed = bound_number(SEED, 0, info="the same seed and text give the same trials",
                                        elem_id="tune-seed")
                self.tune_run, self.tune_stop, self.tune_status = run_controls("tune", "Run tune")
                self.tune_send = gr.Button(SEND_LABEL, interactive=False, elem_id="tune-send")
                self.tune_best = gr.State(None)
                self.tune_table = gr.Dataframe(headers=TUNE_HEADERS, interactive=False, elem_id="tune-table")
                self.tune_plot = gr.Plot(show_label=False, elem_id="tune-plot")
                self.tune_files = gr.File(label="trials.jsonl and best.json", file_count="multiple",
                                          interactive=False, elem_id="tune-files")
            stop_ack = gr.Textbox(visible=False)
            cancel_trigger = gr.Button(visible=False)  # for program clients' Job.cancel()
        self.outputs = {"heatmap": self.heatmap, "csv": self.csv, "best": self.best, "send": self.send_button}
        self.tune_outputs = {"table": self.tune_table, "plot": self.tune_plot, "files": self.tune_files,
                             "best": self.tune_best, "send": self.tune_send}
        texts = {"source": source, "text": text, "upload": upload, "strategy": self.panel.strategy}
        strategy_controls = self.panel.named_inputs()
        # In the order positional API clients pass them.
        inputs = {**texts, "grid_x": grid_x, "grid_y": grid_y, "mode": mode, "passes": passes, "max_docs": max_docs,
                  "max_tokens_per_doc": max_tokens, **strategy_controls}
        handler = self.runner.wrap(TAB, self.prepare, list(inputs), status=self.status)
        running = self.run.click(handler, inputs_kwargs=inputs,
                                 outputs=[self.heatmap, self.status, self.csv, self.run, self.stop, self.best,
                                          self.send_button], api_name="sweep",
                                 concurrency_limit=None, show_progress="hidden")
        self.stop.click(self.stop_run, None, stop_ack, api_name="stop_sweep", concurrency_limit=None,
                        show_progress="hidden")
        gr.on([self.panel.strategy.change, self.panel.stack.change], by_name(searchable, ["strategy", "stack"]),
              inputs_kwargs={"strategy": self.panel.strategy, "stack": self.panel.stack}, outputs=search,
              api_name=False, queue=False, show_progress="hidden")
        tune_inputs = {**texts, "search": search, "mode": mode, "passes": passes, "max_docs": max_docs,
                       "max_tokens_per_doc": max_tokens, "trials": trials, "seed": seed, **strategy_controls}
        tune_handler = self.runner.wrap(TUNE, self.prepare_tune, list(tune_inputs), status=self.tune_status)
        tuning = self.tune_run.click(tune_handler, inputs_kwargs=tune_inputs,
                                     outputs=[self.tune_table, self.tune_plot, self.tune_status, self.tune_files,
                                              self.tune_run, self.tune_stop, self.tune_best, self.tune_send],
                                     api_name="tune", concurrency_limit=None, show_progress="hidden")
        self.tune_stop.click(self.stop_tune, None, stop_ack, api_name="stop_tune", concurrency_limit=None,
                             show_progress="hidden")
        cancellable_by_clients(cancel_trigger, running, tuning)
        if self.compare is not None and tabs is not None:
            self._wire_send(self.send_button, self.best, self.status, self.send_sweep_best)
            self._wire_send(self.tune_send, self.tune_best, self.tune_status, self.send_tune_best)

