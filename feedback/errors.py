"""The one exception type for user errors: shown as a one-line message, never a traceback."""
from __future__ import annotations

import threading


class FeedbackError(ValueError):
    """Bad input or an unusable environment, explained in words a user can act on."""


class Stopped(FeedbackError):
    """A job ended early because it was asked to: Stop, a cancelled request, or its caller left."""


def check_stop(stop: threading.Event | None, what: str = "the job") -> None:
    """Raise `Stopped` when `stop` is set. Long jobs call this between windows, documents, grid
    points and traces, so they end within one of those after their caller goes away."""
    if stop is not None and stop.is_set():
        raise Stopped(f"{what} was stopped")
