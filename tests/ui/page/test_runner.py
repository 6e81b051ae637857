"""The one wrapper for model handlers: the line is released on every exit path, waiting is visible
and can be left, and every model handler of the app runs its work inside the GPU function."""

from __future__ import annotations

import inspect
import sys
import time
import types
from dataclasses import dataclass

import gradio as gr
import pytest

import ui.page.runner as runner_module
from feedback.errors import FeedbackError, Stopped
from feedback.serve.gate import Gate
from feedback.serve.gpu_time import GpuWork
from tests.polling import wait_for
from tests.ui.model_handlers import (
    MODEL_HANDLERS,
    SETTINGS,
    handler_values,
    line_free,
    model_handlers,
    remember_compare,
    start,
)
from ui.page.runner import ABANDON_S, GpuTask, Jobs, ModelRunner, Outcome, Work


@dataclass
class TickTask(GpuTask):
    """Model-free work: `steps` items, `delay` seconds apart; checks stop between items."""

    steps: int
    delay: float
    fail: BaseException | None = None
    model: str | None = None
    gpu: GpuWork = GpuWork()

    def run(self, lm, stop):
        for i in range(self.steps):
            if stop.is_set():
                raise Stopped("stopped")
            time.sleep(self.delay)
            yield i
        if self.fail is not None:
            raise self.fail


class Ticker(Work):
    """Model-free work (`TickTask`) and what the page was sent of it."""

    label = "a test job"

    def __init__(self, steps: int = 5, delay: float = 0.02, fail: BaseException | None = None):
        self.task = TickTask(steps, delay, fail)
        self.outcome: Outcome | None = None
        self.seen: list = []

    def waiting(self, place):
        return {"waiting": place}

    def progress(self, items, elapsed):
        self.seen += items
        return {"items": list(items)}

    def finish(self, outcome):
        self.outcome = outcome
        return {"finish": outcome.kind}


def make_runner(max_waiting: int | None = None, **kwargs) -> ModelRunner:
    gate = Gate(1, lease_s=0.6, max_waiting=max_waiting)
    return ModelRunner(types.SimpleNamespace(gate=gate), gpu=lambda fn, **_: fn, **kwargs)


def _idle(runner: ModelRunner, timeout: float = 5.0) -> float:
    t0 = time.monotonic()
    while runner.pool.gate.status()["running"] or runner.pool.gate.status()["waiting"]:
        assert time.monotonic() - t0 < timeout, runner.pool.gate.status()
        time.sleep(0.01)
    return time.monotonic() - t0


def test_a_finished_job_streams_its_items_and_releases_the_line():
    runner, work = make_runner(), Ticker(steps=5)
    updates = list(runner.drive("s1", "compare", work))
    assert work.seen == [0, 1, 2, 3, 4] and updates[-1] == {"finish": "done"}
    assert work.outcome.kind == "done" and work.outcome.seconds > 0
    _idle(runner)
    assert not runner.jobs.active("s1")


@pytest.mark.parametrize(
    "error, shown",
    [
        (RuntimeError("kaboom"), "A test job failed: RuntimeError: kaboom"),
        (FeedbackError("too long"), "too long"),
    ],
)
def test_a_failing_job_reports_once_and_releases_the_line(error, shown):
    runner, work = make_runner(), Ticker(steps=2, fail=error)
    updates = []
    with pytest.raises(gr.Error, match=shown):
        for u in runner.drive("s1", "sweep", work):
            updates.append(u)
    assert updates[-1] == {"finish": "failed"} and work.outcome.error is error
    _idle(runner)


def test_stop_ends_a_running_job_within_a_step():
    runner, work = make_runner(), Ticker(steps=10_000, delay=0.01)
    gen = runner.drive("s1", "perplexity", work)
    next(gen)
    assert runner.stop("perplexity", types.SimpleNamespace(session_hash="s1")) == "Stopping…"
    assert runner.stop("perplexity", types.SimpleNamespace(session_hash="other")) == "Nothing is running."
    assert list(gen)[-1] == {"finish": "stopped"}
    assert _idle(runner) < 1 and len(work.seen) < 10_000


