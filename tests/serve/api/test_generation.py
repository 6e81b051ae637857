"""The generation router served on its own: its model pool, settings and recent runs come through
`dependency_overrides`, as a test or another app may give them."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from feedback.core.engine import run_to_end
from feedback.core.session import RecentRuns
from feedback.serve.api import generation
from feedback.serve.api.deps import ApiSettings, get_pool, get_recent, get_settings
from feedback.serve.api.schemas import GenerateIn, to_config
from feedback.serve.pool import ModelPool


def test_generate_on_a_bare_app_with_its_collaborators_overridden(tiny_lm):
    recent = RecentRuns()
    app = FastAPI()
    app.include_router(generation.router)
    app.dependency_overrides |= {
        get_pool: lambda: ModelPool.serving(tiny_lm),
        get_settings: lambda: ApiSettings(),
        get_recent: lambda: recent,
    }
    body = {"prompt": "Name a colour.", "max_new_tokens": 3, "steps": False}
    with TestClient(app) as client:
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        with client.stream("POST", "/generate/stream", json=body) as streamed:
            events = [line for line in streamed.iter_lines() if line]
        refused = client.post("/generate", json=body | {"max_new_tokens": 10**6})
    direct = run_to_end(tiny_lm, to_config(GenerateIn(**body), tiny_lm.name))
    assert [row["token_ids"] for row in data["rows"]] == [row.token_ids for row in direct.rows]
    assert all("steps" not in row for row in data["rows"])
    assert recent.get(data["run_id"]).rows[1].token_ids == data["rows"][1]["token_ids"]  # kept for follow-ups
    assert '"event": "start"' in events[0] and '"event": "done"' in events[-1]
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "max_new_tokens"]
