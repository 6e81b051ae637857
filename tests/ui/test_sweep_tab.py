"""The Sweep tab's "Send best to Compare" (ui/sweep_tab.py): what a finished Sweep or Tune keeps of
its best point, and how the handler puts it into a Compare column and shows the Compare tab. The
handlers run as the page wires them, on the tiny model (a real sweep and tune of two points)."""
from __future__ import annotations

import types

import pytest

from feedback.strategies import REGISTRY
from ui.compare.settings import column_key
from ui.sweep_tab import kept_best, target_column, unique_name

TEXT = "def add(a, b):\n    return a + b\n\nThe function add returns the sum of its two arguments. " * 2


@pytest.fixture(scope="module")
def app(tiny_lm):
    from feedback.serve.pool import ModelPool
    from ui.layout import FeedbackLensApp

    app = FeedbackLensApp(ModelPool.serving(tiny_lm))
    app.demo = app.build()
    return app


def event(app, name: str):
    """The page's event whose handler is `name` (a model handler's API name or a plain handler's name)."""
    return next(fn for fn in app.demo.fns.values() if name in (fn.api_name, getattr(fn.fn, "__name__", None)))


def first_values(ev) -> dict:
    """The event's inputs by the name its handler takes them by, as a new page has them."""
    return {n: c.value for n, c in zip(ev.input_keyword_names, ev.inputs, strict=True)}


def run_job(app, api: str, **changes) -> list[dict]:
    """Every update of a Sweep or Tune run through its handler, as the page runs it."""
    ev = event(app, api)
    values = first_values(ev) | {"source": "pasted text", "text": TEXT, "max_docs": 2} | changes
    return [u for u in ev.fn(types.SimpleNamespace(session_hash=f"send-{api}"), **values) if isinstance(u, dict)]


def send(app, handler: str, best, **compare) -> dict:
    """The send handler's updates for a kept best point and the Compare columns as `compare` sets them."""
    ev = event(app, handler)
    assert app.sweep.tabs in ev.outputs  # the handler may switch tabs
    return ev.fn(None, **first_values(ev) | {"best": best} | compare)


def test_the_target_is_the_first_shown_column_on_the_strategy_else_column_2():
    strategies = ["none", "residual", "deep_cache", "deep_cache"]
    assert target_column("deep_cache", strategies, shown=3) == 2
    assert target_column("deep_cache", strategies, shown=2) == 1  # column 3 hidden: the feedback column
    assert target_column("anchor", strategies, shown=4) == 1
    assert target_column("none", strategies, shown=2) == 0


def test_the_name_is_numbered_while_another_column_has_it():
    assert unique_name("Sweep best", ["Baseline", "Feedback", "Column 3"], 1) == "Sweep best"
    assert unique_name("Sweep best", ["Baseline", "Sweep best", "Column 3"], 1) == "Sweep best"  # its own name
    assert unique_name("Sweep best", ["Sweep best", "Feedback", "Sweep best 2"], 1) == "Sweep best 3"


def test_a_finished_sweep_sends_its_best_point_to_compare(app, tiny_lm):
    updates = run_job(app, "sweep", strategy="deep_cache", grid_x="lam=0,0.1", grid_y="", deep_cache_theta=20)
    sweep = app.sweep
    assert updates[0][sweep.best] is None and updates[0][sweep.send_button]["interactive"] is False  # cleared at start
    best = updates[-1][sweep.best]
    assert "Done: 2 points" in updates[-1][sweep.status] and updates[-1][sweep.send_button]["interactive"] is True
    # lam=0 only measures the baseline: never best. The fixed values come along with defaults filled in.
    assert best["source"] == "Sweep" and best["strategy"] == "deep_cache" and best["params"]["lam"] == 0.1
    assert best["params"]["theta"] == 20 and set(best["params"]) == {p.name for p in REGISTRY["deep_cache"].params}

    out = send(app, "send_sweep_best", best)  # a new page: columns 1-2 are Baseline and residual
    col = app.compare.ui.cols[1]
    assert out[col.settings["name"]] == "Sweep best" and out[col.panel.strategy] == "deep_cache"
    assert out[col.panel.component("deep_cache", "lam")] == 0.1 and out[col.panel.component("deep_cache", "theta")] == 20
    assert out[col.panel.groups["deep_cache"]]["visible"] and not out[col.panel.groups["residual"]]["visible"]
    assert "deep_cache" in out[col.heading] and "lam=0.1" in out[col.heading] and "Sweep best" in out[col.heading]
    assert out[app.sweep.tabs]["selected"] == "compare"
    assert "Column 2 (Sweep best)" in out[app.compare.ui.run.status]
    other = app.compare.ui.cols[0]
    assert other.settings["name"] not in out and other.panel.strategy not in out  # the other columns stay
    assert app.compare.ui.settings["prompt"] not in out and app.compare.ui.settings["columns"] not in out


