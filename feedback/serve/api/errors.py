"""How the API answers what goes wrong: every error is `{"error": ...}` with its status (the
invalid-request answer adds `details`, one per field), and bodies over the size limit are refused
while they are read."""

from __future__ import annotations

from collections.abc import Callable

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from feedback.errors import FeedbackError
from feedback.serve.gate import Busy


class ApiError(HTTPException):
    """A refusal or failure with its HTTP status, answered as `{"error": ...}`."""


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than {limit} bytes")


class BodyLimit:
    """ASGI middleware: refuse bodies over `limit` bytes, declared or streamed (chunked), with 413.
    `limit` is a number, or a function of the request's path giving its limit (None: not limited
    here), for a server whose routes take different bodies."""

    def __init__(self, app, limit: int | Callable[[str], int | None]):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        limit = self.limit(scope["path"]) if callable(self.limit) and scope["type"] == "http" else self.limit
        if scope["type"] != "http" or limit is None:
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await _too_large(limit, scope, receive, send)
        seen, started = 0, False

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)  # FastAPI passes HTTPExceptions from body reading through
            return message

        async def tracking(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited, tracking)
        except BodyTooLarge:  # raised through a route that does not answer it itself
            if started:
                raise
            await _too_large(limit, scope, receive, send)


async def _too_large(limit: int, scope, receive, send) -> None:
    response = JSONResponse({"error": f"request body is larger than {limit} bytes"}, 413)
    await response(scope, receive, send)


async def http_error(_request, exc: HTTPException) -> JSONResponse:
    return JSONResponse({"error": exc.detail}, exc.status_code, headers=getattr(exc, "headers", None))


async def invalid_request(_request, exc: RequestValidationError) -> JSONResponse:
    """400 for a body that is not JSON; otherwise 422 naming each field that is wrong and why."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return JSONResponse({"error": "the body is not valid JSON"}, 400)
    details = [
        {"field": ".".join(str(p) for p in e.get("loc", ())[1:]) or "body", "message": e.get("msg", "")}
        for e in errors
    ]
    text = "; ".join(f"{d['field']}: {d['message']}" for d in details)
    return JSONResponse({"error": f"invalid request: {text}", "details": details}, 422)


async def refused(_request, exc: FeedbackError) -> JSONResponse:
    """The library's refusals: 503 with Retry-After when the model line is full, else 422."""
    if isinstance(exc, Busy):
        return JSONResponse({"error": str(exc)}, 503, headers={"Retry-After": str(exc.retry_after_s)})
    return JSONResponse({"error": str(exc)}, 422)


HANDLERS = {HTTPException: http_error, RequestValidationError: invalid_request, FeedbackError: refused}
