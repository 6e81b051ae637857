"""How the page's server is assembled: the HTTP API mounted beside Gradio, and the middleware that
makes every door hold the same rules.

- Keys (FEEDBACK_GRADIO_API=keys): program clients of the Gradio API — its REST call routes, and
  gradio_client, which says so in a header — need an API key like the HTTP API; the page does not.
  A client that imitates a browser page still gets in, with the page's limits; to close the Gradio
  API to anyone without credentials, use the UI login (--auth), which covers every Gradio route.
- Malformed calls: Gradio's call and upload routes raise on payloads outside their own schema (a
  fuzzer found 13 such 500s); such a request is answered 400 with what went wrong.
- Body sizes: a request to a Gradio route may be as large as an HTTP API request plus the run
  history a browser sends back (`PAGE_MAX_BODY_BYTES`), an upload as large as an uploaded file
  may be plus its framing; larger ones get 413 while they are read, before Gradio parses them.
"""
from __future__ import annotations

import logging

from starlette.middleware import Middleware
from starlette.responses import JSONResponse

from feedback.serve.api import ApiSettings, KeyGate, api_routes
from feedback.serve.api.errors import BodyLimit
from feedback.serve.limits import MAX_BODY_BYTES, PAGE_MAX_BODY_BYTES, UPLOAD_BODY_MAX_BYTES
from feedback.serve.pool import ModelPool

log = logging.getLogger("feedback_lens.server")

# Gradio's routes that run or feed handlers when called by a program.
_PROGRAM_ROUTES = ("/gradio_api/call/", "/gradio_api/run/", "/call/", "/run/")
_CLIENT_ROUTES = ("/gradio_api/", "/queue/", "/upload")
_FRAGILE_ROUTES = ("/gradio_api/call/", "/gradio_api/upload", "/gradio_api/queue/join", "/gradio_api/run/")


def gradio_protected(path: str, headers: dict) -> bool:
    """With FEEDBACK_GRADIO_API=keys: which requests to the Gradio server need a key."""
    if path.startswith("/api"):
        return False  # the HTTP API checks its own keys
    if path.startswith(_PROGRAM_ROUTES):
        return True
    return headers.get(b"x-gradio-user", b"") == b"api" and path.startswith(_CLIENT_ROUTES)


class MalformedCalls:
    """ASGI middleware: an exception from one of Gradio's call or upload routes before any response
    has started is the request's fault (the routes raise on payloads outside their schema), so it is
    answered 400 with the error, not 500; it is logged as one line."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(_FRAGILE_ROUTES):
            return await self.app(scope, receive, send)
        started = False

        async def tracking(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except Exception as exc:  # Gradio rejected the payload by raising
            if started:
                raise
            log.info("malformed call to %s refused: %s: %s", scope["path"], type(exc).__name__, exc)
            response = JSONResponse({"error": f"malformed request: {type(exc).__name__}: {exc}"[:2000]}, 400)
            await response(scope, receive, send)


def body_limit(settings: ApiSettings):
    """The largest body each of the server's paths takes (None: the HTTP API, which limits its own)."""
    history_allowance = PAGE_MAX_BODY_BYTES - MAX_BODY_BYTES

    def limit(path: str) -> int | None:
        if path.startswith("/api"):
            return None
        if path.rstrip("/").endswith("/upload"):
            return UPLOAD_BODY_MAX_BYTES
        return settings.max_body_bytes + history_allowance

    return limit


def app_kwargs(pool: ModelPool, settings: ApiSettings) -> dict:
    """`launch(app_kwargs=...)`: the HTTP API at /api and the server's middleware (the first is
    the outermost: keys are checked before a body is read, its size before Gradio parses it)."""
    middleware = [Middleware(BodyLimit, limit=body_limit(settings)), Middleware(MalformedCalls)]
    if settings.gradio_keys:
        middleware.insert(0, Middleware(KeyGate, keys=settings.keys, protected=gradio_protected))
    return {"routes": api_routes(pool, settings), "middleware": middleware}
