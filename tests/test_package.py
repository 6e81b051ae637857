"""The installable package (pyproject.toml): a wheel built here, offline and in about a second, holds
every package of `feedback` and `ui` (subpackages found, not listed), the files they read beside
their code, the `feedback-lens` command and lm-eval entry point, and the pinned requirements as its
dependencies and extras; tasks.py installs the same requirement files.

A real install into a fresh virtualenv (`python3 -m venv V && V/bin/pip install .`, then
`V/bin/feedback-lens --help` from another folder) takes minutes and the package index; it is not
repeated here."""

from __future__ import annotations

import configparser
import importlib.metadata as md
import importlib.util
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
DATA_SUFFIXES = {".js", ".css", ".json", ".jsonl", ".html"}  # what the code reads beside itself
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "feedback", "ui")


def _requirement_files() -> dict[str, list[str]]:
    """The requirement files pyproject reads: "dependencies", and each extra by name."""
    dynamic = PYPROJECT["tool"]["setuptools"]["dynamic"]
    out = {"dependencies": dynamic["dependencies"]["file"]}
    out |= {extra: spec["file"] for extra, spec in dynamic["optional-dependencies"].items()}
    return {k: [v] if isinstance(v, str) else v for k, v in out.items()}


def _requirements(*names: str) -> list[str]:
    lines = [line.strip() for name in names for line in (ROOT / name).read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """A wheel of a clean copy of the sources (no build/ left over from an earlier build in the
    checkout, no __pycache__), built without the network: no build isolation, no index."""
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("package")
    src = tmp / "src"
    for name in [*SOURCES, *{f for files in _requirement_files().values() for f in files}]:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(path, src / name)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [built] = (tmp / "dist").glob("feedback_lens-*.whl")
    with zipfile.ZipFile(built) as zf:
        yield zf


def _dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    [path] = [n for n in wheel.namelist() if n.endswith(f".dist-info/{name}")]
    return wheel.read(path).decode()


def test_the_wheel_holds_every_package_and_the_files_read_beside_the_code(wheel):
    names = set(wheel.namelist())
    for top in ("feedback", "ui"):
        for path in (ROOT / top).rglob("*"):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            if path.suffix == ".py" or path.suffix in DATA_SUFFIXES:
                assert path.relative_to(ROOT).as_posix() in names, (
                    f"{path.relative_to(ROOT)} is not in the wheel"
                )
    assert "ui/compare/board.js" in names
    # the library's data (example prompts, built-in questions) is inside the package
    from feedback import ASSETS

    assert {f"feedback/assets/{p.name}" for p in ASSETS.iterdir() if p.is_file()} <= names
    assert not [n for n in names if n.startswith(("tests/", "docs/")) or "__pycache__" in n]


def test_the_command_and_the_lm_eval_entry_point(wheel):
    ini = configparser.ConfigParser(delimiters=("=",))
    ini.optionxform = str  # names as written
    ini.read_string(_dist_info(wheel, "entry_points.txt"))
    points = {
        (group, name): md.EntryPoint(name, value, group)
        for group in ini.sections()
        for name, value in ini[group].items()
    }
    script = points[("console_scripts", "feedback-lens")]
    assert script.value == "feedback.cli:main"
    assert callable(script.load())  # `feedback-lens` is `python -m feedback` (feedback/__main__.py calls it)
    model = points[("lm_eval.models", "feedback-lens")]
    assert model.value == "feedback.eval.lmeval:FeedbackLM"
    pytest.importorskip("lm_eval")
    from lm_eval.api.model import LM
    from lm_eval.api.registry import Registry

    from feedback.eval.lmeval import NAME, FeedbackLM

    # what lm-eval's plugin discovery does with it (PR #4013; 0.4.13 reads no entry points): a lazy
    # placeholder in the model registry, loaded when the name is asked for
    registry = Registry("model", base_cls=LM)
    registry.register(model.name, target=model)
    assert model.name == NAME and registry.get(NAME) is FeedbackLM


def test_the_dependencies_are_the_pinned_requirement_files(wheel):
    lines = _dist_info(wheel, "METADATA").splitlines()
    requires = [Requirement(line.split(": ", 1)[1]) for line in lines if line.startswith("Requires-Dist: ")]
    files = _requirement_files()
    assert sorted(str(r) for r in requires if r.marker is None) == sorted(
        str(Requirement(r)) for r in _requirements(*files.pop("dependencies"))
    )
    extras = {line.split(": ", 1)[1] for line in lines if line.startswith("Provides-Extra: ")}
    assert extras == set(files) and {"eval", "dev"} <= extras
    for extra, names in files.items():
        wanted = {Requirement(r).name for r in _requirements(*names)}
        got = {r.name for r in requires if r.marker is not None and r.marker.evaluate({"extra": extra})}
        assert got == wanted, extra
    assert any(str(r) == "torch==2.13.0" for r in requires)


def test_requirement_files_are_plain_and_tasks_installs_what_pyproject_reads():
    files = _requirement_files()
    for name in {f for group in files.values() for f in group}:
        # setuptools reads these as requirement lines: an include (-r) or a pip option would break the build
        assert not [line for line in _requirements(name) if line.startswith("-")], name
        for line in _requirements(name):
            Requirement(line)
    spec = importlib.util.spec_from_file_location("tasks", ROOT / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    assert list(tasks.RUN_REQUIREMENTS) == files["dependencies"]
    assert set(tasks.TEST_REQUIREMENTS) == {f for group in files.values() for f in group}
