"""The Gradio Blocks app: Compare (side-by-side streaming with live charts) and History tabs.

One generator per Generate click drives one engine run with both rows in a single batch, so both
columns stream from the same forward passes. The UI only formats engine records; no model maths.
"""
from __future__ import annotations

import json
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr

from feedback import memory
from feedback.engine import Engine
from feedback.errors import FeedbackError
from feedback.model import ModelPool
from feedback.records import SERVED_MAX_NEW_TOKENS, DeepConfConfig, RowSpec, RunConfig, RunResult
from feedback.sampling import SamplingConfig
from feedback.strategies import REGISTRY
from ui import charts, history, render
from ui.controls import build_strategy_controls, parse_number, with_named_params
from ui.deepthink_tab import ETA_CHOICES, DeepThinkTab
from ui.lab import LabTabs

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CHART_INTERVAL_S = 0.25  # charts at most ~4 times a second; text goes out every step
MEMORY_POINTS = 600
UI_MAX_NEW_TOKENS = SERVED_MAX_NEW_TOKENS

try:  # ZeroGPU on Hugging Face Spaces: the decorated function gets the GPU; elsewhere a no-op.
    import spaces

    gpu = spaces.GPU
    ZEROGPU = True
except ImportError:  # pragma: no cover - depends on the environment
    def gpu(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)

    ZEROGPU = False


def load_examples() -> list[str]:
    data = json.loads((ASSETS / "examples.json").read_text(encoding="utf-8"))
    return [e["prompt"] for e in data]


@dataclass
class Sessions:
    """Per-browser-session stop signals; keyed by Gradio's session hash, never shared."""

    stops: dict[str, threading.Event] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, session: str) -> threading.Event:
        with self.lock:
            event = self.stops[session] = threading.Event()
            return event

    def end(self, session: str, event: threading.Event) -> None:
        with self.lock:
            if self.stops.get(session) is event:
                del self.stops[session]

    def stop(self, session: str) -> bool:
        with self.lock:
            event = self.stops.get(session)
        if event is not None:
            event.set()
        return event is not None

    def running(self, session: str) -> bool:
        with self.lock:
            return session in self.stops


def build_config(prompt, chat_template, model, strategy, temperature, top_p, top_k, min_p, repetition_penalty,
                 max_new_tokens, seed, k, window, threshold_mode, threshold, params: dict) -> RunConfig:
    """A validated RunConfig from the Compare tab's control values."""
    if strategy not in REGISTRY:
        raise FeedbackError(f"unknown strategy {strategy!r}")
    max_new = parse_number(max_new_tokens, "max new tokens", integer=True)
    if max_new > UI_MAX_NEW_TOKENS:
        raise FeedbackError(f"max new tokens is capped at {UI_MAX_NEW_TOKENS} in the UI, got {max_new}")
    thr = None
    if threshold_mode == "fixed":
        thr = parse_number(threshold, "threshold")
    return RunConfig(
        prompt=prompt or "", model=model, chat_template=bool(chat_template), max_new_tokens=max_new,
        seed=parse_number(seed, "seed", integer=True),
        sampling=SamplingConfig(parse_number(temperature, "temperature"),
                                parse_number(top_k, "top-k", integer=True), parse_number(top_p, "top-p"),
                                parse_number(min_p, "min-p"), parse_number(repetition_penalty, "repetition penalty")),
        deepconf=DeepConfConfig(parse_number(k, "DeepConf k", integer=True),
                                parse_number(window, "window", integer=True), thr),
        rows=[RowSpec("baseline"), RowSpec("feedback", strategy, params)],
    ).validate()


