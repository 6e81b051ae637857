"""The one wrapper every page handler that runs the model goes through (Compare, Calibrate,
Perplexity, Sweep, Deep Think).

For each request it:
1. reads the inputs and validates them (`prepare`), before anything waits: a bad input is refused at
   once with a `gr.Error` (a toast; the tab's earlier results stay as they were);
2. takes a place in the process's one model line (`ModelPool.gate`, shared with the HTTP API) and,
   while waiting, tells the page its position and what it waits behind; Stop leaves the line;
3. runs the model work on a worker thread, inside the `spaces.GPU` function (ZeroGPU; a no-op
   elsewhere), streaming the work's progress to the page at least every HEARTBEAT_S seconds. On
   ZeroGPU that function runs in another process, forked from this one: what crosses is pickled
   (the work's `GpuTask`, a `StopSignal`, each progress item), so the work's task is plain data
   naming its model, and it asks for the GPU time its size needs (`GpuTask.gpu`). Work longer than
   the cap runs as consecutive calls where it is made of independent pieces (`GpuTask.split`:
   Recall's prompts), else it is refused in step 1;
4. releases the line on every exit path: done, error, Stop, a cancelled request, and a page that
   stopped listening (a closed tab): a watchdog stops any job whose page has not taken an update for
   ABANDON_S seconds, so its work ends within a step / window / trace and the next in line goes.

A tab supplies a `Work`: the model work itself (`task`, run inside the GPU function) and how its
progress and end look on the page (dicts of component updates, built in the handler's thread).
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import gradio as gr

from feedback.core.budget import Budget
from feedback.errors import FeedbackError, Stopped, one_line
from feedback.serve.gate import Busy, Place
from feedback.serve.gpu_time import GpuClock, GpuWork
from feedback.serve.limits import gpu_duration_cap_setting
from feedback.serve.pool import ModelPool
from ui.page import notice, render, stop_signal
from ui.page.stop_signal import JobStop, StopSignal

log = logging.getLogger("feedback_lens.ui")

HEARTBEAT_S = 0.5  # the page hears from a waiting or running job at least this often
UPDATE_EVERY_S = 0.2  # ... and at most this often while it streams
ABANDON_S = 6.0  # a job whose page took no update for this long is stopped (closed tab, lost client)
WATCH_EVERY_S = 0.5


def zero_gpu():
    """`spaces.GPU` on a ZeroGPU Space; elsewhere a decorator that changes nothing."""
    try:
        import spaces
    except ImportError:

        def no_op(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

        return no_op
    return spaces.GPU


@dataclass
class Outcome:
    """How a job ended: "done", "stopped" (Stop / cancel / page gone), "left" (left the line before
    it ran) or "failed" (with the error)."""

    kind: str
    error: BaseException | None = None
    seconds: float = 0.0
    trace: str = (
        ""  # the failure's traceback, as text (an exception that crossed from ZeroGPU's worker has none)
    )

    @property
    def message(self) -> str:
        if self.error is None:
            return ""
        if isinstance(self.error, FeedbackError):
            return str(self.error)
        if isinstance(self.error, gr.Error):  # e.g. ZeroGPU's "ZeroGPU worker error: GPU task aborted"
            return f"{self.error.title}: {self.error.message}"
        return one_line(self.error)


class GpuTask:
    """The model work of one request as it crosses into the GPU function: plain data (settings,
    texts, the name of its model), which ZeroGPU pickles to its GPU worker. `run(lm, stop)` runs
    there, on the model the pool holds by that name (None when `model` is None): it yields
    plain-data progress items, each pickled back as it comes (nothing large on every item: a
    stream's state grows on the page's side), and checks `stop` (a `StopSignal`) between steps.
    `gpu`: what it will do, which sizes the GPU time it asks for. Subclasses are dataclasses with
    these two fields."""

    model: str | None
    gpu: GpuWork
    # A task whose engine runs may decode beside other requests' runs (the model's one decode loop):
    # such a task has a `shared` field, which the runner sets when its place in line shares.
    shares_decode: ClassVar[bool] = False

    def run(self, lm, stop: StopSignal) -> Iterator[Any]:
        raise NotImplementedError

    def split(self, fits: Callable[[GpuWork], bool]) -> list[GpuTask]:
        """The task as consecutive GPU calls, for a request longer than one call may ask for
        (ZeroGPU's cap): a task made of independent pieces (Recall's prompts) returns parts of its
        own class, in order, each one's work `fits` where a piece alone does; the rest run whole."""
        return [self]


