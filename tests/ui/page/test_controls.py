"""The strategy panel: controls generated from the Param schema, presets, and values read back."""

from __future__ import annotations

import gradio as gr
import pytest

from feedback.errors import FeedbackError
from feedback.strategies import REGISTRY, get_strategy
from ui.page.controls import (
    CUSTOM,
    about,
    build_strategy_panel,
    chosen,
    component_for,
    matching_preset,
    parse_number,
)


def panel(context: str = "generate", selected: str = "residual"):
    with gr.Blocks():
        return build_strategy_panel(30, selected, context=context)


def test_every_registered_parameter_gets_a_control_with_its_api_name():
    p = panel()
    expected = [(name, q.name) for name, cls in REGISTRY.items() for q in cls.params]
    assert p.keys == expected and set(p.groups) == set(REGISTRY)
    assert p.api_names[:3] == ["residual_alpha", "residual_source_layer", "residual_target_layer"]
    alpha = p.component("residual", "alpha")
    # a number box that says its range; a typed 5 reaches the strategy, which refuses it naming alpha
    # (a box's own bounds would have Gradio refuse it in its own words, before any handler)
    assert isinstance(alpha, gr.Number) and (alpha.minimum, alpha.maximum) == (None, None)
    assert "(-1 to 1)" in alpha.info
    layer = p.component("residual", "source_layer")
    assert isinstance(layer, gr.Slider) and (layer.minimum, layer.maximum, layer.step) == (0, 29, 1)
    window = p.component("deep_cache", "window")  # 1 to 100,000: typed, not dragged
    assert isinstance(window, gr.Number) and window.precision == 0 and "(1 to 100000)" in window.info


def test_the_page_starts_on_a_preset_that_shows_a_difference():
    p = panel()
    assert p.preset.value == "visible effect" and p.component("residual", "alpha").value == 0.1
    assert p.groups["residual"].visible is True and p.groups["anchor"].visible is False
    assert "visible effect" in p.about.value and REGISTRY["residual"].formula in p.about.value


def test_perplexity_only_controls_are_hidden_where_only_generation_runs():
    assert panel("generate").component("anchor", "prompt_tokens").visible is False
    assert panel("perplexity").component("anchor", "prompt_tokens").visible is True


def test_perplexity_tabs_start_on_the_setting_tuned_for_perplexity():
    p = panel("perplexity", "deep_cache")
    assert p.preset.value == "tuned for perplexity" and p.component("deep_cache", "lam").value == 0.02
    assert p.show("soft_token")[p.preset]["value"] == "best on dev (no clear gain)"
    assert panel("generate", "deep_cache").preset.value == "visible effect"


def test_show_selects_a_strategy_with_a_preset_or_explicit_values():
    p = panel()
    out = p.show("deep_cache", "tuned for perplexity")
    assert out[p.strategy] == "deep_cache" and out[p.preset]["value"] == "tuned for perplexity"
    assert out[p.component("deep_cache", "lam")] == 0.02 and out[p.groups["deep_cache"]]["visible"] is True
    assert out[p.groups["residual"]]["visible"] is False and "−0.36 %" in out[p.about]
    restored = p.show("residual", params={"alpha": 0.3, "source_layer": 20, "target_layer": 5})
    assert restored[p.preset]["value"] == CUSTOM and restored[p.component("residual", "alpha")] == 0.3
    assert (
        p.show("residual", params={"alpha": 0.1, "source_layer": 21, "target_layer": 9})[p.preset]["value"]
        == "visible effect"
    )


def test_matching_preset_and_about():
    assert matching_preset("anchor", {"alpha": 0.05}, 30) == "defaults"
    assert matching_preset("anchor", {"alpha": 0.07}, 30) == CUSTOM
    assert "Custom settings" in about("soft_token", CUSTOM) and "recurrent" in about("soft_token", None)


