"""DeepConf's offline pieces: threshold calibration, answer extraction and (weighted) voting.

Calibration: run warm-up traces, take each trace's lowest group confidence, and set the online
early-stop threshold to s = percentile(100 - eta) of them, eta being the share of traces kept:
DeepConf-low keeps the 10% most confident (aggressive), DeepConf-high keeps 90% (safe).
Voting: stopped traces never vote (their tokens still count as cost); a confidence-weighted vote
first keeps the top eta% traces by that confidence, then sums their confidences per answer.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from feedback.errors import FeedbackError

PRESETS = {"deepconf-low": 10.0, "deepconf-high": 90.0}


def check_eta(eta: float) -> float:
    if not isinstance(eta, (int, float)) or not math.isfinite(eta) or not 0 < eta <= 100:
        raise FeedbackError(f"eta (the share of traces kept, in %) must be in (0, 100], got {eta!r}")
    return float(eta)


def calibrate_threshold(lowest_groups: Sequence[float], eta: float) -> float:
    """Early-stop threshold from warm-up traces' lowest group confidences: percentile(100 - eta)."""
    check_eta(eta)
    values = [v for v in lowest_groups if v is not None and math.isfinite(v)]
    if not values:
        raise FeedbackError("calibration needs at least one warm-up trace with a confidence")
    return float(np.percentile(values, 100.0 - eta))


_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER = re.compile(r"answer\s*(?:is)?\s*[:=]\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced."""
    last = None
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            last = text[m.end():i - 1]
    return last


def normalise(answer: str) -> str:
    """Comparable form: trimmed, lower case, no trailing punctuation; numbers canonical (1,000.0 -> 1000)."""
    a = answer.strip().strip("$").strip().rstrip(".!;,").strip().lower()
    a = re.sub(r"\s+", " ", a)
    if _NUMBER.fullmatch(a):
        value = float(a.replace(",", ""))
        return str(int(value)) if value.is_integer() else repr(value)
    return a


def compile_answer_regex(pattern: str | None) -> re.Pattern | None:
    if pattern is None:
        return None
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise FeedbackError(f"answer regex does not compile: {exc}") from None
    return compiled


def extract_answer(text: str, pattern: re.Pattern | None = None) -> str | None:
    """The trace's final answer, normalised: a user regex (its first group, else the match), else
    \\boxed{...}, else a final "Answer: ...", else the whole reply when it is a short phrase of up to
    three words with a letter in it ("Paris.", "H2O"), else the last number; None if nothing is found."""
    if pattern is not None:
        matches = list(pattern.finditer(text))
        if not matches:
            return None
        m = matches[-1]
        return normalise(m.group(1) if m.groups() else m.group(0))
    boxed = _boxed(text)
    if boxed is not None and boxed.strip():
        return normalise(boxed)
    answers = _ANSWER.findall(text)
    if answers:
        line = answers[-1].strip().splitlines()[0] if answers[-1].strip() else ""
        numbers = _NUMBER.findall(line)
        if line:
            return normalise(numbers[0] if numbers and _NUMBER.fullmatch(line.rstrip(".").strip()) else line)
    short = text.strip().rstrip(".!")
    if short and len(short.split()) <= 3 and re.search(r"[^\W\d_]", short):
        return normalise(short)
    numbers = _NUMBER.findall(text)
    return normalise(numbers[-1]) if numbers else None


@dataclass
class Trace:
    """One finished (or stopped) trace as voting sees it."""

    answer: str | None
    stopped: bool
    tokens: int
    lowest_group: float
    tail: float


@dataclass
class Vote:
    answer: str | None
    share: float  # the winner's share of the (weighted) votes
    tallies: dict[str, float]
    voters: int


def vote(traces: Sequence[Trace], weight: str | None = None, eta: float = 100.0) -> Vote:
    """Majority (`weight=None`) or confidence-weighted vote (`lowest_group` or `tail`) over the traces
    that were not stopped and have an answer; the weighted vote first keeps the top `eta`% of them
    by that confidence. Ties go to the answer reached first in trace order."""
    check_eta(eta)
    eligible = [t for t in traces if not t.stopped and t.answer is not None]
    if weight is not None:
        if weight not in ("lowest_group", "tail"):
            raise FeedbackError(f"vote weight must be lowest_group or tail, got {weight!r}")
        eligible = [t for t in eligible if math.isfinite(getattr(t, weight))]
        if eligible and eta < 100:
            cut = np.percentile([getattr(t, weight) for t in eligible], 100.0 - eta)
            eligible = [t for t in eligible if getattr(t, weight) >= cut]
    tallies: dict[str, float] = defaultdict(float)
    for t in eligible:
        tallies[t.answer] += getattr(t, weight) if weight else 1.0
    if not tallies:
        return Vote(None, 0.0, {}, 0)
    best = max(tallies.values())
    winner = next(a for a in tallies if tallies[a] == best)  # dicts keep first-seen order
    total = sum(tallies.values())
    return Vote(winner, best / total if total else 0.0, dict(tallies), len(eligible))
