"""Whether a strategy beats the baseline: the one verdict on a ΔPPL % and its 95% CI that every
report naming a "best" setting gives (the Sweep and Tune of the page, `python -m feedback sweep` and
`tune`). ΔPPL > 0 means the strategy made perplexity worse than the baseline.

- improves: ΔPPL < 0 and the CI lies wholly below 0: a real improvement on these texts;
- within noise: ΔPPL < 0 but the CI reaches 0 (or there is no CI): lower, yet a rerun could go
  either way;
- worse: ΔPPL ≥ 0, or the CI wholly above 0: no better than the baseline.

Only a setting that beats the baseline (improves, or within noise) is ever recommended; a tuned
setting must also not be worse on the held-out text it is confirmed on (`not_recommended`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

IMPROVES, NOISE, WORSE = "improves", "within noise", "worse"


@dataclass(frozen=True)
class Verdict:
    kind: str  # IMPROVES, NOISE or WORSE
    text: str  # in words, for a status line: "CI excludes 0: a real improvement"

    @property
    def beats_baseline(self) -> bool:
        return self.kind != WORSE


def _number(value) -> bool:
    """A finite number (numpy's too); None and NaN (no bootstrap, a value json_safe blanked) are not."""
    try:
        return value is not None and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def verdict(delta_pct: float | None, ci95: Sequence[float | None] | None) -> Verdict:
    """The verdict on ΔPPL % `delta_pct` with its 95% CI `ci95` ([low, high] %; None, or NaN ends,
    when there was no bootstrap). A missing ΔPPL is no evidence of beating the baseline: worse."""
    lo, hi = ci95 if ci95 is not None and len(ci95) == 2 else (None, None)
    has_ci = _number(lo) and _number(hi)
    if has_ci and lo > 0:
        return Verdict(WORSE, "worse than the baseline: CI above 0")
    if not _number(delta_pct) or delta_pct >= 0:
        return Verdict(WORSE, "no better than the baseline: ΔPPL ≥ 0" + ("; CI spans 0" if has_ci else ""))
    if has_ci and hi < 0:
        return Verdict(IMPROVES, "CI excludes 0: a real improvement")
    return Verdict(
        NOISE, "within noise: CI spans 0" if has_ci else "lower, but untested: no CI (bootstrap off)"
    )


def ci_text(lo, hi) -> str:
    """A 95% CI as reports print it, "[-0.512, +0.104]", or "(no CI)" without a bootstrap (NaN, or
    None once saved as JSON)."""
    return f"[{lo:+.3f}, {hi:+.3f}]" if _number(lo) and _number(hi) else "(no CI)"


def not_recommended(best: Verdict, test: Verdict | None = None, noun: str = "point") -> str | None:
    """Why a best setting is no recommendation, in words ("no point beats the baseline"), or None
    when it is one: it beats the baseline and, when `test` (its score on held-out text) is given,
    is not worse there."""
    if not best.beats_baseline:
        return f"no {noun} beats the baseline"
    if test is not None and not test.beats_baseline:
        return f"the best {noun} is not confirmed on the test text: there it is {test.text}"
    return None
