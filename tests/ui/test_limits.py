"""The Deep Think, Perplexity, Sweep and Tune tabs hold the limits where they are declared: each
number box shows its declared bound, and each handler refuses a value just past it, naming the field."""

from __future__ import annotations

import inspect
import re
import types

import gradio as gr
import pytest

from feedback.core.bounds import Bound
from feedback.core.records import DEEPCONF_WINDOW, SEED
from feedback.core.sampling import MIN_TEMPERATURE, TEMPERATURE, TOP_P
from feedback.eval.perplexity import PASSES
from feedback.serve.limits import (
    MAX_DOCS,
    MAX_TOKENS_PER_DOC,
    TRACE_MAX_NEW_TOKENS,
    TRACES,
    TRIALS,
    WARMUP_TRACES,
)
from ui.page.deepconf import ETA

# Deep Think samples, so its temperature box starts at the sampling floor instead of 0 (greedy).
SAMPLED = Bound(TEMPERATURE.name, MIN_TEMPERATURE, TEMPERATURE.hi)
LIMITS = [  # (endpoint, input name, its bound, other values the check needs)
    ("deepthink", "traces", TRACES, {}),
    ("deepthink", "warmup", WARMUP_TRACES, {}),
    ("deepthink", "max_new", TRACE_MAX_NEW_TOKENS, {}),
    ("deepthink", "window", DEEPCONF_WINDOW, {}),
    ("deepthink", "temperature", SAMPLED, {}),
    ("deepthink", "top_p", TOP_P, {}),
    ("deepthink", "seed", SEED, {}),
    ("deepthink", "eta", ETA, {"eta_preset": "custom"}),  # the box is read only for a custom η
    ("perplexity", "passes", PASSES, {}),
    ("perplexity", "max_docs", MAX_DOCS, {}),
    ("perplexity", "max_tokens_per_doc", MAX_TOKENS_PER_DOC, {}),
    ("sweep", "passes", PASSES, {}),
    ("sweep", "max_docs", MAX_DOCS, {}),
    ("sweep", "max_tokens_per_doc", MAX_TOKENS_PER_DOC, {}),
    ("tune", "passes", PASSES, {}),
    ("tune", "max_docs", MAX_DOCS, {}),
    ("tune", "max_tokens_per_doc", MAX_TOKENS_PER_DOC, {}),
    ("tune", "trials", TRIALS, {}),
    ("tune", "seed", SEED, {}),
]


@pytest.fixture(scope="module")
def handlers(tiny_lm):
    """Each model endpoint's event, by API name."""
    from feedback.serve.pool import ModelPool
    from ui.layout import FeedbackLensApp

    demo = FeedbackLensApp(ModelPool.serving(tiny_lm)).build()
    return {
        fn.api_name: fn
        for fn in demo.fns.values()
        if fn.api_name in {"deepthink", "perplexity", "sweep", "tune"}
    }


def controls(event) -> dict:
    """The event's input components by the name its handler takes them by."""
    return dict(zip(event.input_keyword_names, event.inputs, strict=True))


@pytest.mark.parametrize("endpoint, name, bound, extra", LIMITS, ids=[f"{e}-{n}" for e, n, _, _ in LIMITS])
def test_each_box_shows_its_declared_bound_and_the_handler_refuses_one_past_it(
    handlers, endpoint, name, bound, extra
):
    event = handlers[endpoint]
    box = controls(event)[name]
    assert isinstance(box, gr.Number) and bound.info in (box.info or "")  # said, and checked by the handler:
    assert (box.minimum, box.maximum) == (
        None,
        None,
    )  # Gradio would refuse past its own bounds in its own words
    assert box.precision == (0 if bound.integer else None)
    values = {n: c.value for n, c in controls(event).items()} | extra | {name: bound.hi + 1}
    with pytest.raises(
        gr.Error, match=re.escape(f"{bound.name} must be between {bound.lo:g} and {bound.hi:g}")
    ):
        list(event.fn(types.SimpleNamespace(session_hash=f"limits-{endpoint}-{name}"), **values))