def test_layer_updates():
    p = panel()
    updates = p.layer_updates(12)
    assert updates[p.component("residual", "source_layer")]["maximum"] == 11
    assert updates[p.component("residual", "source_layer")]["value"] == 8  # round(0.7 * 12)
    assert p.component("residual", "alpha") not in updates


def test_component_kinds_follow_the_schema():
    with gr.Blocks():
        choice = component_for(
            {
                "name": "mode",
                "type": "str",
                "default": "a",
                "minimum": None,
                "maximum": None,
                "choices": ["a", "b"],
                "help": "",
            },
            "x1",
        )
        flag = component_for(
            {
                "name": "gate",
                "type": "bool",
                "default": True,
                "minimum": None,
                "maximum": None,
                "choices": None,
                "help": "on/off",
            },
            "x2",
        )
        free = component_for(
            {
                "name": "theta",
                "type": "float",
                "default": 20.0,
                "minimum": 0.0,
                "maximum": None,
                "choices": None,
                "help": "",
                "is_layer": False,
            },
            "x3",
        )
    assert isinstance(choice, gr.Dropdown) and isinstance(flag, gr.Checkbox) and isinstance(free, gr.Number)
    assert free.info == " (≥ 0)"


def test_a_layer_slider_comes_from_the_schema_not_the_parameter_name():
    plain = {"type": "int", "default": 0, "minimum": 0, "maximum": 8, "choices": None, "help": ""}
    with gr.Blocks():
        named_like_a_layer = component_for({**plain, "name": "layers_kept", "is_layer": False}, "y1")
        a_layer = component_for({**plain, "name": "source", "is_layer": True}, "y2")
    assert isinstance(named_like_a_layer, gr.Number) and isinstance(a_layer, gr.Slider)
    for cls in REGISTRY.values():  # every strategy's schema says which parameters are layer indices
        assert [p["is_layer"] for p in cls.schema(30)["params"]] == [q.is_layer for q in cls.params]


def test_parse_number_edge_cases():
    assert parse_number("3", "n", integer=True) == 3 and parse_number(2.0, "n", integer=True) == 2
    for value, message in [
        (float("inf"), "finite"),
        ("x", "must be a number"),
        (None, "must be a number"),
        (1.5, "whole number"),
        (0, "n must be between 1 and 9, got 0"),
    ]:
        with pytest.raises(FeedbackError, match=message):
            parse_number(value, "n", integer=True, lo=1, hi=9)
    with pytest.raises(FeedbackError, match="at least 2"):
        parse_number(1, "passes", lo=2)


def test_a_bound_number_box_takes_its_range_and_hint_from_the_bound():
    from feedback.core.bounds import Bound
    from ui.page.controls import bound_number

    trials, eta = Bound("trials", 1, 24, integer=True), Bound("eta", 0.0001, 100)
    with gr.Blocks():
        whole = bound_number(trials, 12)
        share = bound_number(eta, 50, label="custom η %", info="the share kept")
    # the range is said, and checked by the handler (Bound.check), not by the box (see bound_number)
    assert (whole.minimum, whole.maximum, whole.precision, whole.label, whole.info) == (
        None,
        None,
        0,
        "trials",
        "1 to 24",
    )
    assert (share.minimum, share.maximum, share.precision) == (None, None, None)
    assert share.label == "custom η %" and share.info == "the share kept; 0.0001 to 100"


def test_strategy_controls_by_their_api_names():
    p = panel()
    named = p.named_inputs()
    assert list(named) == ["stack", *p.api_names] and named["residual_alpha"] is p.component(
        "residual", "alpha"
    )
    values = {name: c.value for name, c in named.items()} | {"prompt": "other values are left alone"}
    assert chosen(values | {"strategy": "residual"}) == (
        "residual",
        {"alpha": 0.1, "source_layer": 21, "target_layer": 9},
    )
    assert chosen(values | {"strategy": "none", "stack": "deep_cache"}) == (None, {})


