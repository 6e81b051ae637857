"""ZeroGPU's constraints, simulated (`tests/ui/zerogpu_double.py`): every model tab runs its work in
another process, forked from the app's, with its arguments, each progress item and its end pickled
across; nothing crossing may hold a tensor or fail to pickle; Stop (the whole run, one column)
still reaches the work; a failure there reaches the page with its message; and each request asks
for the GPU time its size needs, a request over the cap refused before it waits.

`python -m pytest -q -s tests/ui/test_zerogpu.py -k every_model_tab` prints the bytes per yield."""

from __future__ import annotations

import re
import sys
import threading
import types
from dataclasses import dataclass

import gradio as gr
import pytest

from feedback.errors import FeedbackError
from feedback.serve import gpu_time
from feedback.serve.gate import Gate
from feedback.serve.gpu_time import GpuWork
from feedback.serve.limits import GPU_DURATION_CAP_ENV, GPU_DURATION_CAP_S, gpu_duration_cap_setting
from tests.ui.model_handlers import (
    MODEL_HANDLERS,
    SETTINGS,
    handler_values,
    line_free,
    model_handlers,
    remember_compare,
    start,
)
from tests.ui.zerogpu_double import ZeroGPU
from ui.page.runner import GpuTask, ModelRunner, Outcome, Work
from ui.perplexity.recall import recall_gpu_work

STREAM_ITEM_MAX_BYTES = 16_000  # a progress item: one step's tokens, one scored window, one line of text


@pytest.fixture(scope="module")
def zerogpu():
    """The double, as `import spaces` finds it while the module's app is built."""
    double = ZeroGPU()
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "spaces", double.module())
        yield double


@pytest.fixture(scope="module")
def served(zerogpu, tiny_lm):
    """The real app on the tiny model, its GPU function decorated by the double."""
    from feedback.serve.pool import ModelPool
    from ui.layout import FeedbackLensApp

    pool = ModelPool.serving(tiny_lm)
    app = FeedbackLensApp(pool)
    demo = app.build()
    yield types.SimpleNamespace(app=app, demo=demo, pool=pool)
    app.runner.jobs.stop_all()


def stream_items(call) -> list[int]:
    """The bytes of a call's streamed items: every yield but the last (the end: a result, `Finished`)."""
    return call.yield_bytes[:-1]


def test_every_model_tab_runs_through_zerogpus_process_boundary(served, zerogpu):
    app, runner = served.app, served.app.runner
    assert zerogpu.decorated == 1 and runner.zero_gpu  # decorated once, at start; marked as ZeroGPU's
    handlers = model_handlers(served.demo)
    assert set(handlers) == MODEL_HANDLERS
    settings, rows = dict(SETTINGS), []
    for name, fn in handlers.items():
        before = len(zerogpu.calls)
        updates = list(
            start(fn, handler_values(app, fn, settings), f"zero-{name}")
        )  # raises if the work failed
        assert zerogpu.violations == [], zerogpu.violations
        assert len(zerogpu.calls) == before + 1, name
        call = zerogpu.calls[-1]
        assert call.ran and call.yield_bytes and call.result_bytes, name
        assert 0 < call.duration <= runner.gpu_cap, (name, call.duration)
        assert max(stream_items(call), default=0) < STREAM_ITEM_MAX_BYTES, (name, call.yield_types)
        if name == "compare":
            remember_compare(app, settings, updates)
            assert settings["last"]["rows"] and all(r["token_ids"] for r in settings["last"]["rows"])
        line_free(served.pool)
        items = stream_items(call)
        rows.append(
            (
                name,
                call.duration,
                call.arg_bytes,
                len(call.yield_bytes),
                sum(items) / max(1, len(items)),
                max(items, default=0),
                call.yield_bytes[-1],
            )
        )
    print("\nZeroGPU double: bytes pickled across per call (tiny model, quick settings)")
    print(f"{'tab':<11}{'asks s':>7}{'args':>8}{'yields':>7}{'mean item':>10}{'max item':>9}{'last':>8}")
    for name, seconds, args, n, mean, biggest, last in rows:
        print(f"{name:<11}{seconds:>7}{args:>8,}{n:>7}{mean:>10,.0f}{biggest:>9,}{last:>8,}")


