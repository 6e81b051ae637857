"""The page server's middleware, on small ASGI apps standing in for Gradio's routes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from gradio.utils import error_payload
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route

from feedback.errors import FeedbackError
from feedback.serve.gate import Busy
from ui.page import notice
from ui.page.server import DirectCalls, login_page_route


def _gradio_like(error: BaseException):
    """A route that answers an error as Gradio's direct-call route does: its payload, status 500."""

    async def run(_request):
        return JSONResponse(error_payload(error, False), 500)

    app = Starlette(
        routes=[Route("/gradio_api/run/x", run, methods=["POST"]), Route("/other", run, methods=["POST"])],
        middleware=[Middleware(DirectCalls)],
    )  # inside the app, as in Gradio's
    app.get_blocks = lambda: SimpleNamespace(fns={})  # no endpoint streams here
    return app


@pytest.mark.parametrize(
    "error, status",
    [
        (notice.refusal(FeedbackError("prompt is empty")), 422),
        (notice.refusal(Busy("the model is busy")), 503),
        (notice.failure("Generation failed: RuntimeError: boom"), 500),
        (RuntimeError("a crash"), 500),
    ],
)
def test_a_direct_call_answers_with_the_status_of_what_happened(error, status):
    async def calls():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(_gradio_like(error)), base_url="http://t"
        ) as c:
            return await c.post("/gradio_api/run/x"), await c.post("/other")

    r, other = asyncio.run(calls())
    assert r.status_code == status
    assert (r.headers.get("retry-after") == "10") == (status == 503)
    assert r.json()["error"] == getattr(error, "message", None)  # Gradio hides a crash's text
    assert other.status_code == 500  # other routes are left as they are


def test_the_login_page_needs_only_its_own_routes():
    assert all(
        map(login_page_route, ["/", "/login", "/theme.css", "/assets/index-abc.js", "/static/fonts/a.woff2"])
    )
    assert not any(
        map(
            login_page_route,
            [
                "/config",
                "/manifest.json",
                "/gradio_api/info",
                "/favicon.ico",
                "/gradio_api/heartbeat/x",
                "/openapi.json",
                "/assetsx",
            ],
        )
    )


def test_a_refusal_shows_its_text_as_typed():
    markup = '<img src="/x"><a href="https://example.org/login">Session expired</a><h1>NOTICE</h1>'
    error = notice.refusal(FeedbackError(f"unknown strategy {markup!r}"))
    assert "<" not in error.message and '&lt;img src="/x">' in error.message and error.title == notice.REFUSED
