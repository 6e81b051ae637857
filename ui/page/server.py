"""How the page's server is assembled: the HTTP API mounted beside Gradio, and the middleware that
makes every door hold the same rules.

- Keys (FEEDBACK_GRADIO_API=keys, with FEEDBACK_API_KEYS): the Gradio side is closed like the HTTP
  API. The page asks for a login (Gradio's own, which then guards every Gradio route: the page, its
  files and every Gradio API endpoint); an API key is a password it takes, beside the --auth pair
  if one is set. A program may log in the same way (`Client(url, auth=("any", KEY))`) or send the
  key as `Authorization: Bearer KEY` (`KeySession` lets such a request in as a logged-in session).
  Without the setting, the Gradio side is as --auth leaves it: open, or behind that login.
  With a login (keys, or --auth), no Gradio route answers without it but the login page itself:
  the page's HTML, its scripts, styles and fonts, and the login form's POST (`LOGIN_PAGE`);
  Gradio's own login leaves more open (its theme, manifest, startup and heartbeat routes, its
  route list), which `LoginFirst` closes.
- Malformed calls: Gradio's call and upload routes raise on payloads outside their own schema (a
  fuzzer found 13 such 500s); such a request is answered 400 with what went wrong.
- Refusals at `/gradio_api/run/<endpoint>` (one HTTP answer per call): Gradio answers every error
  there 500; a refused input is the caller's mistake, answered 422, and a full model line 503 with
  Retry-After, like the HTTP API (`DirectCalls`, which reads the kind from the message's title); a
  streaming endpoint (every model job), which could answer there only its first update, is refused.
- Body sizes: a request to a Gradio route may be as large as an HTTP API request plus the run
  history a browser sends back (`PAGE_MAX_BODY_BYTES`), an upload as large as an uploaded file
  may be plus its framing; larger ones get 413 while they are read, before Gradio parses them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging

from starlette.middleware import Middleware
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse

from feedback.serve.api import ApiSettings, api_routes, key_ok
from feedback.serve.api.errors import BodyLimit
from feedback.serve.gate import RETRY_AFTER_S
from feedback.serve.limits import MAX_BODY_BYTES, PAGE_MAX_BODY_BYTES, UPLOAD_BODY_MAX_BYTES
from feedback.serve.pool import ModelPool
from ui.page import notice

log = logging.getLogger("feedback_lens.server")

_FRAGILE_ROUTES = ("/gradio_api/call/", "/gradio_api/upload", "/gradio_api/queue/join", "/gradio_api/run/")
_ONE_ANSWER_ROUTES = (
    "/gradio_api/run/",
    "/gradio_api/api/",
)  # Gradio's direct calls: the status is the answer
# What the login page needs before anyone has logged in: its HTML, the scripts, styles and fonts it
# loads (Gradio's build: /assets, /static; the theme's colours: /theme.css) and the form's POST.
LOGIN_PAGE = ("/", "/login", "/login/", "/theme.css")
LOGIN_PAGE_FOLDERS = ("/assets/", "/static/")
# Gradio's launch calls this on its own server, without credentials, to run the app's startup;
# it stays open until that has happened (it only answers true or false), then needs a login too.
STARTUP = "/gradio_api/startup-events"
KEY_USER = "api key"  # the user name Gradio sees for a request let in by its API key
KEY_LOGIN_MESSAGE = "Log in with any user name and an API key of this server as the password."


def page_auth(settings: ApiSettings, pair: tuple[str, str] | None):
    """`launch(auth=...)`: None (an open page), the --auth pair, or, with keys required
    (FEEDBACK_GRADIO_API=keys), a check that takes the pair or any user name with an API key."""
    if not settings.gradio_keys:
        return pair

    def login(user: str, password: str) -> bool:
        if (
            pair is not None
            and hmac.compare_digest(str(user).encode(), pair[0].encode())
            and hmac.compare_digest(str(password).encode(), pair[1].encode())
        ):
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
        if scope["type"] == "http" and not _is_api(scope["path"]):
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


def _is_api(path: str) -> bool:
    return path == "/api" or path.startswith("/api/")


def login_page_route(path: str) -> bool:
    """Whether `path` is one the login page needs, open before a login."""
    return path in LOGIN_PAGE or path.startswith(LOGIN_PAGE_FOLDERS)


class LoginFirst:
    """ASGI middleware (a page with a login): every Gradio route but the login page's own answers 401
    until the request is logged in, with Gradio's session cookie or (with keys) an API key, which
    `KeySession`, outside this one, has turned into that cookie. The HTTP API (/api) checks its own keys."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and not _is_api(scope["path"])
            and not login_page_route(scope["path"])
            and not _starting(scope)
            and not _logged_in(scope)
        ):
            response = JSONResponse(
                {"error": "log in first: this server requires a login (or an API key)"}, 401
            )
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _starting(scope) -> bool:
    return scope["path"] == STARTUP and not scope["app"].startup_events_triggered