def test_a_compare_runs_items_do_not_grow_with_the_run(served, zerogpu):
    """Each step's item carries that step alone: a 4-step and a 24-step run stream items of one size."""
    fn = model_handlers(served.demo)["compare"]
    sizes = {}
    for steps in (4, 24):
        settings = SETTINGS | {"max-new-tokens": steps, "thr-mode": "off"}
        list(start(fn, handler_values(served.app, fn, settings), f"grow-{steps}"))
        items = [
            b
            for b, t in zip(zerogpu.calls[-1].yield_bytes, zerogpu.calls[-1].yield_types)
            if t == "StepEvent"
        ]
        sizes[steps] = max(items)
    assert sizes[24] < 1.5 * sizes[4], sizes


def test_stop_reaches_the_work_in_the_gpu_process_and_keeps_what_it_made(served, zerogpu):
    """Stop, and Stop on one column, cross to the worker (shared memory): the run ends within a step
    and its result comes back (a closed generator would lose it)."""
    app = served.app
    fn = model_handlers(served.demo)["compare"]
    values = handler_values(app, fn, SETTINGS | {"max-new-tokens": 400, "thr-mode": "off"})
    request = types.SimpleNamespace(session_hash="zero-stop")

    def run_and(action) -> dict:
        last, done = None, False
        for update in start(fn, values, request.session_hash):
            if not done and "step" in str(update.get(app.compare.ui.run.status, "")):
                done = action()
            last = update.get(app.compare.ui.out.run_json.data) or last
        return last

    whole = run_and(lambda: app.compare.stop_run("", request) == "Stopping…")
    assert all(r["stop_reason"] == "stopped" and len(r["token_ids"]) < 400 for r in whole["rows"])
    line_free(served.pool)
    one = run_and(lambda: app.compare.stop_column("2", request) == "Stopping column 2…")
    assert one["rows"][1]["stop_reason"] == "stopped" and one["rows"][0]["stop_reason"] != "stopped"
    assert len(one["rows"][1]["token_ids"]) < len(one["rows"][0]["token_ids"])
    line_free(served.pool)


def test_a_gpu_worker_that_dies_fails_the_request_and_frees_the_line(served, zerogpu):
    fn = model_handlers(served.demo)["compare"]
    zerogpu.abort_after = 1
    try:
        with pytest.raises(gr.Error, match="A Compare run failed: ZeroGPU worker error: GPU task aborted"):
            list(start(fn, handler_values(served.app, fn, SETTINGS), "zero-abort"))
    finally:
        zerogpu.abort_after = None
    line_free(served.pool)


# ---- the boundary's checks, with model-free work ----
@dataclass
class Yields(GpuTask):
    """Model-free work that yields `items`, then raises `error` (if any)."""

    items: list
    error: BaseException | None = None
    model: str | None = None
    gpu: GpuWork = GpuWork(steps=10)

    def run(self, lm, stop):
        for item in self.items:
            yield item() if callable(item) else item
        if self.error is not None:
            raise self.error


class Plain(Work):
    label = "a test job"

    def __init__(self, task: GpuTask):
        self.task, self.outcome = task, None

    def finish(self, outcome: Outcome) -> dict:
        self.outcome = outcome
        return {"finish": outcome.kind}


def drive(task: GpuTask, double: ZeroGPU) -> Plain:
    runner = ModelRunner(types.SimpleNamespace(gate=Gate(1)), gpu=double.GPU)
    work = Plain(task)
    list(runner.drive("s", "t", work))
    return work


def a_tensor():
    import torch

    return torch.zeros(2, 3)


def a_function():
    return lambda: None


@pytest.mark.parametrize(
    "task, where, why",
    [
        (Yields([1, a_tensor]), "yield 2 of the GPU function (a Tensor)", r"a torch.Tensor \(shape \(2, 3\)"),
        (Yields([{"fine": 1}, a_function]), "yield 2 of the GPU function (a function)", "cannot be pickled"),
        (
            Yields([threading.Lock()]),
            "an argument of the GPU function",
            "cannot pickle '_thread.lock' object",
        ),
    ],
)
def test_what_cannot_cross_the_boundary_fails_the_request_and_is_recorded(task, where, why):
    double = ZeroGPU()
    with pytest.raises(gr.Error, match="A test job failed: BoundaryError"):
        drive(task, double)
    assert len(double.violations) == 1 and double.violations[0].startswith(where), double.violations
    assert re.search(why, double.violations[0])


@pytest.mark.parametrize(
    "error, shown",
    [
        (FeedbackError("too long"), "too long"),
        (RuntimeError("kaboom"), "A test job failed: RuntimeError: kaboom"),
    ],
)
def test_a_failure_in_the_gpu_process_reaches_the_page_with_its_message(error, shown):
    """`spaces` sends an exception raised in its worker as its class name alone; the work's end
    crosses as an item instead, so the page says what went wrong."""
    double = ZeroGPU()
    with pytest.raises(gr.Error) as raised:
        drive(Yields([1, 2], error), double)
    assert raised.value.message == shown
    assert double.calls[0].yield_types == ["int", "int", "Ended"]


