"""First-come, first-served admission to model work, shared by the page and the HTTP API.

Every caller takes a `Ticket`, waits in one line, runs while it holds a slot, and leaves. A ticket
that `shares` (an engine run, which decodes beside the others in the model's one decode loop:
`feedback.core.sharing`) may start while other sharing tickets run, up to `capacity` of them and
while their memory needs (`need_mb`, the run's cache and scoring) fit `room_mb` together; any other
work (perplexity, sweeps, tuning) runs alone. The line's order is kept whatever the kind: the first
in line that cannot start yet holds the ones behind it. Waiting is
done in short `wait` calls, each of which renews the ticket's lease: a waiter that stops renewing
(its browser tab closed, its generator was never resumed, its HTTP client hung up) loses its place
within `lease_s` seconds, so an abandoned request never blocks the people behind it. A ticket that
holds a slot has no lease: whoever holds it must leave on every exit path (the callers do so in
`finally` blocks, and their work stops within a step when its caller goes away).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from feedback.errors import FeedbackError

LEASE_S = 3.0
RETRY_AFTER_S = 10  # what a refused caller is told to wait before trying again


class Busy(FeedbackError):
    """The model is busy: the waiting line for this kind of caller is full, or the wait timed out."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class Ticket:
    """One caller's place: in the line, then holding a slot. `label` says what it runs ("a Sweep
    from the page", "an API generate request"), for the people waiting behind it."""

    kind: str
    label: str
    need_mb: float | None = None  # memory it holds while it runs (a sharing ticket is admitted by it)
    shares: bool = False  # decodes beside other sharing tickets' runs
    joined: float = field(default_factory=time.monotonic)
    seen: float = field(default_factory=time.monotonic)  # last renewal of the lease while waiting
    started: float | None = None  # when it got a slot
    left: bool = False


@dataclass
class Place:
    """Where a waiting ticket stands: 1 = next; what runs now and what waits ahead of it."""

    position: int
    running: list[tuple[str, float]]  # (label, seconds it has run)
    ahead: list[str]


