"""POST /generate and /generate/stream: baseline and feedback rows of one run."""

from __future__ import annotations

from typing import Literal

import anyio
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from feedback.core.engine import Run, start_run
from feedback.serve.api.deps import ApiSettings, Pool, Recent, Settings, require_key
from feedback.serve.api.schemas import ERRORS, GenerateIn, to_config
from feedback.serve.api.streaming import answer, stream_format
from feedback.serve.limits import check_run
from feedback.serve.pool import ModelPool

router = APIRouter(dependencies=[Depends(require_key)], responses=ERRORS)


def start(req: GenerateIn, pool: ModelPool, settings: ApiSettings) -> Run:
    """The request's run, validated, tokenised, within budget and with its strategies built: all
    before it queues for the model (a worker thread runs this)."""
    lm = pool.get(req.model)
    return start_run(lm, check_run(to_config(req, lm.name), lm.num_layers), budget=settings.budget)


@router.post(
    "/generate",
    summary="baseline and feedback rows (each may have its own prompt or conversation); the whole "
    "RunResult when done",
    description="A client that hangs up before the answer stops the run within a step. The result's "
    "`run_id` names it for /continue and /branch.",
)
async def generate(
    req: GenerateIn, request: Request, pool: Pool, settings: Settings, recent: Recent
) -> JSONResponse:
    run = await anyio.to_thread.run_sync(start, req, pool, settings)
    return await answer(run, request, req.steps, None, pool, settings, recent)


@router.post(
    "/generate/stream",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "the run's events",
            "content": {"application/x-ndjson": {}, "text/event-stream": {}},
        }
    },
    summary="the same run, streamed: NDJSON lines (default) or Server-Sent Events",
    description="Events: `start` (rows, prompt tokens), one `step` per decode step with each live "
    "row's record, `done` with the RunResult, or `error`. Closing the connection stops "
    "the run within one step. `format=sse` or `Accept: text/event-stream` selects SSE.",
)
async def generate_stream(
    req: GenerateIn,
    request: Request,
    pool: Pool,
    settings: Settings,
    recent: Recent,
    format: Literal["ndjson", "sse"] | None = Query(None),
) -> StreamingResponse:
    run = await anyio.to_thread.run_sync(start, req, pool, settings)
    return await answer(
        run, request, req.steps, stream_format(request, format, "ndjson"), pool, settings, recent
    )