def test_a_column_already_on_the_strategy_takes_it_under_a_name_no_other_column_has(app, tiny_lm):
    best = kept_best("Sweep", "deep_cache", {"lam": 0.05}, tiny_lm.num_layers, -1.5)
    out = send(app, "send_sweep_best", best, columns=3, **{column_key(0, "name"): "Sweep best"})
    col = app.compare.ui.cols[2]  # column 3 starts on deep_cache
    assert out[col.settings["name"]] == "Sweep best 2" and out[col.panel.strategy] == "deep_cache"
    assert out[col.panel.component("deep_cache", "lam")] == 0.05 and "lam=0.05" in out[col.heading]


def test_a_stack_is_swept_on_its_members_parameters_and_sent_as_a_stack(app, tiny_lm):
    from ui.sweep_tab import searchable

    assert "deep_cache.lam" in searchable({"strategy": "inner_loop", "stack": "deep_cache"})["choices"]
    updates = run_job(app, "sweep", strategy="inner_loop", stack="deep_cache", grid_x="deep_cache.lam=0,0.1",
                      grid_y="", inner_loop_beta=0.3)
    best = updates[-1][app.sweep.best]
    assert best["strategy"] == "inner_loop+deep_cache" and best["params"]["deep_cache.lam"] == 0.1
    assert best["params"]["inner_loop.beta"] == 0.3  # the fixed member keeps the value set above
    out = send(app, "send_sweep_best", best)
    col = app.compare.ui.cols[1]
    assert out[col.panel.strategy] == "inner_loop" and out[col.panel.stack]["value"] == "deep_cache"
    assert out[col.panel.component("deep_cache", "lam")] == 0.1 and out[col.panel.component("inner_loop", "beta")] == 0.3
    assert "inner_loop+deep_cache" in out[col.heading]


def test_a_finished_tune_sends_its_best_trial(app, tiny_lm):
    # lam is searched over 0.002 to 0.3 (never the baseline's 0), and a first trial is never pruned: a best exists
    updates = run_job(app, "tune", strategy="deep_cache", search=["lam"], trials=2, seed=0)
    tune = app.sweep
    assert updates[0][tune.tune_best] is None and updates[0][tune.tune_send]["interactive"] is False
    best = updates[-1][tune.tune_best]
    assert "Done: 2 trials" in updates[-1][tune.tune_status] and updates[-1][tune.tune_send]["interactive"] is True
    assert best["source"] == "Tune" and set(best["params"]) == {p.name for p in REGISTRY["deep_cache"].params}
    out = send(app, "send_tune_best", best)
    col = app.compare.ui.cols[1]
    lam = out[col.panel.component("deep_cache", "lam")]
    assert out[col.settings["name"]] == "Tune best" and lam == best["params"]["lam"] > 0
    assert out[app.sweep.tabs]["selected"] == "compare" and f"lam={lam:g}" in out[col.heading]


@pytest.mark.parametrize("handler, status, says", [("send_sweep_best", "status", "no best point yet"),
                                                  ("send_tune_best", "tune_status", "no best trial yet")])
def test_without_a_best_point_nothing_is_sent_and_the_status_line_says_why(app, handler, status, says):
    out = send(app, handler, None)
    assert list(out) == [getattr(app.sweep, status)] and "Not sent" in out[getattr(app.sweep, status)]
    assert says in out[getattr(app.sweep, status)]
    assert app.sweep.send_button.interactive is False and app.sweep.tune_send.interactive is False  # off on a new page


@pytest.mark.parametrize("grid_x, grid_y, message", [
    ("beta=1", "", "grid x: unknown parameter 'beta'"),
    ("lam=0,0.1", "lam", "grid y expects NAME=V1,V2,..., got 'lam'"),
    ("", "", "give at least one grid x NAME=V1,V2,..."),
])
def test_a_refused_grid_names_the_box_it_was_typed_in(app, grid_x, grid_y, message):
    """The page's refusal names its own field ("grid x"), not the command line's flag (--grid)."""
    import gradio as gr

    with pytest.raises(gr.Error) as refused:
        run_job(app, "sweep", strategy="deep_cache", grid_x=grid_x, grid_y=grid_y)
    assert refused.value.message.startswith(message) and "--grid" not in refused.value.message
