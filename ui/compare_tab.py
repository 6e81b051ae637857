"""Compare tab: one prompt, baseline and feedback columns streamed side by side from one engine run,
with live confidence and memory charts; Calibrate sets the early-stop threshold from warm-up traces.

Columns are built in a loop from `COLUMNS`; handlers return dicts keyed by component. The model work
goes through `ModelRunner` (line, GPU function, Stop, closed tabs, errors); this module only turns
engine records into HTML and figures.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from feedback import memory
from feedback.deepthink import SERVED_MAX_TRACES, DeepThinkConfig, check_budget, warm_up
from feedback.engine import Engine, Run, StepEvent
from feedback.errors import FeedbackError
from feedback.model import ModelPool
from feedback.records import (SERVED_MAX_NEW_TOKENS, DeepConfConfig, RowResult, RowSpec, RunConfig, RunResult,
                              first_divergence)
from feedback.sampling import SamplingConfig
from ui import charts, history, render
from ui.controls import StrategyPanel, build_strategy_panel, parse_number
from ui.deepconf import ETA_CHOICES, resolve_eta
from ui.runner import ModelRunner, Outcome, TabWork, cancellable_by_clients, reporting

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CHART_INTERVAL_S = 0.25  # charts at most ~4 times a second; text goes out with every update
MEMORY_POINTS = 240
IDLE_POLL_S = 5.0  # memory chart while idle (and the page visible); inside a run it is sampled per step
DEFAULT_THRESHOLD = 4.5  # lowest group confidence (w = 32) of normal answers on the embedded model: 4.7–7.1
CALIBRATION_SAMPLING = (0.7, 0.95)  # temperature, top-p for warm-up traces when Compare is greedy
TAB = "compare"


@dataclass(frozen=True)
class ColumnSpec:
    """One output column: its row name in the run, its title, and whether it carries the strategy."""

    row: str
    title: str
    feedback: bool


COLUMNS = (ColumnSpec("baseline", "Baseline", False), ColumnSpec("feedback", "Feedback", True))


@dataclass
class Column:
    spec: ColumnSpec
    heading: gr.Markdown
    text: gr.HTML
    stats: gr.HTML


def load_examples() -> list[str]:
    data = json.loads((ASSETS / "examples.json").read_text(encoding="utf-8"))
    return [e["prompt"] for e in data]


def memory_entry(mem: dict, sample: memory.MemorySample) -> dict:
    """A sample on the chart's time axis (seconds since `mem["origin"]`, a wall-clock time)."""
    return sample.to_dict() | {"t": round(time.time() - mem["origin"], 3)}


