"""The shared model line: first come, first served; bounded waiting; timeouts."""
from __future__ import annotations

import threading
import time

import pytest

from feedback.gate import Busy, Gate


def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.005)


def test_waiters_are_served_in_arrival_order_whatever_their_kind():
    gate, order = Gate(1), []
    gate.acquire("ui")
    threads = []
    for name, kind in [("page-1", "ui"), ("api-1", "api"), ("api-2", "api"), ("page-2", "ui")]:
        def work(name=name, kind=kind):
            with gate.slot(kind):
                order.append(name)
        t = threading.Thread(target=work)
        t.start()
        threads.append(t)
        _wait_for(lambda n=len(threads): gate.status()["waiting"] == n)
    gate.release()
    for t in threads:
        t.join(5)
    assert order == ["page-1", "api-1", "api-2", "page-2"]
    assert gate.status() == {"capacity": 1, "running": 0, "waiting": 0}


def test_a_full_line_for_one_kind_refuses_at_once_but_not_other_kinds():
    gate = Gate(1)
    assert not gate.would_refuse("api", 0)  # a free slot is always taken
    gate.acquire("ui")
    def queued_api_call():
        with gate.slot("api", max_waiting=1):
            pass

    waiter = threading.Thread(target=queued_api_call)
    waiter.start()
    _wait_for(lambda: gate.status()["waiting"] == 1)
    assert gate.would_refuse("api", 1)
    t0 = time.perf_counter()
    with pytest.raises(Busy, match="busy"):
        gate.acquire("api", max_waiting=1)
    assert time.perf_counter() - t0 < 0.5
    assert not gate.would_refuse("ui", None)
    gate.release()
    waiter.join(5)
    assert gate.status()["running"] == 0


def test_a_wait_that_times_out_leaves_the_line():
    gate = Gate(1)
    gate.acquire()
    with pytest.raises(Busy, match="stayed busy for 0.1 s"):
        gate.acquire("api", timeout=0.1)
    assert gate.status() == {"capacity": 1, "running": 1, "waiting": 0}
    gate.release()
    with pytest.raises(RuntimeError):
        gate.release()


def test_capacity_two_runs_two_at_once():
    gate = Gate(2)
    gate.acquire()
    gate.acquire(timeout=0.1)
    with pytest.raises(Busy):
        gate.acquire(timeout=0.05)
    with pytest.raises(Exception, match="at least 1"):
        Gate(0)
