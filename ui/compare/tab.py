"""Compare tab, the prompt workbench: 2 to 4 columns streamed side by side from one engine run, each
with its own name, strategy and parameters and optionally its own prompt, system prompt,
temperature, top-p and seed; the other sampling settings and DeepConf are shared (common random
numbers). Stop one column while the others go on. After a run: re-run one column with changed
settings, Continue the conversation in every column, branch from any alternative token, switch to
a word diff or formatted Markdown, copy a link that restores the setup. Live confidence and memory
charts; Calibrate sets the early-stop threshold.

Where things are: the settings are declared once in `ui.page.settings` (controls, checks, their
place in a RunConfig); the components are built by `ui.compare.layout`; what a run shows is a view
(`ui.compare.view`), streamed by the works in `ui.compare.work`. This module holds the handlers,
each getting its controls' values as one dict by name, and maps views onto the components. The model
work goes through `ModelRunner` (line, GPU function, Stop, closed tabs, errors).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace

import gradio as gr

from feedback.core import memory
from feedback.core.engine import start_run
from feedback.core.records import RowSpec, RunConfig, RunResult
from feedback.core.sampling import SamplingConfig
from feedback.core.session import branch, continue_run, rerun
from feedback.errors import FeedbackError
from feedback.eval.deepthink import DeepThinkConfig, check_budget
from feedback.serve.limits import check_run, check_saved_run
from feedback.serve.pool import ModelPool
from ui.compare import link
from ui.compare.layout import CompareControls, build_controls
from ui.compare.stream import empty_doc
from ui.compare.view import CalibrationView, PageView, RunView, finished, heading
from ui.compare.work import MEMORY_POINTS, CalibrateWork, CompareWork, RerunWork, memory_entry
from ui.page import charts, history, notice, render
from ui.page.deepconf import resolve_eta
from ui.page.handoff import COMPARE_TAB
from ui.page.runner import ModelRunner, by_name, cancellable_by_clients
from ui.page.settings import (
    CALIBRATION,
    COLUMN,
    MAX_COLUMNS,
    MIN_COLUMNS,
    SHARED,
    SHARED_BY_NAME,
    Page,
    Scope,
    column_specs,
    column_values,
    read_all,
    row_spec,
    run_config,
)

TAB = COMPARE_TAB
log = logging.getLogger("feedback_lens.ui")
# Warm-up traces when Compare is greedy (every greedy trace is the same) sample as Deep Think does.
CALIBRATION_SAMPLING = (DeepThinkConfig.temperature, DeepThinkConfig.top_p)
# The shared settings Calibrate reads (with every column's, to find the first with a strategy).
CALIBRATE_READS = (
    "prompt",
    "chat_template",
    "model",
    "temperature",
    "top_p",
    "max_new_tokens",
    "seed",
    "k",
    "window",
    "columns",
)


BRANCH_REQUEST_MAX_CHARS = 1000  # {"row": a column name, "step": n, "token_id": n}, as the page sends it


def parse_branch(text: str | None) -> tuple[str, int, int]:
    """(column name, step, token id) from the page's branch request (JSON)."""
    if not isinstance(text, str) or len(text) > BRANCH_REQUEST_MAX_CHARS:
        raise FeedbackError("choose an alternative token in a token's card to branch from")
    try:
        data = json.loads(text or "")
        row, step, token = data["row"], data["step"], data["token_id"]
    except (ValueError, TypeError, KeyError, RecursionError):  # not JSON, not this shape, or nested too deep
        raise FeedbackError("choose an alternative token in a token's card to branch from") from None
    if not isinstance(row, str) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in (step, token)
    ):
        raise FeedbackError("a branch names a column, a step and a token id")
    return row, step, token


def parse_column(text: str | None) -> int:
    """The column (0-based) of the page's column request: its number, 1 to MAX_COLUMNS (a rating's
    verdict may follow it)."""
    value = ((text or "").split() or [""])[0] if isinstance(text, str) else ""
    if not value.isdigit() or not 1 <= int(value) <= MAX_COLUMNS:
        raise FeedbackError(f"choose a column (1 to {MAX_COLUMNS}) to re-run or stop, got {value[:20]!r}")
    return int(value) - 1


