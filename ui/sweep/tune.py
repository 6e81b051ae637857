"""Tune, the Sweep tab's companion: a search of the strategy's parameters (`feedback.eval.tune`) with a
small trial budget, each trial streamed into a table and the history chart; on builtin:dev its best
trial is then scored once on builtin:test, and kept for "Send best to Compare" only when it beats
the baseline on dev and is not worse on test (`ui.sweep.best`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import gradio as gr

from feedback.core.records import SEED
from feedback.errors import FeedbackError
from feedback.eval import corpus
from feedback.eval.figures import format_params, history_figure, table_row
from feedback.eval.perplexity import Estimate, PPLConfig, estimate
from feedback.eval.tune import TuneSettings, jsonl_text, parse_fixed, run_tune, search_space
from feedback.eval.tune import prepare as tune_data
from feedback.eval.verdict import ci_text, not_recommended, verdict
from feedback.serve.gpu_time import GpuWork
from feedback.serve.limits import MAX_DOCS, SERVED_MAX_TRIALS, TRIALS
from feedback.strategies import get_strategy
from ui.page.controls import bound_number, chosen, chosen_name, run_controls, to_components
from ui.page.exports import export_file, stamp
from ui.page.runner import GpuTask, Outcome, TabWork, reporting
from ui.page.scoring import (
    LESS_TEXT,
    JobClock,
    check_budget,
    doc_limits,
    measure,
    scoring_gpu_work,
    token_counts,
)
from ui.page.stop_signal import StopSignal
from ui.page.text_inputs import load_named, scoring_config
from ui.sweep.best import SEND_LABEL, Judged, kept_best, offer, recommend, take_reports

TUNE = "tune"  # the companion's own jobs, so each Stop ends its own run
TUNE_HEADERS = ["trial", "params", "ΔPPL % dev", "state"]
TUNE_STARTUP = 4  # random trials before TPE models the results (a page run is short)


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


def tune_best(best: dict, test: dict | None) -> Judged:
    """A Tune's best dev trial and its score on test (None: not scored) in words, each with its
    verdict, and why it is no recommendation (None when it is one: it beats the baseline on dev
    and is not worse on test)."""
    dev_ci = best["ci95"] or [None, None]
    dev = verdict(best["delta_pct"], dev_ci)
    label = "best on dev" if dev.beats_baseline else "the lowest dev ΔPPL"
    text = (
        f"{label}: trial {best['trial']} ({format_params(best['params'])}), ΔPPL {best['delta_pct']:+.3f} % "
        f"{ci_text(*dev_ci)} ({dev.text})"
    )
    on_test = None
    if test is not None:
        on_test = verdict(test["delta_pct"], test["ci95"])
        text += (
            f"; on {test['data']} (scored once): ΔPPL {test['delta_pct']:+.3f} %, 95% CI "
            f"{ci_text(*test['ci95'])} % ({on_test.text})"
        )
    return Judged(text, not_recommended(dev, on_test, noun="trial"), dev.text)


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
            return run_tune(
                lm,
                self.docs,
                self.strategy,
                self.base,
                self.fixed,
                self.settings,
                test_docs=self.test_docs,
                on_trial=report,
                stop=halt,
                progress=report,
            )

        yield from reporting(tune, stop)


class TuneWork(TabWork):
    label = "a Tune"

    def __init__(
        self,
        tab,
        lm,
        docs,
        strategy: str,
        base: PPLConfig,
        fixed: dict,
        trials: int,
        seed: int,
        test_docs,
        data: str,
        test: str,
        ests: tuple[Estimate, Estimate | None],
    ):
        super().__init__(tab.tune_run, tab.tune_stop, tab.tune_status)
        self.outputs, self.lm, self.docs, self.strategy, self.base, self.fixed = (
            tab.tune_outputs,
            lm,
            docs,
            strategy,
            base,
            fixed,
        )
        self.trials, self.seed, self.test_docs, self.data, self.test = trials, seed, test_docs, data, test
        self.rows: list[dict] = []
        self.result: dict | None = None
        # at most: a pruned trial scores only the first third of the documents
        self.clock = JobClock(
            lm, ("search, every trial in full: ", "trials", ests[0]), (f"{test} once: ", "", ests[1])
        )
        settings = TuneSettings(
            trials=trials,
            seed=seed,
            startup_trials=TUNE_STARTUP,
            max_trials=SERVED_MAX_TRIALS,
            data=data,
            test=test,
        )
        self.task = TuneTask(
            lm.name,
            scoring_gpu_work(*ests, fewer=f"fewer {TRIALS.name} or {LESS_TEXT}"),
            docs,
            strategy,
            base,
            fixed,
            settings,
            test_docs,
            ests[0],
        )

    def starting(self) -> dict:
        return (
            self.busy()
            | self.say(f"Starting. {self.clock.estimate_text()}")
            | to_components(self.outputs, offer(None))
        )

    def _trials_view(self) -> dict:
        """The trials so far: the table and the history chart."""
        return {
            "table": [table_row(r) for r in self.rows],
            "plot": history_figure(
                self.rows,
                f"{self.strategy}: ΔPPL % vs baseline per trial ({len(self.rows)} of {self.trials})",
            ),
        }

    def progress(self, items: list, elapsed: float) -> dict:
        out = self.busy()
        if take_reports(self, items, elapsed):
            out |= to_components(self.outputs, self._trials_view())
        return out | self.say(
            f"Tuning… {len(self.rows)} of {self.trials} trials done; "
            f"{self.clock.where_text(elapsed)} ({elapsed:.0f} s). {self.clock.estimate_text()}"
        )

    def _best(self, best: dict, test: dict | None) -> tuple[str, dict | None]:
        """The status line's words on the best dev trial and its test score, and what the tab keeps to
        send: a trial that does not beat the baseline on dev, or is worse on test, is no
        recommendation (see `recommend`)."""
        return recommend(
            tune_best(best, test),
            lambda judged: kept_best(
                "Tune", self.strategy, best["strategy_params"], self.lm.num_layers, best["delta_pct"], judged
            ),
        )

    def finish(self, outcome: Outcome) -> dict:
        if not self.rows:
            return self.ended_early(
                outcome, "Stopped before the first trial.", "Left the line; nothing was measured."
            )
        res = self.result or {}
        best, test = res.get("best"), res.get("test")
        pruned = sum(r["state"] == "pruned" for r in self.rows)
        failed = sum(r["state"] == "failed" for r in self.rows)
        refused = f", {failed} refused by the strategy" if failed else ""
        head = {
            "done": f"Done: {len(self.rows)} trials ({pruned} pruned{refused})",
            "stopped": f"Stopped after {len(self.rows)} of {self.trials} trials",
        }.get(outcome.kind, f"Failed after {len(self.rows)} trials: {outcome.message}")
        kept = None  # only the best a status reports, and only a recommendation
        if outcome.kind != "done":
            best_text = "no best point is reported for an unfinished search"
        elif best is None:
            best_text = "no trial completed with the strategy switched on"
        else:
            best_text, kept = self._best(best, test)
        files = None
        if res:
            files = [
                export_file(
                    f"tune-{self.strategy}-trials-{stamp()}.jsonl", jsonl_text(res["header"], self.rows)
                ),
                export_file(
                    f"tune-{self.strategy}-best-{stamp()}.json",
                    json.dumps({k: res.get(k) for k in ("header", "best", "test")}, indent=2),
                ),
            ]
        kind = {"done": "info", "stopped": "stopped"}.get(outcome.kind, "error")
        return (
            self.idle()
            | self.say(f"{head}; {best_text}.", kind)
            | to_components(self.outputs, self._trials_view() | {"files": files} | offer(kept))
        )


def prepare(tab, values: dict) -> TuneWork:
    """`tab`'s Tune (with its pool and runner): search the ticked parameters for the lowest ΔPPL (the
    others keep the values above); on builtin:dev, the best point is then scored once on builtin:test."""
    lm = tab.pool.get()
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
        test_docs = corpus.load("builtin:test")[: MAX_DOCS.check(values["max_docs"])]
    ests = estimates(tab.runner.budget, lm, docs, test_docs, strategy, base, fixed, trials)
    return TuneWork(
        tab,
        lm,
        docs,
        strategy,
        base,
        fixed,
        trials,
        seed,
        test_docs,
        source,
        "builtin:test" if test_docs is not None else "",
        ests,
    )


def estimates(
    budget, lm, docs, test_docs, strategy: str, base: PPLConfig, fixed: dict, trials: int
) -> tuple[Estimate, Estimate | None]:
    """What a search will score at most (every trial in full) and its test once, each refused
    over the budget naming the fields that would make it fit."""
    data = tune_data(lm, docs, test_docs, strategy, base, fixed)  # the documents the library will score
    counts = [len(ids) for _, ids in data.items]
    dev = estimate(counts, data.cfg, trials)
    check_budget(budget, dev, counts, data.cfg)
    if test_docs is None:
        return dev, None
    test_counts = token_counts(lm, data.test_docs, data.cfg)
    test = estimate(test_counts, data.cfg)
    check_budget(budget, test, test_counts, data.cfg)
    return dev, test


def build_controls(tab) -> tuple:
    """The Tune's accordion, inside the Sweep tab: its components become `tab`'s (`tune_run`,
    `tune_status`, `tune_best`, ...); returns its own inputs (search, trials, seed)."""
    with gr.Accordion("Tune: search the parameters instead of a grid", open=False, elem_id="tune"):
        gr.Markdown(
            f"Searches the ticked parameters (Optuna TPE; layers over every layer, the others over each "
            f"parameter's search range) for the lowest ΔPPL on the text above, at most {SERVED_MAX_TRIALS} "
            "trials here (`python -m feedback tune` takes more, logs every trial and resumes). Unticked "
            "parameters keep the values above. A trial scores the first third of the documents first and "
            "is pruned there when even the favourable end of its 95% CI is worse than the median finished "
            "trial. On `builtin:dev`, the best point is then scored once on `builtin:test`; it is offered "
            "to Compare only if it beats the baseline on dev and is no worse on test."
        )
        with gr.Row():
            names = tunable("deep_cache")
            search = gr.CheckboxGroup(names, value=names, label="search these", elem_id="tune-search")
            trials = bound_number(TRIALS, 12, elem_id="tune-trials")
            seed = bound_number(
                SEED, 0, info="the same seed and text give the same trials", elem_id="tune-seed"
            )
        tab.tune_run, tab.tune_stop, tab.tune_status = run_controls("tune", "Run tune")
        tab.tune_send = gr.Button(SEND_LABEL, interactive=False, elem_id="tune-send")
        tab.tune_best = gr.State(None)
        tab.tune_table = gr.Dataframe(headers=TUNE_HEADERS, interactive=False, elem_id="tune-table")
        tab.tune_plot = gr.Plot(show_label=False, elem_id="tune-plot")
        tab.tune_files = gr.File(
            label="trials.jsonl and best.json", file_count="multiple", interactive=False, elem_id="tune-files"
        )
    return search, trials, seed