@dataclass
class Ended:
    """The last item of every task: how it ended ("done", "stopped", or "failed" with its `error`
    and its traceback as text) and the seconds its work took inside the GPU function. An exception
    raised in ZeroGPU's worker reaches this process as its class name alone, so the GPU function
    sends how its work ended as an item instead."""

    kind: str
    error: BaseException | None = None
    trace: str = ""
    seconds: float = 0.0


class Work:
    """One request's model work and its look on the page. Subclasses set `label` and `task` (the
    model work: a `GpuTask`) and implement `progress` and `finish` (component updates, in the
    handler's thread). `signal` is the job's stop once it runs (a page handler may stop one row
    through it)."""

    label = "a model run"  # what people waiting behind it are told it is
    task: GpuTask
    calls: list[GpuTask] | None = None  # the GPU calls it runs as, in order (None: `task`, whole)
    signal: StopSignal | None = None
    need_mb: float | None = None  # the memory its runs hold (a task that shares the decode is admitted by it)

    def starting(self) -> dict:
        return {}

    def waiting(self, place: Place) -> dict:
        return {}

    def progress(self, items: list, elapsed: float) -> dict:
        return {}

    def finish(self, outcome: Outcome) -> dict:
        return {}


class TabWork(Work):
    """Work started from a tab with a run button, a Stop button and a status line: while it waits
    or runs, the run button is off and Stop is on; when it ends, the other way round."""

    def __init__(self, run_button, stop_button, status_line):
        self.run_button, self.stop_button, self.status_line = run_button, stop_button, status_line

    def busy(self) -> dict:
        return {self.run_button: gr.update(interactive=False), self.stop_button: gr.update(interactive=True)}

    def idle(self) -> dict:
        return {self.run_button: gr.update(interactive=True), self.stop_button: gr.update(interactive=False)}

    def say(self, text: str, kind: str = "info") -> dict:
        return {self.status_line: render.status_html(text, kind)}

    def starting(self) -> dict:
        return self.busy()

    def waiting(self, place: Place) -> dict:
        return self.busy() | self.say(waiting_text(place), "wait")

    def ended_early(self, outcome: Outcome, stopped: str, left: str = "Left the line; nothing ran.") -> dict:
        """The end of a job that has no result to show: why, in the status line."""
        return self.idle() | self.say(*ended_text(outcome, stopped, left))


def ended_text(outcome: Outcome, stopped: str, left: str = "Left the line; nothing ran.") -> tuple[str, str]:
    """(status text, kind) for a job that ended without a result to show: it left the line
    (`left`), was stopped (`stopped`) or failed (its error)."""
    text = {"left": left, "stopped": stopped}.get(outcome.kind, f"Failed: {outcome.message}")
    return text, "error" if outcome.kind == "failed" else "stopped"


def waiting_text(place: Place) -> str:
    """ "Waiting for the model: 2nd in line, behind a Sweep (running 1 min 20 s) and …"."""

    def ordinal(n: int) -> str:
        return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"

    def duration(s: float) -> str:
        return f"{s:.0f} s" if s < 60 else f"{int(s // 60)} min {int(s % 60)} s"

    running = "; ".join(f"{label} (running {duration(s)})" for label, s in place.running) or "nothing"
    ahead = (
        f", then {len(place.ahead)} waiting ahead of you ({', '.join(place.ahead[:3])}"
        f"{', …' if len(place.ahead) > 3 else ''})"
        if place.ahead
        else ""
    )
    return (
        f"Waiting for the model: {ordinal(place.position)} in line, behind {running}{ahead}. "
        "Compare and Deep Think runs share the model's decode while memory allows, other work runs "
        "alone; press Stop to leave the line."
    )


