"""Bound: a setting's range, declared once; the refusals every door shows."""

from __future__ import annotations

import pytest

from feedback.core.bounds import Bound
from feedback.errors import FeedbackError


def test_check_takes_typed_text_and_names_the_field():
    b = Bound("max new tokens", 1, 1024, integer=True)
    assert b.check("12") == 12 and b.check(3.0) == 3 and isinstance(b.check("3"), int)
    for value, message in [
        (0, "max new tokens must be between 1 and 1024, got 0"),
        ("x", "must be a number"),
        (1.5, "must be a whole number"),
        (float("inf"), "must be finite"),
        (True, "must be a number"),
    ]:
        with pytest.raises(FeedbackError, match=message):
            b.check(value)
    with pytest.raises(FeedbackError, match="^window must be"):
        b.check(2000, "window")


def test_one_sided_bounds_say_which_side():
    with pytest.raises(FeedbackError, match="seed must be at least 0, got -1"):
        Bound("seed", 0, None, integer=True).check(-1)
    with pytest.raises(FeedbackError, match="x must be at most 2, got 3"):
        Bound("x", None, 2).check(3)
    assert Bound("t", None, None).check("-1e9") == -1e9


def test_info_and_a_lower_ceiling():
    assert Bound("n", 1, 1024, integer=True).info == "1 to 1,024"
    assert Bound("p", 0.0, 1.0).info == "0 to 1" and Bound("s", 0, None, integer=True).info == "at least 0"
    served = Bound("n", 1, 4096, integer=True).with_hi(1024)
    assert (served.lo, served.hi, served.integer) == (1, 1024, True)
    assert Bound("n", 1, None).with_hi(8).hi == 8
