"""Strategy parameter schema -> Gradio controls, and values back to parameters."""
from __future__ import annotations

import inspect
import threading
import time

import gradio as gr

from feedback.strategies import REGISTRY
from ui.controls import build_strategy_controls, component_for


def test_every_registered_parameter_gets_a_control():
    with gr.Blocks():
        controls = build_strategy_controls(30, "residual")
    expected = [(name, p.name) for name, cls in REGISTRY.items() for p in cls.params]
    assert controls.keys == expected
    assert set(controls.groups) == set(REGISTRY)
    by_key = dict(zip(controls.keys, controls.components))
    alpha = by_key[("residual", "alpha")]
    assert isinstance(alpha, gr.Slider) and (alpha.minimum, alpha.maximum, alpha.value) == (-1.0, 1.0, 0.05)
    layer = by_key[("residual", "source_layer")]
    assert isinstance(layer, gr.Slider) and (layer.minimum, layer.maximum, layer.step, layer.value) == (0, 29, 1, 21)


def test_only_the_selected_strategy_group_is_visible():
    with gr.Blocks():
        controls = build_strategy_controls(30, "residual")
    assert controls.groups["residual"].visible is True


def test_component_kinds_follow_the_schema():
    with gr.Blocks():
        choice = component_for({"name": "mode", "type": "str", "default": "a", "minimum": None, "maximum": None,
                                "choices": ["a", "b"], "help": ""}, "x1")
        flag = component_for({"name": "gate", "type": "bool", "default": True, "minimum": None, "maximum": None,
                              "choices": None, "help": "on/off"}, "x2")
        free = component_for({"name": "theta", "type": "float", "default": 20.0, "minimum": 0.0, "maximum": None,
                              "choices": None, "help": ""}, "x3")
    assert isinstance(choice, gr.Dropdown) and isinstance(flag, gr.Checkbox) and isinstance(free, gr.Number)


def test_params_for_and_layer_updates():
    with gr.Blocks():
        controls = build_strategy_controls(30, "residual")
    values = [0.2, 20, 5]
    assert controls.params_for("residual", values) == {"alpha": 0.2, "source_layer": 20, "target_layer": 5}
    updates = controls.layer_updates(12)
    by_key = dict(zip(controls.keys, updates))
    assert by_key[("residual", "source_layer")]["maximum"] == 11
    assert by_key[("residual", "source_layer")]["value"] == 8  # round(0.7 * 12)
    assert "maximum" not in by_key[("residual", "alpha")]


def test_a_gated_handler_waits_for_the_shared_model_line():
    from feedback.gate import Gate
    from ui.controls import with_named_params

    with gr.Blocks():
        controls = build_strategy_controls(30, "residual")
    gate, events = Gate(1), []

    def handler(prompt, *values, request=None):
        events.append("ran")
        yield prompt

    wrapped = with_named_params(handler, controls, gate)
    assert inspect.isgeneratorfunction(wrapped)  # Gradio streams it
    gate.acquire("api")  # an API run holds the model
    t = threading.Thread(target=lambda: events.append(list(wrapped("hi", *[None] * len(controls.keys), None))))
    t.start()
    time.sleep(0.2)
    assert events == [] and gate.status()["waiting"] == 1
    gate.release()
    t.join(5)
    assert events == ["ran", ["hi"]] and gate.status()["running"] == 0
