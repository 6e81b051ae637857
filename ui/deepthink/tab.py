"""Deep Think tab: DeepConf's multi-trace vote on both sides (baseline and feedback). The work goes
through `ModelRunner`; this module formats the report.

The handler takes its controls' values by name (the strategy controls as `<strategy>_<param>`), the
names API clients may pass them by; every number is checked against the `Bound` its box shows."""

from __future__ import annotations

import dataclasses
from html import escape

import gradio as gr

from feedback.core.records import DEEPCONF_WINDOW, SEED
from feedback.core.sampling import MIN_TEMPERATURE, TEMPERATURE, TOP_P, SamplingConfig
from feedback.errors import FeedbackError
from feedback.eval.deepthink import SIDES, VOTE_KINDS, DeepThinkConfig, check_budget, deep_think, memory_need
from feedback.eval.voting import ETA
from feedback.serve.gpu_time import GpuWork
from feedback.serve.limits import TRACE_MAX_NEW_TOKENS, TRACES, WARMUP_TRACES
from feedback.serve.pool import ModelPool
from ui.deepthink.calibration import CalibrationPanel
from ui.page import charts, render
from ui.page.controls import (
    bound_number,
    build_strategy_panel,
    chosen,
    lazy_json,
    run_controls,
    to_components,
)
from ui.page.deepconf import ETA_CHOICES, resolve_eta, traces_gpu_work
from ui.page.runner import GpuTask, ModelRunner, Outcome, TabWork, cancellable_by_clients, reporting
from ui.page.stop_signal import StopSignal

TAB = "deepthink"
# Deep Think samples its traces: at temperature 0 every trace of a side would be the same one.
SAMPLED_TEMPERATURE = dataclasses.replace(TEMPERATURE, lo=MIN_TEMPERATURE)


def mark(correct: bool | None) -> str:
    return "" if correct is None else (" ✓ correct" if correct else " ✗ wrong")


def side_markdown(side: str, rep: dict, traces: int) -> str:
    """One side's answer, its other votes with what each means, and the cost."""
    votes = rep["votes"]

    def answer(name: str) -> str:
        v = votes[name]
        return (
            f"<code>{render.md_text(v['answer'])}</code>{mark(v.get('correct'))}"  # the model's text, literal
        )

    saved = "measured" if rep["tokens_saved_method"].startswith("measured") else "at most"
    return (
        f"### {side}\n**DeepConf answer {answer('lowest_group')}** — {rep['share']:.0%} of the "
        f"confidence-weighted vote  \n"
        f"majority vote {answer('majority')} · tail-weighted vote {answer('tail')}  \n"
        f"threshold {rep['threshold']:.2f} · {rep['stopped']} of {traces} online traces stopped early · "
        f"tokens spent {rep['tokens_spent']}, saved {saved} {rep['tokens_saved']}"
    )


def votes_help() -> str:
    return (
        "<div class='fl-note'><b>Three votes, three questions.</b> "
        + " · ".join(
            f"<b>{name}</b>: {escape(text)}"
            for name, text in [
                ("DeepConf answer", VOTE_KINDS["lowest_group"]),
                ("majority", VOTE_KINDS["majority"]),
                ("tail-weighted", VOTE_KINDS["tail"]),
            ]
        )
        + ". They differ when confident and unconfident traces disagree.</div>"
    )


def trace_rows(report: dict) -> list[list]:
    rows = []
    for side in SIDES:
        for t in report["sides"][side]["traces"]:
            state = "stopped" if t["stopped"] else "filtered" if t["excluded"] else "voted"
            low = t["lowest_group"]
            correct = {True: "✓", False: "✗"}.get(t.get("correct"), "—")
            rows.append(
                [
                    side,
                    t["phase"],
                    t["name"],
                    state,
                    t["tokens"],
                    None if low is None else round(low, 2),
                    t["answer"],
                    correct,
                    t["text"],
                ]
            )
    return rows


@dataclasses.dataclass
class DeepThinkTask(GpuTask):
    """Deep Think on the GPU: progress lines, then `Finished` with the report."""

    model: str
    gpu: GpuWork
    cfg: DeepThinkConfig
    shared: bool = False  # its traces decode beside other requests' runs (set by the runner)
    shares_decode = True

    def run(self, lm, stop: StopSignal):
        yield from reporting(
            lambda report, halt: deep_think(lm, self.cfg, progress=report, stop=halt, shared=self.shared),
            stop,
        )