def calibration_sampling(temperature: float, top_p: float) -> tuple[float, float, str]:
    """(temperature, top-p, a note) of Calibrate's warm-up traces: Compare's; when Compare is greedy,
    which gives the same trace every time, Deep Think's, and the note says so."""
    if temperature != 0:
        return temperature, top_p, ""
    temperature, top_p = CALIBRATION_SAMPLING
    return (
        temperature,
        top_p,
        (
            f" Compare is greedy (temperature 0), and every greedy trace is the same, so the "
            f"warm-up traces were sampled at temperature {temperature:g}, top-p {top_p:g}."
        ),
    )


class CompareTab:
    """The Compare tab's handlers and their wiring; `build` makes the components (`self.ui`)."""

    def __init__(self, pool: ModelPool, runner: ModelRunner):
        self.pool, self.runner = pool, runner
        self.ui: CompareControls | None = None

    # ---- inputs by name ----
    def settings_inputs(self) -> dict:
        """Every setting's control by API name: the shared ones, then each column's (c<n>_…)."""
        inputs = dict(self.ui.settings)
        for col in self.ui.cols:
            inputs |= col.inputs()
        return inputs

    def initial_values(self) -> dict:
        """The settings as a new page has them, by API name (what an API client gets by default)."""
        return {name: component.value for name, component in self.settings_inputs().items()}

    # ---- views onto the components ----
    def _show_page(self, v: PageView, button) -> dict:
        out: dict = {}
        if v.busy is not None:
            out |= {
                button: gr.update(interactive=not v.busy),
                self.ui.run.stop: gr.update(interactive=v.busy),
            }
        if v.status is not None:
            out[self.ui.run.status] = render.status_html(v.status.text, v.status.kind)
        return out

    def show_run(self, v: RunView) -> dict:
        """The updates that put a run's view on the page."""
        ui = self.ui
        out = self._show_page(v, ui.run.generate)
        if v.columns is not None:
            out |= self.resize(v.columns)
        if v.board is not None:
            out[ui.out.board] = v.board
        if v.metrics is not None:
            out[ui.out.metrics] = v.metrics
        if v.confidence is not None:
            out[ui.out.conf_plot] = v.confidence
        if v.memory is not None:
            out[ui.memory.plot] = v.memory
        if v.mem_state is not None:
            out[ui.memory.state] = v.mem_state
        if v.result is not None:
            out |= {
                ui.out.run_json.data: v.result,
                ui.out.last: v.result,
                ui.follow.row: gr.update(visible=True),
                ui.out.run_json.box: gr.update(open=False),
            }
        return out

    def show_calibration(self, v: CalibrationView) -> dict:
        ui = self.ui
        out = self._show_page(v, ui.calibration.button)
        if v.threshold is not None:
            out |= {ui.settings["threshold_mode"]: "fixed", ui.settings["threshold"]: v.threshold}
        if v.note is not None:
            out[ui.calibration.note] = v.note
        if v.histogram is not None:
            out[ui.calibration.plot] = gr.update(value=v.histogram, visible=True)
        return out

    # ---- model handlers ----
    def served(self, cfg: RunConfig):
        """The engine run of `cfg`, not started, held to the caps and budgets of every run from this
        page (the HTTP API's, with at most the page's columns): its strategies built for the model,
        its prompts tokenised and sized against the context, the budgets and memory. A new run, a
        follow-up and a branch are started from it; a run reloaded from History and a link are
        checked by it, so what the page restores is what Generate would accept. Only a link's model
        that is not served here gives way to the default, and its note says so; a run and a reload
        (`_work`, `restore`) refuse such a model by name first."""
        model = cfg.model if cfg.model in self.pool.allowlist else self.pool.default
        lm = self.pool.get(model)
        cfg = check_run(replace(cfg, model=lm.name), lm.num_layers, MAX_COLUMNS, "columns")
        return start_run(lm, cfg, budget=self.runner.budget)

    def _work(self, cfg: RunConfig, what: str = "Generating") -> CompareWork:
        self.pool.get(cfg.model)  # a model that is not served is refused by name, not replaced
        return CompareWork(self.served(cfg), self.show_run, what)

    def prepare_compare(self, values: dict) -> CompareWork:
        """Stream every column of one run (validated here, before it waits for the model)."""
        return self._work(run_config(values))

    def prepare_continue(self, values: dict) -> CompareWork:
        """The next turn of the conversation: every column gets `message` after its own history."""
        if not values["last"]:
            raise FeedbackError("run a prompt first; Continue sends a follow-up to every column")
        cfg = continue_run(RunResult.from_dict(values["last"]), values["message"] or "")
        return self._work(cfg, "Continuing")

    def prepare_branch(self, values: dict) -> CompareWork:
        """The last run again, forced to the chosen alternative token at its step (in that column,
        or in every column at the same step) and decoding on."""
        if not values["last"]:
            raise FeedbackError("run a prompt first; then pick an alternative token in a token's card")
        row, step, token = parse_branch(values["choice"])
        cfg = branch(
            RunResult.from_dict(values["last"]),
            row,
            step,
            token,
            all_rows=bool(values["all_columns"]),
            matching_only=bool(values.get("matching_only")),
        )
        return self._work(cfg, f"Branching {row} at step {step}")

    def prepare_rerun(self, values: dict) -> RerunWork:
        """One column of the last run again, alone, with its settings as its controls have them now
        (the run's shared settings and the column's conversation as they were); the other columns
        keep their answers."""
        if not values["last"]:
            raise FeedbackError(
                "nothing to re-run yet: Generate first, then change a column's settings and re-run it"
            )
        column = parse_column(values["column"])
        before = RunResult.from_dict(values["last"])
        if column >= len(before.rows):
            raise FeedbackError(
                f"column {column + 1} was not in the last run (it had {len(before.rows)} columns)"
            )
        spec = row_spec(column_values(values, column), Scope(values, column))
        cfg = rerun(before, column, spec)
        self.pool.get(cfg.model)
        return RerunWork(self.served(cfg), self.show_run, before, column)

    def stop_column(self, column: str, request: gr.Request = None) -> str:
        """Stop one column of this session's running Compare run; the others go on. The page sends
        "2 37": column 2, of which it showed 37 tokens, which is what the column keeps (a program
        sends the column alone and it keeps what was decoded when the stop was read)."""
        try:
            index = parse_column(column)
        except FeedbackError as exc:  # said on the page, not a server error
            return f"Not stopped: {exc}"
        words = column.split()
        shown = int(words[1]) if len(words) > 1 and words[1].isdigit() else None
        session = getattr(request, "session_hash", None) or "local"
        works = [w for w in self.runner.jobs.works(session, TAB) if isinstance(w, CompareWork)]
        if not any(w.stop_column(index, shown) for w in works):
            return f"Column {index + 1} is not running."
        return f"Stopping column {index + 1}…"

    def rate_column(
        self,
        hist: list | None,
        last: dict | None,
        request: str | None,
        rated: dict | None = None,
        req: gr.Request = None,
    ) -> dict:
        """Rate a column of the last run ("2 better"): stored with that run in History (a note can
        be added there), for its table and the LLM Comparator export. Clicked while a run streams
        (a column's re-run), it rates the run on the page before it, and a toast says so: the status
        line is the running job's. A run whose record has not reached the page's History yet is
        recorded here (see `record_run`)."""
        ui = self.ui
        try:
            index = parse_column(request)
            verdict = (request or "").split()[1:2] or [""]
            if not last or not last.get("rows"):
                raise FeedbackError("run a prompt first, then rate its columns")
            if index >= len(last["rows"]):
                raise FeedbackError(f"column {index + 1} was not in the last run")
            name = last["rows"][index]["name"]
            new = history.rate_shown(hist, last, verdicts(rated, last), name, verdict[0])
        except FeedbackError as exc:
            notice.warning(f"Not rated: {exc}")
            return {ui.run.status: render.status_html(f"Not rated: {exc}", "error")}
        kept = {self.hist: new, ui.out.rated: with_rating(rated, last, name, verdict[0])}
        said = f"Rated {name}: {verdict[0]} (saved with the run in History, where a note can be added)."
        if self.runner is not None and self.runner.jobs.active(
            getattr(req, "session_hash", None) or "local", TAB
        ):
            notice.info(
                f"Rated {name}: {verdict[0]}, in the run shown before the one now running (saved in "
                "History, where a note can be added)."
            )
            return kept
        return kept | {ui.run.status: render.status_html(said)}

    def prepare_calibrate(self, values: dict) -> CalibrateWork:
        """Warm-up traces of the shared prompt with the baseline and the first column that has a
        strategy (pooled) -> a fixed early-stop threshold."""
        if not values["prompt"] or not values["prompt"].strip():
            raise FeedbackError("prompt is empty")
        scope = Scope(values)
        shared = {name: SHARED_BY_NAME[name].value(values, scope) for name in CALIBRATE_READS}
        feedback = next((s for s in column_specs(values, shared["columns"]) if s.strategy), None)
        if feedback is None:
            raise FeedbackError(
                "Calibrate pools warm-up traces of the baseline and a feedback column: "
                "give one column a strategy"
            )
        temperature, top_p, note = calibration_sampling(shared["temperature"], shared["top_p"])
        SamplingConfig(temperature=temperature, top_p=top_p).validate()  # refused now, not once it runs
        own = read_all(CALIBRATION, values, scope)
        cfg = DeepThinkConfig(
            prompt=shared["prompt"],
            warmup=own["warmup"],
            eta=resolve_eta(own["eta_preset"], own["eta"]),
            window=shared["window"],
            k=shared["k"],
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=shared["max_new_tokens"],
            seed=shared["seed"],
            strategy=feedback.strategy,
            params=feedback.params,
            shared_threshold=True,
            chat_template=shared["chat_template"],
        )
        lm = self.pool.get(shared["model"])
        cfg.validate(lm.num_layers)
        check_budget(lm, cfg, self.runner.budget, warm_up_only=True)
        return CalibrateWork(
            lm,
            cfg,
            note + f" (Columns: the baseline and {render.md_text(feedback.name)}.)",
            self.show_calibration,
        )

    def stop_run(self, shown: str | None = "", request: gr.Request = None) -> str:
        """Stop this session's Compare or Calibrate run (a waiting one leaves the line). `shown`: the
        steps the page's columns showed at the click (the page sends it); the stopped run then
        keeps what was on screen."""
        steps = shown.strip() if isinstance(shown, str) else ""
        if steps.isdigit():
            session = getattr(request, "session_hash", None) or "local"
            for work in self.runner.jobs.works(session, TAB):
                if isinstance(work, CompareWork):
                    work.shown_at_stop(int(steps))
        return self.runner.stop(TAB, request)

    # ---- page handlers ----
    def tick(self, mem: dict | None, request: gr.Request = None):
        """Idle memory polling (a running generation samples memory itself)."""
        session = getattr(request, "session_hash", None) or "local"
        if self.runner.jobs.active(session, TAB):
            return gr.skip()
        mem = (
            dict(mem)
            if mem and "origin" in mem
            else {"origin": time.time(), "samples": [], "label": "the page opened"}
        )
        mem["samples"] = [*mem["samples"], memory_entry(mem, memory.sample())][-MEMORY_POINTS:]
        return self.show_run(
            RunView(
                memory=charts.memory_figure(mem["samples"], mem.get("label", "the run began")), mem_state=mem
            )
        )

    def change_model(self, model: str) -> dict:
        try:
            lm = self.pool.get(model)
        except FeedbackError as exc:
            raise notice.refusal(exc) from None
        out: dict = {}
        for col in self.ui.cols:
            out |= col.panel.layer_updates(lm.num_layers)
        return out

    def resize(self, columns, delta: int = 0) -> dict:
        """Show `columns` columns (2 to 4), or one more or fewer (`delta`)."""
        ui = self.ui
        n = min(MAX_COLUMNS, max(MIN_COLUMNS, int(columns or MIN_COLUMNS) + delta))
        return {
            ui.settings["columns"]: n,
            ui.add_column: gr.update(interactive=n < MAX_COLUMNS),
            ui.remove_column: gr.update(interactive=n > MIN_COLUMNS),
        } | {col.box: gr.update(visible=col.index < n) for col in ui.cols}

    def preview_heading(self, index: int, values: dict):
        """Column `index`'s heading as its settings stand (before a run): name, strategy,
        parameters, colour, what it overrides and its own settings."""
        try:
            spec = row_spec(column_values(values, index), Scope(values, index))
        except FeedbackError:  # a value being typed: the heading waits for one it can show
            return gr.skip()
        return heading(index, spec)

    def _previewer(self, index: int):
        def preview(values: dict) -> str:
            stamp = int(values.pop("stamp"))  # the order the page asked in (STAMP_PREVIEW_JS)
            shown = self.preview_heading(index, values)
            return shown if not isinstance(shown, str) else json.dumps({"stamp": stamp, "html": shown})

        preview.__name__ = f"preview_heading_{index + 1}"
        return preview

    def new_conversation(self) -> dict:
        """Forget the last run: the next Generate starts afresh, Continue has nothing to follow."""
        ui = self.ui
        return {
            ui.out.last: None,
            ui.follow.message: "",
            ui.follow.row: gr.update(visible=False),
            ui.run.status: render.status_html("New conversation: type a prompt and Generate."),
            ui.out.conf_plot: charts.confidence_figure([]),  # no chart of the old run
            ui.out.board: "",
            ui.out.metrics: "",
        }

    # ---- settings in, settings out (History reload, shared links) ----
    def apply_config(self, cfg: RunConfig) -> dict:
        """Every control as `cfg` has it: each shared setting, the columns and each column's."""
        ui = self.ui
        out: dict = {}
        for s in SHARED:
            out |= s.show(cfg, ui.settings[s.name])
        n = min(len(cfg.rows), MAX_COLUMNS)
        out |= self.resize(n)
        for col, spec in zip(ui.cols, cfg.rows[:n]):
            for s in COLUMN:
                out |= s.show(spec, col.settings[s.name])
            out[col.heading] = heading(col.index, spec)
        return out

    def show_strategy(self, column: int, strategy: str, params: dict, name: str) -> dict:
        """Column `column` (0-based) named `name` with `strategy` and `params` in its panel, and its
        heading (a Sweep's or Tune's best point sent here); every other setting stays as it is, and a
        column override shows in the heading once its preview runs on the change."""
        col = self.ui.cols[column]
        return (
            {col.settings["name"]: name}
            | col.panel.show(strategy, params=params)
            | {col.heading: heading(column, RowSpec(name=name, strategy=strategy, params=params))}
        )

    def restore(self, data: dict, view: str | None = None) -> dict:
        """Every control as the run had it, and the run's columns, conversations, metrics and chart.
        A stored run is the browser's word: it is checked as a new run from this page is (its
        model served here, refused by name rather than replaced; its settings; each column's
        answer against the model), so nothing the page could not have run is restored."""
        result = RunResult.from_dict(data)
        cfg = RunConfig.from_dict(result.config)
        lm = self.pool.get(cfg.model)  # as `_work` does: a model not served is refused, not replaced
        check_saved_run(result, lm.vocab_size, lm.num_layers, MAX_COLUMNS, "columns")
        self.served(cfg)
        shown = finished(data)  # drawn in the token view the page shows (`view`, the board's to keep)
        # the page now shows this run, not a link's setup: the link's note goes, and with the link
        # data emptied the page script takes the link out of the address bar
        return self.apply_config(cfg) | self.show_run(shown) | {self.ui.link.note: "", self.ui.link.data: ""}

    def make_link(self, values: dict) -> dict:
        """The link data of the controls as they stand (validated like a run); the page script
        puts it in the address bar and on the clipboard."""
        try:
            cfg = run_config(values)
            self.served(cfg)
            return {self.ui.link.data: link.encode(cfg, values["view"])}
        except FeedbackError as exc:
            raise notice.refusal(exc) from None

    def open_link(self, request: gr.Request = None) -> dict:
        """On page load: the controls from a shared link (`?cfg=…`), if the address has one. A bad
        or tampered link leaves the defaults and says why."""
        ui = self.ui
        data = (getattr(request, "query_params", None) or {}).get(link.PARAM)
        if not data:
            return {ui.link.note: ""}
        try:
            cfg, view = link.opened(data)
            self.served(cfg)
        except FeedbackError as exc:  # the message may quote the link's own values: literal text in the note
            log.info("link refused: %s", exc)
            notice.warning(f"This link's settings were not applied: {exc}")
            return {
                ui.link.note: f"⚠ This link's settings were not applied ({render.md_text(exc)}); "
                "the defaults are shown."
            }
        note = "Settings restored from the link: press Generate to run them."
        if cfg.model not in self.pool.allowlist:
            note += f" (Its model {cfg.model!r} is not served here; {self.pool.default!r} is selected.)"
        return self.apply_config(cfg) | {
            ui.link.note: render.md_text(note),
            ui.run.status: render.status_html(note),
            ui.out.view: view,
            ui.link.data: data,
            ui.out.board: empty_doc(cfg),
        }

    # ---- what events update ----
    def restore_outputs(self) -> list:
        """Every component `restore` and `open_link` may update."""
        ui = self.ui
        shared = [x for s in SHARED for x in s.outputs(ui.settings[s.name])]
        cols = [x for c in ui.cols for x in (c.box, c.heading, *c.setting_outputs())]
        return [
            *shared,
            ui.add_column,
            ui.remove_column,
            *cols,
            ui.out.board,
            ui.out.metrics,
            ui.out.conf_plot,
            ui.out.last,
            ui.out.run_json.data,
            ui.out.run_json.box,
            ui.follow.row,
            ui.run.status,
            ui.link.note,
            ui.link.data,
            ui.out.view,
        ]

    def run_outputs(self) -> list:
        """Everything a Compare run (first turn, follow-up or branch) updates."""
        ui = self.ui
        # as few as can be: the page does work for every output at every streamed update
        return [
            ui.out.board,
            ui.out.metrics,
            ui.out.conf_plot,
            ui.memory.plot,
            ui.run.status,
            ui.out.run_json.data,
            ui.out.run_json.box,
            ui.out.last,
            ui.memory.state,
            ui.follow.row,
            ui.run.generate,
            ui.run.stop,
        ]

    def calibration_outputs(self) -> list:
        ui = self.ui
        return [
            ui.settings["threshold_mode"],
            ui.settings["threshold"],
            ui.calibration.plot,
            ui.calibration.note,
            ui.run.status,
            ui.run.stop,
            ui.calibration.button,
        ]

    # ---- layout and wiring ----
    def build(self, num_layers: int, hist: gr.BrowserState) -> None:
        with gr.Tab("Compare", id=TAB):
            self.ui = build_controls(Page(tuple(self.pool.allowlist), self.pool.default, num_layers))
        self._wire(hist)

    def _model_event(
        self, triggers, prepare, inputs: dict, outputs: list, api_name: str, js: str | None = None
    ):
        """A model handler's event: `prepare` gets `inputs`' values by name (the API's parameters)."""
        handler = self.runner.wrap(TAB, prepare, list(inputs), status=self.ui.run.status)
        return gr.on(
            triggers,
            handler,
            inputs_kwargs=inputs,
            outputs=outputs,
            api_name=api_name,
            concurrency_limit=None,
            show_progress="hidden",
            js=js,
        )

    def _wire(self, hist: gr.BrowserState) -> None:
        ui = self.ui
        settings, outputs = self.settings_inputs(), self.run_outputs()
        run = self._model_event(
            [ui.run.generate.click, ui.settings["prompt"].submit],
            self.prepare_compare,
            settings,
            outputs,
            "compare",
        )
        follow = self._model_event(
            [ui.follow.send.click, ui.follow.message.submit],
            self.prepare_continue,
            {"last": ui.out.last, "message": ui.follow.message},
            outputs,
            "continue",
        )
        branch_inputs = {
            "last": ui.out.last,
            "choice": ui.follow.branch_request,
            "all_columns": ui.follow.branch_all,
            "matching_only": ui.follow.branch_matching,
        }
        branching = self._model_event(
            [ui.follow.branch_go.click],
            self.prepare_branch,
            branch_inputs,
            outputs,
            "branch",
            js=page_request(list(branch_inputs), "choice", "branch"),
        )
        actions = ui.actions
        rerun_inputs = settings | {"last": ui.out.last, "column": actions.request}
        again = self._model_event(
            [actions.rerun.click],
            self.prepare_rerun,
            rerun_inputs,
            outputs,
            "rerun",
            js=page_request(list(rerun_inputs), "column", "column"),
        )
        for event in (run, follow, branching, again):
            event.then(
                record_run,
                [hist, ui.out.last, ui.out.rated],
                hist,
                api_name=False,
                show_progress="hidden",
                concurrency_id=HISTORY_WRITES,
                concurrency_limit=1,
            )
            # the accordion closed with the new run; what it showed of the last one goes
            event.then(None, None, ui.out.run_json.view, js="() => null", api_name=False, queue=False)
        follow.then(lambda: "", None, ui.follow.message, api_name=False, show_progress="hidden", queue=False)
        calibrate_inputs = (
            {name: ui.settings[name] for name in CALIBRATE_READS}
            | ui.calibration.settings
            | {name: component for name, component in settings.items() if name not in ui.settings}
        )
        calibrating = self._model_event(
            [ui.calibration.button.click],
            self.prepare_calibrate,
            calibrate_inputs,
            self.calibration_outputs(),
            "calibrate",
        )
        cancellable_by_clients(ui.run.cancel_trigger, run, follow, branching, again, calibrating)
        actions.stop.click(
            self.stop_column,
            actions.request,
            ui.run.stop_ack,
            api_name="stop_column",
            concurrency_limit=None,
            show_progress="hidden",
            js=page_request(["column"], "column", "column"),
        )
        self.hist = hist
        # queued, so that its toasts reach the page (a queue=False event's only log), one at a time
        # with the runs' records (see `record_run`)
        actions.rate.click(
            self.rate_column,
            [hist, ui.out.last, actions.request, ui.out.rated],
            [hist, ui.run.status, ui.out.rated],
            api_name=False,
            concurrency_id=HISTORY_WRITES,
            concurrency_limit=1,
            show_progress="hidden",
            js=page_request(["hist", "last", "column", "rated"], "column", "column"),
        )
        # the run's own next update (within HEARTBEAT_S) says it is stopping: one channel, so a reply
        # of this event cannot come after the run's last update and overwrite how it ended
        ui.run.stop.click(
            self.stop_run,
            ui.run.stop_ack,
            ui.run.stop_ack,
            api_name="stop",
            concurrency_limit=None,
            show_progress="hidden",
            js=SHOWN_STEP_JS,
        )
        ui.follow.new.click(
            self.new_conversation,
            None,
            [
                ui.out.last,
                ui.follow.message,
                ui.follow.row,
                ui.run.status,
                ui.out.conf_plot,
                ui.out.board,
                ui.out.metrics,
            ],
            api_name="new_conversation",
            show_progress="hidden",
        )
        self._wire_page(settings)

    def _wire_page(self, settings: dict) -> None:
        """The handlers that only update the page: columns, headings, link, memory, token view, model."""
        ui = self.ui
        columns = ui.settings["columns"]
        resize_out = [columns, ui.add_column, ui.remove_column, *[c.box for c in ui.cols]]
        ui.add_column.click(
            lambda n: self.resize(n, +1),
            columns,
            resize_out,
            api_name=False,
            queue=False,
            show_progress="hidden",
        )
        ui.remove_column.click(
            lambda n: self.resize(n, -1),
            columns,
            resize_out,
            api_name=False,
            queue=False,
            show_progress="hidden",
        )
        for col in ui.cols:
            # The shared prompt counts only where a column's own prompt equals it (then it is no
            # override), so it is read when its box is left, not at each key: on change, typing a
            # prompt sent a request per column per key, and a page with 4 columns spent seconds on
            # them after the typing stopped (a click then waited a second on a 2-core machine).
            inputs = {"prompt": ui.settings["prompt"]} | col.inputs() | {"stamp": col.preview}
            gr.on(
                [ui.settings["prompt"].blur] + [c.change for c in col.inputs().values()],
                by_name(self._previewer(col.index), list(inputs)),
                inputs_kwargs=inputs,
                outputs=col.preview,
                js=STAMP_PREVIEW_JS,
                api_name=False,
                queue=False,
                show_progress="hidden",
                trigger_mode="always_last",  # a change while one is asked: asked again once it answers
            )
            col.preview.change(
                None,
                [col.preview, col.heading],
                col.heading,
                js=NEWEST_HEADING_JS.replace("__COLUMN__", str(col.index)),
                api_name=False,
                queue=False,
            )
        linked = settings | {"view": ui.out.view}
        ui.link.button.click(
            by_name(self.make_link, list(linked)),
            inputs_kwargs=linked,
            outputs=ui.link.data,
            api_name="link",
            queue=False,
            show_progress="hidden",
        ).then(None, ui.link.data, ui.link.note, js=COPY_LINK_JS, api_name=False, queue=False)
        ui.link.data.change(None, ui.link.data, None, js=DROP_LINK_JS, api_name=False, queue=False)
        ui.memory.timer.tick(
            self.tick,
            ui.memory.state,
            [ui.memory.state, ui.memory.plot],
            api_name="memory",
            concurrency_limit=None,
            show_progress="hidden",
        )
        ui.memory.page_visible.change(
            lambda visible: gr.Timer(active=bool(visible)),
            ui.memory.page_visible,
            ui.memory.timer,
            api_name=False,
            queue=False,
            show_progress="hidden",
        )
        # the board has every view of the run it shows: switching is the page's alone
        ui.out.view.change(
            None,
            ui.out.view,
            None,
            js="(view) => { window.flBoard?.view(view); }",
            api_name=False,
            queue=False,
        )
        ui.settings["model"].change(
            self.change_model,
            ui.settings["model"],
            [x for c in ui.cols for x in c.panel.components],
            api_name="select_model",
            show_progress="hidden",
        )


