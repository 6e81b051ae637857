"""The Compare tab's components, built in one place (`build_controls`) and held in small objects:
the shared settings and every column's (their controls made by their entries in
`ui.compare.settings`), the run buttons and status line, the outputs, the memory chart, the
conversation and branch controls, the link and Calibrate. The layout decides only where each
control goes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import gradio as gr

from feedback.serve.limits import BOX_MAX_CHARS
from ui import charts, render
from ui.compare.settings import (CALIBRATION, COLUMN, MAX_COLUMNS, MIN_COLUMNS, SHARED, TOKEN_VIEWS, Page, column_key,
                                 default_row)
from ui.compare.view import heading
from ui.controls import LazyJSON, StrategyPanel, lazy_json

ASSETS = Path(__file__).resolve().parents[2] / "assets"
# (verdict, label): on a phone only the sign shows (the word is `fl-word`); the title says it whole
RATE_BUTTONS = (("better", '▲<span class="fl-word"> better</span>'), ("worse", '▼<span class="fl-word"> worse</span>'),
                ("tie", '=<span class="fl-word"> tie</span>'))
IDLE_POLL_S = 5.0  # memory chart while idle (and the page visible); inside a run it is sampled per step


def load_examples() -> list[str]:
    data = json.loads((ASSETS / "examples.json").read_text(encoding="utf-8"))
    return [e["prompt"] for e in data]


@dataclass
class ColumnControls:
    """One output column: its box, heading, settings (by setting name; the strategy's is its panel)
    and outputs (conversation, text)."""

    index: int
    box: gr.Column
    heading: gr.HTML
    settings: dict
    turns: gr.HTML
    text: gr.HTML

    @property
    def panel(self) -> StrategyPanel:
        return self.settings["strategy"]

    def inputs(self) -> dict:
        """Its settings' controls by API name: c2_name, c2_strategy, c2_residual_alpha, c2_temperature, …"""
        return {column_key(self.index, name): component for s in COLUMN
                for name, component in s.inputs(self.settings[s.name]).items()}

    def setting_outputs(self) -> list:
        """Every component restoring its settings may update."""
        return [x for s in COLUMN for x in s.outputs(self.settings[s.name])]


@dataclass
class RunControls:
    generate: gr.Button
    stop: gr.Button
    status: gr.HTML
    stop_ack: gr.Textbox  # Stop's answer: never shares the status line
    cancel_trigger: gr.Button  # for program clients' Job.cancel()


@dataclass
class OutputControls:
    view: gr.Radio  # the token view: confidence, plain or diff
    diff_legend: gr.HTML
    conf_plot: gr.Plot
    run_json: LazyJSON  # the finished run: whole for program clients, shown to a person on demand
    last: gr.State  # the last finished run: what Continue, branches and History go on from
    chart_feed: gr.HTML  # a streaming run's new chart points, which the page script adds to the chart
    metrics: gr.HTML  # one table of every column's metrics


@dataclass
class MemoryControls:
    plot: gr.Plot
    state: gr.State  # its samples
    timer: gr.Timer  # idle polling
    page_visible: gr.Checkbox  # polling pauses while the page is hidden


@dataclass
class FollowControls:
    """Continue the conversation, and branch from an alternative token."""

    row: gr.Row
    message: gr.Textbox
    send: gr.Button
    new: gr.Button
    branch_all: gr.Checkbox
    branch_matching: gr.Checkbox  # with branch_all: only columns whose text matched up to the step
    branch_request: gr.Textbox  # the page script writes the chosen alternative here ...
    branch_go: gr.Button  # ... and clicks this


@dataclass
class ColumnActions:
    """Re-run or stop one column: the page script writes the column's number here and clicks one
    of the buttons."""

    request: gr.Textbox  # "2" (re-run, stop) or "2 better" (rate)
    rerun: gr.Button
    stop: gr.Button
    rate: gr.Button


@dataclass
class LinkControls:
    button: gr.Button
    note: gr.Markdown
    data: gr.Textbox  # the link data, which the page script puts in the address bar


@dataclass
class CalibrationControls:
    settings: dict  # Calibrate's own settings by name (ui.compare.settings.CALIBRATION)
    button: gr.Button
    note: gr.Markdown
    plot: gr.Plot


@dataclass
class CompareControls:
    """Every component of the Compare tab."""

    settings: dict  # the shared settings' controls by name, in the table's order
    cols: list[ColumnControls]
    add_column: gr.Button
    remove_column: gr.Button
    run: RunControls
    out: OutputControls
    memory: MemoryControls
    follow: FollowControls
    link: LinkControls
    calibration: CalibrationControls
    actions: ColumnActions


class Placed:
    """Settings' controls built where the layout puts them; `done()` checks every one got a place."""

    def __init__(self, page: Page, table):
        self.page, self.table, self.built = page, {s.name: s for s in table}, {}

    def place(self, *names: str) -> list:
        for name in names:
            self.built[name] = self.table[name].build(self.page)
        return [self.built[name] for name in names]

    def done(self) -> dict:
        missing = [name for name in self.table if name not in self.built]
        if missing:
            raise ValueError(f"settings without a place in the Compare layout: {', '.join(missing)}")
        return {name: self.built[name] for name in self.table}


def build_controls(page: Page) -> CompareControls:
    """Every component of the Compare tab, inside the current Tab."""
    shared = Placed(page, SHARED)
    with gr.Row(equal_height=False):
        with gr.Column(scale=3, min_width=300):
            prompt, = shared.place("prompt")
            run = _run_controls()
            gr.Examples(load_examples(), inputs=[prompt], label="Examples")
            with gr.Accordion("System prompt", open=False, elem_id="system-accordion"):
                shared.place("system_prompt")
            with gr.Accordion("Evaluation", open=False, elem_id="evaluation"):
                shared.place("reference", "key_facts")
        with gr.Column(scale=2, min_width=300):
            with gr.Row():
                shared.place("model", "chat_template")
            with gr.Accordion("Sampling (shared by every column)", open=False, elem_id="sampling"):
                with gr.Row():
                    shared.place("temperature", "top_p", "top_k")
                with gr.Row():
                    shared.place("min_p", "repetition_penalty", "seed")
                shared.place("max_new_tokens")
            calibration = _deepconf_controls(shared, page)
            link = _link_controls()
    with gr.Row(equal_height=True):
        view = gr.Radio(list(TOKEN_VIEWS), value=TOKEN_VIEWS[0], label="Token view", scale=1, min_width=220,
                        elem_id="token-view", info="markdown: the answer formatted; diff: each column's words "
                                                   "against column 1")
        gr.HTML(render.confidence_legend(), elem_id="legend")
    diff_legend = gr.HTML(render.diff_legend(), visible=False, elem_id="diff-legend-box")
    with gr.Row():
        shared.place("columns")
        add = gr.Button("+ Add column", size="sm", elem_id="add-column")
        remove = gr.Button("− Remove last column", size="sm", interactive=False, elem_id="remove-column")
        branch_all = gr.Checkbox(True, label="a branch applies to every column", elem_id="branch-all",
                                 info="click an alternative in a token's card: every column goes on from that "
                                      "column's text and the token you chose")
        branch_matching = gr.Checkbox(False, label="only columns with the same text up to there",
                                      elem_id="branch-matching",
                                      info="the others are left as they were")
    with gr.Row(equal_height=False, elem_classes="fl-columns", elem_id="columns"):
        cols = [build_column(replace(page, column=i)) for i in range(MAX_COLUMNS)]
    metrics = gr.HTML(elem_id="metrics")
    follow = _follow_controls(branch_all, branch_matching)
    actions = _column_action_controls()
    gr.Markdown("#### Confidence per decode step")
    conf_plot = gr.Plot(charts.confidence_figure([]), show_label=False, elem_id="conf-plot")
    chart_feed = gr.HTML("", elem_id="chart-feed", elem_classes="fl-hidden", container=False)
    gr.Markdown("#### Memory")
    mem_plot = gr.Plot(charts.memory_figure([], "the page opened"), show_label=False, elem_id="mem-plot")
    last = gr.State(None)
    run_json = lazy_json("Run result (JSON)", "run-json", kept=last)
    memory = MemoryControls(mem_plot, gr.State({}), gr.Timer(IDLE_POLL_S),
                            gr.Checkbox(True, elem_id="fl-page-visible", elem_classes="fl-hidden", container=False,
                                        label="page visible"))
    return CompareControls(shared.done(), cols, add, remove, run, OutputControls(view, diff_legend, conf_plot, run_json,
                                                                                 last, chart_feed, metrics),
                           memory, follow, link, calibration, actions)


def build_column(page: Page) -> ColumnControls:
    """Column slot `page.column`: heading, settings (collapsed: every column setting, in the
    table's order), conversation and text."""
    index = page.column
    n = index + 1
    with gr.Column(min_width=0, visible=index < MIN_COLUMNS, elem_id=f"col{n}") as box:
        # HTML, never Markdown: a column's name is the user's (or a link's), shown as text
        title = gr.HTML(heading(index, default_row(index, page.num_layers)), elem_id=f"col{n}-heading")
        with gr.Accordion("Column settings", open=False, elem_id=f"col{n}-settings"):
            settings = {s.name: s.build(page) for s in COLUMN}
        turns = gr.HTML(elem_id=f"col{n}-turns")
        text = gr.HTML(render.render_tokens([]), elem_id=f"col{n}-text")
        gr.HTML(_column_actions(n), elem_id=f"col{n}-actions", container=False)
    return ColumnControls(index, box, title, settings, turns, text)


def _column_actions(n: int) -> str:
    """Under a column: Copy answer (the page script copies the text; nothing goes to the server),
    Re-run (this column alone with its settings as they are now) and the rating buttons (shown
    while idle), Stop (this column alone; shown while a run streams). The page script sends all but
    Copy through the hidden column request (`ColumnActions`)."""
    return (f'<div class="fl-col-actions">'
            f'<button type="button" class="fl-copy" data-col="col{n}" title="copy this column\'s answer">'
            'Copy<span class="fl-word"> answer</span></button>'
            f'<button type="button" class="fl-col-act fl-rerun" data-column="{n}" data-act="rerun" '
            'title="run this column again with its settings as they are now; the other columns stay">Re-run</button>'
            f'<button type="button" class="fl-col-act fl-col-stop" data-column="{n}" data-act="stop" '
            'title="stop this column; the others go on">Stop<span class="fl-word"> column</span></button>'
            + "".join(f'<button type="button" class="fl-col-act fl-rate" data-column="{n}" data-act="rate" '
                      f'data-verdict="{verdict}" title="rate this column {verdict}; saved with the run in History '
                      f'(add a note there)">{label}</button>' for verdict, label in RATE_BUTTONS)
            + '</div>')


def _column_action_controls() -> ColumnActions:
    request = gr.Textbox("", elem_id="fl-column-request", elem_classes="fl-hidden", container=False,
                         label="column request")
    rerun = gr.Button("re-run column", elem_id="fl-rerun-go", elem_classes="fl-hidden")
    stop = gr.Button("stop column", elem_id="fl-stop-go", elem_classes="fl-hidden")
    rate = gr.Button("rate column", elem_id="fl-rate-go", elem_classes="fl-hidden")
    return ColumnActions(request, rerun, stop, rate)


def _run_controls() -> RunControls:
    with gr.Row():
        generate = gr.Button("Generate", variant="primary", elem_id="generate")
        stop = gr.Button("Stop", variant="stop", interactive=False, elem_id="stop")
    status = gr.HTML(render.status_html("Ready. Pick an example or type a prompt, then Generate."), elem_id="status")
    # From the keyboard, the answers are many stops away (examples, settings, columns' settings):
    # this link, shown when it has focus, goes straight to column 1's first token.
    gr.HTML('<a class="fl-skip" href="#columns">Skip to the answers (column 1\'s first token)</a>',
            elem_id="skip-to-answers", container=False)
    # Stop's answer, and what the page sends with Stop (the step it shows; "" from a program)
    return RunControls(generate, stop, status, gr.Textbox("", visible=False), gr.Button(visible=False))


def _deepconf_controls(shared: Placed, page: Page) -> CalibrationControls:
    own = Placed(page, CALIBRATION)
    with gr.Accordion("DeepConf confidence and early stop", open=False, elem_id="deepconf"):
        with gr.Row():
            shared.place("k", "window")
        with gr.Row():
            shared.place("threshold_mode", "threshold")
        gr.Markdown("**Calibrate** runs warm-up traces of the shared prompt (the baseline and the first "
                    "column with a strategy) and sets the threshold to the percentile that keeps η % of them.",
                    elem_classes="fl-note")
        with gr.Row():
            own.place("eta_preset")
        with gr.Row():
            own.place("eta", "warmup")
        button = gr.Button("Calibrate threshold", elem_id="calibrate")
        note = gr.Markdown(elem_id="calib-note")
        plot = gr.Plot(show_label=False, visible=False, elem_id="calib-plot")
    return CalibrationControls(own.done(), button, note, plot)


def _link_controls() -> LinkControls:
    with gr.Row():
        button = gr.Button("Copy link", size="sm", elem_id="copy-link")
    note = gr.Markdown(elem_id="link-note", elem_classes="fl-note")
    data = gr.Textbox("", visible=True, elem_id="link-data", elem_classes="fl-hidden", container=False,
                      label="link data")
    return LinkControls(button, note, data)


def _follow_controls(branch_all: gr.Checkbox, branch_matching: gr.Checkbox) -> FollowControls:
    with gr.Row(visible=False, elem_id="follow-row") as row:
        message = gr.Textbox("", label="Continue the conversation", lines=1, max_length=BOX_MAX_CHARS, scale=4,
                             elem_id="follow-up", placeholder="A follow-up for every column (Enter sends)")
        with gr.Column(scale=1, min_width=160):
            send = gr.Button("Continue", elem_id="continue")
            new = gr.Button("New conversation", size="sm", elem_id="new-conversation")
    request = gr.Textbox("", elem_id="fl-branch-request", elem_classes="fl-hidden", container=False,
                         label="branch request")
    go = gr.Button("branch", elem_id="fl-branch-go", elem_classes="fl-hidden")
    return FollowControls(row, message, send, new, branch_all, branch_matching, request, go)
