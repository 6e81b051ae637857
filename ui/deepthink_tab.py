"""Deep Think tab (multi-trace DeepConf vote per side) and the Compare tab's Calibrate action."""
from __future__ import annotations

from html import escape

import gradio as gr

from feedback.deepthink import MAX_TRACES, SIDES, DeepThinkConfig, deep_think, warm_up
from feedback.errors import FeedbackError
from feedback.model import ModelPool
from feedback.strategies import REGISTRY
from feedback.voting import PRESETS
from ui import charts
from ui.controls import build_strategy_controls, parse_number, with_named_params
from ui.lab import Finished, in_background

ETA_CHOICES = ["DeepConf-low (keep 10%)", "DeepConf-high (keep 90%)", "custom"]


def resolve_eta(preset: str, custom) -> float:
    if preset.startswith("DeepConf-low"):
        return PRESETS["deepconf-low"]
    if preset.startswith("DeepConf-high"):
        return PRESETS["deepconf-high"]
    return parse_number(custom, "eta", lo=0.0001, hi=100)


def side_markdown(side: str, rep: dict, traces: int) -> str:
    votes = rep["votes"]
    return (f"### {side}\n**Answer** `{escape(str(rep['answer']))}` — {rep['share']:.0%} of the weighted vote  \n"
            f"majority `{escape(str(votes['majority']['answer']))}`, tail-weighted "
            f"`{escape(str(votes['tail']['answer']))}`  \n"
            f"threshold {rep['threshold']:.3f} · {rep['stopped']} of {traces} online traces stopped  \n"
            f"tokens spent {rep['tokens_spent']}, saved {rep['tokens_saved']} ({rep['tokens_saved_method']})")


def trace_rows(report: dict) -> list[list]:
    rows = []
    for side in SIDES:
        for t in report["sides"][side]["traces"]:
            state = "stopped" if t["stopped"] else "filtered" if t["excluded"] else "voted"
            low = t["lowest_group"]
            rows.append([side, t["phase"], t["name"], state, t["tokens"], None if low is None else round(low, 3),
                         t["answer"], t["text"][:200]])
    return rows


