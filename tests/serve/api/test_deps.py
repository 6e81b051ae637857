"""The API key, decided by one function (`key_ok`) for the routes and for the middleware, and the
routes' dependencies, exercised on a router served on its own with `dependency_overrides`."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from feedback.serve.api import deps, models
from feedback.serve.api.deps import ApiSettings, KeyGate, get_pool, get_settings, key_ok
from feedback.serve.pool import ModelPool

KEYS = ("k-one", "k-two")


@pytest.mark.parametrize(
    "authorization, keys, good",
    [
        (None, (), True),  # no key configured: every request is good
        ("Bearer anything", (), True),
        ("Bearer k-one", KEYS, True),  # the right key, either of them, any case of the scheme
        ("Bearer k-two", KEYS, True),
        ("bearer k-one", KEYS, True),
        ("Bearer  k-one ", KEYS, True),
        ("Bearer wrong", KEYS, False),  # a wrong key
        ("Bearer k-one-and-more", KEYS, False),
        ("Bearer ", KEYS, False),
        (None, KEYS, False),  # a missing key
        ("", KEYS, False),
        ("Basic k-one", KEYS, False),  # the right key in another scheme
        ("k-one", KEYS, False),
    ],
)
def test_key_ok_decides_whether_credentials_are_good(authorization, keys, good):
    assert key_ok(authorization, keys) is good


@pytest.fixture()
def models_alone(tiny_lm):
    """The models router on a bare app: its pool and settings come only through overrides."""
    app = FastAPI()
    app.include_router(models.router)
    app.dependency_overrides[get_pool] = lambda: ModelPool.serving(tiny_lm)
    app.dependency_overrides[get_settings] = lambda: ApiSettings(keys=KEYS)
    return app


def test_a_router_on_its_own_takes_its_pool_and_settings_from_overrides_and_checks_the_key(models_alone):
    with TestClient(models_alone) as client:
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["models_loaded"] == [
            "tiny"
        ]  # /health needs no key
        r = client.get("/models")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert client.get("/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = client.get("/models", headers={"Authorization": "Bearer k-two"})
        assert r.status_code == 200 and r.json()["models"][0] == r.json()["models"][0] | {
            "name": "tiny",
            "layers": 4,
        }
        r = client.get("/strategies", headers={"Authorization": "Bearer k-one"})
        assert r.status_code == 200 and r.json()["layers"] == 4


def test_the_middleware_and_the_route_decide_with_the_same_function_once(models_alone, monkeypatch):
    """The middleware refuses before the route runs; a key it let through is not judged again."""
    seen: list[str | None] = []

    def watched(authorization, keys):  # the real decision, with a record of each call
        seen.append(authorization)
        return key_ok(authorization, keys)

    monkeypatch.setattr(deps, "key_ok", watched)
    models_alone.add_middleware(KeyGate, keys=KEYS, protected=lambda path, _headers: path != "/health")
    with TestClient(models_alone) as client:
        assert client.get("/models").status_code == 401
        assert client.get("/models", headers={"Authorization": "Bearer k-one"}).status_code == 200
    assert seen == ["", "Bearer k-one"]  # once per request: the route did not decide a second time
