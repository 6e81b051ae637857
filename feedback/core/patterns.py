"""Regular expressions a user supplies: key facts written /like this/ and Deep Think's answer regex.

A user's pattern is compiled once, when the request is validated, with a bounded length, so a
pattern that cannot compile (or that recurses too deeply to compile, such as 500 open groups) is
refused up front naming its field, before any model work. Each search runs with a time limit
(the `regex` module's `timeout`), so a pattern that backtracks catastrophically costs at most
`MATCH_TIMEOUT_S` per text it is tried on, never minutes of the model line.
"""

from __future__ import annotations

from feedback.errors import FeedbackError

MAX_PATTERN_CHARS = 1000  # one user pattern, between its slashes
MATCH_TIMEOUT_S = 0.5  # one search of one text (a Deep Think trace, a row's answer)
# The compile errors of a pattern the parser cannot take: its own errors, too deep a nesting, or
# a repeat count too large for it.
_COMPILE_ERRORS = (RecursionError, OverflowError, ValueError, TypeError, MemoryError)


def is_pattern(fact: str) -> bool:
    """A key fact written /like this/ is a regular expression; any other is plain text."""
    return len(fact) > 2 and fact.startswith("/") and fact.endswith("/")


def compile_pattern(text: str, field: str, flags: int = 0):
    """`text` compiled with the `regex` module (whose searches can time out), or a `FeedbackError`
    naming `field` when it is too long or does not compile."""
    import regex

    if not isinstance(text, str):
        raise FeedbackError(f"{field} must be text, got {text!r}")
    if len(text) > MAX_PATTERN_CHARS:
        raise FeedbackError(f"{field} is limited to {MAX_PATTERN_CHARS} characters, got {len(text)}")
    try:
        return regex.compile(text, flags)
    except (regex.error, *_COMPILE_ERRORS) as exc:
        reason = "it nests too deeply" if isinstance(exc, RecursionError) else str(exc) or type(exc).__name__
        raise FeedbackError(f"{field} does not compile: {reason}") from None


def key_fact_pattern(fact: str, field: str):
    """A /…/ key fact's compiled pattern (case-insensitive), or None for a plain-text fact."""
    if not is_pattern(fact):
        return None
    import regex

    return compile_pattern(fact[1:-1], field, regex.IGNORECASE)


def search(pattern, text: str, timeout: float = MATCH_TIMEOUT_S) -> bool | None:
    """Whether `pattern` occurs in `text`; None when the search ran out of time (or out of stack)."""
    try:
        return pattern.search(text, timeout=max(timeout, 1e-3)) is not None
    except (TimeoutError, RecursionError):
        return None
