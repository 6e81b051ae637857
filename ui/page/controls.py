"""The strategy panel every tab uses: strategy dropdown, what it does, named presets, and the
parameter controls generated from each strategy's `Param` schema; and reading typed numbers back.

Controls: layer indices are sliders over the model's layers; every other number is a number box
with its bounds, so a value out of range is refused with a message (a slider would clamp it
silently) and wide ranges (1 to 100,000) can be typed instead of dragged. A tab's own number boxes
take their range from the `Bound` their handler checks (`bound_number`). The panel's handlers, and
the tabs' that read its controls, take values by name: each control's API name is
`<strategy>_<param>` (`named_inputs`, `chosen`).

Stacks: a second dropdown, "Stack with", adds a second hidden-state strategy after the first on
the same row (`a+b`); both strategies' controls show, and the presets are the ones both share. A
stack of more than two runs from the API, the command line and batch files.
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from feedback.core.bounds import Bound
from feedback.errors import FeedbackError
from feedback.strategies import REGISTRY, SEP, PromptStrategy, get_strategy
from feedback.strategies.stack import is_stack_name, join_params, split_params
from ui.page.runner import by_name

CUSTOM = "custom"
NONE = "none"  # a column without feedback (Compare's columns may each have a strategy or none)
NONE_ABOUT = "**none** — no feedback: the model as it is (a baseline, or a prompt variant on its own)."


def parse_number(
    value, name: str, integer: bool = False, lo: float | None = None, hi: float | None = None
) -> float | int:
    """A typed-in number with no declared `Bound` of its own (a threshold, a floor only), refused as
    a bound refuses: empty, not a number, non-finite, fractional where a whole number is needed, or
    outside [lo, hi]."""
    return Bound(name, lo, hi, integer).check(value)


def api_name(strategy: str, param: str) -> str:
    """A strategy control's API parameter name: `<strategy>_<param>` (e.g. residual_alpha)."""
    return f"{strategy}_{param}"


def about(strategy: str, preset: str | None) -> str:
    """What the strategy (or stack) does, its update rule, and what the chosen preset is for."""
    cls = get_strategy(strategy)
    kind = (
        "prompt-level: the model is unchanged; it is asked differently and given marker tokens"
        if issubclass(cls, PromptStrategy)
        else "recurrent: each token's feedback feeds the next one"
        if cls.recurrent
        else "not recurrent: one parallel pass scores a text exactly"
    )
    if is_stack_name(strategy):
        kind = f"a stack, applied in this order: {' then '.join(cls.member_names())}; {kind}"
    note = next((p.note for p in cls.presets if p.name == preset), None)
    preset_line = (
        f"\n\n**Preset “{preset}”**: {note}"
        if note
        else "\n\n**Custom settings** (choose a preset to see what a setting is known to do)."
    )
    return (
        f"**{strategy}** — {cls.description}.  \n`{cls.formula}`  \n"
        f"<span class='fl-note'>{kind}</span>{preset_line}"
    )


def preset_names(strategy: str) -> list[str]:
    return [p.name for p in get_strategy(strategy).presets] + [CUSTOM]


def first_preset(strategy: str, context: str = "generate") -> str:
    """The preset a panel selects for a strategy: in generation, the first ("visible effect"); in
    perplexity tabs, the one tuned for perplexity (or best on dev) where there is one."""
    names = preset_names(strategy)[:-1]
    if context == "perplexity":
        return next((n for n in names if "perplexity" in n or "best on dev" in n), names[0])
    return names[0]


def matching_preset(strategy: str, params: dict, num_layers: int) -> str:
    """The preset whose values are exactly `params`, else "custom"."""
    cls = get_strategy(strategy)
    for p in cls.presets:
        if cls.preset_values(p.name, num_layers) == {**cls.validate({}, num_layers), **params}:
            return p.name
    return CUSTOM


def _picked(value) -> bool:
    return value not in (None, "", NONE)


def chosen_name(values: dict) -> str | None:
    """The strategy (or stack, `a+b`) a panel's "strategy" and "stack" values name; None for none."""
    first, second = values.get("strategy"), values.get("stack")
    if not _picked(first):
        return None
    return f"{first}{SEP}{second}" if _picked(second) else first


