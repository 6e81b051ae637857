"""The real app's model handlers and quick settings for each, shared by the tests that run every
model tab (tests/ui/page/test_runner.py, tests/ui/test_zerogpu.py)."""

from __future__ import annotations

import json
import time
import types

# Every handler that runs the model (the page's model events), by API name.
MODEL_HANDLERS = {
    "compare",
    "continue",
    "branch",
    "rerun",
    "calibrate",
    "perplexity",
    "sweep",
    "tune",
    "deepthink",
    "recall",
}
TEXT = "def add(a, b):\n    return a + b\n\nThe function add returns the sum of its two arguments."
SETTINGS = {  # elem_id -> value for a quick run of each handler on the tiny model
    "prompt": "Say hi.",
    "max-new-tokens": 3,
    "temperature": 0.0,
    "warmup": 2,
    "ppl-text": TEXT,
    "sweep-text": TEXT,
    "sweep-grid-x": "lam=0,0.1",
    "sweep-grid-y": "",
    "dt-prompt": "What is 2 + 2? Answer with a number.",
    "dt-traces": 1,
    "dt-warmup": 1,
    "dt-max-new": 3,
    "follow-up": "And then?",
    "fl-column-request": "2",
    "recall-lengths": "64",
    "recall-depths": "50",
    "recall-items": 1,
    "recall-max-new": 3,
}


def model_handlers(demo) -> dict:
    """The app's model handlers (those `ModelRunner.wrap` made), by API name; Compare first: the
    follow-ups (continue, branch, rerun) go on from its run."""
    found = {fn.api_name: fn for fn in demo.fns.values() if getattr(fn.fn, "model_handler", False)}
    return dict(sorted(found.items(), key=lambda item: item[0] != "compare"))


def handler_values(app, fn, settings: dict) -> list:
    """The values of `fn`'s inputs: `settings` by elem_id, else each control's own; the Compare
    run to go on from (`settings["last"]`) for the page's `last` state."""
    values = [settings.get(c.elem_id, c.value) for c in fn.inputs]
    return [settings.get("last") if c is app.compare.ui.out.last else v for c, v in zip(fn.inputs, values)]


def start(fn, values: list, session: str):
    """The handler's generator, called as Gradio calls it (keywords for `inputs_kwargs` events)."""
    request = types.SimpleNamespace(session_hash=session)
    if fn.input_keyword_names:
        return fn.fn(request, **dict(zip(fn.input_keyword_names, values, strict=True)))
    return fn.fn(*values, request)


def remember_compare(app, settings: dict, updates: list) -> None:
    """After a Compare run: its result as the page's `last` run, and a branch request on it."""
    last = app.compare.ui.out.last
    settings["last"] = next(u[last] for u in reversed(updates) if isinstance(u, dict) and last in u)
    step0 = settings["last"]["rows"][0]["steps"][0]
    settings["fl-branch-request"] = json.dumps(
        {"row": "Baseline", "step": 0, "token_id": step0["top"][1]["token_id"]}
    )


def line_free(pool, timeout: float = 10.0) -> None:
    """Wait until nothing runs or waits in the model line."""
    t0 = time.monotonic()
    while pool.gate.status()["running"] or pool.gate.status()["waiting"]:
        assert time.monotonic() - t0 < timeout, pool.gate.status()
        time.sleep(0.02)