# A heading preview is asked for on each change of a column's settings. When the page sets many
# settings at once (a link, History, a Sweep's best point), Gradio sends one request per change in
# the same moment (`always_last` only holds back changes that come while one is being answered),
# each with the settings as they stood then, and the answers may come back in any order. So each
# request carries a number in the order it was asked (here), and a heading is shown only if no
# later-asked one has been shown (NEWEST_HEADING_JS): the last asked, with every setting in place,
# is the one that stays.
STAMP_PREVIEW_JS = """(...values) => {
  values[values.length - 1] = String(window.flPreviewStamp = (window.flPreviewStamp || 0) + 1);
  return values;
}"""
NEWEST_HEADING_JS = """(data, shown) => {
  if (!data) return shown;
  const {stamp, html} = JSON.parse(data);
  const newest = (window.flHeadingStamp ??= {});
  if (stamp < (newest[__COLUMN__] || 0)) return shown;
  newest[__COLUMN__] = stamp;
  return html;
}"""

# The link data goes into the address bar (so the page's own URL is the link) and onto the
# clipboard; the note says so, or shows the link when the clipboard is not available.
COPY_LINK_JS = """
(data) => {
  if (!data) return "";
  const url = new URL(window.location.href);
  url.searchParams.set("cfg", data);
  window.history.replaceState(null, "", url.toString());
  const link = url.toString();
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(link).catch(() => {});
    return "Link copied: the address bar holds it too. Opening it restores these settings.";
  }
  return "The address bar now holds the link (copy it from there): " + link;
}
"""


