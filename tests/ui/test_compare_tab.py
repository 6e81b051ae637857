"""Compare-tab values -> RunConfig (every bad value a clear FeedbackError), and a stored run's
settings restored into every control."""
from __future__ import annotations

import gradio as gr
import pytest

from feedback.errors import FeedbackError
from feedback.records import SERVED_MAX_NEW_TOKENS
from ui.compare_tab import COLUMNS, CompareTab

GOOD = dict(prompt="hi", chat_template=True, model="embedded", strategy="residual", temperature=0.7, top_p=0.9,
            top_k=40, min_p=0.0, repetition_penalty=1.1, max_new_tokens=64, seed=3, k=20, window=16,
            threshold_mode="off", threshold=4.5, params={"alpha": 0.1})


def tab() -> CompareTab:
    return CompareTab(pool=None, runner=None)


def test_good_values_build_a_validated_config_with_one_row_per_column():
    cfg = tab().config(**GOOD)
    assert cfg.sampling.temperature == 0.7 and cfg.sampling.top_k == 40 and cfg.deepconf.threshold is None
    assert [r.name for r in cfg.rows] == [c.row for c in COLUMNS] == ["baseline", "feedback"]
    assert cfg.rows[1].params == {"alpha": 0.1} and cfg.rows[0].strategy is None
    assert tab().config(**GOOD | {"threshold_mode": "fixed", "threshold": 7.5}).deepconf.threshold == 7.5


@pytest.mark.parametrize("change, message", [
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": None}, "prompt is empty"),
    ({"max_new_tokens": None}, "max new tokens must be a number"),
    ({"max_new_tokens": 2.5}, "max new tokens must be a whole number"),
    ({"max_new_tokens": SERVED_MAX_NEW_TOKENS + 1}, f"between 1 and {SERVED_MAX_NEW_TOKENS}"),
    ({"temperature": float("nan")}, "temperature must be finite"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_p": float("inf")}, "top-p must be finite"),
    ({"seed": -1}, "seed must be at least 0"),
    ({"window": 0}, "window"),
    ({"threshold_mode": "fixed", "threshold": None}, "threshold must be a number"),
])
def test_bad_values_are_refused_with_a_message(change, message):
    with pytest.raises(FeedbackError, match=message):
        tab().config(**GOOD | change)


def built(lm) -> CompareTab:
    from feedback.model import ModelPool
    from ui.runner import ModelRunner

    pool = ModelPool.serving(lm)
    t = CompareTab(pool, ModelRunner(pool))
    with gr.Blocks():
        t.build(lm.num_layers, gr.BrowserState([]))
    return t


def test_prepare_refuses_strategy_and_context_errors_before_any_waiting(embedded_lm):
    t = built(embedded_lm)
    base = ["hi", True, embedded_lm.name, "residual", "confidence", 0.0, 1.0, 0, 0.0, 1.0, 8, 0, 20, 32, "off", 4.5]
    params = [c.value for c in t.panel.components]
    assert t.prepare_compare(*base, *params).label == "a Compare run"
    alpha = t.panel.keys.index(("residual", "alpha"))
    for change, message in [({3: "nope"}, "unknown strategy"), ({0: "word " * 9000}, "exceeds the model context"),
                            ({2: "evil/model"}, "not in the allowlist")]:
        values = list(base)
        for i, v in change.items():
            values[i] = v
        with pytest.raises(FeedbackError, match=message):
            t.prepare_compare(*values, *params)
    bad = list(params)
    bad[alpha] = 5.0
    with pytest.raises(FeedbackError, match=r"alpha=5.0 is out of range \[-1.0, 1.0\]"):
        t.prepare_compare(*base, *bad)


def test_restore_sets_every_control_from_a_stored_run(embedded_lm):
    from feedback.engine import Engine

    t = built(embedded_lm)
    cfg = t.config(**GOOD | {"model": embedded_lm.name, "strategy": "soft_token", "threshold_mode": "fixed",
                             "threshold": 3.25, "max_new_tokens": 3, "params": {"beta": 0.25, "top_k": 8}})
    data = Engine(embedded_lm).run(cfg).to_dict() | {"run_id": "r1"}
    out = t.restore(data, "plain")
    expected = {t.prompt: "hi", t.chat: True, t.model: embedded_lm.name, t.temperature: 0.7, t.top_p: 0.9,
                t.top_k: 40, t.min_p: 0.0, t.rep: 1.1, t.max_new: 3, t.seed: 3, t.k: 20, t.window: 16,
                t.thr_mode: "fixed", t.threshold: 3.25}
    for comp, value in expected.items():
        assert out[comp] == value, comp.label
    assert out[t.panel.strategy] == "soft_token" and out[t.panel.preset]["value"] == "custom"
    assert out[t.panel.component("soft_token", "beta")] == 0.25 and out[t.panel.component("soft_token", "tau")] == 1.0
    assert out[t.panel.groups["soft_token"]]["visible"] and not out[t.panel.groups["residual"]]["visible"]
    assert "soft_token" in out[t.cols[1].heading] and "beta=0.25" in out[t.cols[1].heading]
    assert out[t.last]["run_id"] == "r1" and "fl-tok" not in out[t.cols[0].text]  # the plain view asked for
