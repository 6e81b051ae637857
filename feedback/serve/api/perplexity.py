"""POST /ppl: teacher-forced perplexity of a text, baseline vs a strategy."""

from __future__ import annotations

import threading

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from feedback.core.model import LoadedModel
from feedback.core.strict_json import json_safe
from feedback.eval import corpus
from feedback.eval.perplexity import PPLConfig, document_ids, evaluate, scoring_work, surprise_diff
from feedback.serve.api.deps import ApiSettings, Pool, Settings, require_key
from feedback.serve.api.schemas import ERRORS, PPLIn
from feedback.serve.api.streaming import turn, until_gone
from feedback.serve.pool import ModelPool

router = APIRouter(dependencies=[Depends(require_key)], responses=ERRORS)


def prepare(
    req: PPLIn, pool: ModelPool, settings: ApiSettings
) -> tuple[LoadedModel, PPLConfig, list[corpus.Document]]:
    """The model, the validated config and the text, the scoring costed against the budget: all
    before the request queues (a worker thread runs this)."""
    lm = pool.get(req.model)
    cfg = PPLConfig(
        req.strategy,
        dict(req.params),
        req.mode,
        passes=req.passes,
        window=req.window,
        chunk=req.chunk,
        stride=req.stride,
        bootstrap=req.bootstrap,
        seed=req.seed,
    ).validate(lm.context_length, lm.num_layers)
    docs = [corpus.Document("text", req.text)]
    settings.budget.check_scoring(*scoring_work([len(ids) for ids in document_ids(lm, docs, cfg)], cfg))
    return lm, cfg, docs


@router.post(
    "/ppl",
    summary="teacher-forced perplexity of a text, baseline vs a strategy, with a paired bootstrap CI",
    description="Refused (422) when it would score more than the server's budget; a client that hangs "
    "up stops the scoring within one forward pass.",
)
async def ppl(req: PPLIn, request: Request, pool: Pool, settings: Settings) -> JSONResponse:
    lm, cfg, docs = await anyio.to_thread.run_sync(prepare, req, pool, settings)
    async with turn(pool, settings, "an API perplexity request", request):
        stop = threading.Event()
        res = await until_gone(
            request, stop, lambda: evaluate(lm, docs, cfg, token_detail=req.token_detail, stop=stop)
        )
    if req.token_detail:
        res["token_detail"] = surprise_diff(res)
    return JSONResponse(json_safe(res))