# ---- the GPU time each request asks for ----
def compare_values(served, **changes) -> dict:
    fn = model_handlers(served.demo)["compare"]
    values = dict(zip(fn.input_keyword_names, handler_values(served.app, fn, SETTINGS), strict=True))
    return values | changes


def compare_seconds(served, **changes) -> int:
    return served.app.compare.prepare_compare(compare_values(served, **changes)).task.gpu.seconds()


def test_the_gpu_time_grows_with_rows_and_tokens_and_the_double_is_asked_for_it(served, zerogpu):
    two, three, four = (compare_seconds(served, columns=n, max_new_tokens=64) for n in (2, 3, 4))
    longer = compare_seconds(served, columns=2, max_new_tokens=256)
    assert two < three < four and two < longer
    assert GpuWork(steps=100, row_tokens=400).seconds() > GpuWork(steps=100, row_tokens=100).seconds()
    assert (
        GpuWork(scored=10_000).seconds()
        > GpuWork(scored=1_000).seconds()
        > GpuWork().seconds()
        == gpu_time.START_S
    )
    fn = model_handlers(served.demo)["compare"]
    values = compare_values(served, columns=3, max_new_tokens=5)
    scale = (
        served.app.runner.clock.scale
    )  # this machine's speed as learnt so far (it may change after the call)
    list(fn.fn(types.SimpleNamespace(session_hash="zero-asks"), **values))
    assert zerogpu.calls[-1].duration == served.app.compare.prepare_compare(values).task.gpu.seconds(scale)


def test_the_gpu_time_asked_for_learns_this_machines_speed(served, zerogpu):
    """A whole run's measured time scales what later requests ask for: the tiny model is far faster
    than the development CPU's rates, so after one run long enough to measure, the same request
    asks for less (never below the start-up term)."""
    runner, fn = served.app.runner, model_handlers(served.demo)["compare"]
    runner.clock = gpu_time.GpuClock()
    # predicted ~20 s at the starting rates; the tiny model takes a second or two even on a busy CPU,
    # so the learnt scale is far enough below 1 to ask for whole seconds less
    values = compare_values(served, columns=4, max_new_tokens=160)
    task = served.app.compare.prepare_compare(values).task
    assert task.gpu.variable_s() >= 4 * gpu_time.MIN_MEASURED_S
    list(fn.fn(types.SimpleNamespace(session_hash="zero-learn"), **values))
    first = zerogpu.calls[-1].duration
    assert first == task.gpu.seconds() and runner.clock.ratios and runner.clock.scale < 1
    print("\nmeasured ÷ predicted GPU time, tiny model:", [round(r, 3) for r in runner.clock.ratios])
    learnt = runner.clock.scale  # what the next call asks by (its own end may raise it: a slower run)
    list(fn.fn(types.SimpleNamespace(session_hash="zero-learn"), **values))
    assert gpu_time.START_S <= zerogpu.calls[-1].duration == task.gpu.seconds(learnt) < first


def test_the_clock_keeps_the_slowest_recent_ratio_with_a_margin():
    clock, work = gpu_time.GpuClock(), GpuWork(steps=100)  # 4.5 s predicted
    clock.observe(GpuWork(steps=10), 100.0)  # predicted under MIN_MEASURED_S: says nothing
    assert clock.scale == 1.0 and not clock.ratios
    clock.observe(work, 0.45)
    assert clock.scale == pytest.approx(gpu_time.MARGIN * 0.1)
    clock.observe(work, 0.9)  # a slower run: the scale follows the slowest
    clock.observe(work, 0.45)
    assert clock.scale == pytest.approx(gpu_time.MARGIN * 0.2)
    for _ in range(gpu_time.KEEP):  # ... of the last KEEP
        clock.observe(work, 0.045)
    assert clock.scale == gpu_time.MIN_SCALE
    clock.observe(work, 100.0)
    assert clock.scale == gpu_time.MAX_SCALE