def test_deep_think_refuses_a_top_p_of_zero_as_sampling_does(handlers):
    """0 is inside TOP_P's range, but sampling refuses it (nothing would be kept): refused before any work."""
    event = handlers["deepthink"]
    values = {n: c.value for n, c in controls(event).items()} | {"top_p": 0}
    with pytest.raises(gr.Error, match=re.escape("top_p must be > 0")):
        list(event.fn(types.SimpleNamespace(session_hash="limits-top-p"), **values))


def test_handlers_take_every_value_by_name_in_the_order_positional_clients_pass_them(handlers):
    """The API's parameter names are the handlers' names: the tab's own, then `<strategy>_<param>`."""
    heads = {
        "deepthink": [
            "prompt",
            "expected",
            "strategy",
            "traces",
            "warmup",
            "eta_preset",
            "eta",
            "window",
            "max_new",
            "temperature",
            "top_p",
            "seed",
            "regex",
            "shared",
            "check",
        ],
        "perplexity": [
            "source",
            "text",
            "upload",
            "strategy",
            "mode",
            "passes",
            "max_docs",
            "max_tokens_per_doc",
        ],
        "sweep": [
            "source",
            "text",
            "upload",
            "strategy",
            "grid_x",
            "grid_y",
            "mode",
            "passes",
            "max_docs",
            "max_tokens_per_doc",
        ],
        "tune": [
            "source",
            "text",
            "upload",
            "strategy",
            "search",
            "mode",
            "passes",
            "max_docs",
            "max_tokens_per_doc",
            "trials",
            "seed",
        ],
    }
    for endpoint, head in heads.items():
        event = handlers[endpoint]
        names = event.input_keyword_names
        assert names[: len(head)] == head, endpoint
        assert "residual_alpha" in names[len(head) :] and "deep_cache_lam" in names[len(head) :], endpoint
        params = inspect.signature(event.fn).parameters
        assert list(params) == ["request", *names]
        assert all(p.kind is p.KEYWORD_ONLY for p in list(params.values())[1:])


def test_a_refusal_stays_in_the_status_line(handlers):
    """The refusal's first update writes it into the tab's status line (a toast vanishes), then the
    error ends the event."""
    event = handlers["deepthink"]
    values = {n: c.value for n, c in controls(event).items()} | {"top_p": 0}
    updates = event.fn(types.SimpleNamespace(session_hash="limits-status"), **values)
    (status_update,) = next(updates).values()
    assert "Not started" in status_update and "top_p must be &gt; 0" in status_update
    with pytest.raises(gr.Error, match=re.escape("top_p must be > 0")):
        next(updates)


@pytest.mark.parametrize("endpoint", ["sweep", "tune"])
def test_a_job_over_the_budget_is_refused_naming_the_fields_that_fit_and_one_that_fits_starts_with_its_estimate(  # noqa: E501
    handlers, endpoint
):
    """40 built-in documents, uncut, for 12 points (or trials) is over the default budget: the status
    line keeps the reason and the per-document limit (or document count) that would fit; with that
    limit the job starts, and its first update is the estimate (the request is closed there, before
    it waits for the model)."""
    event = handlers[endpoint]
    values = {n: c.value for n, c in controls(event).items()} | {
        "source": "builtin:dev",
        "max_docs": 40,
        "max_tokens_per_doc": 100_000,
        "trials": 12,
    }
    values = {k: v for k, v in values.items() if k in controls(event)}
    updates = event.fn(types.SimpleNamespace(session_hash=f"budget-{endpoint}"), **values)
    (status,) = next(updates).values()
    assert "Not started" in status and "FEEDBACK_BUDGET_SCORED_TOKENS" in status
    cap = int(re.search(r"It fits with max tokens per document ([\d,]+)", status).group(1).replace(",", ""))
    with pytest.raises(gr.Error):
        next(updates)
    starting = event.fn(
        types.SimpleNamespace(session_hash=f"fits-{endpoint}"), **values | {"max_tokens_per_doc": cap}
    )
    text = " ".join(str(v) for v in next(starting).values())
    starting.close()  # leaves before it joins the line: nothing runs
    assert "Starting. Estimate: " in text and "token-forwards" in text
