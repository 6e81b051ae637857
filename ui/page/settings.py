"""The Compare tab's settings, declared once: one entry per setting the tab sends to a run. The table
is the page's (`ui.page`), not the Compare package's, because other tabs read it too: History's
exports and reload (`ui.page.history`), the Sweep's "Send best to Compare" (column keys and slots).

`SHARED` holds what every column shares (prompt, model, sampling, DeepConf, evaluation, how many
columns), `COLUMN` what each column has of its own (name, strategy and parameters, its own prompt,
system prompt, temperature, top-p and seed), `CALIBRATION` Calibrate's own settings. An entry says
- its name: the Gradio API parameter (a column's is `c<n>_<name>`, e.g. `c2_temperature`) and the
  key the tab's handlers read its value by;
- its control: kind, label, first value, hint, and the declared `Bound` it takes its range from;
- how the control's value is read (checked, with a `FeedbackError` naming the field) and where it
  lives in a `RunConfig` (shared) or a `RowSpec` (column): a dotted path such as
  `sampling.temperature`.

From the entries the tab builds its controls and its events' inputs, turns the values into a
RunConfig (`run_config`, keyword construction only) and a RunConfig back into its controls (History
reload, a shared link: `show`); a link keeps the column fields listed here (`ROW_FIELDS`), History's
CSV a column per shared setting a config holds (`SHARED`, by its path) and each column's own value of
the settings it stands in for (`OVERRIDES`), and a column's heading
the badge of each column setting that is set. Adding a column setting is adding an entry to
`COLUMN`; a shared one also gets its place in the layout (`ui.compare.layout`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from feedback.core.bounds import Bound
from feedback.core.records import (
    DEEPCONF_K,
    DEEPCONF_WINDOW,
    ROW_OVERRIDES,
    SEED,
    DeepConfConfig,
    RowSpec,
    RunConfig,
)
from feedback.core.sampling import (
    MIN_P,
    MIN_TEMPERATURE,
    REPETITION_PENALTY,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    SamplingConfig,
    check_temperature,
)
from feedback.errors import FeedbackError
from feedback.eval.voting import ETA
from feedback.serve.limits import BOX_MAX_CHARS, MAX_NEW_TOKENS, NAME_MAX_CHARS, WARMUP_TRACES
from feedback.strategies import REGISTRY
from ui.page.controls import NONE, StrategyPanel, build_strategy_panel, chosen, first_preset, parse_number
from ui.page.deepconf import ETA_CHOICES

MIN_COLUMNS, MAX_COLUMNS = 2, 4
TOKEN_VIEWS = (
    "confidence",
    "plain",
    "markdown",
    "diff",
)  # how the columns' text is shown; the first is a new page's
COLUMNS = Bound("columns", MIN_COLUMNS, MAX_COLUMNS, integer=True)
# (default name, default strategy) of each column slot; columns 3 and 4 appear on "Add column".
# An added column starts on another strategy's "visible effect" preset, so it shows something new at
# once; "none" with a prompt override makes it a prompt variant.
DEFAULT_COLUMNS = (
    ("Baseline", NONE),
    ("Feedback", "residual"),
    ("Column 3", "deep_cache"),
    ("Column 4", "anchor"),
)
DEFAULT_THRESHOLD = 4.5  # lowest group confidence (w = 32) of normal answers on the embedded model: 4.7–7.1
FIRST_MAX_NEW_TOKENS = 160  # a new page's run: long enough to show a difference, short enough to wait for
COLUMN_NAME_MAX_CHARS = NAME_MAX_CHARS  # a column is a row: its name is held as the API holds a row's


class _Marker:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


FROM_CONFIG = _Marker("FROM_CONFIG")  # a control's first value: the config dataclass's own default
KEEP = _Marker("KEEP")  # a value to show that leaves the control as it is
DEFAULT_RUN, DEFAULT_ROW = RunConfig(prompt=""), RowSpec()  # where FROM_CONFIG reads
CONFIG_PARTS = {"sampling": SamplingConfig, "deepconf": DeepConfConfig}  # a RunConfig's nested configs


@dataclass(frozen=True)
class Page:
    """What building a control needs to know: the models served, the model's layers (strategy
    sliders) and, for a column setting, the column slot (0-based)."""

    models: tuple[str, ...]
    default_model: str
    num_layers: int
    column: int | None = None


@dataclass(frozen=True)
class Scope:
    """Where a value is read: every value of the event by name (a column's prompt is compared with
    the shared one, the threshold reads its mode) and the column slot (None for a shared setting)."""

    values: dict
    column: int | None = None


def resolve(source, path: str):
    """The value at a dotted path of a config ("sampling.temperature")."""
    for part in path.split("."):
        source = getattr(source, part)
    return source


def _same(value):
    return value


def _blank_for_none(value):
    return "" if value is None else value


def _whole_text(value) -> str:
    """A whole number as a text box shows it, every digit ("" for none)."""
    return "" if value is None else str(value)


def _number_text(value) -> str:
    """A number as a text box shows it ("" for none)."""
    return "" if value is None else f"{value:g}"


def offered(control, value) -> bool:
    """Whether `control` can show `value`: a radio or a dropdown only one of its choices (a link's
    model that is not served here leaves the selection as it is)."""
    choices = getattr(control, "choices", None)
    if choices is None:
        return True
    return value in [c[1] if isinstance(c, tuple) else c for c in choices]


@dataclass(frozen=True)
class Field:
    """A setting with one control: a number box, a text box, a checkbox, a radio or a dropdown."""

    name: str
    path: str | None  # where it lives in a RunConfig / RowSpec; None: not in a config (it qualifies another)
    control: type  # gr.Number, gr.Textbox, gr.Checkbox, gr.Radio or gr.Dropdown
    label: str
    first: Any = FROM_CONFIG  # the control's first value: FROM_CONFIG, a value, or fn(page)
    info: str | None = None
    bound: Bound | None = None  # the declared range: a number box's minimum and maximum, and the check
    what: str | None = None  # the field as messages name it; default: the label
    parse: Callable[[Any, Scope], Any] | None = (
        None  # control value -> config value; default: the bound's check
    )
    shown: Callable[[Any], Any] = _same  # config value -> control value (or KEEP)
    get: Callable[[Any], Any] | None = None  # reads it from a config where no path says where it is
    optional: bool = False  # an empty control means None (for a column: the shared setting's value)
    badge: Callable[[Any], str] | None = None  # a column heading's badge for a value that is set
    choices: Callable[[Page], list] | list | None = None  # a radio's or dropdown's
    options: dict = field(default_factory=dict)  # the control's other arguments (elem_id, lines, step, ...)

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.path,) if self.path else ()

    def build(self, page: Page) -> gr.components.Component:
        """The control, inside the current Blocks (a column's element id gets its `col<n>-` prefix)."""
        kwargs = dict(self.options)
        # A number's range is checked by the handler (`Bound.check`, naming the setting), not by the
        # box: Gradio refuses a value out of a box's own minimum/maximum before any handler runs, so
        # the status line would keep saying whatever it said before.
        if self.bound is not None and self.control is gr.Number and self.bound.integer:
            kwargs["precision"] = 0
        if self.info is not None:
            kwargs["info"] = self.info
        if self.bound is not None and self.control is gr.Number and self.bound.info not in (self.info or ""):
            kwargs["info"] = (
                f"{self.info}; {self.bound.info}" if self.info else self.bound.info
            )  # its range, said
        if self.choices is not None:
            kwargs["choices"] = self.choices(page) if callable(self.choices) else list(self.choices)
        if page.column is not None and "elem_id" in kwargs:
            kwargs["elem_id"] = f"col{page.column + 1}-{kwargs['elem_id']}"
        return self.control(value=self.first_value(page), label=self.label, **kwargs)

    def first_value(self, page: Page):
        if self.first is FROM_CONFIG:
            return self.shown(self.read(DEFAULT_RUN if page.column is None else DEFAULT_ROW))
        return self.first(page) if callable(self.first) else self.first

    def inputs(self, control) -> dict:
        """The event inputs it adds, by (unprefixed) name."""
        return {self.name: control}

    def outputs(self, control) -> list:
        return [control]

    def value(self, values: dict, scope: Scope):
        """Its config value from the event's values by name; a FeedbackError naming it if it has none."""
        raw = values[self.name]
        if self.optional and (raw is None or (isinstance(raw, str) and not raw.strip())):
            return None
        if self.parse is not None:
            return self.parse(raw, scope)
        if self.bound is not None:
            return self.bound.check(raw, self.what or self.label)
        return raw

    def fields(self, value) -> dict:
        """`value` at its place in the config, by path."""
        return {self.path: value} if self.path else {}

    def read(self, source):
        """Its value in `source` (a RunConfig or a RowSpec)."""
        return self.get(source) if self.get is not None else resolve(source, self.path)

    def show(self, source, control) -> dict:
        """The control as `source` has it (nothing for a setting no config holds, a value to KEEP
        or a choice the control does not offer)."""
        if self.get is None and self.path is None:
            return {}
        value = self.shown(self.read(source))
        return {} if value is KEEP or not offered(control, value) else {control: value}

    def badges(self, spec: RowSpec) -> list[str]:
        value = self.read(spec) if self.badge is not None else None
        return [] if value is None else [self.badge(value)]


@dataclass(frozen=True)
class StrategyChoice:
    """A column's feedback strategy (or a stack of two) and its parameters, in one strategy panel
    (dropdowns, presets, a control per parameter of every strategy): `c<n>_strategy`, `c<n>_stack` and
    `c<n>_<strategy>_<param>` in the API; `strategy` and `params` in a RowSpec."""

    name: str = "strategy"
    paths: tuple[str, ...] = ("strategy", "params")
    bound: Bound | None = None

    def build(self, page: Page) -> StrategyPanel:
        return build_strategy_panel(
            page.num_layers, DEFAULT_COLUMNS[page.column][1], prefix=f"c{page.column + 1}", allow_none=True
        )

    def inputs(self, panel: StrategyPanel) -> dict:
        return {"strategy": panel.strategy} | panel.named_inputs()

    def outputs(self, panel: StrategyPanel) -> list:
        return panel.outputs()

    def value(self, values: dict, scope: Scope) -> tuple[str | None, dict]:
        """(strategy, the chosen strategy's parameter values); (None, {}) for none. An unknown
        strategy is passed on: the engine refuses it with the strategies it knows."""
        return chosen(values)

    def fields(self, value: tuple[str | None, dict]) -> dict:
        strategy, params = value
        return {"strategy": strategy, "params": params}

    def show(self, spec: RowSpec, panel: StrategyPanel) -> dict:
        return panel.show(spec.strategy or NONE, params=spec.params if spec.strategy else None)

    def badges(self, spec: RowSpec) -> list[str]:
        return []  # the heading names the strategy and its parameters itself


def _threshold(raw, scope: Scope) -> float | None:
    """The early-stop threshold, when early stop is on (its box is not read otherwise)."""
    return parse_number(raw, "threshold") if scope.values["threshold_mode"] == "fixed" else None


def _temperature(raw, scope: Scope) -> float:
    return check_temperature(raw, TEMPERATURE.name)  # 0 (greedy) or at least the sampling floor


def _top_p(raw, scope: Scope) -> float:
    value = TOP_P.check(raw, TOP_P.name)
    if value == 0.0:
        raise FeedbackError("top_p must be above 0 (1 = off): top-p 0 keeps no token")
    return value


def parse_key_facts(text: str | None) -> list[str]:
    """One key fact per line (blank lines ignored); /…/ is a regular expression."""
    return [line.strip() for line in (text or "").splitlines() if line.strip()]


def _column_name(raw, scope: Scope) -> str:
    return (raw or "").strip() or DEFAULT_COLUMNS[scope.column][0]


def _prompt_override(raw, scope: Scope) -> str | None:
    """A column's own prompt; one equal to the shared prompt is no override."""
    return raw if raw != (scope.values.get("prompt") or "") else None


NUMBER = {"min_width": 100}  # the sampling and DeepConf boxes share rows

SHARED: tuple[Field, ...] = (
    Field(
        "prompt",
        "prompt",
        gr.Textbox,
        "Prompt",
        parse=lambda raw, scope: raw or "",
        options=dict(
            lines=4,
            max_length=BOX_MAX_CHARS,
            elem_id="prompt",
            placeholder="Ask something… (Enter runs, Shift+Enter for a new line)",
        ),
    ),
    Field(
        "system_prompt",
        "system_prompt",
        gr.Textbox,
        "System prompt (every column; a column may override it)",
        optional=True,
        shown=_blank_for_none,
        options=dict(lines=2, max_length=BOX_MAX_CHARS, elem_id="system-prompt"),
    ),
    Field(
        "chat_template",
        "chat_template",
        gr.Checkbox,
        "Use the chat template",
        parse=lambda raw, scope: bool(raw),
        options=dict(elem_id="chat-template"),
    ),
    Field(
        "model",
        "model",
        gr.Dropdown,
        "Model",
        first=lambda page: page.default_model,
        choices=lambda page: list(page.models),
        options=dict(elem_id="model"),
    ),
    Field(
        "temperature",
        "sampling.temperature",
        gr.Number,
        "temperature",
        bound=TEMPERATURE,
        info=f"0 = greedy, else ≥ {MIN_TEMPERATURE:g}",
        parse=_temperature,
        options=NUMBER | dict(step=0.05, elem_id="temperature"),
    ),
    Field(
        "top_p",
        "sampling.top_p",
        gr.Number,
        "top-p",
        bound=TOP_P,
        info="1 = off",
        options=NUMBER | dict(step=0.05, elem_id="top-p"),
    ),
    Field(
        "top_k",
        "sampling.top_k",
        gr.Number,
        "top-k",
        bound=TOP_K,
        info="0 = off",
        options=NUMBER | dict(elem_id="top-k"),
    ),
    Field(
        "min_p",
        "sampling.min_p",
        gr.Number,
        "min-p",
        bound=MIN_P,
        info="0 = off",
        options=NUMBER | dict(step=0.01, elem_id="min-p"),
    ),
    Field(
        "repetition_penalty",
        "sampling.repetition_penalty",
        gr.Number,
        "repetition penalty",
        bound=REPETITION_PENALTY,
        info="1 = off",
        options=NUMBER | dict(step=0.05, elem_id="repetition-penalty"),
    ),
    Field(
        "max_new_tokens",
        "max_new_tokens",
        gr.Number,
        "max new tokens",
        first=FIRST_MAX_NEW_TOKENS,
        bound=MAX_NEW_TOKENS,
        info=MAX_NEW_TOKENS.info,
        options=dict(elem_id="max-new-tokens"),
    ),
    Field("seed", "seed", gr.Number, "seed", bound=SEED, options=NUMBER | dict(elem_id="seed")),
    Field(
        "k",
        "deepconf.k",
        gr.Number,
        "k (top-k for confidence)",
        bound=DEEPCONF_K,
        what=DEEPCONF_K.name,
        options=NUMBER | dict(elem_id="deepconf-k"),
    ),
    Field(
        "window",
        "deepconf.window",
        gr.Number,
        "group window (tokens)",
        bound=DEEPCONF_WINDOW,
        what=DEEPCONF_WINDOW.name,
        options=NUMBER | dict(elem_id="deepconf-window"),
    ),
    Field(
        "threshold_mode",
        None,
        gr.Radio,
        "early stop",
        choices=["off", "fixed"],
        get=lambda cfg: "off" if cfg.deepconf.threshold is None else "fixed",
        info="stop a column once its window is full and its group confidence falls below the threshold",
        options=dict(elem_id="thr-mode"),
    ),
    Field(
        "threshold",
        "deepconf.threshold",
        gr.Number,
        "threshold (group confidence)",
        first=DEFAULT_THRESHOLD,
        parse=_threshold,
        shown=lambda value: KEEP if value is None else value,
        info=(
            "normal answers of the embedded model stay above 4.7 (window 32); Calibrate measures it for "
            "your prompt"
        ),
        options=NUMBER | dict(precision=2, elem_id="threshold"),
    ),
    Field(
        "reference",
        "reference",
        gr.Textbox,
        "Reference answer",
        optional=True,
        shown=_blank_for_none,
        info=(
            "its perplexity after each column's prompt (with the column's strategy where it can score a text)"
        ),
        options=dict(lines=2, max_length=BOX_MAX_CHARS, elem_id="reference"),
    ),
    Field(
        "key_facts",
        "key_facts",
        gr.Textbox,
        "Key facts",
        parse=lambda raw, scope: parse_key_facts(raw),
        shown="\n".join,
        info="one per line; /…/ is a regular expression; each column's recall is shown",
        options=dict(lines=2, elem_id="key-facts"),
    ),
    # How many columns run: the rows of the config are the first `columns` columns' settings.
    Field(
        "columns",
        None,
        gr.Number,
        "columns",
        first=MIN_COLUMNS,
        bound=COLUMNS,
        get=lambda cfg: len(cfg.rows),
        options=dict(elem_id="n-columns", elem_classes="fl-hidden", container=False),
    ),
)

COLUMN: tuple[Field | StrategyChoice, ...] = (
    Field(
        "name",
        "name",
        gr.Textbox,
        "Name",
        first=lambda page: DEFAULT_COLUMNS[page.column][0],
        parse=_column_name,
        options=dict(max_length=COLUMN_NAME_MAX_CHARS, elem_id="name"),
    ),
    StrategyChoice(),
    Field(
        "prompt",
        "prompt",
        gr.Textbox,
        "Prompt override",
        optional=True,
        parse=_prompt_override,
        shown=_blank_for_none,
        options=dict(
            lines=2, max_length=BOX_MAX_CHARS, elem_id="prompt", placeholder="empty: the shared prompt"
        ),
    ),
    Field(
        "system",
        "system_prompt",
        gr.Textbox,
        "System prompt override",
        optional=True,
        shown=_blank_for_none,
        options=dict(
            lines=1, max_length=BOX_MAX_CHARS, elem_id="system", placeholder="empty: the shared system prompt"
        ),
    ),
    # A text box, not a number box: a page's number box cannot be empty (it shows and sends 0, greedy).
    Field(
        "temperature",
        "temperature",
        gr.Textbox,
        "temperature",
        bound=TEMPERATURE,
        optional=True,
        info=f"empty: the shared temperature; 0 = greedy, else {MIN_TEMPERATURE:g} to {TEMPERATURE.hi:g}",
        parse=_temperature,
        shown=_number_text,
        badge=lambda t: f"temperature {t:g}",
        options=dict(lines=1, max_lines=1, elem_id="temperature", placeholder="the shared temperature"),
    ),
    Field(
        "top_p",
        "top_p",
        gr.Textbox,
        "top-p",
        bound=TOP_P,
        optional=True,
        info="empty: the shared top-p; above 0, up to 1 (1 = off)",
        parse=_top_p,
        shown=_number_text,
        badge=lambda p: f"top-p {p:g}",
        options=dict(lines=1, max_lines=1, elem_id="top-p", placeholder="the shared top-p"),
    ),
    Field(
        "seed",
        "seed",
        gr.Textbox,
        "seed",
        bound=SEED,
        optional=True,
        info="empty: the shared seed; a whole number, 0 or more (another seed draws other tokens)",
        shown=_whole_text,
        badge=lambda seed: f"seed {seed}",
        options=dict(lines=1, max_lines=1, elem_id="seed", placeholder="the shared seed"),
    ),
)

CALIBRATION: tuple[Field, ...] = (
    Field(
        "eta_preset",
        None,
        gr.Radio,
        "calibration η",
        first=ETA_CHOICES[1],
        choices=ETA_CHOICES,
        options=dict(elem_id="eta-preset"),
    ),
    Field(
        "eta",
        None,
        gr.Number,
        "custom η %",
        first=50,
        bound=ETA,
        parse=lambda raw, scope: raw,  # checked by `resolve_eta`, which reads it only for a custom η
        options=NUMBER | dict(elem_id="eta"),
    ),
    Field(
        "warmup",
        None,
        gr.Number,
        "warm-up traces per column",
        first=8,
        bound=WARMUP_TRACES,
        what=WARMUP_TRACES.name,
        options=NUMBER | dict(elem_id="warmup"),
    ),
)

SHARED_BY_NAME = {s.name: s for s in SHARED}
ROW_FIELDS = tuple(path for s in COLUMN for path in s.paths)  # the RowSpec fields a column's settings set
# (row field, shared path) pairs: the column settings that stand in for a shared one (declared once,
# as ROW_OVERRIDES in feedback/core/records.py, where a row's own value replaces the run's)
_SHARED_PATH = dict(ROW_OVERRIDES)
OVERRIDES = tuple((s.path, _SHARED_PATH[s.path]) for s in COLUMN if getattr(s, "path", None) in _SHARED_PATH)


def column_key(index: int, name: str) -> str:
    """A column setting's input name for column slot `index` (0-based): c2_temperature."""
    return f"c{index + 1}_{name}"


def column_values(values: dict, index: int) -> dict:
    """Column slot `index`'s values out of an event's, by their unprefixed names."""
    prefix = column_key(index, "")
    return {k[len(prefix) :]: v for k, v in values.items() if k.startswith(prefix)}


def read_all(settings, values: dict, scope: Scope) -> dict:
    """Every setting's checked value, by name."""
    return {s.name: s.value(values, scope) for s in settings}


def row_spec(values: dict, scope: Scope) -> RowSpec:
    """A column's RowSpec from its values by (unprefixed) name; errors name the column."""
    try:
        found = {}
        for s in COLUMN:
            found |= s.fields(s.value(values, scope))
    except FeedbackError as exc:
        raise FeedbackError(f"column {scope.column + 1}: {exc}") from None
    return RowSpec(**found)


def column_specs(values: dict, columns: int) -> list[RowSpec]:
    """The first `columns` columns' rows from an event's values; their names must differ."""
    specs = [row_spec(column_values(values, i), Scope(values, i)) for i in range(columns)]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise FeedbackError(f"column names must be different, got {', '.join(names)}")
    return specs


def _nested(found: dict) -> dict:
    """{"sampling.top_p": 0.9} -> {"sampling": {"top_p": 0.9}}."""
    out: dict = {}
    for path, value in found.items():
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def run_config(values: dict) -> RunConfig:
    """A validated RunConfig from an event's values by name (shared settings by theirs, column
    settings as c<n>_<name>); each value goes to its entry's path, by keyword."""
    shared = read_all(SHARED, values, Scope(values))
    found = {path: value for s in SHARED for path, value in s.fields(shared[s.name]).items()}
    data = _nested(found)
    parts = {name: kind(**data.pop(name, {})) for name, kind in CONFIG_PARTS.items()}
    return RunConfig(
        **data,
        **parts,
        rows=column_specs(values, shared["columns"]),
        quality=True,  # self and prompt perplexity per row: ~a forward pass each, after the run
    ).validate()


def badges(spec: RowSpec) -> list[str]:
    """The heading badges of a column's own settings that are set ("temperature 0")."""
    return [text for s in COLUMN for text in s.badges(spec)]


def default_row(column: int, num_layers: int) -> RowSpec:
    """The row a column slot starts as (its heading before any edit): its default name, and its
    default strategy at that strategy's first preset."""
    name, strategy = DEFAULT_COLUMNS[column]
    if strategy == NONE:
        return RowSpec(name=name)
    return RowSpec(
        name=name,
        strategy=strategy,
        params=REGISTRY[strategy].preset_values(first_preset(strategy), num_layers),
    )