def test_a_cancelled_request_stops_its_work_and_releases_the_line():
    """Gradio closes the handler's generator on cancel: the worker must stop and leave the line."""
    runner, work = make_runner(), Ticker(steps=10_000, delay=0.01)
    gen = runner.drive("s1", "deepthink", work)
    next(gen)
    gen.close()
    assert _idle(runner) < 2


def test_a_page_that_stops_listening_has_its_job_stopped():
    """A closed tab: Gradio never resumes the handler again. The watchdog notices and stops it."""
    runner = make_runner(jobs=Jobs(abandon_s=0.5))
    work = Ticker(steps=10_000, delay=0.01)
    gen = runner.drive("s1", "sweep", work)
    next(gen)  # ... and never again
    t = _idle(runner, timeout=5)
    assert t < 3 and len(work.seen) < 10_000
    time.sleep(0.6)
    assert not runner.jobs.active("s1")  # forgotten once its worker ended


def test_waiting_shows_the_place_and_stop_leaves_the_line():
    runner = make_runner()
    held = runner.pool.gate.acquire(label="an API generate request")
    gen = runner.drive("s1", "compare", Ticker())
    next(gen)  # the first update comes before the line is joined: from then on Gradio can close it
    assert runner.pool.gate.status()["waiting"] == 0
    first = next(gen)
    place = first["waiting"]
    assert place.position == 1 and place.running[0][0] == "an API generate request"
    assert runner.pool.gate.status()["waiting"] == 1
    runner.stop("compare", types.SimpleNamespace(session_hash="s1"))
    assert list(gen)[-1] == {"finish": "left"}
    assert runner.pool.gate.status()["waiting"] == 0
    # closing a waiting request (cancel, tab gone) also leaves the line
    gen = runner.drive("s2", "compare", Ticker())
    next(gen), next(gen)
    gen.close()
    assert runner.pool.gate.status()["waiting"] == 0
    runner.pool.gate.release(held)


def test_a_full_line_is_refused_at_once():
    runner = make_runner(max_waiting=0)
    held = runner.pool.gate.acquire()
    gen = runner.drive("s1", "compare", Ticker())
    next(gen)
    assert next(gen) == {"finish": "failed"}  # the page is put back as it was ...
    with pytest.raises(
        gr.Error, match=r"the most this server lets wait\); try again in 10 s"
    ):  # ... and told why
        next(gen)
    runner.pool.gate.release(held)


def test_wrap_validates_before_waiting_and_names_parameters():
    runner = make_runner()
    calls = []

    def prepare(values):
        calls.append(values["prompt"])
        if not values["prompt"]:
            raise FeedbackError("prompt is empty")
        return Ticker(steps=int(values["count"]))

    handler = runner.wrap("compare", prepare, ["prompt", "count", "residual_alpha"])
    held = runner.pool.gate.acquire()
    with pytest.raises(gr.Error, match="prompt is empty"):
        next(handler(None, prompt="", count=1, residual_alpha=None))  # refused without waiting behind the run
    runner.pool.gate.release(held)
    assert runner.pool.gate.status()["waiting"] == 0
    done = handler(types.SimpleNamespace(session_hash="x"), prompt="hi", count=2, residual_alpha=None)
    assert list(done)[-1] == {"finish": "done"}
    assert list(inspect.signature(handler).parameters) == ["request", "prompt", "count", "residual_alpha"]
    assert inspect.isgeneratorfunction(handler) and handler.model_handler


# ---- every model handler of the real app goes through the wrapper and runs inside spaces.GPU ----
@pytest.fixture()
def fake_spaces(monkeypatch):
    """A stand-in `spaces` package whose GPU decorator records when the decorated work runs, and
    can make the work fail after its first progress item (`state["fail"] = True`)."""
    state = {"inside": 0, "decorated": 0, "fail": False}

    def GPU(fn=None, duration=None):
        assert callable(duration)
        state["decorated"] += 1

        def wrapped(*args, **kwargs):
            state["inside"] += 1
            try:
                for item in fn(*args, **kwargs):
                    yield item
                    if state["fail"]:
                        raise RuntimeError("the GPU went away")
            finally:
                state["inside"] -= 1

        return wrapped

    monkeypatch.setitem(sys.modules, "spaces", types.SimpleNamespace(GPU=GPU))
    return state


