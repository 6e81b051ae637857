"""HTTP API beside the UI: compare (whole or streamed), follow-ups (next turn, branch), perplexity, health, models, strategies.

Mounted at /api in the Gradio server (`app.py`). It uses the same engine, validation and model pool
as the page, and the same first-come line to the model (`ModelPool.gate`), with a cap on how many
API requests may wait, so API traffic cannot starve the page. OpenAPI: /api/openapi.json, docs: /api/docs.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
import os
import threading
import time
from contextlib import aclosing, asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, AsyncIterator, Iterator, Literal

import anyio
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.routing import Mount

from feedback.core.budget import Budget
from feedback.core.confidence import DEFAULT_K, DEFAULT_WINDOW
from feedback.core.engine import Engine, Run, StepEvent
from feedback.core.records import (MAX_KEY_FACTS, MAX_PROMPT_CHARS, DeepConfConfig, RowResult, RowSpec, RunConfig,
                                   RunResult, default_rows)
from feedback.core.sampling import SamplingConfig
from feedback.core.session import RecentRuns, branch, continue_run
from feedback.errors import FeedbackError, Stopped
from feedback.eval import corpus
from feedback.eval.perplexity import PPLConfig, document_ids, evaluate, scoring_work, surprise_diff
from feedback.serve.gate import Busy
from feedback.serve.limits import MAX_BODY_BYTES, MAX_MESSAGES, SERVED_MAX_NEW_TOKENS, SERVED_TEXT_MAX_CHARS
from feedback.serve.pool import ModelPool
from feedback.strategies import REGISTRY

API_ROWS_CAP = 8
RECENT_RUNS = 64  # results kept for /continue and /branch by run_id
ParamValue = bool | int | float | str


@dataclass(frozen=True)
class ApiSettings:
    """Limits and keys; `from_env` reads the FEEDBACK_API_* variables."""

    keys: tuple[str, ...] = ()
    max_body_bytes: int = MAX_BODY_BYTES
    max_waiting: int = 8  # API requests allowed to wait for the model at once; more get 503
    wait_s: float = 300.0  # longest wait for the model before a 503
    budget: Budget = field(default_factory=Budget)  # the same per-request budgets as the page
    gradio_keys: bool = False  # FEEDBACK_GRADIO_API=keys: the Gradio API's clients need a key too

    @classmethod
    def from_env(cls) -> "ApiSettings":
        env = os.environ.get
        keys = tuple(k.strip() for k in env("FEEDBACK_API_KEYS", "").split(",") if k.strip())
        gradio = env("FEEDBACK_GRADIO_API", "open").strip().lower()
        if gradio not in ("open", "keys"):
            raise FeedbackError(f"FEEDBACK_GRADIO_API must be open or keys, got {gradio!r}")
        if gradio == "keys" and not keys:
            raise FeedbackError("FEEDBACK_GRADIO_API=keys needs FEEDBACK_API_KEYS")
        try:
            return cls(keys, int(env("FEEDBACK_API_MAX_BODY", cls.max_body_bytes)),
                       int(env("FEEDBACK_API_QUEUE", cls.max_waiting)), float(env("FEEDBACK_API_WAIT_S", cls.wait_s)),
                       Budget.from_env(), gradio == "keys")
        except ValueError as exc:
            raise FeedbackError(f"bad FEEDBACK_API_* setting: {exc}") from None


# ---- request bodies (their constraints are the OpenAPI schema; the engine re-validates) ----
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class SamplingIn(_Body):
    temperature: float = Field(0.0, ge=0, le=10, description="0 = greedy; otherwise at least 0.01")
    top_k: int = Field(0, ge=0, le=1_000_000, description="0 = off")
    top_p: float = Field(1.0, gt=0, le=1, description="1 = off")
    min_p: float = Field(0.0, ge=0, le=1, description="0 = off")
    repetition_penalty: float = Field(1.0, ge=0.01, le=10, description="1 = off")


class DeepConfIn(_Body):
    k: int = Field(DEFAULT_K, ge=1, le=1000, description="top-k for token confidence")
    window: int = Field(DEFAULT_WINDOW, ge=1, le=100_000, description="group confidence window (tokens)")
    threshold: float | None = Field(None, description="early stop when group confidence falls below; null = off")


class MessageIn(_Body):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_PROMPT_CHARS)


class RowIn(_Body):
    name: str = Field(min_length=1, max_length=64)
    strategy: str | None = Field(None, description="null for a plain baseline row")
    params: dict[str, ParamValue] = Field(default_factory=dict, max_length=32)
    seed_offset: int = Field(0, ge=0, le=2**31, description="rows with equal offsets share random draws")
    threshold: float | None = Field(None, description="this row's early-stop threshold; null: the run's")
    prompt: str | None = Field(None, min_length=1, max_length=MAX_PROMPT_CHARS,
                               description="this row's own prompt (a prompt variant; its newest user turn); "
                                           "null: the run's")
    system_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description="null: the run's")
    messages: list[MessageIn] | None = Field(None, max_length=MAX_MESSAGES,
                                             description="this row's earlier conversation turns, before its prompt "
                                                         "(chat template only)")
    prefix: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, max_length=SERVED_MAX_NEW_TOKENS,
        description="token ids the reply is forced to start with (a branch's replay); marked `forced` in the steps")


class _RunFields(_Body):
    """What a run is, shared by new requests and the saved runs that follow-ups send back."""

    prompt: str = Field("", max_length=MAX_PROMPT_CHARS,
                        description="every row's prompt, unless a row has its own (may be empty only then)")
    model: str | None = Field(None, description="a name from GET /api/models; null: the default")
    chat_template: bool = True
    system_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    max_new_tokens: int = Field(128, ge=1, le=SERVED_MAX_NEW_TOKENS)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    sampling: SamplingIn = Field(default_factory=SamplingIn)
    deepconf: DeepConfIn = Field(default_factory=DeepConfIn)
    reference: str | None = Field(None, min_length=1, max_length=MAX_PROMPT_CHARS,
                                  description="a reference answer: its perplexity after each row's prompt")
    key_facts: list[Annotated[str, Field(min_length=1, max_length=1000)]] = Field(
        default_factory=list, max_length=MAX_KEY_FACTS,
        description="texts (or /regular expressions/) each answer should contain: recall per row")
    quality: bool = Field(False, description="also self-perplexity and prompt perplexity per row (forward passes)")


class GenerateIn(_RunFields):
    strategy: str = Field("residual", description="the feedback row's strategy (GET /api/strategies)")
    params: dict[str, ParamValue] = Field(default_factory=dict, max_length=32)
    rows: list[RowIn] | None = Field(None, min_length=1, max_length=API_ROWS_CAP,
                                     description="explicit rows; overrides strategy/params (default: "
                                                 "baseline + one feedback row)")
    steps: bool = Field(True, description="include per-token step records in the result")


class SavedConfigIn(_RunFields):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    dtype: str = "auto"
    rows: list[RowIn] = Field(min_length=1, max_length=API_ROWS_CAP)


class SavedRowIn(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    name: str = Field(min_length=1, max_length=64)
    strategy: str | None = None
    params: dict[str, ParamValue] = Field(default_factory=dict, max_length=32)
    token_ids: list[Annotated[int, Field(ge=0)]] = Field(max_length=SERVED_MAX_NEW_TOKENS)
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class SavedRunIn(BaseModel):
    """A RunResult as /generate returned it (its steps, metrics and memory are ignored: send it with
    `steps: false`, or its `run_id`, to stay well under the body limit)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    run_id: str | None = Field(None, max_length=64)
    config: SavedConfigIn
    rows: list[SavedRowIn] = Field(min_length=1, max_length=API_ROWS_CAP)