def chosen(values: dict) -> tuple[str | None, dict]:
    """The strategy a panel's values choose, from a handler's values by name ("strategy", "stack",
    `<strategy>_<param>`): its name (a stack's, `a+b`, when "Stack with" names a second) and its
    parameters; (None, {}) for none. An unknown name is passed on: the engine refuses it with the
    strategies it knows."""
    name = chosen_name(values)
    if name is None:
        return None, {}

    def own(member: str) -> dict:
        params = REGISTRY[member].params if member in REGISTRY else ()
        return {p.name: values[api_name(member, p.name)] for p in params}

    if not is_stack_name(name):
        return name, own(name)
    return name, join_params({m: own(m) for m in name.split(SEP)})


def stackable(names: list[str]) -> list[str]:
    """The strategies that may join a stack: the hidden-state ones (a prompt-level one changes the prompt)."""
    return [n for n in names if n in REGISTRY and not issubclass(REGISTRY[n], PromptStrategy)]


def stack_offer(names: list[str], first: str) -> tuple[list[str], bool]:
    """ "Stack with": its choices after `first` (none, or another hidden-state strategy) and whether
    it shows (only after a hidden-state strategy)."""
    stacks = stackable(names)
    return [NONE, *(n for n in stacks if n != first)], first in stacks


def _range_text(lo, hi) -> str:
    """ " (0 to 1)", " (≥ 1)", " (≤ 5)" or ""."""
    if lo is None and hi is None:
        return ""
    if hi is None:
        return f" (≥ {lo:g})"
    if lo is None:
        return f" (≤ {hi:g})"
    return f" ({lo:g} to {hi:g})"


def component_for(schema: dict, elem_id: str, value=None, visible: bool = True) -> gr.components.Component:
    """One control for one parameter schema entry (see `Param.schema`)."""
    label = schema["name"]
    value = schema["default"] if value is None else value
    lo, hi = schema["minimum"], schema["maximum"]
    info = (schema["help"] or "") + _range_text(lo, hi)
    if schema["choices"]:
        return gr.Dropdown(
            schema["choices"], value=value, label=label, info=info or None, elem_id=elem_id, visible=visible
        )
    if schema["type"] == "bool":
        return gr.Checkbox(value=value, label=label, info=info or None, elem_id=elem_id, visible=visible)
    if schema["is_layer"]:
        return gr.Slider(
            lo, hi, value=value, step=1, label=label, info=info, elem_id=elem_id, visible=visible
        )
    integer = schema["type"] == "int"
    # the range is in the help and checked by the strategy, naming the parameter (see `bound_number`)
    return gr.Number(
        value=value,
        label=label,
        info=info or None,
        precision=0 if integer else None,
        step=1 if integer else 0.01,
        elem_id=elem_id,
        visible=visible,
    )


