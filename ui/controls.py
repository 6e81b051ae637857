"""Gradio controls generated from a strategy's parameter schema, and reading their values back."""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
from dataclasses import dataclass

import gradio as gr

from feedback.errors import FeedbackError
from feedback.gate import Gate
from feedback.strategies import REGISTRY


def parse_number(value, name: str, integer: bool = False, lo: float | None = None,
                 hi: float | None = None) -> float | int:
    """A typed-in number, refused with a clear message when empty, not a number, non-finite,
    fractional where a whole number is needed, or outside [lo, hi]."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise FeedbackError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise FeedbackError(f"{name} must be finite, got {value!r}")
    if integer and not number.is_integer():
        raise FeedbackError(f"{name} must be a whole number, got {value!r}")
    out = int(number) if integer else number
    if (lo is not None and out < lo) or (hi is not None and out > hi):
        raise FeedbackError(f"{name} must be in [{lo}, {hi}], got {out}")
    return out


@dataclass
class StrategyControls:
    """The controls of every registered strategy, flattened in a fixed order for event inputs."""

    groups: dict[str, gr.Group]
    components: list[gr.components.Component]
    keys: list[tuple[str, str]]  # (strategy, param) for each component, same order

    def params_for(self, strategy: str, values: list) -> dict:
        """The selected strategy's parameter values out of the flattened input list."""
        return {param: value for (name, param), value in zip(self.keys, values) if name == strategy}

    def visibility_updates(self, strategy: str) -> list:
        """Show the selected strategy's group, hide the others."""
        return [gr.update(visible=name == strategy) for name in self.groups]

    def follow(self, dropdown: gr.Dropdown) -> None:
        """Show the group of whichever strategy `dropdown` selects."""
        dropdown.change(self.visibility_updates, dropdown, list(self.groups.values()), api_name=False)

    def layer_updates(self, num_layers: int) -> list:
        """Updates that re-range every layer slider to a model with `num_layers` layers."""
        updates = []
        for name, param in self.keys:
            p = next(q for q in REGISTRY[name].params if q.name == param)
            updates.append(gr.update(maximum=num_layers - 1, value=p.default_for(num_layers))
                           if p.is_layer else gr.update())
        return updates


def component_for(schema: dict, elem_id: str) -> gr.components.Component:
    """One control for one parameter schema entry (see `Param.schema`)."""
    label, info = schema["name"], schema["help"] or None
    if schema["choices"]:
        return gr.Dropdown(schema["choices"], value=schema["default"], label=label, info=info, elem_id=elem_id)
    if schema["type"] == "bool":
        return gr.Checkbox(value=schema["default"], label=label, info=info, elem_id=elem_id)
    lo, hi = schema["minimum"], schema["maximum"]
    step = 1 if schema["type"] == "int" else 0.01
    if lo is not None and hi is not None:
        return gr.Slider(lo, hi, value=schema["default"], step=step, label=label, info=info, elem_id=elem_id)
    return gr.Number(value=schema["default"], label=label, info=info, precision=0 if step == 1 else None,
                     elem_id=elem_id)


def build_strategy_controls(num_layers: int, selected: str, prefix: str = "param") -> StrategyControls:
    """A group of controls per strategy (only the selected one visible); call inside a Blocks.
    `prefix` keeps element ids unique when several tabs have their own controls."""
    groups, components, keys = {}, [], []
    for name, cls in REGISTRY.items():
        with gr.Group(visible=name == selected) as group:
            for p in cls.schema(num_layers)["params"]:
                components.append(component_for(p, f"{prefix}-{name}-{p['name']}"))
                keys.append((name, p["name"]))
        groups[name] = group
    return StrategyControls(groups, components, keys)


def with_named_params(fn, controls: StrategyControls, gate: Gate | None = None):
    """Wrap a handler `fn(fixed..., *param_values, request=None)` so that its API signature names
    every strategy control (`residual_alpha`, ...) instead of anonymous positions. With `gate`, the
    handler runs only in its turn on the process's model line (shared with the HTTP API)."""
    base = inspect.signature(fn)
    fixed = [p for p in base.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    named = [inspect.Parameter(f"{strategy}_{param}", inspect.Parameter.POSITIONAL_OR_KEYWORD)
             for strategy, param in controls.keys]
    # Gradio injects the request only into a positional parameter, so it comes last here.
    request = inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                annotation=gr.Request)
    turn = gate.slot if gate is not None else contextlib.nullcontext

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def wrapper(*args):
            *values, req = args
            with turn():
                yield from fn(*values, request=req)
    else:
        @functools.wraps(fn)
        def wrapper(*args):
            *values, req = args
            with turn():
                return fn(*values, request=req)

    wrapper.__signature__ = base.replace(parameters=[*fixed, *named, request])
    return wrapper
