"""What the API's routes depend on, as FastAPI dependencies: its settings, the model pool, the runs
it produced recently, and the API key.

`create_api` puts the settings, pool and recent runs on the app's state; the dependencies read them
from there, so a route is a plain module-level function and a test may hand it others through
`app.dependency_overrides`. Whether a request's credentials are good is decided by one function,
`key_ok`, for the routes (`require_key`) and for the middleware that guards a whole server's paths
(`KeyGate`: the API's, and the Gradio API's with FEEDBACK_GRADIO_API=keys).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.responses import JSONResponse

from feedback.core.budget import Budget
from feedback.core.session import RecentRuns
from feedback.errors import FeedbackError
from feedback.serve.api.errors import ApiError
from feedback.serve.limits import API_WAIT_S, MAX_BODY_BYTES
from feedback.serve.pool import ModelPool

KEY_REQUIRED = "a valid API key is required: Authorization: Bearer KEY"
# Set on a request's state by `KeyGate` once it has found the key good, so the route's own check
# does not decide a second time.
_KEY_CHECKED = "feedback_api_key_checked"


@dataclass(frozen=True)
class ApiSettings:
    """Limits and keys; `from_env` reads the FEEDBACK_API_* variables."""

    keys: tuple[str, ...] = ()
    max_body_bytes: int = MAX_BODY_BYTES
    wait_s: float = API_WAIT_S
    budget: Budget = field(default_factory=Budget)  # the same per-request budgets as the page
    gradio_keys: bool = False  # FEEDBACK_GRADIO_API=keys: the Gradio API's clients need a key too

    @classmethod
    def from_env(cls) -> ApiSettings:
        env = os.environ.get
        keys = tuple(k.strip() for k in env("FEEDBACK_API_KEYS", "").split(",") if k.strip())
        gradio = env("FEEDBACK_GRADIO_API", "open").strip().lower()
        if gradio not in ("open", "keys"):
            raise FeedbackError(f"FEEDBACK_GRADIO_API must be open or keys, got {gradio!r}")
        if gradio == "keys" and not keys:
            raise FeedbackError("FEEDBACK_GRADIO_API=keys needs FEEDBACK_API_KEYS")
        try:
            return cls(
                keys,
                int(env("FEEDBACK_API_MAX_BODY", cls.max_body_bytes)),
                float(env("FEEDBACK_API_WAIT_S", cls.wait_s)),
                Budget.from_env(),
                gradio == "keys",
            )
        except ValueError as exc:
            raise FeedbackError(f"bad FEEDBACK_API_* setting: {exc}") from None


def get_settings(request: Request) -> ApiSettings:
    return request.app.state.settings


def get_pool(request: Request) -> ModelPool:
    return request.app.state.pool


def get_recent(request: Request) -> RecentRuns:
    """The results this server produced lately, for /continue and /branch by run_id."""
    return request.app.state.recent


Settings = Annotated[ApiSettings, Depends(get_settings)]
Pool = Annotated[ModelPool, Depends(get_pool)]
Recent = Annotated[RecentRuns, Depends(get_recent)]


def key_ok(authorization: str | None, keys: tuple[str, ...]) -> bool:
    """Whether an `Authorization` header value is `Bearer <one of keys>`; with no keys configured
    every request is. Compared in constant time, so the answer's timing says nothing of the keys."""
    if not keys:
        return True
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and any(
        hmac.compare_digest(given.strip().encode(), k.encode()) for k in keys
    )


_bearer = HTTPBearer(auto_error=False, description="an API key from FEEDBACK_API_KEYS")


def require_key(
    request: Request,
    settings: Settings,
    _scheme: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """The routes' key check. `_scheme` declares the bearer scheme in the OpenAPI schema; the
    header itself is judged by `key_ok`, unless `KeyGate` already found it good."""
    if getattr(request.state, _KEY_CHECKED, False):
        return
    if not key_ok(request.headers.get("authorization"), settings.keys):
        raise ApiError(401, KEY_REQUIRED, headers={"WWW-Authenticate": "Bearer"})


class KeyGate:
    """ASGI middleware: a request for which `protected(path, headers)` holds needs a good key
    (`key_ok`), checked before anything reads the body (so a malformed body without a key gets
    401, not 400). The API guards its own routes with it; the Gradio server its API."""

    def __init__(self, app, keys: tuple[str, ...], protected: Callable[[str, dict], bool]):
        self.app, self.keys, self.protected = app, keys, protected

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.keys:
            headers = dict(scope["headers"])
            if self.protected(scope["path"], headers):
                if not key_ok(headers.get(b"authorization", b"").decode("latin-1"), self.keys):
                    response = JSONResponse(
                        {"error": KEY_REQUIRED}, 401, headers={"WWW-Authenticate": "Bearer"}
                    )
                    return await response(scope, receive, send)
                scope.setdefault("state", {})[_KEY_CHECKED] = True
        await self.app(scope, receive, send)