@dataclass(eq=False)
class PageJob:
    session: str
    tab: str
    stop: JobStop = field(default_factory=JobStop)
    last_pull: float = field(default_factory=time.monotonic)
    worker: threading.Thread | None = None
    abandoned: bool = False
    work: Any = None  # what it runs (a Work): a page handler may reach into it (stop one column)

    def pulled(self) -> None:
        self.last_pull = time.monotonic()


class Jobs:
    """This process's page jobs, by browser session and tab; a watchdog thread stops the jobs whose
    page went away."""

    def __init__(self, abandon_s: float = ABANDON_S):
        self.abandon_s = abandon_s
        self._jobs: list[PageJob] = []
        self._lock = threading.Lock()
        self._watchdog: threading.Thread | None = None

    def begin(self, session: str, tab: str) -> PageJob:
        job = PageJob(session, tab)
        with self._lock:
            self._jobs.append(job)
            if self._watchdog is None or not self._watchdog.is_alive():
                self._watchdog = threading.Thread(
                    target=self._watch, name="feedback-lens-watchdog", daemon=True
                )
                self._watchdog.start()
        return job

    def end(self, job: PageJob) -> None:
        with self._lock:
            if job in self._jobs:
                self._jobs.remove(job)

    def stop(self, session: str, tab: str | None = None) -> int:
        """Stop every job of this session (and tab): waiting ones leave the line, running ones end
        within a step. Returns how many were told."""
        with self._lock:
            jobs = [j for j in self._jobs if j.session == session and (tab is None or j.tab == tab)]
        for job in jobs:
            job.stop.set()
        return len(jobs)

    def stop_all(self, timeout: float = 30.0) -> None:
        """Stop every job and wait for their workers (server shutdown, test teardown)."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.stop.set()
        deadline = time.monotonic() + timeout
        for job in jobs:
            if job.worker is not None:
                job.worker.join(max(0.0, deadline - time.monotonic()))

    def works(self, session: str, tab: str) -> list:
        """The works this session's running (not stopping) jobs of `tab` run."""
        with self._lock:
            return [
                j.work for j in self._jobs if j.session == session and j.tab == tab and not j.stop.is_set()
            ]

    def active(self, session: str, tab: str | None = None) -> bool:
        with self._lock:
            return any(
                j.session == session and (tab is None or j.tab == tab) and not j.stop.is_set()
                for j in self._jobs
            )

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_EVERY_S)
            now = time.monotonic()
            with self._lock:
                jobs = list(self._jobs)
                if not jobs:
                    self._watchdog = None
                    return
            for job in jobs:
                if not job.stop.is_set() and now - job.last_pull > self.abandon_s:
                    log.info(
                        "stopping a %s job: its page took no update for %.0f s", job.tab, now - job.last_pull
                    )
                    job.abandoned = True
                    job.stop.set()
                # A job whose page is gone is never resumed, so its handler's cleanup never runs:
                # forget it here once its worker (if any) has finished.
                if job.abandoned and (job.worker is None or not job.worker.is_alive()):
                    self.end(job)


_END = object()


def keyword_signature(names: list[str]) -> inspect.Signature:
    """(request, *, name1, name2, ...): Gradio gives the request to the first parameter annotated
    `gr.Request` (it must be positional) and the `inputs_kwargs` values by name; API clients see
    the names as parameters."""
    request = inspect.Parameter(
        "request", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=gr.Request
    )
    return inspect.Signature(
        [request, *(inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names)]
    )


def by_name(fn: Callable[[dict], Any], names: list[str]) -> Callable:
    """A plain (not model) handler wired with `inputs_kwargs`: `fn(values)` gets the controls'
    values as one dict keyed by name."""

    def handler(request: gr.Request = None, **values):
        try:
            return fn(values)
        except FeedbackError as exc:
            raise notice.refusal(exc) from None

    handler.__signature__ = keyword_signature(names)
    handler.__name__, handler.__doc__ = fn.__name__, fn.__doc__
    handler.__annotations__ = {"request": gr.Request}
    return handler