class _FollowUp(_Body):
    run: SavedRunIn | None = Field(None, description="the earlier RunResult (or give run_id)")
    run_id: str | None = Field(None, min_length=1, max_length=64,
                               description="the run_id of a run this server produced recently")
    steps: bool = Field(True, description="include per-token step records in the result")


class ContinueIn(_FollowUp):
    message: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS, description="the next user message")


class BranchIn(_FollowUp):
    row: str = Field(min_length=1, max_length=64, description="the row whose token is replaced")
    step: int = Field(ge=0, le=SERVED_MAX_NEW_TOKENS, description="the step at which the token is forced")
    token_id: int | None = Field(None, ge=0, description="the token forced at `step` (or give token_text)")
    token_text: str | None = Field(None, min_length=1, max_length=1000,
                                   description="text forced at `step`, as its tokens (or give token_id)")
    all_rows: bool = Field(True, description="force every row the same way after its own tokens (paired); "
                                             "false: only `row`, the others decode afresh")


class PPLIn(_Body):
    text: str = Field(min_length=1, max_length=SERVED_TEXT_MAX_CHARS)
    model: str | None = None
    strategy: str | None = Field(None, description="null: baseline perplexity only")
    params: dict[str, ParamValue] = Field(default_factory=dict, max_length=32)
    mode: Literal["exact", "parallel", "jacobi"] | None = Field(
        None, description="null: parallel for non-recurrent strategies, jacobi for recurrent ones")
    passes: int = Field(3, ge=2, le=32, description="jacobi passes")
    window: int = Field(1024, ge=2, le=1_000_000, description="tokens per scoring window (capped by the context)")
    stride: int = Field(512, ge=1, le=1_000_000)
    chunk: int = Field(512, ge=1, le=1_000_000)
    bootstrap: int = Field(1000, ge=0, le=10_000, description="bootstrap resamples for the 95% CI")
    seed: int = Field(0, ge=0, le=2**31)
    token_detail: bool = Field(False, description="also return per-token NLLs of both sides")