def _logged_in(scope) -> bool:
    """Whether the request carries a session cookie that the Gradio app (`scope["app"]`) issued."""
    gradio, cookies = scope["app"], HTTPConnection(scope).cookies
    return any(
        cookies.get(name) in gradio.tokens
        for name in (f"access-token-{gradio.cookie_id}", f"access-token-unsecure-{gradio.cookie_id}")
    )


class DirectCalls:
    """ASGI middleware for Gradio's direct calls (`/gradio_api/run/<endpoint>`), which answer with
    one HTTP status. Gradio answers every error there with 500: a refusal of the caller's input
    (`notice.REFUSED` as the error's title) is answered 422 and a full model line (`notice.BUSY`)
    503 with Retry-After, as the HTTP API answers them; a failure keeps its 500. An endpoint that
    streams (every model job) would answer only its first update there (its status, "Waiting…" or
    "Not started: …", with a 200) and be abandoned: it is refused (400) with where to call it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(_ONE_ANSWER_ROUTES):
            return await self.app(scope, receive, send)
        name = scope["path"].rstrip("/").rsplit("/", 1)[-1]
        if _streams(scope["app"], name):
            response = JSONResponse(
                {
                    "error": f"/{name} streams its answer as it runs: call it through "
                    f"/gradio_api/call/{name} (then read its event stream) or gradio_client"
                },
                400,
            )
            return await response(scope, receive, send)
        start: dict | None = None
        body = bytearray()

        async def held(message):  # a 500's body is read whole (one small JSON object), then sent
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] == 500:
                start = message
                return
            if start is None:
                return await send(message)
            body.extend(message.get("body", b""))
            if not message.get("more_body", False):
                await _send_with_status(send, start, bytes(body))

        await self.app(scope, receive, held)


def _streams(gradio, api_name: str) -> bool:
    """Whether the Gradio app's endpoint `api_name` is a generator (its answer comes as a stream)."""
    return any(fn.api_name == api_name and fn.types_generator for fn in gradio.get_blocks().fns.values())


async def _send_with_status(send, start: dict, body: bytes) -> None:
    try:
        title = json.loads(body).get("title")
    except (ValueError, AttributeError):
        title = None
    headers = list(start["headers"])
    status = {notice.REFUSED: 422, notice.BUSY: 503}.get(title, start["status"])
    if status == 503:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode("latin-1")))
    await send({**start, "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


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


def app_kwargs(pool: ModelPool, settings: ApiSettings, login: bool = False) -> dict:
    """`launch(app_kwargs=...)`: the HTTP API at /api and the server's middleware (the first is
    the outermost: keys and logins are checked before a body is read, its size before Gradio
    parses it). `login`: the page has Gradio's login (--auth), which keys imply."""
    middleware = [
        Middleware(BodyLimit, limit=body_limit(settings)),
        Middleware(MalformedCalls),
        Middleware(DirectCalls),
    ]
    if settings.gradio_keys or login:
        middleware.insert(0, Middleware(LoginFirst))
    if settings.gradio_keys:
        middleware.insert(0, Middleware(KeySession, keys=settings.keys))
    return {"routes": api_routes(pool, settings), "middleware": middleware}
