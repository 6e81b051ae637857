"""POST /continue and /branch: the next turn of an earlier run, or the run replayed and forced to
another token at one step. The earlier run comes back in the request, or by its run_id."""

from __future__ import annotations

from typing import Literal

import anyio
from fastapi import APIRouter, Depends, Query, Request

from feedback.core.engine import Run, start_run
from feedback.core.records import RunResult
from feedback.core.session import RecentRuns, branch, continue_run
from feedback.errors import FeedbackError
from feedback.serve.api.deps import ApiSettings, Pool, Recent, Settings, require_key
from feedback.serve.api.errors import ApiError
from feedback.serve.api.schemas import (
    ERRORS,
    NOT_FOUND,
    STREAMED,
    BranchIn,
    ContinueIn,
    FollowUpIn,
    saved_result,
)
from feedback.serve.api.streaming import answer, stream_format
from feedback.serve.limits import check_run, check_saved_run
from feedback.serve.pool import ModelPool

router = APIRouter(dependencies=[Depends(require_key)], responses=ERRORS | NOT_FOUND | STREAMED)


def earlier(req: FollowUpIn, recent: RecentRuns) -> RunResult:
    """The run a follow-up follows: sent back whole, or one of this server's recent runs."""
    if (req.run is None) == (req.run_id is None):
        raise FeedbackError("give either run (an earlier RunResult) or run_id (a recent run of this server)")
    if req.run is not None:
        return saved_result(req.run)
    try:
        return recent.get(req.run_id)
    except FeedbackError as exc:  # an id of the form this server gives, of a run it does not hold (any more)
        raise ApiError(404, str(exc)) from None


def forced_tokens(req: BranchIn, lm) -> list[int]:
    """The token ids a branch forces at its step: `token_id`, or `token_text`'s tokens."""
    if (req.token_id is None) == (req.token_text is None):
        raise FeedbackError("give either token_id or token_text")
    if req.token_id is not None:
        return [req.token_id]
    return list(lm.tokenizer(req.token_text, add_special_tokens=False)["input_ids"])


def start(req: ContinueIn | BranchIn, pool: ModelPool, settings: ApiSettings, recent: RecentRuns) -> Run:
    """The follow-up's run on the model the earlier run used, validated like a new request and
    within budget before it queues (a worker thread runs this)."""
    past = earlier(req, recent)
    lm = pool.get(past.config.get("model"))
    # a saved run is the client's word, not this server's: checked as a new request is, answers too
    check_saved_run(past, lm.vocab_size, lm.num_layers)
    if isinstance(req, ContinueIn):
        config = continue_run(past, req.message)
    else:
        config = branch(past, req.row, req.step, forced_tokens(req, lm), req.all_rows, req.matching_only)
    # the follow-up itself is a new request, held to the same caps
    return start_run(lm, check_run(config, lm.num_layers), budget=settings.budget)


async def follow_up(
    req: ContinueIn | BranchIn,
    request: Request,
    format: str | None,
    pool: ModelPool,
    settings: ApiSettings,
    recent: RecentRuns,
):
    """Continue and branch alike: the run built from the earlier one, whole unless asked to stream."""
    run = await anyio.to_thread.run_sync(start, req, pool, settings, recent)
    return await answer(run, request, req.steps, stream_format(request, format, None), pool, settings, recent)


@router.post(
    "/continue",
    summary="the next turn of an earlier run: each row answers `message` after its own conversation",
    description="Give the earlier RunResult (`run`, best sent with `steps: false`) or its `run_id`. "
    "Each row's history is its own prompt and answer, so the rows' conversations diverge "
    "as their answers did. Settings carry over. `format=ndjson|sse` streams it as "
    "/generate/stream does.",
)
async def continue_(
    req: ContinueIn,
    request: Request,
    pool: Pool,
    settings: Settings,
    recent: Recent,
    format: Literal["ndjson", "sse"] | None = Query(None),
):
    return await follow_up(req, request, format, pool, settings, recent)


@router.post(
    "/branch",
    summary="an earlier run again, replayed up to `step` and forced to another token there",
    description="`row` is replayed token for token up to `step`, then forced `token_id` (or "
    "`token_text`'s tokens), then decodes on; with `all_rows` (default) every row goes on "
    "from that same text and token, so the rows compare what each does from one point "
    "(`matching_only`: only rows whose answer matched up to `step`; the others are "
    "replayed as they were). Forced steps are marked `forced`, the token chosen here "
    "also `chosen`. `format=ndjson|sse` streams it.",
)
async def branch_(
    req: BranchIn,
    request: Request,
    pool: Pool,
    settings: Settings,
    recent: Recent,
    format: Literal["ndjson", "sse"] | None = Query(None),
):
    return await follow_up(req, request, format, pool, settings, recent)