def deep_think_gpu_work(lm, cfg: DeepThinkConfig) -> GpuWork:
    """Its batched runs: the warm-up traces, the online ones and, in check mode, the stopped ones
    finished (at most every online trace), both sides in each."""
    return traces_gpu_work(
        lm, cfg, [2 * cfg.warmup, 2 * cfg.traces] + ([2 * cfg.traces] if cfg.check else [])
    )


class DeepThinkWork(TabWork):
    label = "a Deep Think run"

    def __init__(self, tab: DeepThinkTab, lm, cfg: DeepThinkConfig):
        super().__init__(tab.run, tab.stop, tab.status)
        self.outputs, self.lm, self.cfg = tab.outputs, lm, cfg
        self.report = None
        self.task = DeepThinkTask(lm.name, deep_think_gpu_work(lm, cfg), cfg)
        self.need_mb = memory_need(lm, cfg)[0]

    def progress(self, items: list, elapsed: float) -> dict:
        out = self.busy()
        for item in items:
            if isinstance(item, str):
                out |= self.say(f"Running… {item} ({elapsed:.0f} s)")
            else:
                self.report = item.result
        return out

    def finish(self, outcome: Outcome) -> dict:
        rep = self.report
        if rep is None:
            return self.ended_early(outcome, "Stopped; no vote was taken.")
        notes = "".join(f" Note: {w}" for w in rep["warnings"])
        return (
            self.idle()
            | self.say(f"Done in {rep['wall_seconds']:.1f} s.{notes}")
            | to_components(self.outputs, report_view(rep, self.cfg.traces))
        )


def report_view(rep: dict, traces: int) -> dict:
    """What the tab shows of a report, by output name: both sides' answers, the votes, each side's
    confidence curves, every trace, the JSON and the warm-up histogram."""
    sides = rep["sides"]
    summary = (
        side_markdown("Baseline", sides["baseline"], traces)
        + "\n\n"
        + side_markdown("Feedback", sides["feedback"], traces)
    )
    return {
        "summary": summary,
        "votes": charts.vote_figure(sides, rep["config"].get("expected")),
        "baseline_curves": charts.trace_figure("baseline", sides["baseline"], 0),
        "feedback_curves": charts.trace_figure("feedback", sides["feedback"], 1),
        "table": trace_rows(rep),
        "report": rep,
        "report_kept": rep,
        "report_box": gr.update(open=False),
        "warmup_histogram": charts.histogram_figure(
            {side: sides[side]["warmup_lowest_groups"] for side in SIDES}, rep["thresholds"]
        ),
    }