class ModelRunner:
    """Wraps tab handlers: `wrap(tab, prepare)` returns the generator Gradio calls."""

    def __init__(self, pool: ModelPool, gpu=None, jobs: Jobs | None = None, budget: Budget | None = None):
        self.pool = pool
        self.budget = budget if budget is not None else Budget.from_env()  # per request, as the HTTP API's
        self.jobs = jobs or Jobs()
        decorate = gpu if gpu is not None else zero_gpu()
        # Decorated once: ZeroGPU expects its GPU functions to exist when the app starts. Each call
        # asks for the time its task's size needs (the duration callable gets the call's arguments).
        # what the GPU time asked for is scaled by: this machine's measured speed, learnt as requests end
        self.clock = GpuClock()
        self._on_gpu = decorate(self._gpu_function(), duration=lambda task, stop: self.gpu_seconds(task))
        # ZeroGPU's decorator marks what it wraps; elsewhere `spaces.GPU` returns the function as it is.
        self.zero_gpu = hasattr(self._on_gpu, "zerogpu")
        self.gpu_cap = gpu_duration_cap_setting()

    def _gpu_function(self) -> Callable:
        pool = self.pool

        def items(task: GpuTask, stop: StopSignal) -> Iterator[Any]:
            lm = pool.resident(task.model) if task.model is not None else None
            yield from task.run(lm, stop)

        def run_task(task: GpuTask, stop: StopSignal) -> Iterator[Any]:
            """The function inside `spaces.GPU`: on ZeroGPU it runs in the GPU worker, a process
            forked from this one, where the pool holds the models this process had loaded."""
            yield from _ended_as_item(items(task, stop))

        return run_task

    def gpu_seconds(self, task: GpuTask) -> int:
        """`spaces.GPU`'s duration for one call: what the task's size needs at this machine's speed
        (never over the cap: a call accepted before a slower request raised the scale still runs)."""
        return min(self.gpu_cap, task.gpu.seconds(self.clock.scale))

    def gpu_calls(self, task: GpuTask) -> list[GpuTask]:
        """The GPU calls `task` runs as: itself where it fits the cap (or no cap applies, off
        ZeroGPU), else its parts; a call that cannot fit is refused here, before the request waits
        (ZeroGPU would refuse it after: "illegal duration")."""
        if not self.zero_gpu:
            return [task]
        scale = self.clock.scale

        def fits(work: GpuWork) -> bool:
            return work.seconds(scale) <= self.gpu_cap

        calls = [task] if fits(task.gpu) else task.split(fits)
        for call in calls:
            call.gpu.check(self.gpu_cap, scale)
        return calls

    # ---- the wrapper ----
    def wrap(self, tab: str, prepare: Callable[[dict], Work], names: list[str], status=None) -> Callable:
        """A Gradio generator handler for an event wired with `inputs_kwargs={name: component}`:
        Gradio passes one keyword per control (`names`, also the API's parameter names) and
        `prepare(values)` gets them as one dict, validates and returns the `Work`. A refused
        request says why in the tab's `status` line too (a toast vanishes; the line stays)."""
        runner = self

        def handler(request: gr.Request = None, **values):
            session = getattr(request, "session_hash", None) or "local"
            try:
                work = prepare(values)
                work.calls = runner.gpu_calls(work.task)
            except FeedbackError as exc:
                if status is not None:
                    yield {status: render.status_html(f"Not started: {exc}", "error")}
                raise notice.refusal(exc) from None
            yield from runner.drive(session, tab, work)

        handler.__signature__ = keyword_signature(names)
        handler.__name__, handler.__doc__ = prepare.__name__, prepare.__doc__
        handler.__annotations__ = {
            "request": gr.Request
        }  # Gradio finds the request parameter by its type hint
        handler.model_handler = (
            True  # marks the handlers that go through here (tests check every model event)
        )
        return handler

    def stop(self, tab: str, request: gr.Request | None) -> str:
        session = getattr(request, "session_hash", None) or "local"
        return "Stopping…" if self.jobs.stop(session, tab) else "Nothing is running."

    def drive(self, session: str, tab: str, work: Work) -> Iterator[dict]:
        """Wait in line, run, stream; see the module docstring."""
        job = self.jobs.begin(session, tab)
        job.work = work
        outcome: list[Outcome] = []  # set once the job has ended one way or another
        try:
            # Yield at once: Gradio keeps (and closes on cancel) only a generator that has yielded,
            # so one cancelled before its first update would run on until the watchdog noticed.
            yield _updates(work.starting())
            ticket = yield from self._wait_in_line(job, work, outcome)
            if ticket is not None:
                yield from self._run(job, work, ticket, outcome)
        finally:
            if not outcome:  # cancelled or closed before the end: stop the worker, if any
                job.stop.set()
            self.jobs.end(job)

    def _wait_in_line(self, job: PageJob, work: Work, outcome: list) -> Iterator[dict]:
        """Join the line and wait, telling the page its place; returns the ticket once it holds a
        slot, or None when Stop made it leave. Closing the generator leaves the line."""
        gate = self.pool.gate
        shares = self._shares(work)
        for call in work.calls or [work.task]:
            if call.shares_decode:
                call.shared = shares
        try:
            ticket = gate.join("ui", work.label, work.need_mb, shares)
        except Busy as exc:
            outcome.append(Outcome("failed", exc))
            yield _updates(work.finish(outcome[0]))  # the page's buttons back as they were, then the message
            raise notice.refusal(exc) from None
        try:
            while not gate.wait(ticket, HEARTBEAT_S):
                if job.stop.is_set():
                    gate.leave(ticket)
                    outcome.append(Outcome("left"))
                    yield _updates(work.finish(outcome[0]))
                    return None
                yield _updates(work.waiting(gate.where(ticket)))
                job.pulled()
        except BaseException:
            gate.leave(ticket)
            raise
        return ticket

    def _shares(self, work: Work) -> bool:
        """Whether the work decodes beside other requests' runs: an engine task, off ZeroGPU (there
        each request is its own GPU call, in a process of its own), on a model whose runs share."""
        task = work.task
        if not task.shares_decode or self.zero_gpu or task.model is None:
            return False
        return self.pool.shares(self.pool.resident(task.model))

    def _run(self, job: PageJob, work: Work, ticket, outcome: list) -> Iterator[dict]:
        """Start the worker (which leaves the line when the work ends) and stream its progress."""
        items: queue.Queue = queue.Queue()
        work.signal = stop_signal.claim()  # what the work reads, in whichever process it runs
        job.stop.attach(work.signal)
        ctx = contextvars.copy_context()  # Gradio's request context, for spaces.GPU and gr.Warning
        job.worker = threading.Thread(
            target=ctx.run,
            args=(self._work, work, job, ticket, items),
            name=f"feedback-lens-{job.tab}",
            daemon=True,
        )
        job.worker.start()
        started = time.monotonic()
        last = started - UPDATE_EVERY_S  # the first update goes at once
        while True:
            # at most UPDATE_EVERY_S apart: what arrives meanwhile goes out in one update, so a fast
            # decode on a busy machine does not queue updates the page has no time to draw (it then
            # shows tokens seconds late, and a Stop keeps tokens it never showed)
            time.sleep(max(0.0, last + UPDATE_EVERY_S - time.monotonic()))
            batch, end = _drain(items, HEARTBEAT_S)
            if batch or end is None:
                yield _updates(work.progress(batch, time.monotonic() - started))
                job.pulled()
                last = time.monotonic()
            if end is not None:
                break
        end.seconds = time.monotonic() - started
        outcome.append(end)
        yield _updates(work.finish(end))
        if end.kind == "failed":
            if not isinstance(end.error, FeedbackError):
                if end.trace:
                    log.error("%s failed:\n%s", job.tab, end.trace.rstrip())
                else:
                    log.error("%s failed", job.tab, exc_info=end.error)
                raise notice.failure(f"{work.label[0].upper()}{work.label[1:]} failed: {end.message}")
            raise notice.refusal(end.error)

    def _work(self, work: Work, job: PageJob, ticket, items: queue.Queue) -> None:
        """On the worker thread: the work's task inside the GPU function; always leaves the line."""
        try:
            for call in work.calls or [work.task]:
                ended: Ended | None = None
                for item in self._on_gpu(call, work.signal):
                    if isinstance(item, Ended):
                        ended = item
                    else:
                        items.put(item)
                end = _outcome(ended, job.stop.is_set())
                if end.kind != "done":
                    break
                if ended is not None:  # a whole call: what its size took here
                    self.clock.observe(call.gpu, ended.seconds)
        except BaseException as exc:  # the GPU function itself failed (on ZeroGPU: its worker, a refusal)
            end = Outcome("stopped") if job.stop.is_set() else Outcome("failed", exc)
        finally:
            self.pool.gate.leave(ticket)
        items.put((_END, end))


