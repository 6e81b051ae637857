"""How the page's server is assembled: the HTTP API mounted beside Gradio, and the middleware that
makes every door hold the same rules.

- Keys (FEEDBACK_GRADIO_API=keys, with FEEDBACK_API_KEYS): the Gradio side is closed like the HTTP
  API. The page asks for a login (Gradio's own, which then guards every Gradio route: the page, its
  files and every Gradio API endpoint); an API key is a password it takes, beside the --auth pair
  if one is set. A program may log in the same way (`Client(url, auth=("any", KEY))`) or send the
  key as `Authorization: Bearer KEY` (`KeySession` lets such a request in as a logged-in session).
  Without the setting, the Gradio side is as --auth leaves it: open, or behind that login.
- Malformed calls: Gradio's call and upload routes raise on payloads outside their own schema (a
  fuzzer found 13 such 500s); such a request is answered 400 with what went wrong.
- Body sizes: a request to a Gradio route may be as large as an HTTP API request plus the run
  history a browser sends back (`PAGE_MAX_BODY_BYTES`), an upload as large as an uploaded file
  may be plus its framing; larger ones get 413 while they are read, before Gradio parses them.
"""
from __future__ import annotations

import hashlib
import hmac
import logging

from starlette.middleware import Middleware
from starlette.responses import JSONResponse

from feedback.serve.api import ApiSettings, api_routes, key_ok
from feedback.serve.api.errors import BodyLimit
from feedback.serve.limits import MAX_BODY_BYTES, PAGE_MAX_BODY_BYTES, UPLOAD_BODY_MAX_BYTES
from feedback.serve.pool import ModelPool

log = logging.getLogger("feedback_lens.server")

_FRAGILE_ROUTES = ("/gradio_api/call/", "/gradio_api/upload", "/gradio_api/queue/join", "/gradio_api/run/")
KEY_USER = "api key"  # the user name Gradio sees for a request let in by its API key
KEY_LOGIN_MESSAGE = "Log in with any user name and an API key of this server as the password."


def page_auth(settings: ApiSettings, pair: tuple[str, str] | None):
    """`launch(auth=...)`: None (an open page), the --auth pair, or, with keys required
    (FEEDBACK_GRADIO_API=keys), a check that takes the pair or any user name with an API key."""
    if not settings.gradio_keys:
        return pair

    def login(user: str, password: str) -> bool:
        if pair is not None and hmac.compare_digest(str(user).encode(), pair[0].encode()) and \
                hmac.compare_digest(str(password).encode(), pair[1].encode()):
            return True
        return key_ok(f"Bearer {password}", settings.keys)

    return login


class KeySession:
    """ASGI middleware (FEEDBACK_GRADIO_API=keys): a request to a Gradio route whose
    `Authorization: Bearer KEY` holds a good key is let in as a logged-in session, so a program
    needs no login round trip; one without a good key or login meets Gradio's own 401."""

    def __init__(self, app, keys: tuple[str, ...]):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not scope["path"].startswith("/api"):
            headers = dict(scope["headers"])
            if key_ok(headers.get(b"authorization", b"").decode("latin-1"), self.keys):
                scope = dict(scope, headers=self._logged_in(scope, headers))
        await self.app(scope, receive, send)

    def _logged_in(self, scope, headers: dict) -> list:
        """The request's headers with a session cookie that the Gradio app (`scope["app"]`) knows."""
        gradio = scope["app"]
        token = "key-" + hashlib.sha256(headers[b"authorization"]).hexdigest()[:40]
        gradio.tokens[token] = KEY_USER  # one token per key, re-registered after a logout removes it
        cookie = f"access-token-{gradio.cookie_id}={token}".encode("latin-1")
        rest = [(k, v) for k, v in scope["headers"] if k != b"cookie"]
        others = headers.get(b"cookie")
        return rest + [(b"cookie", cookie + (b"; " + others if others else b""))]


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
        middleware.insert(0, Middleware(KeySession, keys=settings.keys))
    return {"routes": api_routes(pool, settings), "middleware": middleware}