class ErrorOut(BaseModel):
    error: str
    details: list[dict[str, Any]] | None = None


ERRORS = {code: {"model": ErrorOut, "description": text} for code, text in [
    (400, "malformed JSON"), (401, "missing or wrong API key"), (413, "request body too large"),
    (422, "invalid values"), (503, "the model is busy; see Retry-After")]}


class ApiError(HTTPException):
    pass


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than {limit} bytes")


class BodyLimit:
    """ASGI middleware: refuse bodies over `limit` bytes, declared or streamed (chunked)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            response = JSONResponse({"error": f"request body is larger than {self.limit} bytes"}, 413)
            return await response(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise BodyTooLarge(self.limit)  # FastAPI passes HTTPExceptions from body reading through
            return message

        await self.app(scope, limited, send)


def key_ok(headers: dict, keys: tuple[str, ...]) -> bool:
    """Whether ASGI `headers` carry `Authorization: Bearer <one of keys>` (constant-time compare)."""
    auth = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, given = auth.partition(" ")
    return scheme.lower() == "bearer" and any(hmac.compare_digest(given.strip().encode(), k.encode()) for k in keys)


class KeyGate:
    """ASGI middleware: requests to paths for which `protected(path, headers)` is true need a valid
    key, checked before anything reads the body (so a malformed body without a key gets 401, not 400)."""

    def __init__(self, app, keys: tuple[str, ...], protected):
        self.app, self.keys, self.protected = app, keys, protected

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.keys:
            headers = dict(scope["headers"])
            if self.protected(scope["path"], headers) and not key_ok(headers, self.keys):
                response = JSONResponse({"error": "a valid API key is required: Authorization: Bearer KEY"}, 401,
                                        headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


OPEN_API_PATHS = ("/health", "/openapi.json", "/docs")  # what the API serves without a key


def _api_protected(path: str, _headers: dict) -> bool:
    path = path.removeprefix("/api")
    return not any(path == p or path.startswith(p + "/") for p in OPEN_API_PATHS)


def to_config(req: GenerateIn, model: str) -> RunConfig:
    """The request as a `RunConfig`, through the same validation as the UI's runs."""
    rows = ([RowSpec(**r.model_dump()) for r in req.rows] if req.rows
            else default_rows(req.strategy, dict(req.params)))
    return RunConfig(prompt=req.prompt, model=model, chat_template=req.chat_template, system_prompt=req.system_prompt,
                     max_new_tokens=req.max_new_tokens, seed=req.seed,
                     sampling=SamplingConfig(**req.sampling.model_dump()),
                     deepconf=DeepConfConfig(**req.deepconf.model_dump()), rows=rows, reference=req.reference,
                     key_facts=list(req.key_facts), quality=req.quality).validate()