def _outcome(ended: Ended | None, stopped: bool) -> Outcome:
    if ended is None or ended.kind == "done":
        return Outcome("stopped" if stopped else "done")
    if ended.kind == "stopped" or stopped:
        return Outcome("stopped")
    return Outcome("failed", ended.error, trace=ended.trace)


def _ended_as_item(items: Iterator[Any]) -> Iterator[Any]:
    """`items`, then how they ended (an `Ended`, with the seconds they took) instead of an exception."""
    started = time.perf_counter()
    try:
        yield from items
    except Stopped:
        yield Ended("stopped", seconds=time.perf_counter() - started)
    except Exception as exc:  # noqa: BLE001 (every failure is reported to the page)
        yield Ended("failed", _crossable(exc), traceback.format_exc(), time.perf_counter() - started)
    else:
        yield Ended("done", seconds=time.perf_counter() - started)


def _crossable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling (ZeroGPU sends it to this process), else a RuntimeError saying
    what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 (any way pickling fails)
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _updates(out: dict):
    """Gradio reads `{}` as one value, not as "no updates": send a skip instead."""
    return out if out else gr.skip()


@dataclass
class Finished:
    """The return value of a function run by `reporting`."""

    result: Any


class _Halt:
    """A stop signal that is on when the job's is, or when this helper was told to halt on its own
    (the job's own signal is left alone, so a failure is not mistaken for a Stop)."""

    def __init__(self, job_stop: threading.Event):
        self.job_stop, self.own = job_stop, threading.Event()

    def is_set(self) -> bool:
        return self.job_stop.is_set() or self.own.is_set()

    def set(self) -> None:
        self.own.set()


