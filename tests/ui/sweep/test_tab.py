"""The Sweep tab's "Send best to Compare" (ui/sweep/tab.py): what a finished Sweep or Tune keeps of
its best point — nothing when it does not beat the baseline, the status line saying so — and how the
handler puts it into a Compare column and shows the Compare tab. The handlers run as the page wires
them, on the tiny model (a real sweep and tune of two or three points); the page's first Run is
checked against the served budget on the served model."""

from __future__ import annotations

import types

import pytest

from feedback.strategies import REGISTRY
from ui.page.settings import column_key
from ui.sweep.best import kept_best, recommend, target_column, unique_name
from ui.sweep.tune import tune_best

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
    return [
        u for u in ev.fn(types.SimpleNamespace(session_hash=f"send-{api}"), **values) if isinstance(u, dict)
    ]


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
    assert (
        unique_name("Sweep best", ["Baseline", "Sweep best", "Column 3"], 1) == "Sweep best"
    )  # its own name
    assert unique_name("Sweep best", ["Sweep best", "Feedback", "Sweep best 2"], 1) == "Sweep best 3"


def test_a_finished_sweep_sends_its_best_point_to_compare(app, tiny_lm):
    updates = run_job(app, "sweep", strategy="deep_cache", grid_x="lam=0,0.1", grid_y="", deep_cache_theta=20)
    sweep = app.sweep
    assert (
        updates[0][sweep.best] is None and updates[0][sweep.send_button]["interactive"] is False
    )  # cleared at start
    best = updates[-1][sweep.best]
    assert (
        "Done: 2 points" in updates[-1][sweep.status]
        and updates[-1][sweep.send_button]["interactive"] is True
    )
    assert "best (strength-0 points left out): lam=0.1, ΔPPL -" in updates[-1][sweep.status]
    assert best["verdict"] in updates[-1][sweep.status]  # the verdict on it, as the status line said
    # lam=0 only measures the baseline: never best. The fixed values come along with defaults filled in.
    assert best["source"] == "Sweep" and best["strategy"] == "deep_cache" and best["params"]["lam"] == 0.1
    assert best["params"]["theta"] == 20 and set(best["params"]) == {
        p.name for p in REGISTRY["deep_cache"].params
    }

    out = send(app, "send_sweep_best", best)  # a new page: columns 1-2 are Baseline and residual
    col = app.compare.ui.cols[1]
    assert out[col.settings["name"]] == "Sweep best" and out[col.panel.strategy] == "deep_cache"
    assert (
        out[col.panel.component("deep_cache", "lam")] == 0.1
        and out[col.panel.component("deep_cache", "theta")] == 20
    )
    assert out[col.panel.groups["deep_cache"]]["visible"] and not out[col.panel.groups["residual"]]["visible"]
    assert (
        "deep_cache" in out[col.heading]
        and "lam=0.1" in out[col.heading]
        and "Sweep best" in out[col.heading]
    )
    assert out[app.sweep.tabs]["selected"] == "compare"
    note = out[app.compare.ui.run.status]
    assert "Column 2 (Sweep best)" in note and best["verdict"] in note
    other = app.compare.ui.cols[0]
    assert other.settings["name"] not in out and other.panel.strategy not in out  # the other columns stay
    assert app.compare.ui.settings["prompt"] not in out and app.compare.ui.settings["columns"] not in out


def test_a_sweep_whose_lowest_point_is_worse_than_the_baseline_offers_nothing(app):
    # on the tiny model, residual feedback raises perplexity at every strength tried: the lowest ΔPPL is > 0
    updates = run_job(app, "sweep", strategy="residual", grid_x="alpha=0,0.3,0.6", grid_y="")
    sweep, last = app.sweep, updates[-1]
    status = last[sweep.status]
    assert last[sweep.best] is None and last[sweep.send_button]["interactive"] is False
    assert "Done: 3 points; no point beats the baseline, so nothing is offered to Compare" in status
    assert "the lowest ΔPPL (strength-0 points left out): alpha=0.3, ΔPPL +" in status
    assert "no better than the baseline: ΔPPL ≥ 0; CI spans 0" in status and "best (" not in status


