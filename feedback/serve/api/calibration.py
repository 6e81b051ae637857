"""POST /calibrate: is the model's confidence worth trusting? Per row (baseline and a strategy), on a
question set with gold answers: reliability bins, ECE, adaptive ECE, Brier score and AUROC of each
DeepConf measure, and what the early-stop threshold keeps (`feedback.eval.calibration`)."""

from __future__ import annotations

import threading

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from feedback.core.model import LoadedModel
from feedback.core.strict_json import json_safe
from feedback.eval.calibration import (
    CalibrationConfig,
    calibrate,
    check_budget,
    check_questions,
    read_questions,
)
from feedback.serve.api.deps import ApiSettings, Pool, Settings, require_key
from feedback.serve.api.schemas import ERRORS, CalibrateIn
from feedback.serve.api.streaming import turn, until_gone
from feedback.serve.limits import SERVED_CALIBRATION_MAX_NEW_TOKENS, SERVED_CALIBRATION_SAMPLES
from feedback.serve.pool import ModelPool

router = APIRouter(dependencies=[Depends(require_key)], responses=ERRORS)


def config(req: CalibrateIn) -> CalibrationConfig:
    """The request as the library's config (not yet validated against a model)."""
    return CalibrationConfig(
        strategy=req.strategy,
        params=dict(req.params),
        samples=req.samples,
        max_new_tokens=req.max_new_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        window=req.window,
        k=req.k,
        etas=list(req.etas),
        bins=req.bins,
        answer_regex=req.answer_regex,
        chat_template=req.chat_template,
    )


def questions_of(req: CalibrateIn) -> list[dict]:
    """The request's questions, or the built-in set when it gives none."""
    return (
        check_questions([q.model_dump() for q in req.questions])
        if req.questions is not None
        else read_questions("builtin")
    )


def prepare(
    req: CalibrateIn, pool: ModelPool, settings: ApiSettings
) -> tuple[LoadedModel, list[dict], CalibrationConfig]:
    """The model, the questions and the validated config, the work costed against the budget
    (`check_budget`: `decoded_tokens` of them): all before the request queues (a worker thread runs this)."""
    lm = pool.get(req.model)
    cfg = config(req)
    cfg.validate(lm.num_layers)
    questions = questions_of(req)
    check_budget(lm, questions, cfg, settings.budget)
    return lm, questions, cfg


@router.post(
    "/calibrate",
    summary="is the confidence worth trusting? reliability bins, ECE, adaptive ECE, Brier and AUROC of "
    "each DeepConf measure per row, on sampled traces of questions with gold answers",
    description="Every question is sampled `samples` times per row (baseline and `strategy`), run to its "
    "end; Platt scaling is fitted on the dev questions (even positions) and scored on the test "
    "ones (odd). A request that names no size (`{}`) is small: the built-in questions, "
    f"{SERVED_CALIBRATION_SAMPLES} samples each of at most {SERVED_CALIBRATION_MAX_NEW_TOKENS} "
    "new tokens (about half a minute for the embedded model on 2 CPU cores). Refused (422) "
    "when its traces would decode more than the server's budget, costed as questions x 2 rows "
    "x samples x max_new_tokens; a client that hangs up stops it within a decode step.",
)
async def calibration(req: CalibrateIn, request: Request, pool: Pool, settings: Settings) -> JSONResponse:
    lm, questions, cfg = await anyio.to_thread.run_sync(prepare, req, pool, settings)
    async with turn(pool, settings, "an API calibration request", request):
        stop = threading.Event()
        res = await until_gone(request, stop, lambda: calibrate(lm, questions, cfg, stop=stop))
    if not req.traces:
        res.pop("traces")
    return JSONResponse(json_safe(res))