class DeepThinkTab:
    def __init__(self, pool: ModelPool):
        self.pool = pool

    def config(self, prompt, strategy, traces, warmup, eta_preset, eta, window, max_new, temperature, top_p, seed,
               regex, shared, check, params: dict) -> DeepThinkConfig:
        return DeepThinkConfig(
            prompt=prompt or "", traces=parse_number(traces, "traces", integer=True, lo=1, hi=MAX_TRACES),
            warmup=parse_number(warmup, "warm-up traces", integer=True, lo=1, hi=MAX_TRACES),
            eta=resolve_eta(eta_preset, eta), window=parse_number(window, "window", integer=True, lo=1),
            max_new_tokens=parse_number(max_new, "max new tokens", integer=True, lo=1, hi=1024),
            temperature=parse_number(temperature, "temperature", lo=0.01, hi=10),
            top_p=parse_number(top_p, "top-p", lo=0.01, hi=1), seed=parse_number(seed, "seed", integer=True, lo=0),
            strategy=strategy, params=params, answer_regex=regex or None, shared_threshold=bool(shared),
            check=bool(check))

    def run(self, prompt, strategy, traces, warmup, eta_preset, eta, window, max_new, temperature, top_p, seed,
            regex, shared, check, *param_values, request: gr.Request = None):
        """N sampled traces per side with calibrated early stop, then the votes."""
        skip = gr.skip()
        try:
            if not prompt or not prompt.strip():
                raise FeedbackError("prompt is empty")
            params = self.controls.params_for(strategy, list(param_values))
            cfg = self.config(prompt, strategy, traces, warmup, eta_preset, eta, window, max_new, temperature,
                              top_p, seed, regex, shared, check, params)
            lm = self.pool.get()
            for warning in cfg.validate(lm.num_layers):
                gr.Warning(warning)
            for item in in_background(lambda report: deep_think(lm, cfg, progress=report)):
                if isinstance(item, Finished):
                    rep = item.result
                else:
                    yield f"Running… {escape(item)}", skip, skip, skip, skip, skip, skip
        except FeedbackError as exc:
            raise gr.Error(str(exc)) from None
        sides = rep["sides"]
        yield (side_markdown("Baseline", sides["baseline"], cfg.traces) + "\n\n" +
               side_markdown("Feedback", sides["feedback"], cfg.traces) + f"\n\n{rep['wall_seconds']:.1f} s",
               charts.vote_figure(sides), charts.trace_figure("baseline", sides["baseline"], 0),
               charts.trace_figure("feedback", sides["feedback"], 1), trace_rows(rep), rep,
               charts.histogram_figure({side: sides[side]["warmup_lowest_groups"] for side in SIDES},
                                       rep["thresholds"]))

    def calibrate(self, prompt, chat_template, strategy, temperature, top_p, seed, window, k, max_new, eta_preset,
                  eta, warmup, *param_values, request: gr.Request = None):
        """Warm-up traces of the Compare prompt (both rows, pooled) -> a fixed early-stop threshold."""
        try:
            if not prompt or not prompt.strip():
                raise FeedbackError("prompt is empty")
            temp = parse_number(temperature, "temperature")
            if temp == 0:
                raise FeedbackError("calibration samples several traces: set a temperature above 0 first")
            cfg = DeepThinkConfig(
                prompt=prompt, warmup=parse_number(warmup, "warm-up traces", integer=True, lo=1, hi=MAX_TRACES),
                eta=resolve_eta(eta_preset, eta), window=parse_number(window, "window", integer=True, lo=1),
                k=parse_number(k, "k", integer=True, lo=1), temperature=temp,
                top_p=parse_number(top_p, "top-p", lo=0.01, hi=1),
                max_new_tokens=parse_number(max_new, "max new tokens", integer=True, lo=1, hi=1024),
                seed=parse_number(seed, "seed", integer=True, lo=0), strategy=strategy,
                params=self.compare_controls.params_for(strategy, list(param_values)), shared_threshold=True,
                chat_template=bool(chat_template))
            lm = self.pool.get()
            cfg.validate(lm.num_layers)
            _, lows, thresholds = warm_up(lm, cfg)
        except FeedbackError as exc:
            raise gr.Error(str(exc)) from None
        s = thresholds["baseline"]
        note = (f"Calibrated from {2 * cfg.warmup} warm-up traces (η = {cfg.eta:g}% kept): threshold **{s:.3f}**, "
                "now used for early stop.")
        return "fixed", s, charts.histogram_figure(lows, {"shared": s}), note

    def build(self, num_layers: int) -> None:
        strategies = list(REGISTRY)
        with gr.Tab("Deep Think", id="deepthink"):
            gr.Markdown("DeepConf on both sides: warm-up traces calibrate an early-stop threshold, more traces run "
                        "with online early stop, and the survivors vote (weighted by their lowest group "
                        "confidence after keeping the top η%). Stopped traces never vote; their tokens still count.")
            prompt = gr.Textbox(label="Question", lines=2, elem_id="dt-prompt",
                                value="What is 6 multiplied by 7? Answer with a number.")
            with gr.Row():
                strategy = gr.Dropdown(strategies, value=strategies[0], label="Feedback strategy")
                traces = gr.Number(8, label="traces per side", precision=0, minimum=1, maximum=MAX_TRACES)
                warmup = gr.Number(4, label="warm-up traces per side", precision=0, minimum=1, maximum=MAX_TRACES)
            with gr.Row():
                eta_preset = gr.Radio(ETA_CHOICES, value=ETA_CHOICES[1], label="η (share kept)")
                eta = gr.Number(50, label="custom η %", minimum=0.0001, maximum=100)
                window = gr.Number(16, label="window", precision=0, minimum=1)
            with gr.Row():
                max_new = gr.Number(96, label="max new tokens", precision=0, minimum=1, maximum=1024)
                temperature = gr.Number(0.7, label="temperature", minimum=0.01, maximum=10)
                top_p = gr.Number(0.95, label="top-p", minimum=0.01, maximum=1)
                seed = gr.Number(0, label="seed", precision=0, minimum=0)
            with gr.Row():
                regex = gr.Textbox(label="answer regex (optional; first group)", placeholder=r"Answer: (\d+)")
                shared = gr.Checkbox(False, label="one threshold for both sides")
                check = gr.Checkbox(False, label="check mode (finish stopped traces to measure tokens saved)")
            self.controls = build_strategy_controls(num_layers, strategies[0], prefix="dt")
            go = gr.Button("Run Deep Think", variant="primary", elem_id="dt-run")
            summary = gr.Markdown(elem_id="dt-summary")
            votes = gr.Plot(show_label=False, elem_id="dt-votes")
            warm_hist = gr.Plot(show_label=False, elem_id="dt-warmup")
            with gr.Row():
                base_curves = gr.Plot(show_label=False)
                fb_curves = gr.Plot(show_label=False)
            table = gr.Dataframe(headers=["side", "phase", "trace", "state", "tokens", "lowest group", "answer",
                                          "text"], interactive=False, wrap=True)
            with gr.Accordion("Report (JSON)", open=False):
                report = gr.JSON()
            self.controls.follow(strategy)
            go.click(with_named_params(self.run, self.controls, self.pool.gate),
                     [prompt, strategy, traces, warmup, eta_preset, eta, window, max_new, temperature, top_p, seed,
                      regex, shared, check, *self.controls.components],
                     [summary, votes, base_curves, fb_curves, table, report, warm_hist], api_name="deepthink",
                     concurrency_id="model", concurrency_limit=1)