@dataclass
class StrategyPanel:
    """Strategy dropdown, explanation, preset dropdown and every strategy's parameter controls
    (only the selected strategy's group visible), flattened in a fixed order for event inputs."""

    strategy: gr.Dropdown
    stack: gr.Dropdown  # "Stack with": a second strategy applied after the first, or none
    preset: gr.Dropdown
    about: gr.Markdown
    groups: dict[str, gr.Group]
    components: list[gr.components.Component]
    keys: list[tuple[str, str]]  # (strategy, param) for each component, same order
    num_layers: int
    context: str = "generate"

    @property
    def api_names(self) -> list[str]:
        """API parameter names of the controls, `<strategy>_<param>` (e.g. residual_alpha)."""
        return [api_name(strategy, param) for strategy, param in self.keys]

    def named_inputs(self) -> dict[str, gr.components.Component]:
        """The controls by API name, for an event's `inputs_kwargs` ("stack" and `<strategy>_<param>`)."""
        return {"stack": self.stack} | dict(zip(self.api_names, self.components))

    def component(self, strategy: str, param: str) -> gr.components.Component:
        return self.components[self.keys.index((strategy, param))]

    def _stack_update(self, first: str, second: str | None) -> dict:
        """ "Stack with": offered after a hidden-state strategy, listing the others."""
        choices, shown = stack_offer(list(self.groups), first)
        return {self.stack: gr.update(choices=choices, value=second or NONE, visible=shown)}

    def show(self, strategy: str, preset: str | None = None, params: dict | None = None) -> dict:
        """Updates that select `strategy` (a stack of two too), with a preset's values (or explicit
        `params`)."""
        if strategy not in REGISTRY and not is_stack_name(strategy):  # "none": nothing to set
            return (
                {
                    self.strategy: NONE,
                    self.preset: gr.update(choices=[], value=None, visible=False),
                    self.about: NONE_ABOUT,
                }
                | self._stack_update(NONE, None)
                | {group: gr.update(visible=False) for group in self.groups.values()}
            )
        members = strategy.split(SEP)
        if len(members) > 2:
            raise FeedbackError(
                f"the page stacks two strategies; {strategy} has {len(members)} (run it from the "
                "API, the command line or a batch file)"
            )
        if params is None:
            preset = preset or first_preset(strategy, self.context)
            params = get_strategy(strategy).preset_values(preset, self.num_layers)
        elif preset is None:
            preset = matching_preset(strategy, params, self.num_layers)
        own = split_params(params, tuple(members)) if len(members) > 1 else {strategy: params}
        out: dict = {
            self.strategy: members[0],
            self.preset: gr.update(choices=preset_names(strategy), value=preset, visible=True),
            self.about: about(strategy, preset),
        }
        out |= self._stack_update(members[0], members[1] if len(members) > 1 else None)
        out |= {group: gr.update(visible=name in members) for name, group in self.groups.items()}
        out |= {self.component(m, k): v for m in members for k, v in own[m].items() if (m, k) in self.keys}
        return out

    def outputs(self) -> list:
        return [self.strategy, self.stack, self.preset, self.about, *self.groups.values(), *self.components]

    def layer_updates(self, num_layers: int) -> dict:
        """Re-range every layer slider to a model with `num_layers` layers."""
        self.num_layers = num_layers
        out = {}
        for (name, param), comp in zip(self.keys, self.components):
            p = next(q for q in REGISTRY[name].params if q.name == param)
            if p.is_layer:
                out[comp] = gr.update(maximum=num_layers - 1, value=p.default_for(num_layers))
        return out

    def _selected(self, values: dict) -> str:
        """The panel's strategy as one name: the first, or the stack `first+second`."""
        first, second = values["strategy"], values["stack"]
        # a stale "Stack with" (the first strategy changed under it) is not a stack the page offers
        choices, shown = stack_offer(list(self.groups), first)
        return (
            chosen_name({"strategy": first, "stack": second if shown and second in choices else None}) or NONE
        )

    def _on_strategy(self, values: dict) -> dict:
        return self.show(self._selected(values))

    def _on_preset(self, values: dict) -> dict:
        strategy, preset = self._selected(values), values["preset"]
        if strategy == NONE:
            return {}
        if preset == CUSTOM:
            return {self.about: about(strategy, CUSTOM)}
        return self.show(strategy, preset)

    def _on_edit(self, values: dict) -> dict:
        """A value edited by hand: the settings are no longer a preset's."""
        strategy = self._selected(values)
        return {self.preset: CUSTOM, self.about: about(strategy, CUSTOM)} if strategy != NONE else {}

    def wire(self) -> None:
        """User edits only (`.input`, not `.change`), so programmatic updates — a run reloaded from
        History, a shared link — are never overwritten by a preset."""
        quiet = dict(api_name=False, queue=False, show_progress="hidden")
        chosen_inputs = {"strategy": self.strategy, "stack": self.stack}
        for dropdown in (self.strategy, self.stack):
            dropdown.input(
                by_name(self._on_strategy, ["strategy", "stack"]),
                inputs_kwargs=chosen_inputs,
                outputs=self.outputs(),
                **quiet,
            )
        self.preset.input(
            by_name(self._on_preset, ["strategy", "stack", "preset"]),
            inputs_kwargs=chosen_inputs | {"preset": self.preset},
            outputs=self.outputs(),
            **quiet,
        )
        on_edit = by_name(self._on_edit, ["strategy", "stack"])
        for comp in self.components:
            comp.input(on_edit, inputs_kwargs=chosen_inputs, outputs=[self.preset, self.about], **quiet)


