"""Deep Think tab: DeepConf's multi-trace vote on both sides (baseline and feedback). The work goes
through `ModelRunner`; this module formats the report."""
from __future__ import annotations

import threading
from html import escape

import gradio as gr

from feedback.errors import FeedbackError
from feedback.eval.deepthink import SIDES, VOTE_KINDS, DeepThinkConfig, check_budget, deep_think
from feedback.serve.limits import SERVED_MAX_TRACES, SERVED_TRACE_MAX_NEW_TOKENS
from feedback.serve.pool import ModelPool
from ui import charts
from ui.controls import build_strategy_panel, parse_number, run_controls
from ui.deepconf import ETA_CHOICES, resolve_eta
from ui.runner import ModelRunner, Outcome, TabWork, cancellable_by_clients, reporting

TAB = "deepthink"


def mark(correct: bool | None) -> str:
    return "" if correct is None else (" ✓ correct" if correct else " ✗ wrong")


def side_markdown(side: str, rep: dict, traces: int) -> str:
    """One side's answer, its other votes with what each means, and the cost."""
    votes = rep["votes"]

    def answer(name: str) -> str:
        v = votes[name]
        return f"`{escape(str(v['answer']))}`{mark(v.get('correct'))}"

    saved = ("measured" if rep["tokens_saved_method"].startswith("measured") else "at most")
    return (f"### {side}\n**DeepConf answer {answer('lowest_group')}** — {rep['share']:.0%} of the confidence-weighted "
            f"vote  \n"
            f"majority vote {answer('majority')} · tail-weighted vote {answer('tail')}  \n"
            f"threshold {rep['threshold']:.2f} · {rep['stopped']} of {traces} online traces stopped early · "
            f"tokens spent {rep['tokens_spent']}, saved {saved} {rep['tokens_saved']}")


def votes_help() -> str:
    return ("<div class='fl-note'><b>Three votes, three questions.</b> " +
            " · ".join(f"<b>{name}</b>: {escape(text)}" for name, text in
                       [("DeepConf answer", VOTE_KINDS["lowest_group"]), ("majority", VOTE_KINDS["majority"]),
                        ("tail-weighted", VOTE_KINDS["tail"])]) +
            ". They differ when confident and unconfident traces disagree.</div>")


def trace_rows(report: dict) -> list[list]:
    rows = []
    for side in SIDES:
        for t in report["sides"][side]["traces"]:
            state = "stopped" if t["stopped"] else "filtered" if t["excluded"] else "voted"
            low = t["lowest_group"]
            correct = {True: "✓", False: "✗"}.get(t.get("correct"), "—")
            rows.append([side, t["phase"], t["name"], state, t["tokens"], None if low is None else round(low, 2),
                         t["answer"], correct, t["text"]])
    return rows


class DeepThinkWork(TabWork):
    label = "a Deep Think run"

    def __init__(self, tab: "DeepThinkTab", lm, cfg: DeepThinkConfig):
        super().__init__(tab.run, tab.stop, tab.status)
        self.tab, self.lm, self.cfg = tab, lm, cfg
        self.report = None
        self.gpu_seconds = 60 + 3 * cfg.max_new_tokens

    def run(self, stop: threading.Event):
        yield from reporting(lambda report, halt: deep_think(self.lm, self.cfg, progress=report, stop=halt), stop)

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
        sides = rep["sides"]
        summary = (side_markdown("Baseline", sides["baseline"], self.cfg.traces) + "\n\n" +
                   side_markdown("Feedback", sides["feedback"], self.cfg.traces))
        return self.idle() | self.say(f"Done in {rep['wall_seconds']:.1f} s."
                                      + "".join(f" Note: {w}" for w in rep["warnings"])) | {
            self.tab.summary: summary, self.tab.votes: charts.vote_figure(sides),
            self.tab.curves[0]: charts.trace_figure("baseline", sides["baseline"], 0),
            self.tab.curves[1]: charts.trace_figure("feedback", sides["feedback"], 1),
            self.tab.table: trace_rows(rep), self.tab.report: rep,
            self.tab.warm_hist: charts.histogram_figure({side: sides[side]["warmup_lowest_groups"] for side in SIDES},
                                                        rep["thresholds"])}


