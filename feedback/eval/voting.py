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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from feedback.core.bounds import Bound
from feedback.core.patterns import MATCH_TIMEOUT_S, compile_pattern
from feedback.errors import FeedbackError

PRESETS = {"deepconf-low": 10.0, "deepconf-high": 90.0}
# eta, the share of traces kept, in %: any share in (0, 100]; a number box needs a closed range,
# so the doors that take it typed offer this one (its floor the smallest share they offer).
ETA = Bound("eta", 0.0001, 100)


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


# a user's answer regex gets this long per trace: a backtracking pattern cannot hold the model line
REGEX_TIMEOUT_S = MATCH_TIMEOUT_S

_BOXED = re.compile(r"\\boxed\s*\{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_SENTENCE_END = r"(?:[.!](?:\s|$)|\n|$)"
# "The answer is 17.", "Answer: Paris", "the answer to the question "…?" is 30": the value up to the
# end of its sentence. The words between "answer" and "is" stay inside one sentence.
_STATED = re.compile(
    r"\banswer\b(?:\s+to\b(?:\"[^\"\n]*\"|“[^”\n]*”|[^.!\n\"“])*?)?\s*(?:\bis\b|:|=)\s*"
    r"(?P<value>.+?)" + _SENTENCE_END,
    re.IGNORECASE,
)
# "The number 9 is the answer", "so 42 is our final answer"
_NAMED = re.compile(
    r"(?P<value>[^\s.,;:!?]+)\s+is\s+(?:the|our|my)\s+(?:final\s+|correct\s+)?answer\b", re.IGNORECASE
)
# "So, 9 times 3 is also 21", "Therefore, 2^5 is 62": a conclusion that ends in a number
_CONCLUSION = re.compile(
    r"\b(?:so|therefore|thus|hence)\b[^.!\n]*?(?:\bis\b|\bare\b|\bequals\b|=|\bget\b)\s*(?:also\s+)?"
    r"(?P<value>-?\d[\d,]*(?:\.\d+)?)",
    re.IGNORECASE,
)
# "12 + 7 = 9", "100 divided by 4 equals 25", "is equal to 3"
_RESULT = re.compile(r"(?:=|\bequals\b|\bis equal to\b)\s*(?P<value>-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
_WORD_NUMBERS = (
    {
        w: str(i)
        for i, w in enumerate(
            "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
            "fifteen sixteen seventeen eighteen nineteen twenty".split()
        )
    }
    | {
        w: str(10 * i)
        for i, w in enumerate("thirty forty fifty sixty seventy eighty ninety".split(), start=3)
    }
    | {"hundred": "100", "thousand": "1000"}
)
_NUMBER_WORD = re.compile(r"\b(" + "|".join(_WORD_NUMBERS) + r")\b", re.IGNORECASE)
# Questions that want a number: "Answer with a number", "How many …", "What is 6 multiplied by 7?"
_NUMERIC_QUESTION = re.compile(
    r"\bnumber\b|\bhow (?:many|much)\b|\d\s*(?:[-+*/x×^]|times|plus|minus|"
    r"multiplied|divided|to the power)",
    re.IGNORECASE,
)
# Words that carry no answer when a reply restates the question ("The capital of France is Paris.")
_FILLER = set(
    "a an the is are was were be been it its this that which of in on at for to and or by with as "
    "usually typically often generally always approximately about around roughly called known "
    "also very just simply".split()
)


def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced."""
    last = None
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            last = text[m.end() : i - 1]
    return last


def normalise(answer: str) -> str:
    """Comparable form: trimmed, lower case, no quotes or trailing punctuation; numbers canonical
    (1,000.0 -> 1000)."""
    a = answer.strip().strip("$").strip().rstrip(".!;,").strip().strip("\"'“”‘’`").strip().lower()
    a = re.sub(r"\s+", " ", a)
    if _NUMBER.fullmatch(a):
        value = float(a.replace(",", ""))
        return str(int(value)) if value.is_integer() else repr(value)
    return a


def compile_answer_regex(pattern: str | None):
    """A user's answer pattern, compiled with a bounded length by the `regex` module (so that
    matching can time out); refused naming the field when it cannot compile."""
    if pattern is None:
        return None
    return compile_pattern(pattern, "answer regex")


def wants_number(question: str | None) -> bool | None:
    """Whether a question asks for a number (None: no question to tell from)."""
    return None if not question else bool(_NUMERIC_QUESTION.search(question))


def _words_to_digits(text: str) -> str:
    return _NUMBER_WORD.sub(lambda m: _WORD_NUMBERS[m.group(1).lower()], text)


def _stated_number(value: str) -> str | None:
    """The number a stated answer gives: "17", "27, which is also a number" -> 27, "2^5, which is
    125" -> 125 (a result inside the statement wins), "2^5" -> None (an expression, not a number)."""
    results = _RESULT.findall(value) + re.findall(r"\bis\s+(-?\d[\d,]*(?:\.\d+)?)", value)
    if results:
        return normalise(results[-1])
    m = _NUMBER.match(value.strip().strip("\"'“”‘’`$"))
    if m and not re.match(r"\s*[\^*/+×x]", value.strip().strip("\"'“”‘’`$")[m.end() :]):
        return normalise(m.group(0))
    return None


def _stated(text: str) -> str | None:
    """The value of the last explicit answer statement ("The answer is …", "9 is the answer")."""
    found = [(m.start(), m.group("value")) for rx in (_STATED, _NAMED) for m in rx.finditer(text)]
    return max(found)[1].strip() if found else None


def _new_words(text: str, question: str) -> str | None:
    """The first clause of a reply without the question's words and filler: "The capital of France
    is Paris." -> "paris". None when more than four words remain (not a short answer)."""
    clause = re.split(r"[.!?;\n]|,\s*(?:but|and|which|so|not)\b", text.strip(), maxsplit=1)[0]
    asked = {w.lower() for w in re.findall(r"[\w']+", question)}
    words = [
        w for w in re.findall(r"[\w'^+-]+", clause) if w.lower() not in asked and w.lower() not in _FILLER
    ]
    return normalise(" ".join(words)) if 0 < len(words) <= 4 else None


def _user_match(text: str, pattern) -> str | None:
    try:
        matches = list(pattern.finditer(text, timeout=REGEX_TIMEOUT_S))
    except (TimeoutError, RecursionError):
        raise FeedbackError(
            f"the answer regex took longer than {REGEX_TIMEOUT_S:g} s on one trace "
            "(catastrophic backtracking?); simplify it"
        ) from None
    if not matches:
        return None
    m = matches[-1]
    return normalise(m.group(1) if m.groups() else m.group(0))


def extract_answer(text: str, pattern=None, question: str | None = None) -> str | None:
    """The trace's final answer, normalised, or None. In order:
    1. a user regex (its first group, else the match; time-limited);
    2. the last \\boxed{...};
    3. the last explicit statement: "The answer is 17.", "Answer: Paris", "9 is the answer";
    4. for a question that wants a number (or no question): a conclusion ("So, 9 times 3 is 21"),
       else the last equation result of the first paragraph ("12 + 7 = 9", "equals 25"), else the
       whole reply if it is a short phrase, else the last number (number words count: "eight" = 8);
    5. for other questions: the whole reply if it is a short phrase ("Paris."), else the first
       clause without the question's words ("The capital of France is Paris." -> "paris")."""
    if pattern is not None:
        return _user_match(text, pattern)
    boxed = _boxed(text)
    if boxed is not None and boxed.strip():
        return normalise(boxed)
    numeric = wants_number(question)
    plain = _words_to_digits(text) if numeric is not False else text
    stated = _stated(plain)
    if stated:
        if numeric is False:
            return normalise(stated) if len(stated.split()) <= 4 else _new_words(stated, question or "")
        number = _stated_number(stated)
        if number is not None:
            return number
        if len(stated.split()) <= 3 and re.search(r"\d", stated):
            return normalise(stated)  # an expression such as "2^5": what the trace said, not a number
        if numeric is None and len(stated.split()) <= 4:
            return normalise(stated)
    short = text.strip().rstrip(".!")
    is_short = bool(short) and len(short.split()) <= 3 and re.search(r"[^\W\d_]", short) is not None
    if numeric is False:
        return normalise(short) if is_short else _new_words(text, question or "")
    conclusions = _CONCLUSION.findall(plain)
    if conclusions:
        return normalise(conclusions[-1])
    first_paragraph = re.split(r"\n\s*\n", plain.strip(), maxsplit=1)[0]
    results = _RESULT.findall(first_paragraph)
    if results:
        return normalise(results[-1])
    if is_short and numeric is None:
        return normalise(short)
    numbers = _NUMBER.findall(plain)
    return normalise(numbers[-1]) if numbers else None


def answer_matches(answer: str | None, expected: str | None) -> bool | None:
    """Whether an extracted answer is the expected one: equal once normalised (numbers by value),
    or containing the expected words as a whole ("deep blue" matches "blue"). None without an
    expected answer."""
    if expected is None or not str(expected).strip():
        return None
    if answer is None:
        return False
    want, got = normalise(str(expected)), normalise(answer)
    if want == got:
        return True
    if _NUMBER.fullmatch(want) or _NUMBER.fullmatch(got):
        return False
    return re.search(r"(?<![\w])" + re.escape(want) + r"(?![\w])", got) is not None


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
