"""The Compare tab's components, built in one place (`build_controls`) and held in small objects:
the shared settings and every column's (their controls made by their entries in
`ui.page.settings`), the run buttons and status line, the outputs, the memory chart, the
conversation and branch controls, the link and Calibrate. The layout decides only where each
control goes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import gradio as gr

import feedback
from feedback.core.records import RunConfig
from feedback.serve.limits import BOX_MAX_CHARS
from ui.compare.stream import empty_doc
from ui.compare.view import heading
from ui.page import charts, render
from ui.page.controls import LazyJSON, StrategyPanel, lazy_json
from ui.page.settings import (
    CALIBRATION,
    COLUMN,
    MAX_COLUMNS,
    MIN_COLUMNS,
    SHARED,
    TOKEN_VIEWS,
    Page,
    column_key,
    default_row,
)

HERE = Path(__file__).resolve().parent
# (verdict, sign): on a phone only the sign shows (the word is `fl-word`); the title says it whole
RATINGS = (("better", "▲"), ("worse", "▼"), ("tie", "="))
IDLE_POLL_S = 5.0  # memory chart while idle (and the page visible); inside a run it is sampled per step


def load_examples() -> list[str]:
    data = json.loads((feedback.ASSETS / "examples.json").read_text(encoding="utf-8"))
    return [e["prompt"] for e in data]


@dataclass
class ColumnControls:
    """One column's settings: its tab in the Columns settings (shown while the column is), the
    heading they make (a preview of what the column will run) and the settings by setting name (the
    strategy's is its panel). What the column shows of a run is the board's."""

    index: int
    box: gr.Tab
    heading: gr.HTML
    settings: dict
    preview: gr.Textbox  # hidden: the newest heading preview and the order it was asked in

    @property
    def panel(self) -> StrategyPanel:
        return self.settings["strategy"]

    def inputs(self) -> dict:
        """Its settings' controls by API name: c2_name, c2_strategy, c2_residual_alpha, c2_temperature, …"""
        return {
            column_key(self.index, name): component
            for s in COLUMN
            for name, component in s.inputs(self.settings[s.name]).items()
        }

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
    view: gr.Radio  # the token view: confidence, plain, markdown or diff (the board switches, no server call)
    board: gr.HTML  # the columns: the run's token events (ui.compare.stream), drawn by board.js
    conf_plot: gr.Plot
    run_json: LazyJSON  # the finished run: whole for program clients, shown to a person on demand
    last: gr.State  # the last finished run: what Continue, branches and History go on from
    metrics: gr.HTML  # one table of every column's metrics
    rated: gr.State  # the ratings given on this page to the run it shows: {"run_id", "ratings"}


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
    settings: dict  # Calibrate's own settings by name (ui.page.settings.CALIBRATION)
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
    """Every component of the Compare tab, inside the current Tab. The prompt and the run buttons
    come first and every setting sits in one closed box of tabs, so that after Generate the answers
    are on screen without scrolling (at 1440 x 900)."""
    shared = Placed(page, SHARED)
    with gr.Row(equal_height=False):
        with gr.Column(scale=4, min_width=300):
            (prompt,) = shared.place("prompt")
            run, link = _run_controls()
        with gr.Column(scale=1, min_width=200):
            with gr.Row():
                run.generate.render()
                run.stop.render()
            link.button.render()
            # From the keyboard, the answers are many stops away (examples, settings): this link,
            # shown when it has focus, goes straight to column 1's first token.
            gr.HTML(
                '<a class="fl-skip" href="#columns">Skip to the answers (column 1\'s first token)</a>',
                elem_id="skip-to-answers",
                container=False,
            )
            examples(prompt)
    with gr.Accordion(
        "Settings: columns, model and sampling, DeepConf, system prompt", open=False, elem_id="settings"
    ):
        with gr.Tabs(elem_id="settings-tabs", overflow_behavior="wrap"):  # every tab reachable on a phone
            with gr.Tab("Columns", id="columns-tab"):
                with gr.Row():
                    shared.place("columns")
                    add = gr.Button("+ Add column", size="sm", elem_id="add-column")
                    remove = gr.Button(
                        "− Remove last column", size="sm", interactive=False, elem_id="remove-column"
                    )
                with gr.Row():
                    branch_all = gr.Checkbox(
                        True,
                        label="a branch applies to every column",
                        elem_id="branch-all",
                        info="click an alternative in a token's card: every column goes on "
                        "from that column's text and the token you chose",
                    )
                    branch_matching = gr.Checkbox(
                        False,
                        label="only columns with the same text up to there",
                        elem_id="branch-matching",
                        info="the others are left as they were",
                    )
                with gr.Tabs(elem_id="column-tabs", overflow_behavior="wrap"):
                    cols = [build_column(replace(page, column=i)) for i in range(MAX_COLUMNS)]
            with gr.Tab("Model and sampling", id="sampling-tab", elem_id="sampling"):
                with gr.Row():
                    shared.place("model", "chat_template", "max_new_tokens")
                gr.Markdown(
                    "Shared by every column (a column may set its own temperature, top-p and seed).",
                    elem_classes="fl-note",
                )
                with gr.Row():
                    shared.place("temperature", "top_p", "top_k")
                with gr.Row():
                    shared.place("min_p", "repetition_penalty", "seed")
            with gr.Tab("DeepConf", id="deepconf-tab", elem_id="deepconf"):
                calibration = _deepconf_controls(shared, page)
            with gr.Tab("System prompt and evaluation", id="system-tab", elem_id="system-settings"):
                shared.place("system_prompt")
                with gr.Row(elem_id="evaluation"):
                    shared.place("reference", "key_facts")
    with gr.Row(equal_height=True, elem_id="view-row"):
        view = gr.Radio(
            list(TOKEN_VIEWS),
            value=TOKEN_VIEWS[0],
            label="Token view",
            scale=1,
            min_width=300,
            elem_id="token-view",
            show_label=False,
        )
        gr.HTML(render.confidence_legend(), elem_id="legend", scale=3)  # under the views on a phone (CSS)
    # before a run: the default columns, headed, empty
    first = empty_doc(
        RunConfig(prompt="", rows=[default_row(i, page.num_layers) for i in range(MIN_COLUMNS)])
    )
    board = gr.HTML(
        first,
        html_template='<div class="fl-board"></div>',
        js_on_load=board_js(),
        elem_id="columns",
        apply_default_css=False,
        container=False,
    )
    metrics = gr.HTML(elem_id="metrics")
    follow = _follow_controls(branch_all, branch_matching)
    actions = _column_action_controls()
    gr.Markdown("#### Confidence per decode step")
    conf_plot = gr.Plot(charts.confidence_figure([]), show_label=False, elem_id="conf-plot")
    gr.Markdown("#### Memory")
    mem_plot = gr.Plot(charts.memory_figure([], "the page opened"), show_label=False, elem_id="mem-plot")
    last = gr.State(None)
    run_json = lazy_json("Run result (JSON)", "run-json", kept=last)
    memory = MemoryControls(
        mem_plot,
        gr.State({}),
        gr.Timer(IDLE_POLL_S),
        gr.Checkbox(
            True, elem_id="fl-page-visible", elem_classes="fl-hidden", container=False, label="page visible"
        ),
    )
    return CompareControls(
        shared.done(),
        cols,
        add,
        remove,
        run,
        OutputControls(view, board, conf_plot, run_json, last, metrics, gr.State(None)),
        memory,
        follow,
        link,
        calibration,
        actions,
    )


def examples(prompt: gr.Textbox) -> gr.Dropdown:
    """The example prompts, one line each: the one picked goes into the prompt box (in the page;
    nothing is sent to the server)."""
    choices = [(_short(p), p) for p in load_examples()]
    box = gr.Dropdown(choices, value=None, label="Examples", elem_id="examples", info="fills the prompt box")
    box.input(None, box, prompt, js="(picked) => picked", api_name=False, queue=False, show_progress="hidden")
    return box


def _short(prompt: str, chars: int = 60) -> str:
    line = " ".join(prompt.split())
    return line if len(line) <= chars else line[: chars - 1].rstrip() + "…"


def board_js() -> str:
    """The board's script with what it shares with the server: the confidence colours, the card's
    fixed rows, the rating buttons, the diff legend, the memory chart's least span."""
    config = {
        "bins": [
            [None if bound == float("inf") else bound, color] for bound, _, color in render.CONFIDENCE_BINS
        ],
        "chosen_row": list(render.CHOSEN_ROW),
        "replayed_row": list(render.REPLAYED_ROW),
        "part_rows": {k: list(v) for k, v in render.PART_ROWS.items()},
        "ratings": [[verdict, sign] for verdict, sign in RATINGS],
        "diff_legend": render.diff_legend(),
        "memory_min_span": charts.MEMORY_MIN_SPAN_MB,
    }
    return (
        (HERE / "board.js")
        .read_text(encoding="utf-8")
        .replace("__CONFIG__", json.dumps(config, ensure_ascii=False))
    )


def build_column(page: Page) -> ColumnControls:
    """Column `page.column`'s tab of settings: the heading they make, then every column setting in
    the table's order."""
    index = page.column
    n = index + 1
    with gr.Tab(
        f"Column {n}", id=f"col{n}-tab", visible=index < MIN_COLUMNS, elem_id=f"col{n}-settings"
    ) as box:
        # HTML, never Markdown: a column's name is the user's (or a link's), shown as text
        title = gr.HTML(heading(index, default_row(index, page.num_layers)), elem_id=f"col{n}-heading")
        settings = {s.name: s.build(page) for s in COLUMN}
        preview = gr.Textbox(
            "", elem_id=f"col{n}-preview", elem_classes="fl-hidden", container=False, label="heading preview"
        )
    return ColumnControls(index, box, title, settings, preview)


def _column_action_controls() -> ColumnActions:
    request = gr.Textbox(
        "", elem_id="fl-column-request", elem_classes="fl-hidden", container=False, label="column request"
    )
    rerun = gr.Button("re-run column", elem_id="fl-rerun-go", elem_classes="fl-hidden")
    stop = gr.Button("stop column", elem_id="fl-stop-go", elem_classes="fl-hidden")
    rate = gr.Button("rate column", elem_id="fl-rate-go", elem_classes="fl-hidden")
    return ColumnActions(request, rerun, stop, rate)


def _run_controls() -> tuple[RunControls, LinkControls]:
    """The run buttons and the link's (placed by the caller), the status line and the link's note
    (here, under the prompt)."""
    generate = gr.Button("Generate", variant="primary", elem_id="generate", min_width=90, render=False)
    stop = gr.Button("Stop", variant="stop", interactive=False, elem_id="stop", min_width=70, render=False)
    button = gr.Button("Copy link", size="sm", elem_id="copy-link", render=False)
    status = gr.HTML(
        render.status_html("Ready. Pick an example or type a prompt, then Generate."),
        elem_id="status",
        render=False,
    )
    note = gr.Markdown(elem_id="link-note", elem_classes="fl-note", render=False)
    data = gr.Textbox(
        "", visible=True, elem_id="link-data", elem_classes="fl-hidden", container=False, label="link data"
    )
    # Stop's answer, and what the page sends with Stop (the step it shows; "" from a program)
    run = RunControls(generate, stop, status, gr.Textbox("", visible=False), gr.Button(visible=False))
    status.render()
    note.render()
    return run, LinkControls(button, note, data)


def _deepconf_controls(shared: Placed, page: Page) -> CalibrationControls:
    own = Placed(page, CALIBRATION)
    with gr.Row():
        shared.place("k", "window")
    with gr.Row():
        shared.place("threshold_mode", "threshold")
    gr.Markdown(
        "**Calibrate** runs warm-up traces of the shared prompt (the baseline and the first "
        "column with a strategy) and sets the threshold to the percentile that keeps η % of them.",
        elem_classes="fl-note",
    )
    with gr.Row():
        own.place("eta_preset")
    with gr.Row():
        own.place("eta", "warmup")
    button = gr.Button("Calibrate threshold", elem_id="calibrate")
    note = gr.Markdown(elem_id="calib-note")
    plot = gr.Plot(show_label=False, visible=False, elem_id="calib-plot")
    return CalibrationControls(own.done(), button, note, plot)


def _follow_controls(branch_all: gr.Checkbox, branch_matching: gr.Checkbox) -> FollowControls:
    with gr.Row(visible=False, elem_id="follow-row") as row:
        message = gr.Textbox(
            "",
            label="Continue the conversation",
            lines=1,
            max_length=BOX_MAX_CHARS,
            scale=4,
            elem_id="follow-up",
            placeholder="A follow-up for every column (Enter sends)",
        )
        with gr.Column(scale=1, min_width=160):
            send = gr.Button("Continue", elem_id="continue")
            new = gr.Button("New conversation", size="sm", elem_id="new-conversation")
    request = gr.Textbox(
        "", elem_id="fl-branch-request", elem_classes="fl-hidden", container=False, label="branch request"
    )
    go = gr.Button("branch", elem_id="fl-branch-go", elem_classes="fl-hidden")
    return FollowControls(row, message, send, new, branch_all, branch_matching, request, go)
