"""Compare tab, the prompt workbench: 2 to 4 columns streamed side by side from one engine run, each
with its own name, strategy and parameters and optionally its own prompt and system prompt; sampling
and DeepConf are shared (common random numbers). After a run: Continue the conversation in every
column, branch from any alternative token, switch to a word diff, copy a link that restores the
setup. Live confidence and memory charts; Calibrate sets the early-stop threshold.

Columns are built in a loop from `DEFAULT_COLUMNS`; handlers return dicts keyed by component. The model work
goes through `ModelRunner` (line, GPU function, Stop, closed tabs, errors); this module only turns
engine records into HTML and figures.
"""
from __future__ import annotations

import functools
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from feedback.core import memory
from feedback.core.engine import Engine, Run, StepEvent
from feedback.core.records import DeepConfConfig, RowResult, RowSpec, RunConfig, RunResult, first_divergence
from feedback.core.sampling import SamplingConfig
from feedback.core.session import branch, continue_run
from feedback.errors import FeedbackError
from feedback.eval.deepthink import DeepThinkConfig, check_budget, warm_up
from feedback.serve.limits import SERVED_MAX_NEW_TOKENS, SERVED_MAX_TRACES
from feedback.serve.pool import ModelPool
from feedback.strategies import REGISTRY
from ui import charts, history, link, render
from ui.controls import NONE, StrategyPanel, build_strategy_panel, first_preset, named_params, parse_number
from ui.deepconf import ETA_CHOICES, resolve_eta
from ui.runner import ModelRunner, Outcome, TabWork, cancellable_by_clients, reporting

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CHART_INTERVAL_S = 0.25  # charts at most ~4 times a second; text goes out with every update
MEMORY_POINTS = 240
IDLE_POLL_S = 5.0  # memory chart while idle (and the page visible); inside a run it is sampled per step
DEFAULT_THRESHOLD = 4.5  # lowest group confidence (w = 32) of normal answers on the embedded model: 4.7–7.1
CALIBRATION_SAMPLING = (0.7, 0.95)  # temperature, top-p for warm-up traces when Compare is greedy
TAB = "compare"


MAX_COLUMNS = 4
MIN_COLUMNS = 2
# (default name, default strategy) of each column slot; columns 3 and 4 appear on "Add column".
# An added column starts on another strategy's "visible effect" preset, so it shows something new at
# once; "none" with a prompt override makes it a prompt variant.
DEFAULT_COLUMNS = (("Baseline", NONE), ("Feedback", "residual"), ("Column 3", "deep_cache"), ("Column 4", "anchor"))


@dataclass
class Column:
    """One output column: its settings (name, strategy and parameters, prompt and system prompt
    overrides) and its outputs (heading, conversation, text, stats)."""

    index: int
    box: gr.Column
    heading: gr.Markdown
    name: gr.Textbox
    panel: StrategyPanel
    prompt: gr.Textbox
    system: gr.Textbox
    turns: gr.HTML
    text: gr.HTML
    stats: gr.HTML

    @property
    def inputs(self) -> list:
        return [self.name, self.panel.strategy, self.prompt, self.system, *self.panel.components]

    @property
    def api_names(self) -> list[str]:
        n = f"c{self.index + 1}"
        return [f"{n}_name", f"{n}_strategy", f"{n}_prompt", f"{n}_system",
                *[f"{n}_{name}" for name in self.panel.api_names]]

    def spec(self, values: list, shared_prompt: str) -> RowSpec:
        """This column's row from its input values (in `inputs` order)."""
        name, strategy, prompt, system, *params = values
        name = (name or "").strip() or DEFAULT_COLUMNS[self.index][0]
        strategy = None if strategy in (None, "", NONE) else strategy
        own = (prompt or "").strip()
        return RowSpec(name, strategy, self.panel.params_for(strategy, params) if strategy else {},
                       prompt=prompt if own and prompt != shared_prompt else None,
                       system_prompt=system if (system or "").strip() else None)


def _first_user_turn(messages: list[dict] | None) -> str | None:
    return next((m["content"] for m in messages or [] if m.get("role") == "user"), None)