def test_a_tune_whose_best_trial_is_worse_than_the_baseline_on_dev_offers_nothing(app):
    # residual at a strength that raises perplexity on the tiny model, wherever it injects
    updates = run_job(
        app, "tune", strategy="anchor", search=["source_layer"], anchor_alpha=1.0, trials=2, seed=0
    )
    tune, last = app.sweep, updates[-1]
    status = last[tune.tune_status]
    assert last[tune.tune_best] is None and last[tune.tune_send]["interactive"] is False
    assert (
        "Done: 2 trials" in status
        and "no trial beats the baseline, so nothing is offered to Compare" in status
    )
    assert "the lowest dev ΔPPL: trial" in status and "best on dev" not in status


def _trial(delta, ci):
    return {
        "trial": 3,
        "params": {"lam": 0.05},
        "delta_pct": delta,
        "ci95": ci,
        "strategy_params": {"lam": 0.05},
    }


def test_a_dev_best_that_is_worse_on_test_is_no_recommendation_and_says_so():
    # the reported case: a dev best whose held-out ΔPPL is +0.491 %, its CI above 0
    test = {"data": "builtin:test", "delta_pct": 0.491, "ci95": [0.1, 0.9]}
    judged = tune_best(_trial(-0.3, [-0.6, -0.05]), test)
    assert judged.why == (
        "the best trial is not confirmed on the test text: there it is worse than the baseline: CI above 0"
    )
    assert (
        "best on dev: trial 3 (lam=0.05), ΔPPL -0.300 % [-0.600, -0.050] (CI excludes 0: a real improvement)"
        in judged.text
    )
    assert (
        "on builtin:test (scored once): ΔPPL +0.491 %, 95% CI [+0.100, +0.900] % (worse than the baseline"
        in judged.text
    )
    text, kept = recommend(judged, lambda verdict: {"kept": verdict})
    assert kept is None and text.startswith("the best trial is not confirmed on the test text")
    # within noise on test (ΔPPL < 0, CI across 0): still a recommendation, marked as such
    judged = tune_best(_trial(-0.3, [-0.6, -0.05]), test | {"delta_pct": -0.1, "ci95": [-0.4, 0.2]})
    assert judged.why is None and "(within noise: CI spans 0)" in judged.text
    assert recommend(judged, lambda verdict: {"kept": verdict}) == (
        judged.text,
        {"kept": "CI excludes 0: a real improvement"},
    )
    # no bootstrap: a dev best without a CI is lower but untested, and without a test text nothing more
    # is said
    judged = tune_best(_trial(-0.3, [None, None]), None)
    assert judged.why is None and "-0.300 % (no CI) (lower, but untested" in judged.text


def test_a_column_already_on_the_strategy_takes_it_under_a_name_no_other_column_has(app, tiny_lm):
    best = kept_best("Sweep", "deep_cache", {"lam": 0.05}, tiny_lm.num_layers, -1.5)
    out = send(app, "send_sweep_best", best, columns=3, **{column_key(0, "name"): "Sweep best"})
    col = app.compare.ui.cols[2]  # column 3 starts on deep_cache
    assert out[col.settings["name"]] == "Sweep best 2" and out[col.panel.strategy] == "deep_cache"
    assert out[col.panel.component("deep_cache", "lam")] == 0.05 and "lam=0.05" in out[col.heading]


def test_a_stack_is_swept_on_its_members_parameters_and_sent_as_a_stack(app, tiny_lm):
    from ui.sweep.tune import searchable

    assert "deep_cache.lam" in searchable({"strategy": "inner_loop", "stack": "deep_cache"})["choices"]
    updates = run_job(
        app,
        "sweep",
        strategy="inner_loop",
        stack="deep_cache",
        grid_x="deep_cache.lam=0,0.1",
        grid_y="",
        inner_loop_beta=0.3,
    )
    best = updates[-1][app.sweep.best]
    assert best["strategy"] == "inner_loop+deep_cache" and best["params"]["deep_cache.lam"] == 0.1
    assert best["params"]["inner_loop.beta"] == 0.3  # the fixed member keeps the value set above
    out = send(app, "send_sweep_best", best)
    col = app.compare.ui.cols[1]
    assert out[col.panel.strategy] == "inner_loop" and out[col.panel.stack]["value"] == "deep_cache"
    assert (
        out[col.panel.component("deep_cache", "lam")] == 0.1
        and out[col.panel.component("inner_loop", "beta")] == 0.3
    )
    assert "inner_loop+deep_cache" in out[col.heading]