class CompareWork(TabWork):
    """One Compare run: the engine streams step events; the page gets columns, stats and charts."""

    label = "a Compare run"

    def __init__(self, tab: "CompareTab", run: Run, view: str):
        super().__init__(tab.generate, tab.stop, tab.status)
        self.tab, self.engine_run, self.view = tab, run, view
        cfg = run.config
        self.rows = [RowResult(r.name, r.strategy, dict(r.params)) for r in run.result.rows]
        self.caches = [render.SpanCache() for _ in self.rows]
        self.mem = {"origin": time.time(), "samples": [], "label": "the run began"}
        self.result: RunResult | None = None
        self.last_chart = 0.0
        self.ui_seconds = 0.0
        self.threshold, self.window = cfg.deepconf.threshold, cfg.deepconf.window
        self.started = False
        self.gpu_seconds = 30 + cfg.max_new_tokens  # generous: ~0.1 s a step on a CPU, far less on a GPU

    def run(self, stop: threading.Event):
        self.engine_run.stop_event = stop  # the job's stop: Stop, cancel, or a page that went away
        for event in self.engine_run:
            yield event
        yield self.engine_run.result

    def _apply(self, event: StepEvent) -> None:
        for i, rec in event.records.items():
            self.rows[i].steps.append(rec)
            self.rows[i].token_ids.append(rec.token_id)
        for i, why in event.finished.items():
            self.rows[i].stop_reason, self.rows[i].stop_step = why, event.step
        if event.memory is not None:
            entry = event.memory.to_dict()  # t: seconds since the run began
            self.mem["samples"] = [*self.mem["samples"], entry][-MEMORY_POINTS:]

    def progress(self, items: list, elapsed: float) -> dict:
        t = time.perf_counter()
        out: dict = {}
        if not self.started:  # the run began `elapsed` seconds ago: the memory chart's time origin
            self.started = True
            self.mem["origin"] = time.time() - elapsed
            out = self.busy() | self.tab.headings(self.rows)
        for item in items:
            if isinstance(item, StepEvent):
                self._apply(item)
            elif isinstance(item, RunResult):
                self.result = item
        rows = self.result.rows if self.result is not None else self.rows
        if self.result is None:
            out |= self.tab.columns(rows, self.view, live=True, caches=self.caches)
            step = max((len(r.steps) for r in rows), default=0)
            out |= self.say(f"Generating… step {step} of {self.engine_run.config.max_new_tokens} ({elapsed:.0f} s)")
            if t - self.last_chart >= CHART_INTERVAL_S:
                self.last_chart = t
                out |= {self.tab.conf_plot: self.tab.confidence_chart(rows, self.threshold, self.window),
                        self.tab.mem_plot: charts.memory_figure(self.mem["samples"]), self.tab.mem_state: self.mem}
        self.ui_seconds += time.perf_counter() - t
        return out

    def finish(self, outcome: Outcome) -> dict:
        if self.result is None:  # the run ended without its final result: keep what streamed, say why
            steps = max((len(r.steps) for r in self.rows), default=0)
            kept = self.tab.columns(self.rows, self.view, live=False, caches=self.caches) if steps else {}
            return kept | self.ended_early(outcome, f"Stopped after {steps} steps." if steps
                                           else "Stopped before the first token.")
        t = time.perf_counter()
        result = self.result
        self.mem["samples"] = [*self.mem["samples"], memory_entry(self.mem, memory.sample())][-MEMORY_POINTS:]
        out = self.idle() | self.tab.headings(result.rows) | self.tab.columns(result.rows, self.view, live=False,
                                                                              caches=self.caches)
        out |= {self.tab.conf_plot: self.tab.confidence_chart(result.rows, self.threshold, self.window),
                self.tab.mem_plot: charts.memory_figure(self.mem["samples"]), self.tab.mem_state: self.mem}
        self.ui_seconds += time.perf_counter() - t
        data = result.to_dict() | {"ui_seconds": self.ui_seconds}
        out |= {self.tab.run_json: data, self.tab.last: data}
        out |= self.say(done_text(result), "stopped" if outcome.kind == "stopped" else "info")
        return out


def done_text(result: RunResult) -> str:
    div = result.first_divergence_step
    stopped = " (stopped)" if any(r.stop_reason == "stopped" for r in result.rows) else ""
    same = "the columns are identical" if div is None else f"the columns first differ at step {div}"
    return f"Done{stopped} in {result.wall_seconds:.1f} s · prompt {result.prompt_tokens} tokens · {same}"


class CalibrateWork(TabWork):
    """Warm-up traces of the Compare prompt, both rows pooled -> a fixed early-stop threshold."""

    label = "a Calibrate run"

    def __init__(self, tab: "CompareTab", lm, cfg: DeepThinkConfig, note: str):
        super().__init__(tab.calibrate, tab.stop, tab.status)
        self.tab, self.lm, self.cfg, self.note = tab, lm, cfg, note
        self.gpu_seconds = 30 + cfg.max_new_tokens
        self.result = None

    def run(self, stop: threading.Event):
        yield from reporting(lambda report, halt: warm_up(self.lm, self.cfg, halt, report), stop)

    def progress(self, items: list, elapsed: float) -> dict:
        out = self.busy()
        for item in items:
            if isinstance(item, str):
                out |= self.say(f"Calibrating… {item} ({elapsed:.0f} s)")
            else:
                self.result = item.result
        return out

    def finish(self, outcome: Outcome) -> dict:
        if self.result is None:
            return self.ended_early(outcome, "Calibration stopped.", "Left the line; nothing was calibrated.")
        _, lows, thresholds = self.result
        s = round(thresholds["baseline"], 2)
        note = (f"Calibrated from {2 * self.cfg.warmup} warm-up traces (η = {self.cfg.eta:g} % kept): threshold "
                f"**{s:.2f}**, now used for early stop.{self.note}")
        return self.idle() | self.say(f"Calibrated: early stop below {s:.2f}.") | {
            self.tab.thr_mode: "fixed", self.tab.threshold: s, self.tab.calib_note: note,
            self.tab.calib_plot: gr.update(value=charts.histogram_figure(lows, {"shared": s}), visible=True)}


