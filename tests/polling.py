"""Waiting in a test for something another thread or process makes true."""

from __future__ import annotations

import time


def wait_for(condition, what: str, within_s: float = 10.0, every_s: float = 0.05) -> None:
    """Return once `condition()` is true; fail, naming `what`, if it is not within `within_s`."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < within_s, f"{what}: not within {within_s} s"
        time.sleep(every_s)