def modified(spec: RowSpec, first: RowSpec | None = None) -> list[str]:
    """What a column overrides of the run's shared input (for its heading's badges). In a
    conversation every column's history differs (their own answers); its prompt counts as modified
    when it began from another question than column 1 (`first`)."""
    prompt = spec.prompt is not None or (
        first is not None and spec.messages is not None
        and _first_user_turn(spec.messages) != _first_user_turn(first.messages))
    return [what for what, changed in (("prompt", prompt), ("system prompt", spec.system_prompt is not None))
            if changed]


def heading(index: int, spec: RowSpec, first: RowSpec | None = None) -> str:
    """Column `index`'s heading for `spec`: its chart colour, name, strategy and parameters, and
    what it overrides (`first`: column 1's spec, for conversations)."""
    return render.column_heading(spec.name, spec.strategy, spec.params, charts.row_color(index), modified(spec, first))


def load_examples() -> list[str]:
    data = json.loads((ASSETS / "examples.json").read_text(encoding="utf-8"))
    return [e["prompt"] for e in data]


def memory_entry(mem: dict, sample: memory.MemorySample) -> dict:
    """A sample on the chart's time axis (seconds since `mem["origin"]`, a wall-clock time)."""
    return sample.to_dict() | {"t": round(time.time() - mem["origin"], 3)}