class CompareTab:
    def __init__(self, pool: ModelPool, runner: ModelRunner):
        self.pool, self.runner = pool, runner

    # ---- rendering (records in, HTML and figures out) ----
    def headings(self, rows: list[RowResult]) -> dict:
        return {c.heading: render.column_heading(c.spec.title, r.strategy, r.params) for c, r in zip(self.cols, rows)}

    def columns(self, rows: list[RowResult], view: str, live: bool, caches: list | None = None) -> dict:
        div = first_divergence(rows[0].token_ids, rows[1].token_ids) if len(rows) > 1 else None
        if live and div is not None and all(len(r.steps) <= div for r in rows):
            div = None  # a prefix so far, not a divergence yet
        caches = caches or [None] * len(rows)
        out = {}
        for col, row, cache in zip(self.cols, rows, caches):
            running = live and row.stop_reason is None
            out[col.text] = render.render_tokens(row.steps, view, live=running, cache=cache, diverge_at=div)
            out[col.stats] = render.render_stats(row, live=running)
        return out

    @staticmethod
    def confidence_chart(rows: list[RowResult], threshold: float | None, window: int):
        div = first_divergence(rows[0].token_ids, rows[1].token_ids) if len(rows) > 1 else None
        if div is not None and all(len(r.steps) <= div for r in rows):
            div = None
        return charts.confidence_figure(rows, threshold, div, window)

    # ---- handlers ----
    def config(self, prompt, chat_template, model, strategy, temperature, top_p, top_k, min_p, repetition_penalty,
               max_new_tokens, seed, k, window, threshold_mode, threshold, params: dict) -> RunConfig:
        """A validated RunConfig from the tab's control values."""
        thr = parse_number(threshold, "threshold") if threshold_mode == "fixed" else None
        rows = [RowSpec(c.row, strategy if c.feedback else None, params if c.feedback else {}) for c in COLUMNS]
        return RunConfig(
            prompt=prompt or "", model=model, chat_template=bool(chat_template),
            max_new_tokens=parse_number(max_new_tokens, "max new tokens", integer=True, lo=1, hi=SERVED_MAX_NEW_TOKENS),
            seed=parse_number(seed, "seed", integer=True, lo=0),
            sampling=SamplingConfig(parse_number(temperature, "temperature", lo=0, hi=10),
                                    parse_number(top_k, "top-k", integer=True, lo=0),
                                    parse_number(top_p, "top-p", lo=0, hi=1), parse_number(min_p, "min-p", lo=0, hi=1),
                                    parse_number(repetition_penalty, "repetition penalty", lo=0.01, hi=10)),
            deepconf=DeepConfConfig(parse_number(k, "DeepConf k", integer=True, lo=1, hi=1000),
                                    parse_number(window, "window", integer=True, lo=1, hi=100_000), thr),
            rows=rows, quality=True,  # self and prompt perplexity per row: ~a forward pass each, after the run
        ).validate()

    def prepare_compare(self, prompt, chat_template, model, strategy, view, temperature, top_p, top_k, min_p,
                        repetition_penalty, max_new_tokens, seed, k, window, threshold_mode, threshold,
                        *param_values) -> CompareWork:
        """Stream both columns of one run (validated here, before it waits for the model)."""
        params = self.panel.params_for(strategy, list(param_values))
        cfg = self.config(prompt, chat_template, model, strategy, temperature, top_p, top_k, min_p,
                          repetition_penalty, max_new_tokens, seed, k, window, threshold_mode, threshold, params)
        lm = self.pool.get(cfg.model)
        return CompareWork(self, Engine(lm).start(cfg, budget=self.runner.budget), view)

    def prepare_calibrate(self, prompt, chat_template, model, strategy, temperature, top_p, seed, window, k,
                          max_new_tokens, eta_preset, eta, warmup, *param_values) -> CalibrateWork:
        """Warm-up traces of this prompt (both rows pooled) -> a fixed early-stop threshold."""
        if not prompt or not prompt.strip():
            raise FeedbackError("prompt is empty")
        temp = parse_number(temperature, "temperature", lo=0, hi=10)
        top = parse_number(top_p, "top-p", lo=0.01, hi=1)
        note = ""
        if temp == 0:  # greedy decoding gives the same trace every time: calibration must sample
            temp, top = CALIBRATION_SAMPLING
            note = (f" Compare is greedy (temperature 0), and every greedy trace is the same, so the warm-up "
                    f"traces were sampled at temperature {temp:g}, top-p {top:g}.")
        cfg = DeepThinkConfig(
            prompt=prompt, warmup=parse_number(warmup, "warm-up traces", integer=True, lo=1, hi=SERVED_MAX_TRACES),
            eta=resolve_eta(eta_preset, eta), window=parse_number(window, "window", integer=True, lo=1, hi=100_000),
            k=parse_number(k, "k", integer=True, lo=1, hi=1000), temperature=temp, top_p=top,
            max_new_tokens=parse_number(max_new_tokens, "max new tokens", integer=True, lo=1, hi=SERVED_MAX_NEW_TOKENS),
            seed=parse_number(seed, "seed", integer=True, lo=0), strategy=strategy,
            params=self.panel.params_for(strategy, list(param_values)), shared_threshold=True,
            chat_template=bool(chat_template))
        lm = self.pool.get(model)
        cfg.validate(lm.num_layers)
        check_budget(lm, cfg, self.runner.budget, warm_up_only=True)
        return CalibrateWork(self, lm, cfg, note)

    def stop_run(self, request: gr.Request = None) -> str:
        """Stop this session's Compare or Calibrate run (a waiting one leaves the line)."""
        return self.runner.stop(TAB, request)

    def tick(self, mem: dict | None, request: gr.Request = None):
        """Idle memory polling (a running generation samples memory itself)."""
        session = getattr(request, "session_hash", None) or "local"
        if self.runner.jobs.active(session, TAB):
            return gr.skip()
        mem = dict(mem) if mem and "origin" in mem else {"origin": time.time(), "samples": [],
                                                          "label": "the page opened"}
        mem["samples"] = [*mem["samples"], memory_entry(mem, memory.sample())][-MEMORY_POINTS:]
        return {self.mem_state: mem,
                self.mem_plot: charts.memory_figure(mem["samples"], mem.get("label", "the run began"))}

    def rerender(self, last: dict | None, view: str) -> dict:
        """Switch the token view of the last finished run without generating again."""
        if not last:
            return {}
        return self.columns(RunResult.from_dict(last).rows, view, live=False)

    def change_model(self, model: str) -> dict:
        try:
            lm = self.pool.get(model)
        except FeedbackError as exc:
            raise gr.Error(str(exc), print_exception=False) from None
        return self.panel.layer_updates(lm.num_layers)

    # ---- reload (from History) ----
    def restore(self, data: dict, view: str) -> dict:
        """Every control as the run had it, and the run's columns, stats and chart."""
        cfg = data["config"]
        s, dc = cfg["sampling"], cfg["deepconf"]
        feedback = next((r for r in cfg["rows"] if r.get("strategy")), None)
        result = RunResult.from_dict(data)
        params = next((r.params for r in result.rows if r.strategy), {})
        out: dict = {self.prompt: cfg["prompt"], self.chat: cfg["chat_template"], self.temperature: s["temperature"],
                     self.top_p: s["top_p"], self.top_k: s["top_k"], self.min_p: s["min_p"],
                     self.rep: s["repetition_penalty"], self.max_new: cfg["max_new_tokens"], self.seed: cfg["seed"],
                     self.k: dc["k"], self.window: dc["window"],
                     self.thr_mode: "off" if dc["threshold"] is None else "fixed"}
        if cfg.get("model") in self.pool.allowlist:
            out[self.model] = cfg["model"]
        if dc["threshold"] is not None:
            out[self.threshold] = dc["threshold"]
        if feedback is not None:
            out |= self.panel.show(feedback["strategy"], params=params)
        out |= self.headings(result.rows) | self.columns(result.rows, view, live=False)
        out |= {self.conf_plot: self.confidence_chart(result.rows, dc["threshold"], dc["window"]),
                self.last: data, self.run_json: data}
        return out

    # ---- layout ----
    def build(self, num_layers: int, hist: gr.BrowserState) -> None:
        with gr.Tab("Compare", id=TAB):
            with gr.Row(equal_height=False):
                with gr.Column(scale=3, min_width=300):
                    self.prompt = gr.Textbox(label="Prompt", lines=4, max_length=20_000, elem_id="prompt",
                                             placeholder="Ask something… (Enter runs, Shift+Enter for a new line)")
                    with gr.Row():
                        self.generate = gr.Button("Generate", variant="primary", elem_id="generate")
                        self.stop = gr.Button("Stop", variant="stop", interactive=False, elem_id="stop")
                    self.status = gr.HTML(render.status_html("Ready. Pick an example or type a prompt, then Generate."),
                                          elem_id="status")
                    gr.Examples(load_examples(), inputs=[self.prompt], label="Examples")
                with gr.Column(scale=2, min_width=300):
                    with gr.Row():
                        self.model = gr.Dropdown(self.pool.allowlist, value=self.pool.default, label="Model",
                                                 elem_id="model")
                        self.chat = gr.Checkbox(True, label="Use the chat template", elem_id="chat-template")
                    self.panel: StrategyPanel = build_strategy_panel(num_layers, "residual", prefix="param")
                    with gr.Accordion("Sampling", open=False, elem_id="sampling"):
                        with gr.Row():
                            self.temperature = gr.Number(0.0, label="temperature", info="0 = greedy, else ≥ 0.01", minimum=0,
                                                         maximum=10, step=0.05, min_width=100, elem_id="temperature")
                            self.top_p = gr.Number(1.0, label="top-p", info="1 = off", minimum=0, maximum=1,
                                                   step=0.05, min_width=100, elem_id="top-p")
                            self.top_k = gr.Number(0, label="top-k", info="0 = off", precision=0, minimum=0,
                                                   min_width=100, elem_id="top-k")
                        with gr.Row():
                            self.min_p = gr.Number(0.0, label="min-p", info="0 = off", minimum=0, maximum=1,
                                                   step=0.01, min_width=100, elem_id="min-p")
                            self.rep = gr.Number(1.0, label="repetition penalty", info="1 = off", minimum=0.01,
                                                 maximum=10, step=0.05, min_width=100, elem_id="repetition-penalty")
                            self.seed = gr.Number(0, label="seed", precision=0, minimum=0, min_width=100, elem_id="seed")
                        self.max_new = gr.Number(160, label="max new tokens", precision=0, minimum=1,
                                                 maximum=SERVED_MAX_NEW_TOKENS, elem_id="max-new-tokens",
                                                 info=f"1 to {SERVED_MAX_NEW_TOKENS}")
                    with gr.Accordion("DeepConf confidence and early stop", open=False, elem_id="deepconf"):
                        with gr.Row():
                            self.k = gr.Number(20, label="k (top-k for confidence)", precision=0, minimum=1,
                                               maximum=1000, min_width=100, elem_id="deepconf-k")
                            self.window = gr.Number(32, label="group window (tokens)", precision=0, minimum=1,
                                                    maximum=100_000, min_width=100, elem_id="deepconf-window")
                        with gr.Row():
                            self.thr_mode = gr.Radio(["off", "fixed"], value="off", label="early stop",
                                                     info="stop a column once its window is full and its group "
                                                          "confidence falls below the threshold", elem_id="thr-mode")
                            self.threshold = gr.Number(DEFAULT_THRESHOLD, label="threshold (group confidence)",
                                                       precision=2, min_width=100, elem_id="threshold",
                                                       info="normal answers of the embedded model stay above 4.7 "
                                                            "(window 32); Calibrate measures it for your prompt")
                        gr.Markdown("**Calibrate** runs warm-up traces of this prompt (both columns) and sets the "
                                    "threshold to the percentile that keeps η % of them.", elem_classes="fl-note")
                        with gr.Row():
                            self.eta_preset = gr.Radio(ETA_CHOICES, value=ETA_CHOICES[1], label="calibration η",
                                                       elem_id="eta-preset")
                        with gr.Row():
                            self.eta = gr.Number(50, label="custom η %", minimum=0.0001, maximum=100, min_width=100,
                                                 elem_id="eta")
                            self.warmup = gr.Number(8, label="warm-up traces per column", precision=0, minimum=1,
                                                    maximum=SERVED_MAX_TRACES, min_width=100, elem_id="warmup")
                        self.calibrate = gr.Button("Calibrate threshold", elem_id="calibrate")
                        self.calib_note = gr.Markdown(elem_id="calib-note")
                        self.calib_plot = gr.Plot(show_label=False, visible=False, elem_id="calib-plot")
            with gr.Row(equal_height=True):
                self.view = gr.Radio(["confidence", "plain"], value="confidence", label="Token view", scale=1,
                                     min_width=160, elem_id="token-view")
                gr.HTML(render.confidence_legend(), elem_id="legend")
            initial = [RowResult(c.row, "residual" if c.feedback else None,
                                 self.panel.params_for("residual", [x.value for x in self.panel.components])
                                 if c.feedback else {}) for c in COLUMNS]
            self.cols: list[Column] = []
            with gr.Row(equal_height=False, elem_classes="fl-columns", elem_id="columns"):
                for spec, row in zip(COLUMNS, initial):
                    with gr.Column(min_width=0):
                        self.cols.append(Column(
                            spec, gr.Markdown(render.column_heading(spec.title, row.strategy, row.params),
                                              elem_id=f"{spec.row}-heading"),
                            gr.HTML(render.render_tokens([]), elem_id=f"{spec.row}-text"),
                            gr.HTML(elem_id=f"{spec.row}-stats")))
            gr.Markdown("#### Confidence per decode step")
            self.conf_plot = gr.Plot(charts.confidence_figure([]), show_label=False, elem_id="conf-plot")
            gr.Markdown("#### Memory")
            self.mem_plot = gr.Plot(charts.memory_figure([], "the page opened"), show_label=False, elem_id="mem-plot")
            with gr.Accordion("Run result (JSON)", open=False):
                self.run_json = gr.JSON(elem_id="run-json")
            self.mem_state = gr.State({})
            self.last = gr.State(None)
            self.stop_ack = gr.Textbox(visible=False)  # Stop's answer: never shares the status line
            self.cancel_trigger = gr.Button(visible=False)  # for program clients' Job.cancel()
            self.timer = gr.Timer(IDLE_POLL_S)
            self.page_visible = gr.Checkbox(True, elem_id="fl-page-visible", elem_classes="fl-hidden",
                                            container=False, label="page visible")
        self._wire(hist)

    def _wire(self, hist: gr.BrowserState) -> None:
        cols_out = [x for c in self.cols for x in (c.heading, c.text, c.stats)]
        outputs = [*cols_out, self.conf_plot, self.mem_plot, self.status, self.run_json, self.last, self.mem_state,
                   self.generate, self.stop]
        inputs = [self.prompt, self.chat, self.model, self.panel.strategy, self.view, self.temperature, self.top_p,
                  self.top_k, self.min_p, self.rep, self.max_new, self.seed, self.k, self.window, self.thr_mode,
                  self.threshold, *self.panel.components]
        compare = self.runner.wrap(TAB, self.prepare_compare, self.panel.api_names)
        run = gr.on([self.generate.click, self.prompt.submit], compare, inputs, outputs, api_name="compare",
                    concurrency_limit=None, show_progress="hidden")
        run.then(record_run, [hist, self.last], hist, api_name=False, show_progress="hidden")
        calibrate = self.runner.wrap(TAB, self.prepare_calibrate, self.panel.api_names)
        calibrating = self.calibrate.click(
            calibrate, [self.prompt, self.chat, self.model, self.panel.strategy, self.temperature, self.top_p,
                        self.seed, self.window, self.k, self.max_new, self.eta_preset, self.eta, self.warmup,
                        *self.panel.components],
            [self.thr_mode, self.threshold, self.calib_plot, self.calib_note, self.status, self.stop, self.calibrate],
            api_name="calibrate", concurrency_limit=None, show_progress="hidden")
        cancellable_by_clients(self.cancel_trigger, run, calibrating)
        self.stop.click(self.stop_run, None, self.stop_ack, api_name="stop", concurrency_limit=None,
                        show_progress="hidden")
        self.timer.tick(self.tick, self.mem_state, [self.mem_state, self.mem_plot], api_name="memory",
                        concurrency_limit=None, show_progress="hidden")
        self.page_visible.change(lambda visible: gr.Timer(active=bool(visible)), self.page_visible, self.timer,
                                 api_name=False, queue=False, show_progress="hidden")
        self.view.change(self.rerender, [self.last, self.view], [x for c in self.cols for x in (c.text, c.stats)],
                         api_name="rerender", show_progress="hidden")
        self.model.change(self.change_model, self.model, self.panel.components, api_name="select_model",
                          show_progress="hidden")


def record_run(hist: list | None, last: dict | None) -> list:
    """Add the run just shown to this browser's history (once)."""
    return history.add_run(hist, last) if last else (hist or [])