def reporting(work: Callable[[Callable[[Any], None], Any], Any], stop: threading.Event) -> Iterator[Any]:
    """Turn `work(report, stop)` — a library call that reports progress through a callback and
    checks a stop signal — into a generator of its reports and then `Finished(result)`. The call
    runs on a helper thread; its errors are raised here. However the generator ends (done, error,
    closed), the call has ended before it returns: closing it halts the call and waits for it, so
    no model work outlives the job that holds the model line."""
    items: queue.Queue = queue.Queue()
    outcome: list = []
    halt = _Halt(stop)

    def target() -> None:
        try:
            outcome.append(Finished(work(items.put, halt)))
        except BaseException as exc:  # re-raised below, in the generator's thread
            outcome.append(exc)
        finally:
            items.put(_END)

    helper = threading.Thread(target=contextvars.copy_context().run, args=(target,), daemon=True)
    helper.start()
    try:
        while (item := items.get()) is not _END:
            yield item
    finally:
        if helper.is_alive():
            halt.set()
            helper.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    yield outcome[0]


def _drain(items: queue.Queue, timeout: float) -> tuple[list, Outcome | None]:
    """Everything queued now (waiting up to `timeout` for the first item), and the end if it came."""
    batch: list = []
    try:
        item = items.get(timeout=timeout)
        while True:
            if isinstance(item, tuple) and len(item) == 2 and item[0] is _END:
                return batch, item[1]
            batch.append(item)
            item = items.get_nowait()
    except queue.Empty:
        return batch, None


def cancellable_by_clients(trigger: gr.Button, *events) -> None:
    """Give program clients a way to cancel these events: gradio_client's `Job.cancel()` looks for
    an event that cancels the one it runs and triggers it, which closes the handler's generator, so
    its job stops (its worker within a step). `trigger` is a hidden button of the tab; the page's
    own Stop buttons stop jobs gracefully instead, so that the final update (partial results,
    "stopped") still arrives."""
    trigger.click(None, None, None, cancels=list(events))
