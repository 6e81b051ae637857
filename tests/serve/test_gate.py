"""The shared model line: first come, first served; bounded waiting; timeouts; leases; places."""

from __future__ import annotations

import threading
import time

import pytest

from feedback.serve.gate import Busy, Gate


def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.005)


def test_waiters_are_served_in_arrival_order_whatever_their_kind():
    gate, order = Gate(1), []
    first = gate.acquire("ui")
    threads = []
    for name, kind in [("page-1", "ui"), ("api-1", "api"), ("api-2", "api"), ("page-2", "ui")]:

        def work(name=name, kind=kind):
            with gate.slot(kind, label=name):
                order.append(name)

        t = threading.Thread(target=work, daemon=True)
        t.start()
        threads.append(t)
        waiting = len(threads)
        _wait_for(lambda n=waiting: gate.status()["waiting"] == n)
    gate.release(first)
    for t in threads:
        t.join(5)
    assert order == ["page-1", "api-1", "api-2", "page-2"]
    assert gate.status() == {
        "capacity": 1,
        "room_mb": None,
        "running": 0,
        "waiting": 0,
        "max_waiting": None,
        "runs": [],
    }


def test_a_full_line_refuses_every_door_at_once():
    """One cap for the page and the API together: when it is full, neither door gets in ahead of
    the other; a free slot is always taken."""
    gate = Gate(1, max_waiting=1)
    assert not gate.would_refuse()
    held = gate.acquire("ui")

    def queued_api_call():
        with gate.slot("api"):
            pass

    waiter = threading.Thread(target=queued_api_call, daemon=True)
    waiter.start()
    _wait_for(lambda: gate.status()["waiting"] == 1)
    assert gate.would_refuse()
    for kind in ("api", "ui"):
        t0 = time.perf_counter()
        with pytest.raises(
            Busy, match=r"busy \(1 running, 1 waiting, the most this server lets wait\); try again in 10 s"
        ) as exc:
            gate.acquire(kind)
        assert time.perf_counter() - t0 < 0.5 and exc.value.retry_after_s == 10
    assert gate.status()["max_waiting"] == 1
    gate.release(held)
    waiter.join(5)
    assert gate.status()["running"] == 0 and not gate.would_refuse()


def test_a_wait_that_times_out_leaves_the_line():
    gate = Gate(1)
    held = gate.acquire(label="a Sweep")
    with pytest.raises(Busy, match="stayed busy for 0.1 s"):
        gate.acquire("api", timeout=0.1)
    status = gate.status()
    assert (status["running"], status["waiting"]) == (1, 0) and status["runs"][0]["label"] == "a Sweep"
    gate.release(held)
    with pytest.raises(RuntimeError):
        gate.release(held)


def test_capacity_two_runs_two_sharing_runs_at_once_and_other_work_alone():
    gate = Gate(2)
    first = gate.acquire(shares=True)
    second = gate.acquire(timeout=0.1, shares=True)
    with pytest.raises(Busy):
        gate.acquire(timeout=0.05, shares=True)  # a third: over the capacity
    gate.release(second)
    with pytest.raises(Busy):
        gate.acquire(timeout=0.05)  # work that runs alone waits for the sharing run to end
    gate.release(first)
    alone = gate.acquire(timeout=0.1)
    with pytest.raises(Busy):
        gate.acquire(timeout=0.05, shares=True)  # ... and nothing shares a step with it
    gate.release(alone)
    with pytest.raises(Exception, match="at least 1"):
        Gate(0)


def test_sharing_runs_are_admitted_while_their_memory_fits_the_room():
    gate = Gate(8, room_mb=100)
    a = gate.acquire(shares=True, need_mb=60)
    with pytest.raises(Busy):
        gate.acquire(timeout=0.05, shares=True, need_mb=50)  # 60 + 50 > 100
    b = gate.acquire(timeout=0.1, shares=True, need_mb=40)  # 60 + 40 fits
    assert gate.status()["running"] == 2
    gate.release(a)
    gate.release(b)
    # one that needs more than the whole room still runs alone (its own run's check refuses what
    # cannot fit at all, before it waits)
    big = gate.acquire(timeout=0.1, shares=True, need_mb=500)
    gate.release(big)


def test_the_first_in_line_that_cannot_start_holds_the_ones_behind_it():
    """First come, first served across kinds: a sharing request behind a Perplexity job waits for it,
    even though it could start beside the sharing run now holding the model."""
    gate = Gate(4)
    running = gate.acquire(shares=True)
    alone = gate.join("ui", "a Perplexity job")  # must wait for the run to end
    behind = gate.join("api", "an API generate request", shares=True)
    assert not gate.wait(behind, 0.05)
    gate.release(running)
    assert gate.wait(alone, 0.1) and not gate.wait(behind, 0.05)
    gate.leave(alone)
    assert gate.wait(behind, 0.1)
    gate.leave(behind)


def test_a_full_line_still_lets_a_sharing_request_start_beside_a_sharing_run():
    gate = Gate(2, max_waiting=0)
    held = gate.acquire(shares=True)
    beside = gate.acquire(timeout=0.1, shares=True)  # nobody waits, and it may start now: not refused
    with pytest.raises(Busy, match="busy"):
        gate.join("ui", "a Sweep")  # runs alone: it would have to wait, and the line holds no one
    gate.release(beside)
    gate.release(held)


def test_a_waiter_that_stops_renewing_its_lease_loses_its_place():
    """A page whose tab closed never calls `wait` again: the people behind it are not blocked."""
    gate = Gate(1, lease_s=0.3)
    held = gate.acquire(label="a Compare run")
    gone = gate.join("ui", "a Sweep")  # joins, then its page goes away
    behind = gate.join("ui", "a Deep Think run")
    place = gate.where(behind)
    assert place.position == 2 and place.ahead == ["a Sweep"] and place.running[0][0] == "a Compare run"
    gate.release(held)
    t0 = time.monotonic()
    while not gate.wait(behind, 0.1):
        assert time.monotonic() - t0 < 3
    assert 0.2 < time.monotonic() - t0 < 2  # served once the abandoned ticket's lease ran out
    assert gate.status()["waiting"] == 0 and gate.status()["runs"][0]["label"] == "a Deep Think run"
    gate.leave(behind)
    gate.leave(gone)  # leaving twice, or after losing the place, is harmless
    assert gate.status()["running"] == 0


def test_leaving_the_line_lets_the_next_one_in_and_cancelled_acquire_gives_up():
    gate = Gate(1)
    held = gate.acquire()
    waiting = gate.join("ui", "first")
    gate.leave(waiting)  # Stop pressed while waiting
    assert gate.status()["waiting"] == 0
    flag = threading.Event()
    result: list = []
    t = threading.Thread(
        target=lambda: result.append(pytest.raises(Busy, gate.acquire, "api", None, "x", flag.is_set))
    )
    t.start()
    _wait_for(lambda: gate.status()["waiting"] == 1)
    flag.set()  # the HTTP client hung up
    t.join(5)
    assert result and gate.status()["waiting"] == 0
    gate.release(held)
