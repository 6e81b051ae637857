"""A Compare run as the page gets it, through the tab's own handlers on a tiny model: the board's
document grows by appending, the live charts are named for it, a re-run replays the other columns."""

from __future__ import annotations

import types

import gradio as gr
import pytest

from ui.compare import stream
from ui.compare.tab import CompareTab


@pytest.fixture(scope="module")
def page(tiny_lm):
    from feedback.serve.pool import ModelPool
    from ui.page.runner import ModelRunner

    pool = ModelPool.serving(tiny_lm)
    t = CompareTab(pool, ModelRunner(pool))
    with gr.Blocks() as demo:
        t.build(tiny_lm.num_layers, gr.BrowserState([]))
    fns = {fn.api_name: fn.fn for fn in demo.fns.values() if fn.api_name}
    base = t.initial_values() | {
        "prompt": "Say hi.",
        "model": tiny_lm.name,
        "max_new_tokens": 24,
        "threshold_mode": "off",
        "c2_strategy": "residual",
        "c2_residual_alpha": 0.1,
    }
    return t, fns, base


def test_a_run_streams_one_growing_document_and_charts_named_for_it(page):
    t, fns, base = page
    updates = [
        u for u in fns["compare"](types.SimpleNamespace(session_hash="w1"), **base) if isinstance(u, dict)
    ]
    docs = [u[t.ui.out.board] for u in updates if t.ui.out.board in u]
    assert len(docs) >= 2 and all(later.startswith(earlier) for earlier, later in zip(docs, docs[1:]))
    events = stream.parse(docs[-1])
    run_id = events[0][1]["id"]
    assert events[0][1]["fresh"] == [0, 1] and events[-1][0] == "done"
    first = next(
        u for u in updates if t.ui.out.conf_plot in u
    )  # the run's first charts: named for its document
    assert first[t.ui.out.conf_plot].layout.meta["feed"] == run_id
    assert first[t.ui.memory.plot].layout.meta["feed"] == run_id
    final = updates[-1][t.ui.out.run_json.data]
    for i, row in enumerate(final["rows"]):
        assert [e[3] for e in events if e[0] == "t" and e[1] == i] == row["token_ids"]
        (end,) = [e for e in events if e[0] == "end" and e[1] == i]
        assert end == ["end", i, row["stop_reason"], row["stop_step"], len(row["token_ids"])]
    assert [e[1] for e in events if e[0] == "diff"] == [0, 1]
    # the final charts are drawn whole and no longer take points
    assert "meta" not in updates[-1][t.ui.out.conf_plot].layout.to_plotly_json()


def test_a_rerun_replays_the_other_columns_and_streams_its_own(page):
    t, fns, base = page
    request = types.SimpleNamespace(session_hash="w2")
    first = list(fns["compare"](request, **base))[-1][t.ui.out.run_json.data]
    updates = [
        u
        for u in fns["rerun"](request, **base | {"c2_residual_alpha": 0.4, "last": first, "column": "2"})
        if isinstance(u, dict) and t.ui.out.board in u
    ]
    events = stream.parse(updates[0][t.ui.out.board])
    assert events[0][1]["fresh"] == [1]  # only column 2 draws chart points
    assert [e[3] for e in events if e[0] == "t" and e[1] == 0] == first["rows"][0][
        "token_ids"
    ]  # column 1 whole
    whole = stream.parse(updates[-1][t.ui.out.board])
    again = list(fns["compare"](request, **base | {"c2_residual_alpha": 0.4}))[-1][t.ui.out.run_json.data]
    assert [e[3] for e in whole if e[0] == "t" and e[1] == 1] == again["rows"][1]["token_ids"]


def test_a_column_stop_keeps_what_the_page_showed_even_when_the_decode_had_ended_it(page, tiny_lm):
    """A busy page draws behind the decode: a column's Stop can come after the engine has decoded
    that column to its end. The column then keeps the tokens the page showed at the click, as the
    page's own Stop keeps them; a Stop once the page has the result changes nothing."""
    from ui.page import stop_signal
    from ui.page.runner import Outcome
    from ui.page.settings import run_config

    t, _, base = page
    work = t._work(run_config(base))
    work.signal = stop_signal.claim()
    work.progress_view(list(work.task.run(tiny_lm, work.signal)), 1.0)  # decoded whole, nothing drawn yet
    ended = work.rows[1]
    assert ended.stop_reason == "max_tokens" and len(ended.steps) == base["max_new_tokens"]
    assert not work.stop_column(1, len(ended.steps))  # the page showed it all: nothing to keep back
    assert not work.stop_column(1)  # a program's Stop (no count): the column has ended
    assert work.stop_column(1, 5)  # the page showed 5 of its tokens
    rows = work.finish_view(Outcome("done")).result["rows"]
    assert len(rows[1]["token_ids"]) == 5 and rows[1]["stop_reason"] == "stopped"
    assert len(rows[0]["token_ids"]) == base["max_new_tokens"]  # the other column as it ended
    assert not work.stop_column(0, 5)  # the result is the page's: too late