def test_a_second_strategy_stacks_after_the_first():
    p = panel()
    values = {name: c.value for name, c in p.named_inputs().items()}
    name, params = chosen(values | {"strategy": "inner_loop", "stack": "deep_cache"})
    assert name == "inner_loop+deep_cache" and params["deep_cache.lam"] == values["deep_cache_lam"]
    assert set(params) == {q.name for q in get_strategy(name).params}
    # "Stack with" is offered after hidden-state strategies only, never the first one again
    assert p.stack.visible and "residual" not in p.stack.choices[1:] and "restate" not in str(p.stack.choices)
    shown = p.show("inner_loop+deep_cache", preset="tuned for perplexity")
    assert shown[p.strategy] == "inner_loop" and shown[p.stack]["value"] == "deep_cache"
    assert shown[p.stack]["choices"][0] == "none" and "inner_loop" not in shown[p.stack]["choices"]
    assert shown[p.groups["inner_loop"]]["visible"] and shown[p.groups["deep_cache"]]["visible"]
    assert not shown[p.groups["residual"]]["visible"]
    assert (
        shown[p.component("inner_loop", "beta")] == 0.08451
        and shown[p.component("deep_cache", "lam")] == 0.02
    )
    assert shown[p.preset]["choices"] == ["visible effect", "tuned for perplexity", CUSTOM]
    assert "a stack, applied in this order: inner_loop then deep_cache" in shown[p.about]
    custom = p.show("inner_loop+deep_cache", params={"inner_loop.beta": 0.3, "deep_cache.lam": 0.2})
    assert custom[p.preset]["value"] == CUSTOM and custom[p.component("deep_cache", "lam")] == 0.2
    plain = p.show("restate")
    assert not plain[p.stack]["visible"] and plain[p.stack]["value"] == "none"
    with pytest.raises(FeedbackError, match="the page stacks two strategies"):
        p.show("residual+anchor+deep_cache")


def test_the_panel_handlers_take_their_values_by_name():
    with gr.Blocks() as demo:
        p = build_strategy_panel(30, "residual")
    events = list(demo.fns.values())
    # the two dropdowns, the preset, and one edit event per control
    assert len(events) == 3 + len(p.components) and all(fn.input_keyword_names for fn in events)
    on_preset = next(fn for fn in events if fn.input_keyword_names == ["strategy", "stack", "preset"])
    shown = on_preset.fn(None, strategy="deep_cache", stack="none", preset="tuned for perplexity")
    assert (
        shown[p.component("deep_cache", "lam")] == 0.02 and shown[p.preset]["value"] == "tuned for perplexity"
    )
    both = on_preset.fn(None, strategy="inner_loop", stack="deep_cache", preset="visible effect")
    assert both[p.component("deep_cache", "lam")] == 0.1 and both[p.stack]["value"] == "deep_cache"
    on_pick = [
        fn
        for fn in events
        if fn.fn.__name__ == "_on_strategy"
        or fn.input_keyword_names == ["strategy", "stack"]
        and p.strategy in fn.outputs
    ]
    assert len(on_pick) == 2  # the first strategy and "Stack with" answer alike
    picked = on_pick[0].fn(None, strategy="restate", stack="deep_cache")  # a prompt-level one does not stack
    assert picked[p.strategy] == "restate" and picked[p.stack]["value"] == "none"
    edited = next(fn for fn in events if fn.outputs == [p.preset, p.about])
    assert edited.fn(None, strategy="residual", stack="none")[p.preset] == CUSTOM
    assert edited.fn(None, strategy="none", stack="none") == {}
    assert "inner_loop+deep_cache" in edited.fn(None, strategy="inner_loop", stack="deep_cache")[p.about]


def test_a_work_view_maps_to_the_tab_components_by_name():
    from ui.page.controls import to_components

    with gr.Blocks():
        summary, table = gr.Markdown(), gr.Dataframe()
    outputs = {"summary": summary, "table": table}
    assert to_components(outputs, {"summary": "**done**"}) == {summary: "**done**"}
    with pytest.raises(KeyError):
        to_components(outputs, {"chart": None})  # a view names only outputs the tab has
