"""The one exception type for user errors: shown as a one-line message, never a traceback."""

from __future__ import annotations

import threading


class FeedbackError(ValueError):
    """Bad input or an unusable environment, explained in words a user can act on."""


class Stopped(FeedbackError):
    """A job ended early because it was asked to: Stop, a cancelled request, or its caller left."""


def one_line(exc: BaseException) -> str:
    """A failure as one line: a user error's own words; anything else (a bug, a model or a machine
    failing mid-run) its type and the first line of its message, which is enough to recognise and
    report it (a torch error's message can run to many lines)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else "(no message)"
    return first if isinstance(exc, FeedbackError) else f"{type(exc).__name__}: {first}"


def check_stop(stop: threading.Event | None, what: str = "the job") -> None:
    """Raise `Stopped` when `stop` is set. Long jobs call this between windows, documents, grid
    points and traces, so they end within one of those after their caller goes away."""
    if stop is not None and stop.is_set():
        raise Stopped(f"{what} was stopped")