def saved_result(run: SavedRunIn) -> RunResult:
    """A RunResult sent back by a client, as far as a follow-up needs it."""
    rows = [RowResult(r.name, r.strategy, dict(r.params), list(r.token_ids), r.text) for r in run.rows]
    return RunResult(config=run.config.model_dump(), rows=rows, **({"run_id": run.run_id} if run.run_id else {}))


def result_json(run: Run, steps: bool) -> dict:
    data = run.result.to_dict()
    if not steps:
        for row in data["rows"]:
            row.pop("steps")
    return data


def json_safe(value: Any) -> Any:
    """NaN and infinities (an undefined metric) become null: strict JSON has no spelling for them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _event(kind: str, payload: dict, sse: bool) -> str:
    if sse:
        return f"event: {kind}\ndata: {json.dumps(json_safe(payload))}\n\n"
    return json.dumps(json_safe({"event": kind, **payload})) + "\n"


def create_api(pool: ModelPool, settings: ApiSettings | None = None) -> FastAPI:
    """The API as its own FastAPI app (mount it with `api_routes`)."""
    settings = settings or ApiSettings.from_env()
    api = FastAPI(title="Feedback Lens API", version="1.0",
                  description="Baseline vs activation-feedback generation, streamed step records and perplexity, "
                              "on the same engine as the Feedback Lens page. When the server sets "
                              "FEEDBACK_API_KEYS, send `Authorization: Bearer KEY` (all routes but /health, this schema and "
                              "its docs page).",
                  docs_url="/docs", redoc_url=None, openapi_url="/openapi.json", servers=[{"url": "/api"}])
    api.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    api.add_middleware(KeyGate, keys=settings.keys, protected=_api_protected)  # outermost: keys first
    bearer = HTTPBearer(auto_error=False, description="an API key from FEEDBACK_API_KEYS")

    def require_key(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if not settings.keys:
            return
        given = (creds.credentials if creds else "").encode()
        if not any(hmac.compare_digest(given, key.encode()) for key in settings.keys):
            raise ApiError(401, "a valid API key is required: Authorization: Bearer KEY",
                           headers={"WWW-Authenticate": "Bearer"})

    keyed = [Depends(require_key)]

    @api.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        return JSONResponse({"error": exc.detail}, exc.status_code, headers=getattr(exc, "headers", None))

    @api.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return JSONResponse({"error": "the body is not valid JSON"}, 400)
        details = [{"field": ".".join(str(p) for p in e.get("loc", ())[1:]) or "body", "message": e.get("msg", "")}
                   for e in errors]
        text = "; ".join(f"{d['field']}: {d['message']}" for d in details)
        return JSONResponse({"error": f"invalid request: {text}", "details": details}, 422)

    @api.exception_handler(FeedbackError)
    async def refused(_request, exc: FeedbackError):
        if isinstance(exc, Busy):
            return JSONResponse({"error": str(exc)}, 503, headers={"Retry-After": str(exc.retry_after_s)})
        return JSONResponse({"error": str(exc)}, 422)

    recent = RecentRuns(RECENT_RUNS)

    def start(req: GenerateIn) -> Run:
        lm = pool.get(req.model)
        # validated, tokenised, budgets checked, strategies built: all before queueing
        return Engine(lm).start(to_config(req, lm.name), budget=settings.budget)

    def earlier(req: _FollowUp) -> RunResult:
        if (req.run is None) == (req.run_id is None):
            raise FeedbackError("give either run (an earlier RunResult) or run_id (a recent run of this server)")
        return recent.get(req.run_id) if req.run is None else saved_result(req.run)

    def start_follow_up(req: ContinueIn | BranchIn) -> Run:
        past = earlier(req)
        lm = pool.get(past.config.get("model"))
        if isinstance(req, ContinueIn):
            config = continue_run(past, req.message)
        else:
            if (req.token_id is None) == (req.token_text is None):
                raise FeedbackError("give either token_id or token_text")
            tokens = ([req.token_id] if req.token_id is not None
                      else list(lm.tokenizer(req.token_text, add_special_tokens=False)["input_ids"]))
            config = branch(past, req.row, req.step, tokens, req.all_rows)
        return Engine(lm).start(config, budget=settings.budget)

    async def respond(run: Run, request: Request, steps: bool, stream_as: str | None):
        """The run's answer: the whole RunResult when done, or streamed (`stream_as` ndjson or sse)."""
        if stream_as is not None:
            if pool.gate.would_refuse("api", settings.max_waiting):
                raise Busy("the model is busy and the API waiting line is full; try again")
            sse = stream_as == "sse"
            return StreamingResponse(stream(run, steps, sse), media_type="text/event-stream" if sse
                                     else "application/x-ndjson",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async with turn("an API generate request", request) as queued:
            try:
                # a hang-up stops the run between prefill chunks or decode steps: nobody waits for the answer
                async with _watching(request, run.stop_event), aclosing(decode(run)) as steps_seen:
                    async for _ in steps_seen:
                        pass
            except Exception as exc:  # out-of-memory, tokenizer or model errors: this request fails, the server stays
                raise ApiError(500, f"generation failed: {type(exc).__name__}: {exc}") from None
        recent.put(run.result)
        return JSONResponse(json_safe(result_json(run, steps) | {"queued_seconds": round(queued, 4)}))

    @api.get("/health", summary="liveness and load (no key needed)")
    def health() -> dict:
        return {"status": "ok", **pool.gate.status(), "models_loaded": sorted(pool.loaded())}

    @api.get("/models", dependencies=keyed, responses=ERRORS, summary="the model allowlist")
    def models() -> dict:
        loaded = pool.loaded()
        out = []
        for name in pool.allowlist:
            entry: dict = {"name": name, "default": name == pool.default, "loaded": name in loaded}
            if name in loaded:
                lm = loaded[name]
                entry |= {"dtype": lm.dtype, "device": str(lm.device), "layers": lm.num_layers,
                          "context_length": lm.context_length}
            out.append(entry)
        return {"default": pool.default, "models": out}

    @api.get("/strategies", dependencies=keyed, responses=ERRORS, summary="feedback strategies and parameter schemas")
    def strategies(model: str | None = Query(None, description="layer bounds are this model's; default model if null")) -> dict:
        lm = pool.get(model)
        return {"model": lm.name, "layers": lm.num_layers,
                "strategies": [cls.schema(lm.num_layers) for cls in REGISTRY.values()]}

    @asynccontextmanager
    async def turn(label: str, request: Request | None = None) -> AsyncIterator[float]:
        """Hold one slot of the shared model line; yields seconds queued. The wait happens in a
        worker thread; a caller that goes away while waiting (its request cancelled, or — with
        `request` — its client disconnected) leaves the line at once instead of holding its place."""
        gone, lock, held = threading.Event(), threading.Lock(), []

        def take() -> None:
            ticket = pool.gate.acquire("api", settings.max_waiting, settings.wait_s, label=label,
                                       cancelled=gone.is_set)
            with lock:  # the caller may have left between the slot and this line
                if gone.is_set():
                    pool.gate.leave(ticket)
                else:
                    held.append(ticket)

        t0 = time.perf_counter()
        try:
            async with _watching(request, gone):
                await anyio.to_thread.run_sync(take, abandon_on_cancel=True)
            if gone.is_set():
                raise ClientGone()
            yield time.perf_counter() - t0
        finally:
            with lock:
                gone.set()  # a waiter thread left behind by a cancelled request gives up its place
                if held:
                    pool.gate.leave(held.pop())

    async def decode(run: Run) -> AsyncIterator[StepEvent]:
        """The run's steps, each computed in a worker thread; however it ends (done, error, or the
        caller cancelled because the client went away) the run is stopped and its generator closed.
        A cancelled caller does not wait for the step in flight (a long prompt's prefill can take
        a while): the run is told to stop first, and its generator is closed once that step ends."""
        events = iter(run)
        try:
            while (event := await anyio.to_thread.run_sync(next, events, None, abandon_on_cancel=True)) is not None:
                yield event
        finally:
            run.stop()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_close_when_idle, events)

    @api.post("/generate", dependencies=keyed, responses=ERRORS,
              summary="baseline and feedback rows (each may have its own prompt or conversation); the whole "
                      "RunResult when done",
              description="A client that hangs up before the answer stops the run within a step. The result's "
                          "`run_id` names it for /continue and /branch.")
    async def generate(req: GenerateIn, request: Request) -> JSONResponse:
        return await respond(await anyio.to_thread.run_sync(start, req), request, req.steps, None)

    @api.post("/generate/stream", dependencies=keyed, responses=ERRORS,
              summary="the same run, streamed: NDJSON lines (default) or Server-Sent Events",
              description="Events: `start` (rows, prompt tokens), one `step` per decode step with each live "
                          "row's record, `done` with the RunResult, or `error`. Closing the connection stops "
                          "the run within one step. `format=sse` or `Accept: text/event-stream` selects SSE.")
    async def generate_stream(req: GenerateIn, request: Request,
                              format: Literal["ndjson", "sse"] | None = Query(None)) -> StreamingResponse:
        run = await anyio.to_thread.run_sync(start, req)
        return await respond(run, request, req.steps, _stream_format(request, format, "ndjson"))

    @api.post("/continue", dependencies=keyed, responses=ERRORS,
              summary="the next turn of an earlier run: each row answers `message` after its own conversation",
              description="Give the earlier RunResult (`run`, best sent with `steps: false`) or its `run_id`. "
                          "Each row's history is its own prompt and answer, so the rows' conversations diverge "
                          "as their answers did. Settings carry over. `format=ndjson|sse` streams it as "
                          "/generate/stream does.")
    async def continue_(req: ContinueIn, request: Request,
                        format: Literal["ndjson", "sse"] | None = Query(None)):
        return await follow_up(req, request, format)

    @api.post("/branch", dependencies=keyed, responses=ERRORS,
              summary="an earlier run again, replayed up to `step` and forced to another token there",
              description="`row` is replayed token for token up to `step`, then forced `token_id` (or "
                          "`token_text`'s tokens), then decodes on; with `all_rows` (default) every row is "
                          "forced the same way after its own tokens, keeping the comparison paired. Forced "
                          "steps are marked `forced`. `format=ndjson|sse` streams it.")
    async def branch_(req: BranchIn, request: Request, format: Literal["ndjson", "sse"] | None = Query(None)):
        return await follow_up(req, request, format)

    async def follow_up(req: ContinueIn | BranchIn, request: Request, format: str | None):
        """Continue and branch alike: the run built from the earlier one, whole unless asked to stream."""
        run = await anyio.to_thread.run_sync(start_follow_up, req)
        return await respond(run, request, req.steps, _stream_format(request, format, None))

    async def stream(run: Run, steps: bool, sse: bool) -> AsyncIterator[str]:
        names = [r.name for r in run.config.rows]
        try:
            async with turn("an API stream request"):
                yield _event("start", {"rows": [{"name": r.name, "strategy": r.strategy, "params": r.params}
                                                for r in run.result.rows],
                                       "prompt_tokens": run.result.prompt_tokens, "config": run.result.config}, sse)
                async with aclosing(decode(run)) as events:
                    async for event in events:
                        yield _event("step", {
                            "step": event.step,
                            "rows": {names[i]: asdict(rec) for i, rec in event.records.items()},
                            "finished": {names[i]: why for i, why in event.finished.items()},
                            "memory": event.memory.to_dict() if event.memory is not None else None}, sse)
                recent.put(run.result)
                yield _event("done", {"result": result_json(run, steps)}, sse)
        except Busy as exc:  # the line filled up after the check in generate_stream
            yield _event("error", {"error": str(exc), "status": 503}, sse)
        except Exception as exc:  # the stream has started: report in-band, keep serving
            yield _event("error", {"error": f"generation failed: {type(exc).__name__}: {exc}", "status": 500}, sse)

    def ppl_prepare(req: PPLIn):
        lm = pool.get(req.model)
        cfg = PPLConfig(req.strategy, dict(req.params), req.mode, passes=req.passes, window=req.window,
                        chunk=req.chunk, stride=req.stride, bootstrap=req.bootstrap,
                        seed=req.seed).validate(lm.context_length)
        docs = [corpus.Document("text", req.text)]
        settings.budget.check_scoring(*scoring_work([len(ids) for ids in document_ids(lm, docs, cfg)], cfg))
        return lm, cfg, docs

    @api.post("/ppl", dependencies=keyed, responses=ERRORS,
              summary="teacher-forced perplexity of a text, baseline vs a strategy, with a paired bootstrap CI",
              description="Refused (422) when it would score more than the server's budget; a client that hangs "
                          "up stops the scoring within one forward pass.")
    async def ppl(req: PPLIn, request: Request) -> JSONResponse:
        lm, cfg, docs = await anyio.to_thread.run_sync(ppl_prepare, req)  # validated and costed before queueing
        async with turn("an API perplexity request", request):
            stop = threading.Event()
            res = await until_gone(request, stop, lambda: evaluate(lm, docs, cfg, token_detail=req.token_detail,
                                                                   stop=stop))
        if req.token_detail:
            res["token_detail"] = surprise_diff(res)
        return JSONResponse(json_safe(res))

    return api