# Stop sends the steps the board shows of the run's columns, "" before the first
SHOWN_STEP_JS = """() => {
  const steps = window.flBoard ? window.flBoard.steps() : 0;
  return [steps ? String(steps) : ""];
}"""


def page_request(names: list[str], name: str, key: str) -> str:
    """The JS an event runs first in the page: its input `name` (of `names`, in order) is what the
    page script left in `window.flRequest[key]` just before it clicked the event's hidden button.
    A value the script writes into the hidden box itself can reach Gradio's state after the click
    on a busy page, and the event would send the one before."""
    index, count = names.index(name), len(names)
    return (
        f"(...values) => {{ const sent = values.slice(0, {count});"
        f" const asked = (window.flRequest || {{}})[{key!r}];"
        f" if (asked !== undefined) sent[{index}] = asked; return sent; }}"
    )


# A run reloaded from History empties the link data: the address bar then stops holding a link to
# a setup the page no longer shows (a reload of the page would bring that setup back).
DROP_LINK_JS = f"""(data) => {{
  if (data) return;
  const url = new URL(window.location.href);
  if (!url.searchParams.has("{link.PARAM}")) return;
  url.searchParams.delete("{link.PARAM}");
  window.history.replaceState(null, "", url.toString());
}}"""


# The run's record and a rating of its columns are separate requests, each sent with this browser's
# history as the page held it then: a rating clicked as soon as the run is shown can be sent before
# the record has reached the page (or even been asked for). So each writes the whole record of the
# shown run: the record carries the ratings already given (kept on the server, in `rated`, where
# both read them as they are answered, one at a time), and a rating records a run not yet there.
# Whichever answer reaches the page last holds the run and every rating.
HISTORY_WRITES = "compare-history"


def record_run(hist: list | None, last: dict | None, rated: dict | None = None) -> list:
    """This browser's history with the run just shown in it (once), rated as the page rated it
    meanwhile (`rated`); a history that holds the run already is kept as it is (a note added in
    History stays)."""
    return history.add_run(hist, last, verdicts(rated, last)) if last else (hist or [])


def verdicts(rated: dict | None, last: dict) -> dict[str, str]:
    """{column: verdict} given on the page to the run `last` (none when `rated` is another run's)."""
    return rated["ratings"] if rated and rated.get("run_id") == last.get("run_id") else {}


def with_rating(rated: dict | None, last: dict, column: str, verdict: str) -> dict:
    """`rated` for the run `last` with `column` now rated `verdict` (another run's ratings are
    forgotten: the page shows one run)."""
    return {"run_id": last.get("run_id"), "ratings": verdicts(rated, last) | {column: verdict}}