def test_every_model_handler_runs_inside_the_gpu_function_and_frees_the_line_on_every_path(
    fake_spaces, tiny_lm, monkeypatch
):
    """Each model tab's handler, on each exit path: it finishes; it is cancelled (Gradio closes the
    generator); its page stops listening (closed tab); its work fails."""
    from feedback.serve.pool import ModelPool
    from ui.layout import FeedbackLensApp

    pool = ModelPool.serving(tiny_lm)
    app = FeedbackLensApp(pool)
    demo = app.build()
    jobs = app.runner.jobs
    monkeypatch.setattr(runner_module, "WATCH_EVERY_S", 0.05)  # the watchdog looks often: a quick test
    assert fake_spaces["decorated"] == 1
    handlers = model_handlers(demo)
    assert (
        set(handlers) == MODEL_HANDLERS
    )  # and no other handler touches the model (they are plain UI updates)

    forwards: list[int] = []
    settings = dict(SETTINGS)
    handle = tiny_lm.model.register_forward_pre_hook(lambda *_: forwards.append(fake_spaces["inside"]))
    try:
        for name, fn in handlers.items():
            values = handler_values(app, fn, settings)
            before = len(forwards)
            updates = list(start(fn, values, f"finish-{name}"))
            assert updates and len(forwards) > before, name  # finished
            if name == "compare":
                remember_compare(app, settings, updates)
            line_free(pool)
            gen = start(fn, values, f"cancel-{name}")
            next(gen)
            gen.close()  # cancelled
            line_free(pool)
            gone = start(fn, values, f"abandon-{name}")
            next(gone), next(gone)  # in line or running, and never resumed: the page went away
            # The watchdog stops it once its page took no update for `abandon_s`; short here only,
            # as on a busy machine a live run's first update may take longer than that.
            jobs.abandon_s = 0.05
            wait_for(lambda session=f"abandon-{name}": not jobs.active(session), name)
            line_free(pool)
            jobs.abandon_s = ABANDON_S
            gone.close()
            fake_spaces["fail"] = True
            with pytest.raises(gr.Error, match="failed: RuntimeError: the GPU went away"):
                list(start(fn, values, f"fail-{name}"))
            fake_spaces["fail"] = False
            line_free(pool)
    finally:
        handle.remove()
    assert forwards and all(inside == 1 for inside in forwards)


def test_named_handlers_get_one_dict_by_name_and_the_request(tiny_lm):
    """wrap / by_name: Gradio passes `inputs_kwargs` values by keyword; the handler's
    prepare gets them as one dict, API clients see the names as parameters, in order."""
    from ui.page.runner import by_name, keyword_signature

    sig = keyword_signature(["prompt", "temperature"])
    assert list(sig.parameters) == ["request", "prompt", "temperature"]
    assert sig.parameters["request"].annotation is gr.Request
    seen = []
    handler = by_name(lambda values: seen.append(values) or "ok", ["prompt", "temperature"])
    assert handler(None, prompt="hi", temperature=0.5) == "ok" and seen == [
        {"prompt": "hi", "temperature": 0.5}
    ]

    from feedback.serve.pool import ModelPool

    runner = ModelRunner(ModelPool.serving(tiny_lm), gpu=lambda fn, **_: fn)

    def refuse(values):
        raise FeedbackError(f"temperature must be between 0 and 10, got {values['temperature']}")

    model_handler = runner.wrap("t", refuse, ["temperature"])
    assert inspect.isgeneratorfunction(model_handler) and model_handler.model_handler
    with pytest.raises(gr.Error, match="temperature must be between 0 and 10, got 11"):
        next(model_handler(None, temperature=11))
