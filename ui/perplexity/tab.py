"""Perplexity tab: does feedback lower perplexity on *my* text? Both perplexities, ΔPPL with a paired
95% CI, and per-token surprise. The work goes through `ModelRunner`; this module formats numbers.

The handler takes its controls' values by name (the strategy controls as `<strategy>_<param>`),
the names API clients may pass them by.

Like every corpus job (the Sweep's and the Tune's too), it says before it starts what it will score
and about how long that takes, then where it stands, and a request over the scoring budget is
refused naming the fields that would make it fit (`ui.page.scoring`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import gradio as gr

from feedback.eval.perplexity import Estimate, PPLConfig, Tally, estimate, evaluate, surprise_diff
from feedback.serve.gpu_time import GpuWork
from feedback.serve.pool import ModelPool
from ui.page import charts, render
from ui.page.controls import build_strategy_panel, chosen, run_controls, to_components
from ui.page.runner import Finished, GpuTask, ModelRunner, Outcome, TabWork, cancellable_by_clients, reporting
from ui.page.scoring import (
    LESS_TEXT,
    JobClock,
    check_budget,
    doc_limits,
    max_tokens_input,
    measure,
    scoring_gpu_work,
    token_counts,
)
from ui.page.stop_signal import StopSignal
from ui.page.text_inputs import (
    delta_legend,
    load_named,
    mode_inputs,
    scoring_config,
    source_inputs,
    surprise_html,
)
from ui.perplexity.recall import RecallSection

TAB = "perplexity"


def summary_markdown(res: dict) -> str:
    """Both perplexities, ΔPPL with its CI and a plain verdict, and how they were computed."""
    mode = res["mode"] + (f" (approximate, {res['passes']} passes)" if res.get("approximate") else "")
    lines = [f"**Baseline PPL** {res['baseline_ppl']:.3f}"]
    if "feedback_ppl" in res:
        lo, hi = res["ci95"]
        verdict = (
            "feedback **lowers** perplexity (the CI excludes 0)"
            if hi < 0
            else "feedback **raises** perplexity (the CI excludes 0)"
            if lo > 0
            else "no clear difference (the CI includes 0)"
        )
        lines += [
            f"**Feedback PPL** {res['feedback_ppl']:.3f}",
            f"**ΔPPL** {res['delta_pct']:+.3f} %, 95% CI [{lo:+.3f}, {hi:+.3f}] % — {verdict}",
        ]
    lines.append(
        f"{res['documents']} document(s), {res['tokens']} scored tokens · mode {mode} · "
        f"{res['wall_seconds']:.1f} s"
        + (f" · CI by resampling {res['ci_method']}" if "ci_method" in res else "")
    )
    return "  \n".join(lines)


def surprise_figure(detail: dict):
    """Per-token NLL difference (feedback − baseline) along the text."""
    diffs = [f - b for f, b in zip(detail["feedback_nll"], detail["baseline_nll"])]
    labels = [f"{i + 1}: {render.visible(t)}" for i, t in enumerate(detail["tokens"])]
    return charts.bar_figure(labels, diffs, "scored token (position: text)", "NLL feedback − baseline (nats)")


@dataclass
class PerplexityTask(GpuTask):
    """A Perplexity measurement on the GPU: the rate, progress, then `Finished` with the result."""

    model: str
    gpu: GpuWork
    docs: list
    cfg: PPLConfig
    pasted: bool
    est: Estimate

    def run(self, lm, stop: StopSignal):
        def score(report, halt):
            report(measure(self.est, lm, halt))
            return evaluate(lm, self.docs, self.cfg, token_detail=self.pasted, stop=halt, tally=Tally(report))

        yield from reporting(score, stop)


class PerplexityWork(TabWork):
    label = "a Perplexity measurement"

    def __init__(self, tab: PerplexityTab, lm, docs, cfg: PPLConfig, pasted: bool, est: Estimate):
        super().__init__(tab.run, tab.stop, tab.status)
        self.outputs, self.lm, self.docs, self.cfg, self.pasted = tab.outputs, lm, docs, cfg, pasted
        self.clock = JobClock(lm, ("", "", est))
        self.result = None
        self.task = PerplexityTask(lm.name, scoring_gpu_work(est, fewer=LESS_TEXT), docs, cfg, pasted, est)

    def starting(self) -> dict:
        return self.busy() | self.say(f"Starting. {self.clock.estimate_text()}")

    def progress(self, items: list, elapsed: float) -> dict:
        for item in items:
            if not self.clock.take(item, elapsed) and isinstance(item, Finished):
                self.result = item.result
        return self.busy() | self.say(
            f"Scoring… {self.clock.where_text(elapsed)} ({elapsed:.0f} s). {self.clock.estimate_text()}"
        )

    def finish(self, outcome: Outcome) -> dict:
        res = self.result
        if res is None:
            return self.ended_early(
                outcome,
                "Stopped; nothing was measured (a result needs every document).",
                "Left the line; nothing was measured.",
            )
        return (
            self.idle()
            | self.say(f"Done in {res['wall_seconds']:.1f} s.")
            | to_components(self.outputs, result_view(res, self.pasted))
        )


def result_view(res: dict, pasted: bool) -> dict:
    """What the tab shows of a result, by output name: the summary, the pasted text coloured by
    surprise, the chart (per token for pasted text, else per document), the table and the JSON."""
    detail = surprise_diff(res) if pasted and "feedback_nll" in res["per_doc"][0] else None
    table = [
        [
            d["name"],
            d["tokens"],
            round(d["baseline_ppl"], 3),
            round(d.get("feedback_ppl", math.nan), 3),
            round(d.get("delta_pct", math.nan), 3),
        ]
        for d in res["per_doc"]
    ]
    fig = (
        surprise_figure(detail)
        if detail
        else charts.bar_figure(
            [d["name"] for d in res["per_doc"]],
            [d.get("delta_pct", 0.0) for d in res["per_doc"]],
            "document",
            "ΔPPL % per document",
        )
    )
    return {
        "summary": summary_markdown(res),
        "coloured": surprise_html(detail) if detail else "",
        "plot": fig,
        "table": table,
        "result": res,
    }


class PerplexityTab:
    def __init__(self, pool: ModelPool, runner: ModelRunner):
        self.pool, self.runner = pool, runner

    def prepare(self, values: dict) -> PerplexityWork:
        """Both perplexities of the chosen text, ΔPPL with a paired 95% CI, per-token detail."""
        lm = self.pool.get()
        cfg = scoring_config(values, *chosen(values), **doc_limits(values))
        cfg.validate(lm.context_length, lm.num_layers)
        docs = load_named(values)
        counts = token_counts(lm, docs, cfg)
        est = estimate(counts, cfg)
        check_budget(self.runner.budget, est, counts, cfg)
        return PerplexityWork(self, lm, docs, cfg, values["source"] == "pasted text", est)

    def stop_run(self, request: gr.Request = None) -> str:
        return self.runner.stop(TAB, request)

    def build(self, num_layers: int) -> None:
        with gr.Tab("Perplexity", id=TAB):
            gr.Markdown(
                "Teacher-forced perplexity of the same tokens with and without feedback. `exact` decodes "
                "token by token; `parallel` is exact for non-recurrent strategies; `jacobi` approximates "
                "recurrent ones with several passes. The 95% CI is a paired bootstrap."
            )
            source, text, upload, max_docs = source_inputs("ppl")
            with gr.Row(equal_height=False):
                with gr.Column(min_width=280):
                    self.panel = build_strategy_panel(
                        num_layers, "deep_cache", prefix="ppl", context="perplexity"
                    )
                with gr.Column(min_width=280):
                    mode, passes = mode_inputs("ppl")
                    max_tokens = max_tokens_input("ppl")
            self.run, self.stop, self.status = run_controls("ppl", "Measure perplexity")
            self.summary = gr.Markdown(elem_id="ppl-summary")
            self.coloured = gr.HTML(elem_id="ppl-coloured")
            gr.HTML(delta_legend())
            self.plot = gr.Plot(show_label=False, elem_id="ppl-plot")
            self.table = gr.Dataframe(
                headers=["document", "tokens", "baseline PPL", "feedback PPL", "ΔPPL %"],
                interactive=False,
                elem_id="ppl-table",
            )
            with gr.Accordion("Result (JSON)", open=False):
                self.result = gr.JSON()
            self.recall = RecallSection(self.pool, self.runner)  # long-context key-fact recall, its own job
            self.recall.build(num_layers)
            stop_ack = gr.Textbox(visible=False)
            cancel_trigger = gr.Button(visible=False)  # for program clients' Job.cancel()
        # What the work shows, by name, in the order API clients get it.
        self.outputs = {
            "summary": self.summary,
            "coloured": self.coloured,
            "plot": self.plot,
            "table": self.table,
            "result": self.result,
        }
        # In the order positional API clients pass them.
        inputs = {
            "source": source,
            "text": text,
            "upload": upload,
            "strategy": self.panel.strategy,
            "mode": mode,
            "passes": passes,
            "max_docs": max_docs,
            "max_tokens_per_doc": max_tokens,
            **self.panel.named_inputs(),
        }
        handler = self.runner.wrap(TAB, self.prepare, list(inputs), status=self.status)
        running = self.run.click(
            handler,
            inputs_kwargs=inputs,
            outputs=[*self.outputs.values(), self.status, self.run, self.stop],
            api_name="perplexity",
            concurrency_limit=None,
            show_progress="hidden",
        )
        self.stop.click(
            self.stop_run,
            None,
            stop_ack,
            api_name="stop_perplexity",
            concurrency_limit=None,
            show_progress="hidden",
        )
        cancellable_by_clients(cancel_trigger, running)
