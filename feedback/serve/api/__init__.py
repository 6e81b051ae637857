"""HTTP API beside the UI: compare (whole or streamed), follow-ups (next turn, branch), perplexity,
calibration, health, models, strategies.

Mounted at /api in the Gradio server (`app.py`). It uses the same engine, validation and model pool
as the page, and the same first-come line to the model (`ModelPool.gate`), with a cap on how many
API requests may wait, so API traffic cannot starve the page. OpenAPI: /api/openapi.json, docs: /api/docs.

The package: `schemas` (request and response bodies), `deps` (settings, pool, recent runs and the
API key, as FastAPI dependencies), `streaming` (the model line, decoding, streamed events, hang-ups),
`errors` (error answers, the body-size limit), and one router per area: `generation`,
`follow_ups`, `perplexity`, `calibration`, `models`.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI
from starlette.routing import Mount

from feedback.core.session import RecentRuns
from feedback.serve.api import calibration, follow_ups, generation, models, perplexity
from feedback.serve.api.deps import (
    ApiSettings,
    KeyGate,
    get_pool,
    get_recent,
    get_settings,
    key_ok,
    require_key,
)
from feedback.serve.api.errors import HANDLERS, ApiError, BodyLimit
from feedback.serve.api.schemas import BranchIn, ContinueIn, GenerateIn, PPLIn, saved_result, to_config
from feedback.serve.api.streaming import ClientGone
from feedback.serve.pool import ModelPool

__all__ = [
    "ApiError",
    "ApiSettings",
    "BranchIn",
    "ClientGone",
    "ContinueIn",
    "GenerateIn",
    "KeyGate",
    "PPLIn",
    "api_routes",
    "create_api",
    "get_pool",
    "get_recent",
    "get_settings",
    "key_ok",
    "local_server",
    "require_key",
    "saved_result",
    "to_config",
]

ROUTERS = (models.router, generation.router, follow_ups.router, perplexity.router, calibration.router)
OPEN_API_PATHS = ("/health", "/openapi.json", "/docs")  # what the API serves without a key
DESCRIPTION = (
    "Baseline vs activation-feedback generation, streamed step records and perplexity, on the same "
    "engine as the Feedback Lens page. When the server sets FEEDBACK_API_KEYS, send `Authorization: "
    "Bearer KEY` (all routes but /health, this schema and its docs page)."
)


def _api_protected(path: str, _headers: dict) -> bool:
    path = path.removeprefix("/api")
    return not any(path == p or path.startswith(p + "/") for p in OPEN_API_PATHS)


def create_api(pool: ModelPool, settings: ApiSettings | None = None) -> FastAPI:
    """The API as its own FastAPI app (mount it with `api_routes`)."""
    settings = settings or ApiSettings.from_env()
    api = FastAPI(
        title="Feedback Lens API",
        version="1.0",
        description=DESCRIPTION,
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
        servers=[{"url": "/api"}],
    )
    api.state.settings, api.state.pool, api.state.recent = settings, pool, RecentRuns()
    for router in ROUTERS:
        api.include_router(router)
    for kind, handler in HANDLERS.items():
        api.add_exception_handler(kind, handler)
    api.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    # outermost: a request without a good key is refused before its body is read
    api.add_middleware(KeyGate, keys=settings.keys, protected=_api_protected)
    return api


def api_routes(pool: ModelPool, settings: ApiSettings | None = None) -> list[Mount]:
    """Routes to hand the Gradio server (`launch(app_kwargs={"routes": ...})`): the API at /api."""
    return [Mount("/api", app=create_api(pool, settings))]


@contextmanager
def local_server(pool: ModelPool, settings: ApiSettings | None = None) -> Iterator[str]:
    """The API alone, mounted at /api as in the app, on a free 127.0.0.1 port in a background
    thread (tests, benchmarks); yields the server's base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(
            FastAPI(routes=api_routes(pool, settings)), log_level="warning", timeout_graceful_shutdown=2
        )
    )
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
