"""HTML for the compare columns: generated text (plain or confidence-coloured) and per-row stats.

Everything that comes from the model is HTML-escaped, in element content and in attributes.
"""
from __future__ import annotations

import math
from html import escape

from feedback.records import RowResult, StepRecord

MISSING = "—"
HUE_LOW, HUE_HIGH = 0.0, 140.0  # red (low confidence) … green (high confidence)

CSS = """
.fl-text { white-space: pre-wrap; word-break: break-word; line-height: 1.6;
  color: var(--body-text-color); font-family: var(--font-mono, ui-monospace, monospace); font-size: 0.92em; }
.fl-empty { color: var(--body-text-color-subdued, #888); font-style: italic; }
.fl-tok { border-radius: 3px; padding: 0 1px; cursor: help; }
.fl-tok:hover { outline: 1px solid var(--border-color-primary, #999); }
.fl-caret { display: inline-block; width: 0.5em; height: 1.1em; vertical-align: text-bottom;
  background: var(--body-text-color); animation: fl-blink 1s step-end infinite; }
@keyframes fl-blink { 50% { opacity: 0; } }
.fl-stats { border-collapse: collapse; width: 100%; font-size: 0.9em; border: none !important; }
.fl-stats th, .fl-stats td { padding: 2px 8px; border: none !important;
  border-bottom: 1px solid var(--border-color-primary, #ddd) !important; text-align: left; }
.fl-stats th { font-weight: 500; color: var(--body-text-color); opacity: 0.75; width: 45%; }
.fl-stats td { font-variant-numeric: tabular-nums; }
"""

_VISIBLE = {" ": "␠", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
CARET = '<span class="fl-caret"></span>'


def visible(text: str) -> str:
    """Token text with whitespace made visible, for tooltips ("∅" for an empty token)."""
    return "".join(_VISIBLE.get(ch, ch) for ch in text) if text else "∅"


def confidence_hue(value: float, conf_range: tuple[float, float]) -> float:
    """HSL hue for a confidence normalised to `conf_range`, clamped: red (low) to green (high)."""
    lo, hi = conf_range
    x = 0.5 if hi <= lo else (value - lo) / (hi - lo)
    x = min(1.0, max(0.0, x)) if math.isfinite(x) else 0.5
    return HUE_LOW + x * (HUE_HIGH - HUE_LOW)


def token_color(value: float, conf_range: tuple[float, float]) -> str:
    """Translucent background so the text stays legible on light and dark themes."""
    return f"hsla({confidence_hue(value, conf_range):.0f}, 85%, 50%, 0.30)"


def tooltip(step: StepRecord) -> str:
    """Plain-text hover details for one token (the caller escapes it)."""
    lines = [
        f"{visible(step.text)}   p={step.prob:.1%}",
        f"confidence {step.confidence:.3f} · entropy {step.entropy:.3f} nats",
        f"group confidence {step.group_confidence:.3f} · step {step.step}",
    ]
    if step.top:
        lines.append("top-5:")
        lines += [f"  {visible(alt.text)}   {alt.prob:.1%}" for alt in step.top[:5]]
    return "\n".join(lines)


def steps_range(steps: list[StepRecord]) -> tuple[float, float]:
    """Min/max confidence over `steps`; (0.0, 1.0) when there are none."""
    values = [s.confidence for s in steps if math.isfinite(s.confidence)]
    return (min(values), max(values)) if values else (0.0, 1.0)


def confidence_range(rows: list[RowResult]) -> tuple[float, float]:
    """Common colour scale over all rows, so the columns are comparable: the 5th to 95th
    percentile of their confidences, so a few extreme tokens do not wash out all the others."""
    values = sorted(s.confidence for row in rows for s in row.steps if math.isfinite(s.confidence))
    if len(values) < 20:
        return steps_range([s for row in rows for s in row.steps])
    return values[int(0.05 * (len(values) - 1))], values[int(0.95 * (len(values) - 1))]


def _token_span(step: StepRecord, conf_range: tuple[float, float]) -> str:
    return (f'<span class="fl-tok" style="background-color: {token_color(step.confidence, conf_range)}" '
            f'title="{escape(tooltip(step), quote=True)}">{escape(step.text, quote=True)}</span>')


class SpanCache:
    """A streaming row's rendered token spans, redone only when the colour scale changes, so each
    update renders the new tokens instead of the whole text again."""

    def __init__(self) -> None:
        self.conf_range: tuple[float, float] | None = None
        self.spans: list[str] = []

    def spans_for(self, steps: list[StepRecord], conf_range: tuple[float, float]) -> list[str]:
        if conf_range != self.conf_range or len(self.spans) > len(steps):
            self.conf_range, self.spans = conf_range, []
        self.spans += [_token_span(s, conf_range) for s in steps[len(self.spans):]]
        return self.spans


def render_tokens(steps: list[StepRecord], mode: str = "confidence",
                  conf_range: tuple[float, float] | None = None, live: bool = False,
                  cache: SpanCache | None = None) -> str:
    """One column's generated text: "plain" or "confidence" (coloured spans with hover details)."""
    caret = CARET if live else ""
    if not steps:
        return f'<div class="fl-text fl-empty">…{caret}</div>'
    if mode == "plain":
        body = escape("".join(s.text for s in steps), quote=True)
    else:
        rng = conf_range or steps_range(steps)
        spans = cache.spans_for(steps, rng) if cache is not None else [_token_span(s, rng) for s in steps]
        body = "".join(spans)
    return f'<div class="fl-text">{body}{caret}</div>'


def _fmt(value: float | None, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return MISSING
    return format(value, spec)


def live_tokens_per_s(steps: list[StepRecord]) -> float | None:
    """Decode speed from step times, excluding step 0 (the prefill)."""
    seconds = sum(s.time_ms for s in steps[1:]) / 1000.0
    return (len(steps) - 1) / seconds if len(steps) > 1 and seconds > 0 else None


def _confidence_summary(row: RowResult) -> tuple[float | None, float | None]:
    """(mean confidence, lowest group confidence): the final metrics, else from the steps so far."""
    if row.metrics:
        return row.metrics.get("mean"), row.metrics.get("lowest_group")
    if not row.steps:
        return None, None
    return (math.fsum(s.confidence for s in row.steps) / len(row.steps),
            min(s.group_confidence for s in row.steps))


def _stop_text(row: RowResult, live: bool) -> str:
    if row.stop_reason is None:
        return "running…" if live else MISSING
    return row.stop_reason if row.stop_step is None else f"{row.stop_reason} @ step {row.stop_step}"


def render_stats(row: RowResult, live: bool = False) -> str:
    """Compact table: tokens, tokens/s, mean confidence, lowest group confidence, stop reason."""
    tps = live_tokens_per_s(row.steps) if live else row.tokens_per_s
    mean, lowest = _confidence_summary(row)
    items = [
        ("tokens", str(len(row.token_ids))),
        ("tokens/s", _fmt(tps, ".1f")),
        ("mean confidence", _fmt(mean)),
        ("lowest group confidence", _fmt(lowest)),
        ("stop", _stop_text(row, live)),
    ]
    cells = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v, quote=True)}</td></tr>" for k, v in items)
    return f'<table class="fl-stats">{cells}</table>'
