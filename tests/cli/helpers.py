"""How the command-line tests run `python -m feedback`, through the same `main` it calls.

Most commands run in-process (`in_process`): a subprocess spends ~4-6 s importing torch and
transformers before seconds of work, and the model loads from the local cache in ~1 s. Each run's
stdout and stderr are captured and it returns what a subprocess would (exit status, stdout,
stderr); the process-wide state a run may change (environment, torch's thread count and fp32
matmul precision, working directory) is put back so later tests in the session see none of it.
The CLI prints its own warnings to stderr, so they are captured; Python `warnings` would go to
pytest's recorder instead, and log handlers keep the stream they were made with (none is asserted
on). The unknown hub model runs in-process too: the loader reads HF_HUB_OFFLINE on every load.
Refused inputs, which never get as far as a run, go through `refused`.

Real processes (`cli`), kept where only a process shows it: a user's run with its exit status from
`sys.exit` in `feedback/__main__.py` (one refused input: one line, status 2, no traceback), and the
bench, which times cold starts and its own subprocesses."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import torch

from feedback.cli import main

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m feedback ARGS` in a real process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "feedback", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@contextlib.contextmanager
def _process_state_kept():
    """Run in ROOT (as `cli` does), then put back what a run may change for the whole process: the
    environment, torch's CPU threads (FEEDBACK_THREADS) and its fp32 matmul precision (--fast-matmul)."""
    env = dict(os.environ)
    threads = torch.get_num_threads()
    precision = torch.backends.mkldnn.matmul.fp32_precision
    try:
        with contextlib.chdir(ROOT):
            yield
    finally:
        for key in set(os.environ) - set(env):
            del os.environ[key]
        os.environ.update({k: v for k, v in env.items() if os.environ.get(k) != v})
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.backends.mkldnn.matmul.fp32_precision = precision


def _exit_status(args: list[str]) -> int:
    """`main(args)`'s exit status, argparse's exits (usage errors, --help) included."""
    with _process_state_kept():
        try:
            return main(args)
        except SystemExit as exc:
            return 0 if exc.code is None else exc.code


def in_process(*args: str) -> subprocess.CompletedProcess:
    """`python -m feedback ARGS` in this process: its exit status and everything it prints, as
    `cli` returns them. An uncaught exception propagates (a subprocess would print a traceback)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _exit_status(list(args))
    return subprocess.CompletedProcess(
        ["python", "-m", "feedback", *args], code, out.getvalue(), err.getvalue()
    )


def refused(capsys, *args: str) -> str:
    """Run `python -m feedback ARGS` in-process; it must exit with status 2. Returns stderr."""
    code = _exit_status(list(args))
    err = capsys.readouterr().err
    assert code == 2, err
    return err
