"""A typed setting's bounds, declared once and read by every door.

A `Bound` names a field as users see it and says what values it takes. The config dataclasses
validate with it, the HTTP API's pydantic fields take `ge`/`le` from it, the page's number boxes
their `minimum`/`maximum` and the command line its checks, so a limit cannot drift between doors
and every refusal names the field the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from feedback.errors import FeedbackError


@dataclass(frozen=True)
class Bound:
    name: str
    lo: float
    hi: float
    integer: bool = False

    @property
    def info(self) -> str:
        """The range as a control's hint shows it: "1 to 1,024"."""
        return f"{self.lo:,g} to {self.hi:,g}" if not self.integer else f"{int(self.lo):,} to {int(self.hi):,}"

    def check(self, value, name: str | None = None) -> float | int:
        """`value` as a number inside the bounds, or a `FeedbackError` naming the field (`name`, or
        the bound's own). Accepts typed text, as a page's number box may send it."""
        name = name or self.name
        if isinstance(value, bool):
            raise FeedbackError(f"{name} must be a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise FeedbackError(f"{name} must be a number, got {value!r}") from None
        if not math.isfinite(number):
            raise FeedbackError(f"{name} must be finite, got {value!r}")
        if self.integer and not number.is_integer():
            raise FeedbackError(f"{name} must be a whole number, got {value!r}")
        out = int(number) if self.integer else number
        if not self.lo <= out <= self.hi:
            raise FeedbackError(f"{name} must be between {self.lo:g} and {self.hi:g}, got {out}")
        return out

    def with_hi(self, hi: float) -> "Bound":
        """The same field with a lower ceiling (a served cap under a library limit)."""
        return Bound(self.name, self.lo, min(self.hi, hi), self.integer)