class Gate:
    """At most `capacity` sharing runs at once (while their needs fit `room_mb`; None: no memory
    limit), any other work alone; live waiters are served strictly in arrival order, whatever door
    they came through, and at most `max_waiting` of them wait at once (None: no cap).

    One line and one cap for every door is what keeps it fair: a page request that is already
    waiting is served before an API request that came later, and when the line is full every
    door refuses alike (none loses its place to another)."""

    def __init__(
        self,
        capacity: int = 1,
        lease_s: float = LEASE_S,
        max_waiting: int | None = None,
        room_mb: float | None = None,
    ):
        if capacity < 1:
            raise FeedbackError(f"concurrency must be at least 1, got {capacity}")
        self.capacity = capacity
        self.room_mb = room_mb
        self.lease_s = lease_s
        self.max_waiting = max_waiting
        self._line: deque[Ticket] = deque()
        self._running: list[Ticket] = []
        self._cond = threading.Condition()

    # ---- the line ----
    def join(
        self, kind: str = "ui", label: str = "", need_mb: float | None = None, shares: bool = False
    ) -> Ticket:
        """A ticket at the end of the line (`need_mb`, `shares`: see `Ticket`). Raises `Busy` at once
        when `max_waiting` live callers are already waiting (unless a slot is free right now)."""
        with self._cond:
            self._drop_stale()
            ticket = Ticket(kind, label or kind, need_mb, shares)
            if self._refuses(ticket):
                raise Busy(
                    f"the model is busy ({len(self._running)} running, {len(self._line)} waiting, the most "
                    f"this server lets wait); try again in {RETRY_AFTER_S} s"
                )
            self._line.append(ticket)
            return ticket

    def wait(self, ticket: Ticket, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a slot, renewing the ticket's lease; True once it holds one.
        A ticket that lost its place by not renewing in time goes back to the end of the line."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                now = time.monotonic()
                if ticket.left:
                    raise RuntimeError("Gate.wait on a ticket that has left")
                if ticket.started is not None:
                    return True
                ticket.seen = now
                self._drop_stale()
                if ticket not in self._line:
                    self._line.append(ticket)
                if self._line[0] is ticket and self._admits(ticket):
                    self._line.popleft()
                    ticket.started = now
                    self._running.append(ticket)
                    self._cond.notify_all()  # with capacity > 1 the next in line may start too
                    return True
                remaining = deadline - now
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, self.lease_s / 3))

    def _admits(self, ticket: Ticket) -> bool:
        """Caller holds the lock. Whether `ticket` may start beside the running ones: anything when
        nothing runs; a sharing ticket beside sharing ones while they are fewer than `capacity` and
        their memory needs, its own included, fit `room_mb`."""
        if not self._running:
            return True
        if not ticket.shares or not all(t.shares for t in self._running):
            return False
        if len(self._running) >= self.capacity:
            return False
        if self.room_mb is None:
            return True
        return sum(t.need_mb or 0.0 for t in self._running) + (ticket.need_mb or 0.0) <= self.room_mb

    def leave(self, ticket: Ticket) -> None:
        """Give up the place in line, or the slot; safe to call more than once."""
        with self._cond:
            if ticket.left:
                return
            ticket.left = True
            if ticket in self._running:
                self._running.remove(ticket)
            elif ticket in self._line:
                self._line.remove(ticket)
            self._cond.notify_all()

    def where(self, ticket: Ticket) -> Place:
        with self._cond:
            self._drop_stale()
            now = time.monotonic()
            running = [(t.label, now - t.started) for t in self._running]
            if ticket.started is not None or ticket not in self._line:
                return Place(0, running, [])
            index = self._line.index(ticket)
            return Place(index + 1, running, [t.label for t in list(self._line)[:index]])

    # ---- blocking use from a worker thread ----
    def acquire(
        self,
        kind: str = "ui",
        timeout: float | None = None,
        label: str = "",
        cancelled: Callable[[], bool] | None = None,
        need_mb: float | None = None,
        shares: bool = False,
    ) -> Ticket:
        """Wait (blocking) for a slot. Raises `Busy` when the line is full or `timeout` seconds
        pass first; leaves the line at once when `cancelled()` turns true."""
        ticket = self.join(kind, label, need_mb, shares)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                step = self.lease_s / 3
                if deadline is not None:
                    step = min(step, deadline - time.monotonic())
                if step > 0 and self.wait(ticket, step):
                    return ticket
                if deadline is not None and time.monotonic() >= deadline:
                    raise Busy(f"the model stayed busy for {timeout:g} s; try again")
                if cancelled is not None and cancelled():
                    raise Busy("the caller left before its turn")
        except BaseException:
            self.leave(ticket)
            raise

    def release(self, ticket: Ticket) -> None:
        if ticket.started is None or ticket.left:
            raise RuntimeError("Gate.release of a ticket that holds no slot")
        self.leave(ticket)

    @contextmanager
    def slot(
        self,
        kind: str = "ui",
        timeout: float | None = None,
        label: str = "",
        cancelled: Callable[[], bool] | None = None,
        need_mb: float | None = None,
        shares: bool = False,
    ) -> Iterator[Ticket]:
        ticket = self.acquire(kind, timeout, label, cancelled, need_mb, shares)
        try:
            yield ticket
        finally:
            self.leave(ticket)

    # ---- state ----
    def would_refuse(self) -> bool:
        """Whether `join` would raise `Busy` at once right now."""
        with self._cond:
            self._drop_stale()
            return self._refuses()

    def status(self) -> dict:
        """Counts, and what runs now (labels and seconds) — no prompts or other request contents."""
        with self._cond:
            self._drop_stale()
            now = time.monotonic()
            return {
                "capacity": self.capacity,
                "room_mb": self.room_mb,
                "running": len(self._running),
                "waiting": len(self._line),
                "max_waiting": self.max_waiting,
                "runs": [{"label": t.label, "seconds": round(now - t.started, 1)} for t in self._running],
            }

    def _drop_stale(self) -> None:
        """Caller holds the lock. Waiters that stopped renewing their lease lose their place."""
        now = time.monotonic()
        stale = [t for t in self._line if now - t.seen > self.lease_s]
        for t in stale:
            self._line.remove(t)
        if stale:
            self._cond.notify_all()

    def _refuses(self, ticket: Ticket | None = None) -> bool:
        """Caller holds the lock. A full line refuses, unless the line is empty and `ticket` (None:
        work that runs alone) could start right now."""
        if self.max_waiting is None or (not self._line and self._admits(ticket or Ticket("", ""))):
            return False
        return len(self._line) >= self.max_waiting