class DeepThinkTab:
    def __init__(self, pool: ModelPool, runner: ModelRunner):
        self.pool, self.runner = pool, runner

    def prepare(self, values: dict) -> DeepThinkWork:
        """N sampled traces per side with calibrated early stop, then the votes."""
        prompt, (strategy, params) = values["prompt"], chosen(values)
        if not prompt or not prompt.strip():
            raise FeedbackError("the question is empty")
        cfg = DeepThinkConfig(
            prompt=prompt,
            expected=(values["expected"] or "").strip() or None,
            traces=TRACES.check(values["traces"]),
            warmup=WARMUP_TRACES.check(values["warmup"]),
            eta=resolve_eta(values["eta_preset"], values["eta"]),
            window=DEEPCONF_WINDOW.check(values["window"]),
            max_new_tokens=TRACE_MAX_NEW_TOKENS.check(values["max_new"]),
            temperature=SAMPLED_TEMPERATURE.check(values["temperature"]),
            top_p=TOP_P.check(values["top_p"]),
            seed=SEED.check(values["seed"]),
            strategy=strategy,
            params=params,
            answer_regex=values["regex"] or None,
            shared_threshold=bool(values["shared"]),
            check=bool(values["check"]),
        )
        SamplingConfig(
            temperature=cfg.temperature, top_p=cfg.top_p
        ).validate()  # e.g. top_p 0 would keep nothing
        lm = self.pool.get()
        cfg.validate(lm.num_layers)
        check_budget(lm, cfg, self.runner.budget)
        return DeepThinkWork(self, lm, cfg)

    def stop_run(self, request: gr.Request = None) -> str:
        return self.runner.stop(TAB, request)

    def build(self, num_layers: int) -> None:
        with gr.Tab("Deep Think", id=TAB):
            gr.Markdown(
                "DeepConf on both sides: warm-up traces calibrate an early-stop threshold, more traces run "
                "with online early stop, and the survivors vote. Stopped traces never vote; their tokens "
                "still count as cost."
            )
            with gr.Row():
                prompt = gr.Textbox(
                    label="Question",
                    lines=2,
                    elem_id="dt-prompt",
                    scale=3,
                    value="What is 6 multiplied by 7? Answer with a number.",
                )
                expected = gr.Textbox(
                    "42",
                    label="expected answer (optional)",
                    elem_id="dt-expected",
                    scale=1,
                    info="marks each trace and vote correct or wrong",
                )
            with gr.Row(equal_height=False):
                with gr.Column(min_width=280):
                    self.panel = build_strategy_panel(num_layers, "residual", prefix="dt")
                with gr.Column(min_width=280):
                    with gr.Row():
                        traces = bound_number(TRACES, 8, elem_id="dt-traces")
                        warmup = bound_number(
                            WARMUP_TRACES, 4, label="warm-up traces per side", elem_id="dt-warmup"
                        )
                    eta_preset = gr.Radio(ETA_CHOICES, value=ETA_CHOICES[1], label="η (share of traces kept)")
                    with gr.Row():
                        eta = bound_number(ETA, 50, label="custom η %", elem_id="dt-eta")
                        window = bound_number(DEEPCONF_WINDOW, 16, elem_id="dt-window")
                    with gr.Row():
                        max_new = bound_number(TRACE_MAX_NEW_TOKENS, 96, elem_id="dt-max-new")
                        temperature = bound_number(
                            SAMPLED_TEMPERATURE, 0.7, step=0.05, elem_id="dt-temperature"
                        )
                        top_p = bound_number(TOP_P, 0.95, label="top-p", step=0.05, elem_id="dt-top-p")
                        seed = bound_number(
                            SEED, 0, info="the same seed gives the same traces", elem_id="dt-seed"
                        )
                    regex = gr.Textbox(
                        label="answer regex (optional; its first group is the answer)",
                        placeholder=r"Answer: (\d+)",
                        info="otherwise: \\boxed{…}, “the answer is …”, the last equation result, …",
                    )
                    with gr.Row():
                        shared = gr.Checkbox(False, label="one threshold for both sides")
                        check = gr.Checkbox(
                            False, label="check mode (finish stopped traces to measure tokens saved)"
                        )
            self.run, self.stop, self.status = run_controls("dt", "Run Deep Think")
            self.summary = gr.Markdown(elem_id="dt-summary")
            gr.HTML(votes_help())
            self.votes = gr.Plot(show_label=False, elem_id="dt-votes")
            self.warm_hist = gr.Plot(show_label=False, elem_id="dt-warmup-hist")
            with gr.Row():
                self.curves = [
                    gr.Plot(show_label=False, elem_id="dt-curves-baseline"),
                    gr.Plot(show_label=False, elem_id="dt-curves-feedback"),
                ]
            self.table = gr.Dataframe(
                headers=[
                    "side",
                    "phase",
                    "trace",
                    "state",
                    "tokens",
                    "lowest group",
                    "answer",
                    "correct",
                    "text",
                ],
                interactive=False,
                wrap=True,
                elem_id="dt-table",
                column_widths=["7%", "7%", "9%", "7%", "6%", "7%", "8%", "6%", "43%"],
            )
            self.calibration = CalibrationPanel()
            self.calibration.build()
            self.report = lazy_json("Report (JSON)", "dt-report")
            stop_ack = gr.Textbox(visible=False)
            cancel_trigger = gr.Button(visible=False)  # for program clients' Job.cancel()
        # What the work shows, by name, in the order API clients get it.
        self.outputs = {
            "summary": self.summary,
            "votes": self.votes,
            "baseline_curves": self.curves[0],
            "feedback_curves": self.curves[1],
            "table": self.table,
            "report": self.report.data,
            "warmup_histogram": self.warm_hist,
            "report_kept": self.report.kept,
            "report_box": self.report.box,
        }
        # In the order positional API clients pass them.
        inputs = {
            "prompt": prompt,
            "expected": expected,
            "strategy": self.panel.strategy,
            "traces": traces,
            "warmup": warmup,
            "eta_preset": eta_preset,
            "eta": eta,
            "window": window,
            "max_new": max_new,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "regex": regex,
            "shared": shared,
            "check": check,
            **self.panel.named_inputs(),
        }
        handler = self.runner.wrap(TAB, self.prepare, list(inputs), status=self.status)
        running = self.run.click(
            handler,
            inputs_kwargs=inputs,
            outputs=[*self.outputs.values(), self.status, self.run, self.stop],
            api_name="deepthink",
            concurrency_limit=None,
            show_progress="hidden",
        )
        self.calibration.connect(running, self.report.kept)  # from the run's own traces: no model work
        self.stop.click(
            self.stop_run,
            None,
            stop_ack,
            api_name="stop_deepthink",
            concurrency_limit=None,
            show_progress="hidden",
        )
        cancellable_by_clients(cancel_trigger, running)
