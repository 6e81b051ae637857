"""Deployment files agree with the repo: Space card, Dockerfile paths, app.py flags."""
from __future__ import annotations

import re
from pathlib import Path

import gradio
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _front_matter() -> dict[str, str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert text.startswith("---\n")
    block = text.split("---\n")[1]
    return dict(line.split(": ", 1) for line in block.strip().splitlines())


def test_space_card_front_matter():
    fm = _front_matter()
    assert fm["sdk"] == "gradio" and fm["app_file"] == "app.py" and (ROOT / fm["app_file"]).is_file()
    assert fm["sdk_version"] == gradio.__version__
    assert f"gradio=={fm['sdk_version']}" in (ROOT / "requirements.txt").read_text()
    for key in ("title", "emoji", "short_description", "license"):
        assert fm[key]
    assert len(fm["short_description"]) <= 60


def test_dockerfile_copies_existing_paths_and_runs_as_uid_1000():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim", text, re.M)
    assert "useradd -m -u 1000 user" in text and re.search(r"^USER user$", text, re.M)
    assert "EXPOSE 7860" in text and "GRADIO_SERVER_PORT=7860" in text
    for line in re.findall(r"^COPY --chown=user (.+)$", text, re.M):
        *sources, _dest = line.split()
        for src in sources:
            assert (ROOT / src).exists(), f"Dockerfile copies missing path {src}"
    assert 'CMD ["python", "app.py"]' in text and "python -m feedback prepare" in text
    assert "HEALTHCHECK" in text and "127.0.0.1:7860/api/health" in text  # the API's unauthenticated route
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_app_flags_and_environment(monkeypatch):
    import app

    monkeypatch.setenv("GRADIO_SERVER_PORT", "9999")
    monkeypatch.setenv("FEEDBACK_MODELS", "embedded,other")
    args = app.parse_args([])
    assert args.port == 9999 and args.host == "127.0.0.1" and args.models == "embedded,other"
    args = app.parse_args(["--host", "0.0.0.0", "--port", "1234", "--auth", "u:p"])
    assert (args.host, args.port, args.auth) == ("0.0.0.0", 1234, "u:p")


@pytest.mark.parametrize("auth", ["nocolon", ":p", "u:"])
def test_bad_auth_flag_exits_2(auth, capsys):
    import app

    assert app.main(["--auth", auth]) == 2
    assert "--auth expects USER:PASSWORD" in capsys.readouterr().err


def test_bad_api_setting_exits_2(monkeypatch, capsys):
    import app

    monkeypatch.setenv("FEEDBACK_API_WAIT_S", "long")
    assert app.main([]) == 2
    assert "bad FEEDBACK_API_* setting" in capsys.readouterr().err
    monkeypatch.delenv("FEEDBACK_API_WAIT_S")
    monkeypatch.setenv("FEEDBACK_QUEUE_SIZE", "many")
    assert app.main([]) == 2
    assert "the queue size (FEEDBACK_QUEUE_SIZE / --queue-size) must be a number, got 'many'" in capsys.readouterr().err