def test_a_request_over_the_cap_is_refused_before_it_waits_or_reaches_the_gpu(served, zerogpu, monkeypatch):
    runner, fn = served.app.runner, model_handlers(served.demo)["compare"]
    values = compare_values(served, columns=4, max_new_tokens=60)
    seconds = served.app.compare.prepare_compare(values).task.gpu.seconds(runner.clock.scale)
    monkeypatch.setattr(runner, "gpu_cap", seconds - 1)  # a Space whose visitors may ask for a second less
    calls = len(zerogpu.calls)
    held = served.pool.gate.acquire(label="another request")  # a refusal does not wait behind it
    try:
        with pytest.raises(gr.Error) as refused:
            list(fn.fn(types.SimpleNamespace(session_hash="zero-cap"), **values))
        assert served.pool.gate.status()["waiting"] == 0
    finally:
        served.pool.gate.release(held)
    assert refused.value.message == (
        f"this request needs about {seconds} s of GPU time (4 columns x 60 new tokens after a prompt of "
        f"up to {values_prompt_tokens(served, values)} tokens); a request here may ask for at most "
        f"{seconds - 1} s "
        f"({GPU_DURATION_CAP_ENV}): ask for fewer columns, fewer max new tokens or a shorter prompt"
    )
    assert len(zerogpu.calls) == calls  # never asked ZeroGPU for it
    monkeypatch.setattr(runner, "gpu_cap", seconds)  # one that allows it runs it
    list(fn.fn(types.SimpleNamespace(session_hash="zero-cap"), **values))
    assert zerogpu.calls[-1].duration == seconds


def values_prompt_tokens(served, values: dict) -> int:
    run = served.app.compare.prepare_compare(values).engine_run
    return max(len(r.prompt_ids) for r in run.rows)


# ---- a request longer than one call may ask for ----
RECALL_GRID = SETTINGS | {"recall-lengths": "64, 96", "recall-depths": "0, 100", "recall-items": 2}


def recall_request(served):
    fn = model_handlers(served.demo)["recall"]
    values = handler_values(served.app, fn, RECALL_GRID)
    work = served.app.perplexity.recall.prepare(dict(zip(fn.input_keyword_names, values, strict=True)))
    return fn, values, work


def recall_updates(served, fn, values, session: str, on_update=lambda update: None) -> list:
    updates = []
    for update in start(fn, values, session):
        updates.append(update)
        on_update(update)
    return updates


def shown_result(served, updates: list) -> dict:
    result = served.app.perplexity.recall.result
    return next(u[result] for u in reversed(updates) if isinstance(u, dict) and u.get(result) is not None)


def test_a_recall_grid_over_the_cap_runs_as_several_calls_each_within_it(
    served, zerogpu, tiny_lm, monkeypatch
):
    """A grid whose prompts together ask for more than the cap runs as consecutive GPU calls, each
    asking for at most the cap, and gives the result of one whole run; only a prompt that alone
    needs more than the cap is refused (before it waits)."""
    from feedback.eval.recall import evaluate_recall

    runner = served.app.runner
    monkeypatch.setattr(
        runner, "clock", gpu_time.GpuClock()
    )  # the starting rates, whatever earlier tests measured
    fn, values, work = recall_request(served)
    task = work.task
    one_prompt = [
        recall_gpu_work([i], task.rows, task.cfg.max_new_tokens).seconds(runner.clock.scale)
        for i in task.instances
    ]
    cap = max(one_prompt) + 1
    assert len(task.instances) == 8 and task.gpu.seconds(runner.clock.scale) > 2 * cap  # three calls or more
    monkeypatch.setattr(runner, "gpu_cap", cap)
    calls = runner.gpu_calls(task)
    assert len(calls) >= 3 and [i for c in calls for i in c.instances] == task.instances
    assert all(c.gpu.seconds(runner.clock.scale) <= cap for c in calls)

    before = len(zerogpu.calls)
    updates = recall_updates(served, fn, values, "zero-split")
    made = zerogpu.calls[before:]
    assert len(made) == len(calls) and all(c.ran and 0 < c.duration <= cap for c in made), [
        c.duration for c in made
    ]
    assert zerogpu.violations == []
    got = shown_result(served, updates)
    whole = evaluate_recall(tiny_lm, task.cfg, task.rows, instances=task.instances)
    assert {k: v for k, v in got.items() if k != "wall_seconds"} == {
        k: v for k, v in whole.items() if k != "wall_seconds"
    }
    assert 0 < got["wall_seconds"]
    status = served.app.perplexity.recall.status
    said = [str(u[status]) for u in updates if isinstance(u, dict) and status in u]
    assert any(f"as {len(calls)} GPU calls" in s for s in said), said[:2]
    line_free(served.pool)

    # not even one prompt fits a call (at the speed the calls above measured)
    smallest = min(
        recall_gpu_work([i], task.rows, task.cfg.max_new_tokens).seconds(runner.clock.scale)
        for i in task.instances
    )
    monkeypatch.setattr(runner, "gpu_cap", smallest - 1)
    held = len(zerogpu.calls)
    with pytest.raises(
        gr.Error, match=rf"this request needs about {smallest} s of GPU time \(1 prompt of \d+ tokens, 2 rows"
    ):
        recall_updates(served, fn, values, "zero-split-refused")
    assert len(zerogpu.calls) == held