def build_strategy_panel(
    num_layers: int,
    selected: str = "residual",
    prefix: str = "param",
    context: str = "generate",
    strategies: list[str] | None = None,
    allow_none: bool = False,
) -> StrategyPanel:
    """The panel, inside the current Blocks; `prefix` keeps element ids unique per tab. In a
    "generate" context, controls that only perplexity reads are hidden. With `allow_none`, the
    dropdown also offers "none" (no feedback), which may be `selected`. Text perplexity cannot score
    a prompt-level strategy (restate), so a "perplexity" panel does not offer one."""
    names = strategies or [
        n for n, cls in REGISTRY.items() if not (issubclass(cls, PromptStrategy) and context == "perplexity")
    ]
    has = selected in REGISTRY
    preset = first_preset(selected, context) if has else None
    values = REGISTRY[selected].preset_values(preset, num_layers) if has else {}
    strategy = gr.Dropdown(
        ([NONE] if allow_none else []) + names,
        value=selected,
        label="Feedback strategy",
        elem_id=f"{prefix}-strategy",
    )
    preset_dd = gr.Dropdown(
        preset_names(selected) if has else [],
        value=preset,
        label="Preset",
        visible=has,
        elem_id=f"{prefix}-preset",
        info="named settings with what each is for; editing a value makes it custom",
    )
    stack_choices, stack_shown = stack_offer(names, selected)
    stack = gr.Dropdown(
        stack_choices,
        value=NONE,
        label="Stack with",
        elem_id=f"{prefix}-stack",
        visible=stack_shown,
        info="a second strategy, applied after the first on the same row",
    )
    note = gr.Markdown(about(selected, preset) if has else NONE_ABOUT, elem_id=f"{prefix}-about")
    groups, components, keys = {}, [], []
    for name in names:
        cls = REGISTRY[name]
        with gr.Group(visible=name == selected) as group:
            for p in cls.schema(num_layers)["params"]:
                shown = not (p["perplexity_only"] and context == "generate")
                value = values.get(p["name"]) if name == selected else None
                components.append(component_for(p, f"{prefix}-{name}-{p['name']}", value, visible=shown))
                keys.append((name, p["name"]))
        groups[name] = group
    panel = StrategyPanel(strategy, stack, preset_dd, note, groups, components, keys, num_layers, context)
    panel.wire()
    return panel


def bound_number(
    bound: Bound, value, label: str | None = None, info: str | None = None, **kwargs
) -> gr.Number:
    """A number box whose hint says `bound`'s range; `label` (default the bound's name) and `info`
    (said before the range) may say more. The range is the handler's to check (`bound.check`): a box's
    own minimum and maximum make Gradio refuse a value before any handler runs, with its own words,
    and the tab's status line would go on saying whatever it said before."""
    said = bound.info if info is None or bound.info in info else f"{info}; {bound.info}"
    return gr.Number(
        value, label=label or bound.name, precision=0 if bound.integer else None, info=said, **kwargs
    )


def to_components(outputs: dict[str, gr.components.Component], view: dict) -> dict:
    """A work's view (what to show, by output name) as updates of the tab's components."""
    return {outputs[name]: value for name, value in view.items()}


def run_controls(prefix: str, label: str):
    """A tab's run button, its Stop button (off until something runs) and its status line."""
    with gr.Row():
        run = gr.Button(label, variant="primary", elem_id=f"{prefix}-run")
        stop = gr.Button("Stop", variant="stop", interactive=False, elem_id=f"{prefix}-stop")
    status = gr.HTML(elem_id=f"{prefix}-status")
    return run, stop, status


@dataclass
class LazyJSON:
    """A result as JSON: sent to program clients whole (`data`, hidden on the page), shown to a
    person only when the accordion opens, from the server's copy (`kept`). A JSON tree of a long
    result is tens of thousands of nodes a page would otherwise build and keep after every run."""

    data: gr.JSON
    kept: gr.State
    box: gr.Accordion
    view: gr.JSON


def lazy_json(label: str, elem_id: str, kept: gr.State | None = None) -> LazyJSON:
    """`kept`: a State that already holds the result (else a new one)."""
    data = gr.JSON(visible=False, elem_id=elem_id)
    kept = kept if kept is not None else gr.State(None)
    with gr.Accordion(label, open=False, elem_id=f"{elem_id}-box") as box:
        view = gr.JSON(show_label=False, elem_id=f"{elem_id}-view")
    box.expand(lambda value: value, kept, view, api_name=False, queue=False, show_progress="hidden")
    box.collapse(lambda: None, None, view, api_name=False, queue=False, show_progress="hidden")
    return LazyJSON(data, kept, box, view)