class FeedbackLensApp:
    """Holds the model pool and session signals; `build()` returns the Blocks."""

    def __init__(self, pool: ModelPool):
        self.pool = pool
        self.deepthink = DeepThinkTab(pool)
        self.sessions = Sessions()
        self.started = time.time()

    # ---- rendering (no model maths: records in, HTML and figures out) ----
    def _columns(self, result: RunResult, view: str, live: bool, caches: list | None = None):
        rows = result.rows
        rng = render.confidence_range(rows)
        caches = caches or [None, None]
        html = [render.render_tokens(r.steps, view, rng, live=live and r.stop_reason is None, cache=c)
                for r, c in zip(rows[:2], caches)]
        stats = [render.render_stats(r, live=live and r.stop_reason is None) for r in rows[:2]]
        return html, stats

    def _conf_figure(self, result: RunResult, threshold: float | None, window: int):
        div = charts.first_divergence(result.rows)
        return charts.confidence_figure(result.rows, threshold, div, window)

    def _memory(self, samples: list[dict], sample: memory.MemorySample | None = None) -> list[dict]:
        if sample is None:
            sample = memory.sample()
        entry = sample.to_dict() | {"t": round(time.time() - self.started, 3)}
        return [*samples, entry][-MEMORY_POINTS:]

    # ---- handlers ----
    def compare(self, prompt, chat_template, model, strategy, view, temperature, top_p, top_k, min_p,
                repetition_penalty, max_new_tokens, seed, k, window, threshold_mode, threshold, mem,
                *param_values, request: gr.Request = None):
        """Stream both rows; yields (columns, stats, charts, status, json, history, memory, buttons)."""
        try:
            params = self.controls.params_for(strategy, list(param_values))
            config = build_config(prompt, chat_template, model, strategy, temperature, top_p, top_k, min_p,
                                  repetition_penalty, max_new_tokens, seed, k, window, threshold_mode,
                                  threshold, params)
            lm = self.pool.get(config.model)
            session = request.session_hash if request is not None else "local"
            stop = self.sessions.begin(session)
            try:
                run = Engine(lm).start(config, stop_event=stop)
            except BaseException:
                self.sessions.end(session, stop)
                raise
        except FeedbackError as exc:
            raise gr.Error(str(exc)) from None
        yield from self._stream(run, config, view, mem or [], session, stop)

    @gpu
    def _stream(self, run, config: RunConfig, view: str, mem: list, session: str,
                stop: threading.Event):
        thr, window = config.deepconf.threshold, config.deepconf.window
        ui_s, last_chart = 0.0, 0.0
        busy = (gr.update(interactive=False), gr.update(interactive=True))
        skip = gr.skip()
        iterator = iter(run)
        caches = [render.SpanCache(), render.SpanCache()]
        try:
            for event in iterator:
                t = time.perf_counter()
                html, stats = self._columns(run.result, view, True, caches)
                charts_due = t - last_chart >= CHART_INTERVAL_S
                if event.memory is not None:
                    mem = self._memory(mem, event.memory)
                if charts_due:
                    last_chart = t
                    conf_fig, mem_fig = self._conf_figure(run.result, thr, window), charts.memory_figure(mem)
                else:
                    conf_fig = mem_fig = skip
                status = f"Generating… step {event.step + 1} / {config.max_new_tokens}"
                ui_s += time.perf_counter() - t
                yield (*html, *stats, conf_fig, mem_fig, status, skip, skip, mem, *busy)
        except Exception as exc:  # tokenizer / model / out-of-memory errors: tell the user, keep serving
            raise gr.Error(f"generation failed: {type(exc).__name__}: {exc}") from None
        finally:
            iterator.close()
            self.sessions.end(session, stop)
        result = run.result
        t = time.perf_counter()
        html, stats = self._columns(result, view, False, caches)
        mem = self._memory(mem)
        conf_fig, mem_fig = self._conf_figure(result, thr, window), charts.memory_figure(mem)
        ui_s += time.perf_counter() - t
        decode_s = max(result.wall_seconds, 1e-9)
        data = result.to_dict() | {"ui_seconds": ui_s, "run_id": uuid.uuid4().hex[:8]}
        div = result.first_divergence_step
        stopped = " (stopped)" if any(r.stop_reason == "stopped" for r in result.rows) else ""
        status = (f"Done{stopped} in {result.wall_seconds:.1f} s · prompt {result.prompt_tokens} tokens · "
                  f"{'outputs identical' if div is None else f'first divergence at step {div}'} · "
                  f"UI build time {ui_s * 1000:.0f} ms ({100 * ui_s / decode_s:.1f}% of decode time)")
        yield (*html, *stats, conf_fig, mem_fig, status, data, data, mem,
               gr.update(interactive=True), gr.update(interactive=False))

    @staticmethod
    def record(hist: list | None, last: dict | None) -> list:
        """Add the run just shown to this browser's history (once)."""
        return history.add_run(hist, last) if last else (hist or [])

    def stop(self, request: gr.Request = None) -> str:
        """Ask this session's running generation to stop (it ends within one decode step)."""
        session = request.session_hash if request is not None else "local"
        return "Stopping…" if self.sessions.stop(session) else "Nothing is running."

    def tick(self, mem: list, request: gr.Request = None):
        """Idle memory polling (the running generator samples memory itself)."""
        session = request.session_hash if request is not None else "local"
        if self.sessions.running(session):
            return gr.skip(), gr.skip()
        mem = self._memory(mem or [])
        return mem, charts.memory_figure(mem)

    def rerender(self, last: dict | None, view: str):
        """Switch the token view of the last finished run without generating again."""
        if not last:
            return gr.skip(), gr.skip()
        result = RunResult.from_dict(last)
        html, _ = self._columns(result, view, False)
        return html[0], html[1]

    def change_strategy(self, strategy: str):
        return self.controls.visibility_updates(strategy)

    def change_model(self, model: str):
        try:
            lm = self.pool.get(model)
        except FeedbackError as exc:
            raise gr.Error(str(exc)) from None
        return self.controls.layer_updates(lm.num_layers)

    def history_view(self, hist: list | None):
        runs = hist or []
        choices = [(f"{e['id']} · {e['result']['config']['prompt'][:40]}", e["id"]) for e in runs]
        return history.table(runs), gr.update(choices=choices, value=[])

    def export_json(self, hist: list | None, ids: list[str] | None) -> str:
        """Selected runs (all when none is selected) as a JSON list of RunResult objects."""
        return self._export(hist, ids, "json")

    def export_csv(self, hist: list | None, ids: list[str] | None) -> str:
        """Selected runs (all when none is selected) as per-token CSV rows."""
        return self._export(hist, ids, "csv")

    def _export(self, hist: list | None, ids: list[str] | None, kind: str) -> str:
        entries = history.select(hist, ids)
        if not entries:
            raise gr.Error("no runs in this browser's history yet")
        text = history.to_json(entries) if kind == "json" else history.to_csv(entries)
        out = Path(tempfile.mkdtemp(prefix="feedback-lens-")) / f"feedback-lens-runs.{kind}"
        out.write_text(text, encoding="utf-8")
        return str(out)

    def reload(self, hist: list | None, ids: list[str] | None, view: str):
        """Show a stored run in the Compare tab again, with its prompt and settings."""
        entries = history.select(hist, ids[:1] if ids else None)
        if not entries:
            raise gr.Error("choose a run to reload")
        data = entries[0]["result"]
        result = RunResult.from_dict(data)
        cfg = data["config"]
        thr = cfg["deepconf"]["threshold"]
        html, stats = self._columns(result, view, False)
        fig = self._conf_figure(result, thr, cfg["deepconf"]["window"])
        s = cfg["sampling"]
        return (cfg["prompt"], cfg["chat_template"], s["temperature"], s["top_p"], s["top_k"], s["min_p"],
                s["repetition_penalty"], cfg["max_new_tokens"], cfg["seed"], *html, *stats, fig, data,
                gr.update(selected="compare"))

    # ---- layout ----
    def build(self) -> gr.Blocks:
        lm = self.pool.get()
        strategies = list(REGISTRY)
        with gr.Blocks(title="Feedback Lens") as demo:
            gr.Markdown("# Feedback Lens\nThe same prompt, one model, two decodes streamed side by side: a plain "
                        "**baseline** and an **activation-feedback** row. Token colours show DeepConf confidence "
                        "(hover a token for probability, entropy and the top-5 alternatives).")
            hist = gr.BrowserState([], storage_key="feedback-lens-history")
            mem = gr.State([])
            last = gr.State(None)
            with gr.Tabs() as tabs:
                with gr.Tab("Compare", id="compare"):
                    with gr.Row():
                        with gr.Column(scale=3):
                            prompt = gr.Textbox(label="Prompt", lines=4, max_length=20_000, elem_id="prompt",
                                                placeholder="Ask something…")
                            with gr.Row():
                                generate = gr.Button("Generate", variant="primary", elem_id="generate")
                                stop = gr.Button("Stop", variant="stop", interactive=False, elem_id="stop")
                            gr.Examples(load_examples(), inputs=[prompt], label="Examples")
                        with gr.Column(scale=2):
                            model = gr.Dropdown(self.pool.allowlist, value=self.pool.default, label="Model")
                            chat = gr.Checkbox(True, label="Use the chat template")
                            strategy = gr.Dropdown(strategies, value=strategies[0], label="Feedback strategy")
                            self.controls = build_strategy_controls(lm.num_layers, strategies[0])
                            with gr.Accordion("Sampling", open=False):
                                with gr.Row():
                                    temperature = gr.Number(0.0, label="temperature (0 = greedy)", minimum=0,
                                                            maximum=10, min_width=100)
                                    top_p = gr.Number(1.0, label="top-p", minimum=0, maximum=1, min_width=100)
                                    top_k = gr.Number(0, label="top-k (0 = off)", precision=0, minimum=0,
                                                      min_width=100)
                                with gr.Row():
                                    min_p = gr.Number(0.0, label="min-p", minimum=0, maximum=1, min_width=100)
                                    rep = gr.Number(1.0, label="repetition penalty", minimum=0.01, maximum=10,
                                                    min_width=100)
                                    seed = gr.Number(0, label="seed", precision=0, minimum=0, min_width=100)
                                max_new = gr.Number(160, label="max new tokens", precision=0, minimum=1,
                                                    maximum=UI_MAX_NEW_TOKENS, elem_id="max-new-tokens")
                            with gr.Accordion("DeepConf", open=False):
                                with gr.Row():
                                    k = gr.Number(20, label="k (top-k)", precision=0, minimum=1, min_width=100)
                                    window = gr.Number(32, label="group window (tokens)", precision=0, minimum=1,
                                                       min_width=100)
                                with gr.Row():
                                    thr_mode = gr.Radio(["off", "fixed"], value="off", label="early stop",
                                                        min_width=100)
                                    thr = gr.Number(10.0, label="threshold (group confidence)", min_width=100,
                                                    elem_id="threshold")
                                eta_preset = gr.Radio(ETA_CHOICES, value=ETA_CHOICES[1], label="calibration η")
                                with gr.Row():
                                    eta = gr.Number(50, label="custom η %", minimum=0.0001, maximum=100,
                                                    min_width=100)
                                    warmup = gr.Number(8, label="warm-up traces per row", precision=0, minimum=1,
                                                       maximum=64, min_width=100)
                                calibrate = gr.Button("Calibrate threshold", elem_id="calibrate")
                                calib_note = gr.Markdown()
                                calib_plot = gr.Plot(show_label=False, visible=True)
                    view = gr.Radio(["confidence", "plain"], value="confidence", label="Token view",
                                    elem_id="token-view")
                    with gr.Row(equal_height=False):
                        with gr.Column():
                            gr.Markdown("### Baseline")
                            base_html = gr.HTML(render.render_tokens([]), elem_id="baseline-text")
                            base_stats = gr.HTML(elem_id="baseline-stats")
                        with gr.Column():
                            gr.Markdown("### Feedback")
                            fb_html = gr.HTML(render.render_tokens([]), elem_id="feedback-text")
                            fb_stats = gr.HTML(elem_id="feedback-stats")
                    status = gr.Markdown(elem_id="status")
                    gr.Markdown("#### Confidence per decode step")
                    conf_plot = gr.Plot(charts.confidence_figure([]), label="Confidence", show_label=False,
                                        elem_id="conf-plot")
                    gr.Markdown("#### Memory")
                    mem_plot = gr.Plot(charts.memory_figure([]), label="Memory", show_label=False, elem_id="mem-plot")
                    with gr.Accordion("Run result (JSON)", open=False):
                        run_json = gr.JSON(elem_id="run-json")
                self.deepthink.build(lm.num_layers)
                LabTabs(self.pool).build(lm.num_layers)
                with gr.Tab("History", id="history"):
                    gr.Markdown("Runs of this browser (kept in its local storage). Select runs to reload or "
                                "export; with none selected, export takes them all.")
                    hist_table = gr.Dataframe(headers=history.TABLE_HEADERS, interactive=False, wrap=True)
                    hist_ids = gr.Dropdown([], multiselect=True, label="Runs", allow_custom_value=True)
                    with gr.Row():
                        reload_btn = gr.Button("Reload into Compare")
                        json_btn = gr.Button("Export JSON")
                        csv_btn = gr.Button("Export CSV")
                    export_file = gr.File(label="Export", interactive=False)
            timer = gr.Timer(1.0)

            compare_inputs = [prompt, chat, model, strategy, view, temperature, top_p, top_k, min_p, rep, max_new,
                              seed, k, window, thr_mode, thr, mem, *self.controls.components]
            compare_outputs = [base_html, fb_html, base_stats, fb_stats, conf_plot, mem_plot, status, run_json,
                               last, mem, generate, stop]
            compare = with_named_params(self.compare, self.controls, self.pool.gate)
            gen_event = generate.click(compare, compare_inputs, compare_outputs, api_name="compare",
                                       concurrency_id="model", concurrency_limit=1, show_progress="minimal")
            gen_event.then(self.record, [hist, last], hist, api_name=False)
            submit_event = prompt.submit(compare, compare_inputs, compare_outputs, api_name=False,
                                         concurrency_id="model", concurrency_limit=1, show_progress="minimal")
            submit_event.then(self.record, [hist, last], hist, api_name=False)
            self.deepthink.compare_controls = self.controls
            calibrate.click(with_named_params(self.deepthink.calibrate, self.controls, self.pool.gate),
                            [prompt, chat, strategy, temperature, top_p, seed, window, k, max_new, eta_preset, eta,
                             warmup, *self.controls.components], [thr_mode, thr, calib_plot, calib_note],
                            api_name="calibrate", concurrency_id="model", concurrency_limit=1)
            # The acknowledgement goes to a hidden box, not the status line: it can arrive after the
            # generator's final "Done" and would overwrite it.
            stop_ack = gr.Textbox(visible=False)
            stop.click(self.stop, None, stop_ack, api_name="stop", concurrency_limit=None,
                       cancels=[gen_event] if ZEROGPU else None)
            timer.tick(self.tick, mem, [mem, mem_plot], api_name="memory", concurrency_limit=None,
                       show_progress="hidden")
            view.change(self.rerender, [last, view], [base_html, fb_html], api_name="rerender")
            strategy.change(self.change_strategy, strategy, list(self.controls.groups.values()),
                            api_name="strategy_controls")
            model.change(self.change_model, model, self.controls.components, api_name="select_model",
                         concurrency_id="model")
            tabs.select(self.history_view, hist, [hist_table, hist_ids], api_name="history")
            demo.load(self.history_view, hist, [hist_table, hist_ids], api_name=False)
            json_btn.click(self.export_json, [hist, hist_ids], export_file, api_name="export_json")
            csv_btn.click(self.export_csv, [hist, hist_ids], export_file, api_name="export_csv")
            reload_btn.click(self.reload, [hist, hist_ids, view],
                             [prompt, chat, temperature, top_p, top_k, min_p, rep, max_new, seed, base_html,
                              fb_html, base_stats, fb_stats, conf_plot, last, tabs], api_name="reload")
        return demo


def build_app(pool: ModelPool | None = None) -> gr.Blocks:
    from feedback.model import allowlist_from_env

    return FeedbackLensApp(pool or ModelPool(allowlist_from_env())).build()