def test_stop_between_a_grids_calls_ends_it_with_the_prompts_done(served, zerogpu, monkeypatch):
    runner = served.app.runner
    monkeypatch.setattr(runner, "clock", gpu_time.GpuClock())
    fn, values, work = recall_request(served)
    task = work.task
    monkeypatch.setattr(
        runner,
        "gpu_cap",
        1
        + max(
            recall_gpu_work([i], task.rows, task.cfg.max_new_tokens).seconds(runner.clock.scale)
            for i in task.instances
        ),
    )
    calls = len(runner.gpu_calls(task))
    assert calls >= 3
    request = types.SimpleNamespace(session_hash="zero-split-stop")
    status, stopped = served.app.perplexity.recall.status, []

    def stop_after_the_first(update) -> None:
        if not stopped and "1 of 8 prompts done" in str(update.get(status, "")):
            stopped.append(served.app.perplexity.recall.stop_run(request))

    before = len(zerogpu.calls)
    updates = recall_updates(served, fn, values, request.session_hash, stop_after_the_first)
    assert stopped == ["Stopping…"] and len(zerogpu.calls) - before < calls
    partial = shown_result(served, updates)
    assert 1 <= len(partial["items"]) < 8 and "Stopped after" in str(updates[-1].get(status, ""))
    line_free(served.pool)


TYPED = {k: SETTINGS[k] for k in ("prompt", "ppl-text", "sweep-text")}  # what a visitor must type


def test_the_pages_defaults_fit_the_default_cap_recalls_grid_in_several_calls(embedded_lm):
    """A visitor who types a prompt (or text) and changes nothing else is not refused: each tab's
    default request on the embedded model asks for at most the default cap, at the rates measured
    on the development CPU. Recall's default grid (12 prompts of up to 1,024 tokens) asks for more
    at those rates: it runs as several GPU calls, each within the cap."""
    from feedback.serve.pool import ModelPool
    from ui.layout import FeedbackLensApp

    app = FeedbackLensApp(ModelPool.serving(embedded_lm), gpu=lambda fn, **_: fn)
    demo = app.build()
    asks, tasks = {}, {}
    for name, fn in model_handlers(demo).items():
        if name in ("continue", "branch", "rerun"):  # they go on from a Compare run: sized as one
            continue
        prepare = {
            "compare": app.compare.prepare_compare,
            "calibrate": app.compare.prepare_calibrate,
            "perplexity": app.perplexity.prepare,
            "recall": app.perplexity.recall.prepare,
            "sweep": app.sweep.prepare,
            "tune": app.sweep.prepare_tune,
            "deepthink": app.deepthink.prepare,
        }[name]
        values = dict(zip(fn.input_keyword_names, handler_values(app, fn, TYPED), strict=True))
        tasks[name] = prepare(values).task
        asks[name] = tasks[name].gpu.seconds()
    print("\nGPU seconds asked for by each tab's defaults (embedded model):", asks)
    assert asks.pop("recall") > GPU_DURATION_CAP_S
    assert max(asks.values()) <= GPU_DURATION_CAP_S, asks
    calls = tasks["recall"].split(lambda work: work.seconds() <= GPU_DURATION_CAP_S)
    print("Recall's default grid as calls of (s):", [c.gpu.seconds() for c in calls])
    assert len(calls) == 2 and all(c.gpu.seconds() <= GPU_DURATION_CAP_S for c in calls)


def test_the_cap_is_a_setting(monkeypatch):
    assert gpu_duration_cap_setting() == GPU_DURATION_CAP_S
    monkeypatch.setenv(GPU_DURATION_CAP_ENV, "300")
    assert gpu_duration_cap_setting() == 300
    monkeypatch.setenv(GPU_DURATION_CAP_ENV, "0")
    with pytest.raises(
        FeedbackError, match=rf"the GPU duration cap \({GPU_DURATION_CAP_ENV}\) must be at least 1"
    ):
        gpu_duration_cap_setting()