class DeepThinkTab:
    def __init__(self, pool: ModelPool, runner: ModelRunner):
        self.pool, self.runner = pool, runner

    def prepare(self, prompt, expected, strategy, traces, warmup, eta_preset, eta, window, max_new, temperature,
                top_p, seed, regex, shared, check, *param_values) -> DeepThinkWork:
        """N sampled traces per side with calibrated early stop, then the votes."""
        if not prompt or not prompt.strip():
            raise FeedbackError("the question is empty")
        cfg = DeepThinkConfig(
            prompt=prompt or "", expected=(expected or "").strip() or None,
            traces=parse_number(traces, "traces per side", integer=True, lo=1, hi=SERVED_MAX_TRACES),
            warmup=parse_number(warmup, "warm-up traces per side", integer=True, lo=1, hi=SERVED_MAX_TRACES),
            eta=resolve_eta(eta_preset, eta), window=parse_number(window, "window", integer=True, lo=1, hi=100_000),
            max_new_tokens=parse_number(max_new, "max new tokens", integer=True, lo=1, hi=SERVED_TRACE_MAX_NEW_TOKENS),
            temperature=parse_number(temperature, "temperature", lo=0.01, hi=10),
            top_p=parse_number(top_p, "top-p", lo=0.01, hi=1), seed=parse_number(seed, "seed", integer=True, lo=0),
            strategy=strategy, params=self.panel.params_for(strategy, list(param_values)),
            answer_regex=regex or None, shared_threshold=bool(shared), check=bool(check))
        lm = self.pool.get()
        cfg.validate(lm.num_layers)
        check_budget(lm, cfg, self.runner.budget)
        return DeepThinkWork(self, lm, cfg)

    def stop_run(self, request: gr.Request = None) -> str:
        return self.runner.stop(TAB, request)

    def build(self, num_layers: int) -> None:
        with gr.Tab("Deep Think", id=TAB):
            gr.Markdown("DeepConf on both sides: warm-up traces calibrate an early-stop threshold, more traces run "
                        "with online early stop, and the survivors vote. Stopped traces never vote; their tokens "
                        "still count as cost.")
            with gr.Row():
                prompt = gr.Textbox(label="Question", lines=2, elem_id="dt-prompt", scale=3,
                                    value="What is 6 multiplied by 7? Answer with a number.")
                expected = gr.Textbox("42", label="expected answer (optional)", elem_id="dt-expected", scale=1,
                                      info="marks each trace and vote correct or wrong")
            with gr.Row(equal_height=False):
                with gr.Column(min_width=280):
                    self.panel = build_strategy_panel(num_layers, "residual", prefix="dt")
                with gr.Column(min_width=280):
                    with gr.Row():
                        traces = gr.Number(8, label="traces per side", precision=0, minimum=1,
                                           maximum=SERVED_MAX_TRACES, info=f"1 to {SERVED_MAX_TRACES}",
                                           elem_id="dt-traces")
                        warmup = gr.Number(4, label="warm-up traces per side", precision=0, minimum=1,
                                           maximum=SERVED_MAX_TRACES, info=f"1 to {SERVED_MAX_TRACES}",
                                           elem_id="dt-warmup")
                    eta_preset = gr.Radio(ETA_CHOICES, value=ETA_CHOICES[1], label="η (share of traces kept)")
                    with gr.Row():
                        eta = gr.Number(50, label="custom η %", minimum=0.0001, maximum=100)
                        window = gr.Number(16, label="window", precision=0, minimum=1)
                    with gr.Row():
                        max_new = gr.Number(96, label="max new tokens", precision=0, minimum=1,
                                            maximum=SERVED_TRACE_MAX_NEW_TOKENS, info=f"1 to {SERVED_TRACE_MAX_NEW_TOKENS}",
                                            elem_id="dt-max-new")
                        temperature = gr.Number(0.7, label="temperature", minimum=0.01, maximum=10, step=0.05)
                        top_p = gr.Number(0.95, label="top-p", minimum=0.01, maximum=1, step=0.05)
                        seed = gr.Number(0, label="seed", precision=0, minimum=0)
                    regex = gr.Textbox(label="answer regex (optional; its first group is the answer)",
                                       placeholder=r"Answer: (\d+)",
                                       info="otherwise: \\boxed{…}, “the answer is …”, the last equation result, …")
                    with gr.Row():
                        shared = gr.Checkbox(False, label="one threshold for both sides")
                        check = gr.Checkbox(False, label="check mode (finish stopped traces to measure tokens saved)")
            self.run, self.stop, self.status = run_controls("dt", "Run Deep Think")
            self.summary = gr.Markdown(elem_id="dt-summary")
            gr.HTML(votes_help())
            self.votes = gr.Plot(show_label=False, elem_id="dt-votes")
            self.warm_hist = gr.Plot(show_label=False, elem_id="dt-warmup")
            with gr.Row():
                self.curves = [gr.Plot(show_label=False, elem_id="dt-curves-baseline"),
                               gr.Plot(show_label=False, elem_id="dt-curves-feedback")]
            self.table = gr.Dataframe(headers=["side", "phase", "trace", "state", "tokens", "lowest group", "answer",
                                               "correct", "text"], interactive=False, wrap=True, elem_id="dt-table",
                                      column_widths=["7%", "7%", "9%", "7%", "6%", "7%", "8%", "6%", "43%"])
            with gr.Accordion("Report (JSON)", open=False):
                self.report = gr.JSON()
            stop_ack = gr.Textbox(visible=False)
            cancel_trigger = gr.Button(visible=False)  # for program clients' Job.cancel()
        handler = self.runner.wrap(TAB, self.prepare, self.panel.api_names)
        running = self.run.click(handler, [prompt, expected, self.panel.strategy, traces, warmup, eta_preset, eta, window,
                                     max_new, temperature, top_p, seed, regex, shared, check, *self.panel.components],
                           [self.summary, self.votes, *self.curves, self.table, self.report, self.warm_hist, self.status,
                            self.run, self.stop], api_name="deepthink", concurrency_limit=None, show_progress="hidden")
        self.stop.click(self.stop_run, None, stop_ack, api_name="stop_deepthink", concurrency_limit=None,
                        show_progress="hidden")
        cancellable_by_clients(cancel_trigger, running)