def _stream_format(request: Request, format: str | None, default: str | None) -> str | None:
    """ndjson, sse or None (not streamed): `format` if given, else SSE when the client accepts it."""
    if format is not None:
        return format
    return "sse" if "text/event-stream" in request.headers.get("accept", "") else default


class ClientGone(HTTPException):
    """The client went away; nobody reads this answer (499 in nginx's usage)."""

    def __init__(self):
        super().__init__(499, "the client closed the request")


async def _watch_disconnect(request: Request, gone: threading.Event) -> None:
    while not gone.is_set():
        if await request.is_disconnected():
            gone.set()
            return
        await anyio.sleep(0.25)


@asynccontextmanager
async def _watching(request: Request | None, gone: threading.Event) -> AsyncIterator[None]:
    """While the body runs, a background task sets `gone` when the client disconnects."""
    watcher = asyncio.create_task(_watch_disconnect(request, gone)) if request is not None else None
    try:
        yield
    finally:
        if watcher is not None:
            watcher.cancel()


def _close_when_idle(events) -> None:
    """Close a generator that another thread may still be running (it ends within a step once
    its run is stopped); a generator cannot be closed while it executes."""
    while True:
        try:
            events.close()
            return
        except ValueError:  # "generator already executing"
            time.sleep(0.01)


async def until_gone(request: Request, stop: threading.Event, work):
    """`work()` in a worker thread, its `stop` set as soon as the client disconnects (the work then
    ends within a forward pass or step, raising `Stopped`, and the request ends as `ClientGone`)."""
    try:
        async with _watching(request, stop):
            return await anyio.to_thread.run_sync(work)
    except Stopped:
        raise ClientGone() from None
    finally:
        stop.set()


def api_routes(pool: ModelPool, settings: ApiSettings | None = None) -> list[Mount]:
    """Routes to hand the Gradio server (`launch(app_kwargs={"routes": ...})`): the API at /api."""
    return [Mount("/api", app=create_api(pool, settings))]


@contextmanager
def local_server(pool: ModelPool, settings: ApiSettings | None = None) -> Iterator[str]:
    """The API alone, mounted at /api as in the app, on a free 127.0.0.1 port in a background
    thread (tests, benchmarks); yields the server's base URL."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(FastAPI(routes=api_routes(pool, settings)), log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the local API server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
