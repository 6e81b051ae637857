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

# A ceiling this high is an integer type's (a seed's), not a choice: refusals say "at least 0".
TYPE_CEILING = 2**53


@dataclass(frozen=True)
class Bound:
    name: str
    lo: float | None  # None: no floor
    hi: float | None  # None: no ceiling
    integer: bool = False

    @property
    def info(self) -> str:
        """The range as a control's hint shows it: "1 to 1,024", "at least 0"."""
        show = (lambda v: f"{int(v):,}") if self.integer else (lambda v: f"{v:,g}")
        if self.lo is None or self.hi is None:
            return (
                "any number"
                if self.lo is None and self.hi is None
                else (f"at least {show(self.lo)}" if self.hi is None else f"at most {show(self.hi)}")
            )
        return f"{show(self.lo)} to {show(self.hi)}"

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
        if (self.lo is not None and out < self.lo) or (self.hi is not None and out > self.hi):
            raise FeedbackError(
                f"{name} must be {self._range(self.lo is not None and out < self.lo)}, got {out}"
            )
        return out

    def _range(self, below: bool = False) -> str:
        """The range a refusal states; a value under a floor whose ceiling is only an integer
        type's (a seed's) is told the floor alone."""
        hi = None if below and self.hi is not None and self.hi >= TYPE_CEILING else self.hi
        if self.lo is not None and hi is not None:
            return f"between {self.lo:g} and {hi:g}"
        return f"at least {self.lo:g}" if self.lo is not None else f"at most {hi:g}"

    def with_hi(self, hi: float) -> Bound:
        """The same field with a lower ceiling (a served cap under a library limit)."""
        return Bound(self.name, self.lo, hi if self.hi is None else min(self.hi, hi), self.integer)
