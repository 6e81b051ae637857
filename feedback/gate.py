"""First-come, first-served admission to model work, shared by the UI and the HTTP API."""
from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Iterator

from feedback.errors import FeedbackError


class Busy(FeedbackError):
    """The model is busy: the waiting line for this kind of caller is full, or the wait timed out."""

    def __init__(self, message: str, retry_after_s: int = 5):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Gate:
    """At most `capacity` runs at once; waiters are served strictly in arrival order.

    The order is what keeps the page responsive: however many API requests arrive, a page request
    that is already waiting is served before any of them, and each kind can cap its own line."""

    def __init__(self, capacity: int = 1):
        if capacity < 1:
            raise FeedbackError(f"concurrency must be at least 1, got {capacity}")
        self.capacity = capacity
        self._running = 0
        self._line: deque[tuple[object, str]] = deque()
        self._cond = threading.Condition()

    def acquire(self, kind: str = "ui", max_waiting: int | None = None, timeout: float | None = None) -> None:
        """Wait for a slot. Raises `Busy` at once when `kind` already has `max_waiting` callers
        waiting, or when `timeout` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._refuses(kind, max_waiting):
                raise Busy(f"the model is busy ({self._running} running, {len(self._line)} waiting); try again")
            ticket = (object(), kind)
            self._line.append(ticket)
            while not (self._line[0] is ticket and self._running < self.capacity):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._line.remove(ticket)
                    self._cond.notify_all()
                    raise Busy(f"the model stayed busy for {timeout:g} s; try again")
                self._cond.wait(remaining)
            self._line.popleft()
            self._running += 1
            self._cond.notify_all()  # with capacity > 1 the next in line may start too

    def release(self) -> None:
        with self._cond:
            if self._running <= 0:
                raise RuntimeError("Gate.release without a matching acquire")
            self._running -= 1
            self._cond.notify_all()

    @contextmanager
    def slot(self, kind: str = "ui", max_waiting: int | None = None, timeout: float | None = None) -> Iterator[None]:
        self.acquire(kind, max_waiting, timeout)
        try:
            yield
        finally:
            self.release()

    def would_refuse(self, kind: str, max_waiting: int | None) -> bool:
        """Whether `acquire(kind, max_waiting)` would raise `Busy` at once right now."""
        with self._cond:
            return self._refuses(kind, max_waiting)

    def status(self) -> dict:
        with self._cond:
            return {"capacity": self.capacity, "running": self._running, "waiting": len(self._line)}

    def _refuses(self, kind: str, max_waiting: int | None) -> bool:
        """Caller holds the lock. A full line for `kind` refuses, unless a slot is free right now."""
        if max_waiting is None or (not self._line and self._running < self.capacity):
            return False
        return sum(1 for _, k in self._line if k == kind) >= max_waiting