class CompareWork(TabWork):
    """One Compare run (a first turn, a follow-up or a branch): the engine streams step events;
    the page gets columns, stats and charts."""

    label = "a Compare run"

    def __init__(self, tab: "CompareTab", run: Run, view: str, what: str = "Generating"):
        super().__init__(tab.generate, tab.stop, tab.status)
        self.tab, self.engine_run, self.view, self.what = tab, run, view, what
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
            self.last_chart = t  # the first tokens go out alone; drawing charts would hold them back
            out = self.busy() | self.tab.frame(self.engine_run.config)
        for item in items:
            if isinstance(item, StepEvent):
                self._apply(item)
            elif isinstance(item, RunResult):
                self.result = item
        rows = self.result.rows if self.result is not None else self.rows
        if self.result is None:
            out |= self.tab.columns(rows, self.view, live=True, caches=self.caches)
            step = max((len(r.steps) for r in rows), default=0)
            out |= self.say(f"{self.what}… step {step} of {self.engine_run.config.max_new_tokens} ({elapsed:.0f} s)")
            if t - self.last_chart >= CHART_INTERVAL_S:
                self.last_chart = t
                out |= {self.tab.conf_plot: self.tab.confidence_chart(rows, self.threshold, self.window, live=True),
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
        out = self.idle() | self.tab.frame(self.engine_run.config)  # the final update stands on its own
        out |= self.tab.columns(result.rows, self.view, live=False, caches=self.caches)
        out |= {self.tab.conf_plot: self.tab.confidence_chart(result.rows, self.threshold, self.window),
                self.tab.mem_plot: charts.memory_figure(self.mem["samples"]), self.tab.mem_state: self.mem}
        self.ui_seconds += time.perf_counter() - t
        data = result.to_dict() | {"ui_seconds": self.ui_seconds}
        out |= {self.tab.run_json: data, self.tab.last: data, self.tab.follow_row: gr.update(visible=True)}
        out |= self.say(done_text(result), "stopped" if outcome.kind == "stopped" else "info")
        return out


def divergences(rows: list[RowResult], live: bool = False) -> dict[int, int]:
    """Column index -> first step where it differs from column 1 (while streaming, only once both
    have reached that step: until then it is a prefix, not a divergence)."""
    out = {}
    for j, row in enumerate(rows[1:], start=1):
        d = first_divergence(rows[0].token_ids, row.token_ids)
        if d is not None and not (live and (len(rows[0].steps) <= d or len(row.steps) <= d)):
            out[j] = d
    return out


def done_text(result: RunResult) -> str:
    div = divergences(result.rows)
    stopped = " (stopped)" if any(r.stop_reason == "stopped" for r in result.rows) else ""
    if len(result.rows) == 2:
        same = "the columns are identical" if not div else f"the columns first differ at step {div[1]}"
    else:
        same = ("every column matches column 1" if not div else "vs column 1, first difference: " + ", ".join(
            f"{result.rows[j].name} at step {d}" for j, d in div.items()))
    forced = sum(s.forced for r in result.rows for s in r.steps)
    branch = f" · {forced} forced tokens" if forced else ""
    precision = result.config.get("precision") or ""
    fast = f" · {precision}" if precision.startswith("fast") else ""
    return f"Done{stopped} in {result.wall_seconds:.1f} s · prompt {result.prompt_tokens} tokens · {same}{branch}{fast}"


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


def parse_key_facts(text: str | None) -> list[str]:
    """One key fact per line (blank lines ignored); /…/ is a regular expression."""
    return [line.strip() for line in (text or "").splitlines() if line.strip()]


def parse_branch(text: str | None) -> tuple[str, int, int]:
    """(column name, step, token id) from the page's branch request (JSON)."""
    try:
        data = json.loads(text or "")
        row, step, token = data["row"], data["step"], data["token_id"]
    except (ValueError, TypeError, KeyError):
        raise FeedbackError("choose an alternative token in a token's card to branch from") from None
    if not isinstance(row, str) or not all(isinstance(v, int) and not isinstance(v, bool) for v in (step, token)):
        raise FeedbackError("a branch names a column, a step and a token id")
    return row, step, token


class CompareTab:
    def __init__(self, pool: ModelPool, runner: ModelRunner):
        self.pool, self.runner = pool, runner

    # ---- rendering (records in, HTML and figures out) ----
    def frame(self, cfg: RunConfig) -> dict:
        """What a run shows before its first token: the columns it has (visible), their headings
        and each column's conversation so far."""
        out = self.resize(len(cfg.rows), 0)
        for col, spec in zip(self.cols, cfg.rows):
            out[col.heading] = heading(col.index, spec, cfg.rows[0])
            prompt = spec.prompt if spec.prompt is not None else cfg.prompt
            out[col.turns] = render.render_turns(spec.messages or [], prompt)
        return out

    def columns(self, rows: list[RowResult], view: str, live: bool, caches: list | None = None) -> dict:
        div = divergences(rows, live)
        caches = caches or [None] * len(rows)
        marks = render.best_marks(rows)
        out = {self.diff_legend: gr.update(visible=view == "diff")}
        for col, row, cache, best in zip(self.cols, rows, caches, marks):
            running = live and row.stop_reason is None
            at = div.get(col.index) if col.index else min(div.values(), default=None)
            if view == "diff":
                out[col.text] = render.render_diff(rows[0].steps, row.steps, live=running)
            else:
                out[col.text] = render.render_tokens(row.steps, view, live=running, cache=cache, diverge_at=at,
                                                     row=row.name)
            out[col.stats] = render.render_stats(row, live=running, best=best)
        return out

    @staticmethod
    def confidence_chart(rows: list[RowResult], threshold: float | None, window: int, live: bool = False):
        return charts.confidence_figure(rows, threshold, divergences(rows, live), window)

    # ---- handlers ----
    def column_specs(self, columns, values: list, shared_prompt: str) -> list[RowSpec]:
        """The first `columns` columns' rows, from every column's input values (flattened)."""
        n = parse_number(columns, "columns", integer=True, lo=MIN_COLUMNS, hi=MAX_COLUMNS)
        specs, at = [], 0
        for col in self.cols:
            width = len(col.inputs)
            if col.index < n:
                specs.append(col.spec(list(values[at:at + width]), shared_prompt))
            at += width
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise FeedbackError(f"column names must be different, got {', '.join(names)}")
        return specs

    def config(self, prompt, system_prompt, chat_template, model, temperature, top_p, top_k, min_p,
               repetition_penalty, max_new_tokens, seed, k, window, threshold_mode, threshold, reference, key_facts,
               columns, column_values: list) -> RunConfig:
        """A validated RunConfig from the tab's control values."""
        thr = parse_number(threshold, "threshold") if threshold_mode == "fixed" else None
        return RunConfig(
            prompt=prompt or "", model=model, chat_template=bool(chat_template),
            system_prompt=system_prompt if (system_prompt or "").strip() else None,
            max_new_tokens=parse_number(max_new_tokens, "max new tokens", integer=True, lo=1, hi=SERVED_MAX_NEW_TOKENS),
            seed=parse_number(seed, "seed", integer=True, lo=0),
            sampling=SamplingConfig(parse_number(temperature, "temperature", lo=0, hi=10),
                                    parse_number(top_k, "top-k", integer=True, lo=0),
                                    parse_number(top_p, "top-p", lo=0, hi=1), parse_number(min_p, "min-p", lo=0, hi=1),
                                    parse_number(repetition_penalty, "repetition penalty", lo=0.01, hi=10)),
            deepconf=DeepConfConfig(parse_number(k, "DeepConf k", integer=True, lo=1, hi=1000),
                                    parse_number(window, "window", integer=True, lo=1, hi=100_000), thr),
            rows=self.column_specs(columns, column_values, prompt or ""),
            reference=reference if (reference or "").strip() else None, key_facts=parse_key_facts(key_facts),
            quality=True,  # self and prompt perplexity per row: ~a forward pass each, after the run
        ).validate()

    def _work(self, cfg: RunConfig, view: str, what: str = "Generating") -> CompareWork:
        lm = self.pool.get(cfg.model)
        return CompareWork(self, Engine(lm).start(cfg, budget=self.runner.budget), view, what)

    def prepare_compare(self, prompt, system_prompt, chat_template, model, view, temperature, top_p, top_k, min_p,
                        repetition_penalty, max_new_tokens, seed, k, window, threshold_mode, threshold, reference,
                        key_facts, columns, *column_values) -> CompareWork:
        """Stream every column of one run (validated here, before it waits for the model)."""
        cfg = self.config(prompt, system_prompt, chat_template, model, temperature, top_p, top_k, min_p,
                          repetition_penalty, max_new_tokens, seed, k, window, threshold_mode, threshold, reference,
                          key_facts, columns, list(column_values))
        return self._work(cfg, view)

    def prepare_continue(self, last, message, view) -> CompareWork:
        """The next turn of the conversation: every column gets `message` after its own history."""
        if not last:
            raise FeedbackError("run a prompt first; Continue sends a follow-up to every column")
        cfg = continue_run(RunResult.from_dict(last), message or "")
        return self._work(cfg, view, "Continuing")

    def prepare_branch(self, last, choice, all_columns, view) -> CompareWork:
        """The last run again, forced to the chosen alternative token at its step (in that column,
        or in every column at the same step) and decoding on."""
        if not last:
            raise FeedbackError("run a prompt first; then pick an alternative token in a token's card")
        row, step, token = parse_branch(choice)
        cfg = branch(RunResult.from_dict(last), row, step, token, all_rows=bool(all_columns))
        return self._work(cfg, view, f"Branching {row} at step {step}")

    def prepare_calibrate(self, prompt, chat_template, model, temperature, top_p, seed, window, k, max_new_tokens,
                          eta_preset, eta, warmup, columns, *column_values) -> CalibrateWork:
        """Warm-up traces of the shared prompt with the baseline and the first column that has a
        strategy (pooled) -> a fixed early-stop threshold."""
        if not prompt or not prompt.strip():
            raise FeedbackError("prompt is empty")
        feedback = next((s for s in self.column_specs(columns, list(column_values), prompt) if s.strategy), None)
        if feedback is None:
            raise FeedbackError("Calibrate pools warm-up traces of the baseline and a feedback column: "
                                "give one column a strategy")
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
            seed=parse_number(seed, "seed", integer=True, lo=0), strategy=feedback.strategy,
            params=feedback.params, shared_threshold=True, chat_template=bool(chat_template))
        lm = self.pool.get(model)
        cfg.validate(lm.num_layers)
        check_budget(lm, cfg, self.runner.budget, warm_up_only=True)
        return CalibrateWork(self, lm, cfg, note + f" (Columns: the baseline and {feedback.name}.)")

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
            return {self.diff_legend: gr.update(visible=view == "diff")}
        return self.columns(RunResult.from_dict(last).rows, view, live=False)

    def change_model(self, model: str) -> dict:
        try:
            lm = self.pool.get(model)
        except FeedbackError as exc:
            raise gr.Error(str(exc), print_exception=False) from None
        out: dict = {}
        for col in self.cols:
            out |= col.panel.layer_updates(lm.num_layers)
        return out

    def resize(self, columns, delta: int) -> dict:
        """Add or remove the last column (2 to 4)."""
        n = min(MAX_COLUMNS, max(MIN_COLUMNS, int(columns or MIN_COLUMNS) + delta))
        return {self.ncols: n, self.add_col: gr.update(interactive=n < MAX_COLUMNS),
                self.remove_col: gr.update(interactive=n > MIN_COLUMNS)} | {
            col.box: gr.update(visible=col.index < n) for col in self.cols}

    def preview_heading(self, index: int, prompt, name, strategy, own_prompt, system, *params) -> str:
        """A column's heading as its settings stand (before a run): name, strategy, parameters,
        colour and what it overrides."""
        col = self.cols[index]
        return heading(index, col.spec([name, strategy, own_prompt, system, *params], prompt or ""))

    def new_conversation(self) -> dict:
        """Forget the last run: the next Generate starts afresh, Continue has nothing to follow."""
        out = {self.last: None, self.follow: "", self.follow_row: gr.update(visible=False),
               self.status: render.status_html("New conversation: type a prompt and Generate.")}
        for col in self.cols:
            out |= {col.turns: "", col.text: render.render_tokens([]), col.stats: ""}
        return out

    # ---- settings in, settings out (History reload, shared links) ----
    def apply_config(self, cfg: RunConfig) -> dict:
        """Every control as `cfg` has it: shared prompt and settings, the columns and their
        strategies, parameters and overrides."""
        s, dc = cfg.sampling, cfg.deepconf
        n = min(len(cfg.rows), MAX_COLUMNS)
        out: dict = {self.prompt: cfg.prompt, self.system_prompt: cfg.system_prompt or "",
                     self.chat: cfg.chat_template, self.temperature: s.temperature, self.top_p: s.top_p,
                     self.top_k: s.top_k, self.min_p: s.min_p, self.rep: s.repetition_penalty,
                     self.max_new: cfg.max_new_tokens, self.seed: cfg.seed, self.k: dc.k, self.window: dc.window,
                     self.thr_mode: "off" if dc.threshold is None else "fixed", self.reference: cfg.reference or "",
                     self.key_facts: "\n".join(cfg.key_facts)}
        if cfg.model in self.pool.allowlist:
            out[self.model] = cfg.model
        if dc.threshold is not None:
            out[self.threshold] = dc.threshold
        out |= self.resize(n, 0)
        for col, spec in zip(self.cols, cfg.rows[:n]):
            out |= {col.name: spec.name, col.prompt: spec.prompt or "", col.system: spec.system_prompt or ""}
            out |= col.panel.show(spec.strategy or NONE, params=spec.params if spec.strategy else None)
            out[col.heading] = heading(col.index, spec)
        return out

    def restore(self, data: dict, view: str) -> dict:
        """Every control as the run had it, and the run's columns, conversations, stats and chart."""
        result = RunResult.from_dict(data)
        cfg = RunConfig.from_dict(result.config)
        if len(cfg.rows) > MAX_COLUMNS:
            raise FeedbackError(f"the page shows at most {MAX_COLUMNS} columns; this run has {len(cfg.rows)}")
        out = self.apply_config(cfg) | self.frame(cfg) | self.columns(result.rows, view, live=False)
        out |= {self.conf_plot: self.confidence_chart(result.rows, cfg.deepconf.threshold, cfg.deepconf.window),
                self.last: data, self.run_json: data, self.follow_row: gr.update(visible=True)}
        return out

    def make_link(self, prompt, system_prompt, chat_template, model, temperature, top_p, top_k, min_p,
                  repetition_penalty, max_new_tokens, seed, k, window, threshold_mode, threshold, reference, key_facts,
                  columns, *column_values) -> dict:
        """The link data of the controls as they stand (validated like a run); the page script
        puts it in the address bar and on the clipboard."""
        try:
            cfg = self.config(prompt, system_prompt, chat_template, model, temperature, top_p, top_k, min_p,
                              repetition_penalty, max_new_tokens, seed, k, window, threshold_mode, threshold,
                              reference, key_facts, columns, list(column_values))
            return {self.link_data: link.encode(cfg)}
        except FeedbackError as exc:
            raise gr.Error(str(exc), print_exception=False) from None

    def open_link(self, request: gr.Request = None) -> dict:
        """On page load: the controls from a shared link (`?cfg=…`), if the address has one. A bad
        or tampered link leaves the defaults and says why."""
        data = (getattr(request, "query_params", None) or {}).get(link.PARAM)
        if not data:
            return {self.link_note: ""}
        try:
            cfg = link.decode(data)
        except FeedbackError as exc:
            gr.Warning(f"This link's settings were not applied: {exc}")
            return {self.link_note: f"⚠ This link's settings were not applied ({exc}); the defaults are shown."}
        note = "Settings restored from the link: press Generate to run them."
        if cfg.model not in self.pool.allowlist:
            note += f" (Its model {cfg.model!r} is not served here; {self.pool.default!r} is selected.)"
        return self.apply_config(cfg) | {self.link_note: note, self.status: render.status_html(note)}

    def restore_outputs(self) -> list:
        """Every component `restore` and `open_link` may update."""
        shared = [self.prompt, self.system_prompt, self.chat, self.model, self.temperature, self.top_p, self.top_k,
                  self.min_p, self.rep, self.max_new, self.seed, self.k, self.window, self.thr_mode, self.threshold,
                  self.reference, self.key_facts, self.ncols, self.add_col, self.remove_col]
        cols = [x for c in self.cols for x in (c.box, c.heading, c.name, c.prompt, c.system, *c.panel.outputs(),
                                                 c.turns, c.text, c.stats)]
        return [*shared, *cols, self.diff_legend, self.conf_plot, self.last, self.run_json, self.follow_row,
                self.status, self.link_note]

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
                    with gr.Accordion("System prompt", open=False, elem_id="system-accordion"):
                        self.system_prompt = gr.Textbox("", label="System prompt (every column; a column may override "
                                                              "it)", lines=2, max_length=20_000, elem_id="system-prompt")
                    with gr.Accordion("Evaluation", open=False, elem_id="evaluation"):
                        self.reference = gr.Textbox("", label="Reference answer", lines=2, max_length=20_000,
                                                    elem_id="reference", info="its perplexity after each column's "
                                                    "prompt (with the column's strategy where it can score a text)")
                        self.key_facts = gr.Textbox("", label="Key facts", lines=2, elem_id="key-facts",
                                                    info="one per line; /…/ is a regular expression; each column's "
                                                         "recall is shown")
                with gr.Column(scale=2, min_width=300):
                    with gr.Row():
                        self.model = gr.Dropdown(self.pool.allowlist, value=self.pool.default, label="Model",
                                                 elem_id="model")
                        self.chat = gr.Checkbox(True, label="Use the chat template", elem_id="chat-template")
                    self._sampling_controls()
                    self._deepconf_controls()
                    with gr.Row():
                        self.copy_link = gr.Button("Copy link", size="sm", elem_id="copy-link")
                    self.link_note = gr.Markdown(elem_id="link-note", elem_classes="fl-note")
                    self.link_data = gr.Textbox("", visible=True, elem_id="link-data", elem_classes="fl-hidden",
                                                container=False, label="link data")
            with gr.Row(equal_height=True):
                self.view = gr.Radio(["confidence", "plain", "diff"], value="confidence", label="Token view", scale=1,
                                     min_width=220, elem_id="token-view",
                                     info="diff: each column's words against column 1")
                gr.HTML(render.confidence_legend(), elem_id="legend")
            self.diff_legend = gr.HTML(render.diff_legend(), visible=False, elem_id="diff-legend-box")
            with gr.Row():
                self.ncols = gr.Number(MIN_COLUMNS, precision=0, minimum=MIN_COLUMNS, maximum=MAX_COLUMNS,
                                       label="columns", elem_id="n-columns", elem_classes="fl-hidden", container=False)
                self.add_col = gr.Button("+ Add column", size="sm", elem_id="add-column")
                self.remove_col = gr.Button("− Remove last column", size="sm", interactive=False,
                                            elem_id="remove-column")
                self.branch_all = gr.Checkbox(True, label="a branch applies to every column", elem_id="branch-all",
                                              info="click an alternative in a token's card to force it and go on")
            self.cols: list[Column] = []
            with gr.Row(equal_height=False, elem_classes="fl-columns", elem_id="columns"):
                for i, (name, strategy) in enumerate(DEFAULT_COLUMNS):
                    self.cols.append(self._column(i, name, strategy, num_layers))
            with gr.Row(visible=False, elem_id="follow-row") as self.follow_row:
                self.follow = gr.Textbox("", label="Continue the conversation", lines=1, max_length=20_000, scale=4,
                                         elem_id="follow-up", placeholder="A follow-up for every column (Enter sends)")
                with gr.Column(scale=1, min_width=160):
                    self.send = gr.Button("Continue", elem_id="continue")
                    self.new_conv = gr.Button("New conversation", size="sm", elem_id="new-conversation")
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
            self.branch_request = gr.Textbox("", elem_id="fl-branch-request", elem_classes="fl-hidden", container=False,
                                             label="branch request")
            self.branch_go = gr.Button("branch", elem_id="fl-branch-go", elem_classes="fl-hidden")
            self.timer = gr.Timer(IDLE_POLL_S)
            self.page_visible = gr.Checkbox(True, elem_id="fl-page-visible", elem_classes="fl-hidden",
                                            container=False, label="page visible")
        self._wire(hist)

    def _column(self, index: int, name: str, strategy: str, num_layers: int) -> Column:
        """One column: heading, settings (collapsed), conversation, text and stats."""
        n = index + 1
        with gr.Column(min_width=0, visible=index < MIN_COLUMNS, elem_id=f"col{n}") as box:
            params = ({} if strategy == NONE else
                      REGISTRY[strategy].preset_values(first_preset(strategy), num_layers))
            heading = gr.Markdown(render.column_heading(name, None if strategy == NONE else strategy, params,
                                                        charts.row_color(index)),
                                  elem_id=f"col{n}-heading", sanitize_html=False)
            with gr.Accordion("Column settings", open=False, elem_id=f"col{n}-settings"):
                name_box = gr.Textbox(name, label="Name", max_length=40, elem_id=f"col{n}-name")
                panel = build_strategy_panel(num_layers, strategy, prefix=f"c{n}", allow_none=True)
                prompt = gr.Textbox("", label="Prompt override", lines=2, max_length=20_000, elem_id=f"col{n}-prompt",
                                    placeholder="empty: the shared prompt")
                system = gr.Textbox("", label="System prompt override", lines=1, max_length=20_000,
                                    elem_id=f"col{n}-system", placeholder="empty: the shared system prompt")
            turns = gr.HTML(elem_id=f"col{n}-turns")
            text = gr.HTML(render.render_tokens([]), elem_id=f"col{n}-text")
            stats = gr.HTML(elem_id=f"col{n}-stats")
        return Column(index, box, heading, name_box, panel, prompt, system, turns, text, stats)

    def _sampling_controls(self) -> None:
        with gr.Accordion("Sampling (shared by every column)", open=False, elem_id="sampling"):
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

    def _deepconf_controls(self) -> None:
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
            gr.Markdown("**Calibrate** runs warm-up traces of the shared prompt (the baseline and the first "
                        "column with a strategy) and sets the threshold to the percentile that keeps η % of them.",
                        elem_classes="fl-note")
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

    def run_outputs(self) -> list:
        """Everything a Compare run (first turn, follow-up or branch) updates."""
        cols = [x for c in self.cols for x in (c.box, c.heading, c.turns, c.text, c.stats)]
        return [*cols, self.ncols, self.add_col, self.remove_col, self.diff_legend, self.conf_plot, self.mem_plot,
                self.status, self.run_json, self.last, self.mem_state, self.follow_row, self.generate, self.stop]

    def _wire(self, hist: gr.BrowserState) -> None:
        col_inputs = [x for c in self.cols for x in c.inputs]
        col_names = [n for c in self.cols for n in c.api_names]
        shared = [self.prompt, self.system_prompt, self.chat, self.model]
        settings = [self.temperature, self.top_p, self.top_k, self.min_p, self.rep, self.max_new, self.seed, self.k,
                    self.window, self.thr_mode, self.threshold, self.reference, self.key_facts, self.ncols]
        outputs = self.run_outputs()
        compare = self.runner.wrap(TAB, self.prepare_compare, col_names)
        run = gr.on([self.generate.click, self.prompt.submit], compare, [*shared, self.view, *settings, *col_inputs],
                    outputs, api_name="compare", concurrency_limit=None, show_progress="hidden")
        follow = gr.on([self.send.click, self.follow.submit], self.runner.wrap(TAB, self.prepare_continue),
                       [self.last, self.follow, self.view], outputs, api_name="continue", concurrency_limit=None,
                       show_progress="hidden")
        branching = self.branch_go.click(self.runner.wrap(TAB, self.prepare_branch),
                                         [self.last, self.branch_request, self.branch_all, self.view], outputs,
                                         api_name="branch", concurrency_limit=None, show_progress="hidden")
        for event in (run, follow, branching):
            event.then(record_run, [hist, self.last], hist, api_name=False, show_progress="hidden")
        follow.then(lambda: "", None, self.follow, api_name=False, show_progress="hidden", queue=False)
        calibrate = self.runner.wrap(TAB, self.prepare_calibrate, col_names)
        calibrating = self.calibrate.click(
            calibrate, [self.prompt, self.chat, self.model, self.temperature, self.top_p, self.seed, self.window,
                        self.k, self.max_new, self.eta_preset, self.eta, self.warmup, self.ncols, *col_inputs],
            [self.thr_mode, self.threshold, self.calib_plot, self.calib_note, self.status, self.stop, self.calibrate],
            api_name="calibrate", concurrency_limit=None, show_progress="hidden")
        cancellable_by_clients(self.cancel_trigger, run, follow, branching, calibrating)
        self.stop.click(self.stop_run, None, self.stop_ack, api_name="stop", concurrency_limit=None,
                        show_progress="hidden")
        self.new_conv.click(self.new_conversation, None,
                            [self.last, self.follow, self.follow_row, self.status,
                             *[x for c in self.cols for x in (c.turns, c.text, c.stats)]],
                            api_name="new_conversation", show_progress="hidden")
        resize_out = [self.ncols, self.add_col, self.remove_col, *[c.box for c in self.cols]]
        self.add_col.click(lambda n: self.resize(n, +1), self.ncols, resize_out, api_name=False, queue=False,
                           show_progress="hidden")
        self.remove_col.click(lambda n: self.resize(n, -1), self.ncols, resize_out, api_name=False, queue=False,
                              show_progress="hidden")
        for col in self.cols:
            edits = [c.change for c in (self.prompt, *col.inputs)]
            gr.on(edits, functools.partial(self.preview_heading, col.index), [self.prompt, *col.inputs], col.heading,
                  api_name=False, queue=False, show_progress="hidden")
        self.copy_link.click(named_params(self.make_link, col_names), [*shared, *settings, *col_inputs],
                             self.link_data, api_name="link",
                             queue=False, show_progress="hidden").then(
            None, self.link_data, self.link_note, js=COPY_LINK_JS, api_name=False, queue=False)
        self.timer.tick(self.tick, self.mem_state, [self.mem_state, self.mem_plot], api_name="memory",
                        concurrency_limit=None, show_progress="hidden")
        self.page_visible.change(lambda visible: gr.Timer(active=bool(visible)), self.page_visible, self.timer,
                                 api_name=False, queue=False, show_progress="hidden")
        self.view.change(self.rerender, [self.last, self.view],
                         [self.diff_legend, *[x for c in self.cols for x in (c.text, c.stats)]],
                         api_name="rerender", show_progress="hidden")
        self.model.change(self.change_model, self.model, [x for c in self.cols for x in c.panel.components],
                          api_name="select_model", show_progress="hidden")


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


def record_run(hist: list | None, last: dict | None) -> list:
    """Add the run just shown to this browser's history (once)."""
    return history.add_run(hist, last) if last else (hist or [])