def test_a_finished_tune_sends_its_best_trial(app, tiny_lm):
    # lam is searched over 0.002 to 0.3 (never the baseline's 0), and a first trial is never pruned: a best
    # exists
    updates = run_job(app, "tune", strategy="deep_cache", search=["lam"], trials=2, seed=0)
    tune = app.sweep
    assert updates[0][tune.tune_best] is None and updates[0][tune.tune_send]["interactive"] is False
    best = updates[-1][tune.tune_best]
    assert (
        "Done: 2 trials" in updates[-1][tune.tune_status]
        and updates[-1][tune.tune_send]["interactive"] is True
    )
    assert best["source"] == "Tune" and set(best["params"]) == {p.name for p in REGISTRY["deep_cache"].params}
    out = send(app, "send_tune_best", best)
    col = app.compare.ui.cols[1]
    lam = out[col.panel.component("deep_cache", "lam")]
    assert out[col.settings["name"]] == "Tune best" and lam == best["params"]["lam"] > 0
    assert out[app.sweep.tabs]["selected"] == "compare" and f"lam={lam:g}" in out[col.heading]


@pytest.mark.parametrize(
    "handler, status, says",
    [
        ("send_sweep_best", "status", "no best point yet"),
        ("send_tune_best", "tune_status", "no best trial yet"),
    ],
)
def test_without_a_best_point_nothing_is_sent_and_the_status_line_says_why(app, handler, status, says):
    out = send(app, handler, None)
    assert list(out) == [getattr(app.sweep, status)] and "Not sent" in out[getattr(app.sweep, status)]
    assert says in out[getattr(app.sweep, status)]
    assert (
        app.sweep.send_button.interactive is False and app.sweep.tune_send.interactive is False
    )  # off on a new page


@pytest.mark.parametrize(
    "grid_x, grid_y, message",
    [
        ("beta=1", "", "grid x: unknown parameter 'beta'"),
        ("lam=0,0.1", "lam", "grid y expects NAME=V1,V2,..., got 'lam'"),
        ("", "", "give at least one grid x NAME=V1,V2,..."),
    ],
)
def test_a_refused_grid_names_the_box_it_was_typed_in(app, grid_x, grid_y, message):
    """The page's refusal names its own field ("grid x"), not the command line's flag (--grid)."""
    import gradio as gr

    with pytest.raises(gr.Error) as refused:
        run_job(app, "sweep", strategy="deep_cache", grid_x=grid_x, grid_y=grid_y)
    assert refused.value.message.startswith(message) and "--grid" not in refused.value.message


def test_the_first_sweep_and_tune_as_the_page_opens_fit_the_scoring_budget(embedded_lm):
    """Every input at its default (builtin:dev, 10 documents cut to 128 tokens, the 12-point grid, 12
    trials) on the served model is accepted by the served budget: the first Run is not refused. Uncut,
    the same documents are refused."""
    import gradio as gr

    from feedback.core.budget import Budget
    from feedback.errors import FeedbackError
    from feedback.serve.pool import ModelPool
    from ui.page.runner import ModelRunner
    from ui.sweep.tab import SweepTab

    pool = ModelPool.serving(embedded_lm)
    tab = SweepTab(pool, ModelRunner(pool, budget=Budget()))
    with gr.Blocks() as demo:
        tab.build(embedded_lm.num_layers)
    sweep, tune = (
        first_values(next(fn for fn in demo.fns.values() if fn.api_name == api)) for api in ("sweep", "tune")
    )
    assert (sweep["source"], sweep["max_docs"], sweep["max_tokens_per_doc"]) == ("builtin:dev", 10, 128)
    assert sweep["text"] in (None, "") and tune["source"] == sweep["source"]  # one text box serves both
    work = tab.prepare(sweep)
    assert work.total == 12 and len(work.docs) == 10
    assert work.clock.forwards <= Budget().scored_tokens / 4  # room to spare: the cut bounds it, not the text
    tuning = tab.prepare_tune(tune)
    assert tuning.test == "builtin:test" and tuning.trials == 12
    with pytest.raises(FeedbackError, match="FEEDBACK_BUDGET_SCORED_TOKENS"):
        tab.prepare(sweep | {"max_tokens_per_doc": 100_000})
