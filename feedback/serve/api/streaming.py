"""How the API answers with model work: a place in the shared model line, decoding in a worker
thread, the answer whole or as NDJSON / Server-Sent Events, and a client that hangs up stopping it.

The page and the API share one first-come line to the model (`ModelPool.gate`), with one cap on
how many requests may wait in it; an API request waits at most `ApiSettings.wait_s`. A generation
request's run decodes beside the other requests' runs in the model's one decode loop
(`feedback.core.sharing`) while their memory fits; other work holds the model alone. Work runs in
worker threads so the event loop keeps watching the connection: a client that goes away while it
waits leaves the line at once, and one that goes away while its run decodes (or its text is scored)
stops it within a step, a prefill chunk or a scoring window.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import asdict
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from feedback.core.engine import PrefillEvent, Run, StepEvent
from feedback.core.session import RecentRuns
from feedback.core.sharing import run_events
from feedback.core.strict_json import json_safe
from feedback.errors import FeedbackError, Stopped, one_line
from feedback.serve.api.deps import ApiSettings
from feedback.serve.api.errors import ApiError
from feedback.serve.gate import Ticket
from feedback.serve.pool import ModelPool

DISCONNECT_POLL_S = 0.25  # how often a waiting or running request looks for its client


class ClientGone(HTTPException):
    """The client went away; nobody reads this answer (499 in nginx's usage)."""

    def __init__(self):
        super().__init__(499, "the client closed the request")


async def _watch_disconnect(request: Request, gone: threading.Event) -> None:
    while not gone.is_set():
        if await request.is_disconnected():
            gone.set()
            return
        await anyio.sleep(DISCONNECT_POLL_S)


@asynccontextmanager
async def watching(request: Request | None, gone: threading.Event) -> AsyncIterator[None]:
    """While the body runs, a background task sets `gone` when the client disconnects."""
    watcher = asyncio.create_task(_watch_disconnect(request, gone)) if request is not None else None
    try:
        yield
    finally:
        if watcher is not None:
            watcher.cancel()


async def take_place(
    pool: ModelPool,
    settings: ApiSettings,
    label: str,
    request: Request | None = None,
    run: Run | None = None,
) -> tuple[Ticket, float]:
    """A slot of the shared model line, and the seconds waited for it (for `run`, an engine run: a
    place beside the other runs decoding, admitted by its memory need). The wait happens in a
    worker thread; a caller that goes away while waiting (its request cancelled, or — with
    `request` — its client disconnected) leaves the line at once instead of holding its place.
    Raises `Busy` (503 with Retry-After) when the line is full or the wait runs out: the holder
    of the returned ticket must leave the line on every path."""
    gone, lock, held = threading.Event(), threading.Lock(), []
    shares = run is not None and pool.shares(run.lm)
    need = run.memory_mb if run is not None else None

    def take() -> None:
        ticket = pool.gate.acquire(
            "api", settings.wait_s, label=label, cancelled=gone.is_set, need_mb=need, shares=shares
        )
        with lock:  # the caller may have left between the slot and this line
            if gone.is_set():
                pool.gate.leave(ticket)
            else:
                held.append(ticket)

    t0 = time.perf_counter()
    try:
        async with watching(request, gone):
            await anyio.to_thread.run_sync(take, abandon_on_cancel=True)
        if gone.is_set():
            raise ClientGone()
        with lock:
            gone.set()
            return held.pop(), time.perf_counter() - t0
    except BaseException:
        with lock:
            gone.set()  # a waiter thread left behind by a cancelled request gives up its place
            if held:  # the slot came, but the caller had gone
                pool.gate.leave(held.pop())
        raise


@asynccontextmanager
async def turn(
    pool: ModelPool, settings: ApiSettings, label: str, request: Request | None = None, run: Run | None = None
) -> AsyncIterator[tuple[float, bool]]:
    """Hold one slot of the shared model line for the body; yields (seconds queued, whether `run`
    decodes beside others)."""
    ticket, queued = await take_place(pool, settings, label, request, run)
    try:
        yield queued, ticket.shares
    finally:
        pool.gate.leave(ticket)


class HeldStream(StreamingResponse):
    """A streamed answer that holds a slot of the model line, taken before the response started:
    the slot is given back when the response ends however it ends, also when the client left
    before the body was ever read (then the body's generator never runs its own `finally`)."""

    def __init__(self, content, release: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


class _Steps:
    """A run's event generator, stepped in worker threads one step at a time. `close` waits for the
    step in flight (a stopped run ends it within a step) instead of closing the generator while
    another thread runs it: CPython does not make that safe, and a test worker segfaulted inside
    such a `close()` while the decode thread ran the run's step."""

    def __init__(self, events: Iterator[StepEvent]):
        self.events = events
        self.lock = threading.Lock()

    def next(self) -> StepEvent | None:
        with self.lock:
            return next(self.events, None)

    def close(self) -> None:
        with self.lock:
            self.events.close()


async def decode(run: Run, shared: bool = False) -> AsyncIterator[StepEvent]:
    """The run's steps, each computed in a worker thread (`shared`: in the model's decode loop,
    beside other runs); however it ends (done, error, or the caller cancelled because the client
    went away) the run is stopped and its generator closed. A cancelled caller does not wait for
    the step in flight (a long prompt's prefill can take a while): the run is told to stop first,
    and its generator is closed once that step ends."""
    steps = _Steps(run_events(run, shared))
    try:
        while (event := await anyio.to_thread.run_sync(steps.next, abandon_on_cancel=True)) is not None:
            yield event
    finally:
        run.stop()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(steps.close)


async def until_gone(request: Request, stop: threading.Event, work: Callable[[], Any]) -> Any:
    """`work()` in a worker thread, its `stop` set as soon as the client disconnects (the work then
    ends within a forward pass or step, raising `Stopped`, and the request ends as `ClientGone`)."""
    try:
        async with watching(request, stop):
            return await anyio.to_thread.run_sync(work)
    except Stopped:
        raise ClientGone() from None
    finally:
        stop.set()


def result_json(run: Run, steps: bool) -> dict:
    """The run's RunResult as JSON data, without its per-token steps unless `steps`."""
    data = run.result.to_dict()
    if not steps:
        for row in data["rows"]:
            row.pop("steps")
    return data


def event(kind: str, payload: dict, sse: bool) -> str:
    """One streamed event: an SSE block, or one NDJSON line."""
    if sse:
        return f"event: {kind}\ndata: {json.dumps(json_safe(payload))}\n\n"
    return json.dumps(json_safe({"event": kind, **payload})) + "\n"


def stream_format(request: Request, format: str | None, default: str | None) -> str | None:
    """ndjson, sse or None (not streamed): `format` if given, else SSE when the client accepts it."""
    if format is not None:
        return format
    return "sse" if "text/event-stream" in request.headers.get("accept", "") else default


async def _events(
    run: Run, steps: bool, sse: bool, recent: RecentRuns, shared: bool = False
) -> AsyncIterator[str]:
    """A streamed run, which already holds its slot of the model line: `start`, a `prefill` per
    chunk of a prompt longer than one chunk (chunk, chunks, tokens, total), one `step` per decode
    step, then `done` or `error` (in-band: the response has started, so its status can no longer
    say it; every refusal, a full line included, came before it as an HTTP status)."""
    names = [r.name for r in run.config.rows]
    try:
        yield event(
            "start",
            {
                "rows": [
                    {"name": r.name, "strategy": r.strategy, "params": r.params} for r in run.result.rows
                ],
                "prompt_tokens": run.result.prompt_tokens,
                "config": run.result.config,
            },
            sse,
        )
        run.prefill_events = True  # a long prompt's reading is reported as it goes
        async with aclosing(decode(run, shared)) as steps_seen:
            async for step in steps_seen:
                if isinstance(step, PrefillEvent):
                    yield event("prefill", asdict(step), sse)
                    continue
                yield event(
                    "step",
                    {
                        "step": step.step,
                        "rows": {names[i]: asdict(rec) for i, rec in step.records.items()},
                        "finished": {names[i]: why for i, why in step.finished.items()},
                        "memory": step.memory.to_dict() if step.memory is not None else None,
                    },
                    sse,
                )
        recent.put(run.result)
        yield event("done", {"result": result_json(run, steps)}, sse)
    except FeedbackError as exc:  # refused once it ran (a request is sized before it waits, so rarely)
        yield event("error", {"error": str(exc), "status": 422}, sse)
    except Exception as exc:  # the stream has started: report in-band, keep serving
        yield event("error", {"error": f"generation failed: {one_line(exc)}", "status": 500}, sse)


async def answer(
    run: Run,
    request: Request,
    steps: bool,
    stream_as: str | None,
    pool: ModelPool,
    settings: ApiSettings,
    recent: RecentRuns,
):
    """A started run's answer: the whole RunResult once it is done, or streamed (`stream_as`
    ndjson or sse). Either way the run first waits for its slot of the model line, before any
    byte of the answer is sent, so a refusal (a full line, a wait that ran out) is an HTTP 503
    with Retry-After for a stream too. The result is kept in `recent` for follow-ups by its run_id."""
    if stream_as is not None:
        ticket, _ = await take_place(pool, settings, "an API stream request", request, run)
        sse = stream_as == "sse"
        return HeldStream(
            _events(run, steps, sse, recent, ticket.shares),
            release=lambda: pool.gate.leave(ticket),
            media_type="text/event-stream" if sse else "application/x-ndjson",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    async with turn(pool, settings, "an API generate request", request, run) as (queued, shared):
        try:
            # a hang-up stops the run between prefill chunks or decode steps: nobody waits for the answer
            async with watching(request, run.stop_event), aclosing(decode(run, shared)) as steps_seen:
                async for _ in steps_seen:
                    pass
        except FeedbackError:
            raise  # a refusal: 422 naming the field
        except (
            Exception
        ) as exc:  # out-of-memory, tokenizer or model errors: this request fails, the server stays
            raise ApiError(500, f"generation failed: {one_line(exc)}") from None
    recent.put(run.result)
    return JSONResponse(json_safe(result_json(run, steps) | {"queued_seconds": round(queued, 4)}))
