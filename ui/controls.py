"""Gradio controls generated from a strategy's parameter schema, and reading their values back."""
from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from feedback.strategies import REGISTRY


@dataclass
class StrategyControls:
    """The controls of every registered strategy, flattened in a fixed order for event inputs."""

    groups: dict[str, gr.Group]
    components: list[gr.components.Component]
    keys: list[tuple[str, str]]  # (strategy, param) for each component, same order

    def params_for(self, strategy: str, values: list) -> dict:
        """The selected strategy's parameter values out of the flattened input list."""
        return {param: value for (name, param), value in zip(self.keys, values) if name == strategy}

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


def build_strategy_controls(num_layers: int, selected: str) -> StrategyControls:
    """A group of controls per strategy (only the selected one visible); call inside a Blocks."""
    groups, components, keys = {}, [], []
    for name, cls in REGISTRY.items():
        with gr.Group(visible=name == selected) as group:
            for p in cls.schema(num_layers)["params"]:
                components.append(component_for(p, f"param-{name}-{p['name']}"))
                keys.append((name, p["name"]))
        groups[name] = group
    return StrategyControls(groups, components, keys)
