"""HTML for generated text (plain or confidence-coloured, with detail cards), stats tables and legends.

Everything that comes from the model is HTML-escaped, in element content and in attributes; the
detail card's data is JSON in an attribute, and the page script puts it on screen as text only.
"""
from __future__ import annotations

import json
import math
from html import escape

from feedback.records import RowResult, StepRecord, confidence_summary, tokens_per_second

MISSING = "—"
# An absolute scale (the same colour means the same confidence in every run and column), in one hue
# whose strength grows as confidence falls, so it reads for colour-blind eyes too. Bounds are DeepConf
# token confidence with k = 20 on the embedded model: ~5 % of tokens fall below 4, the median is ~5.3,
# ~10 % lie above 8.5 (measured over 6,600 tokens of the example prompts).
CONFIDENCE_BINS = (  # (upper bound, label, background)
    (4.0, "< 4 very uncertain", "rgba(230, 97, 1, 0.55)"),
    (5.0, "4–5 uncertain", "rgba(230, 97, 1, 0.33)"),
    (6.5, "5–6.5 typical", "rgba(230, 97, 1, 0.16)"),
    (9.0, "6.5–9 confident", "rgba(230, 97, 1, 0.06)"),
    (math.inf, "≥ 9 very confident", "transparent"),
)
_VISIBLE = {" ": "·", "\n": "↵", "\t": "⇥", "\r": "␍"}
CARET = '<span class="fl-caret"></span>'
DIVERGE = '<span class="fl-diverge" title="the columns differ from here on">differs from here</span>'


def visible(text: str) -> str:
    """Token text with whitespace made visible, for cards ("∅" for an empty token)."""
    return "".join(_VISIBLE.get(ch, ch) for ch in text) if text else "∅"


def token_color(confidence: float) -> str:
    """Background for a token's confidence on the absolute scale (transparent when undefined)."""
    if not math.isfinite(confidence):
        return "transparent"
    return next(color for bound, _, color in CONFIDENCE_BINS if confidence < bound)


def confidence_legend(k: int = 20) -> str:
    swatches = "".join(f'<span><span class="fl-swatch" style="background:{color}"></span>{escape(label)}</span>'
                       for _, label, color in CONFIDENCE_BINS)
    return (f'<div class="fl-legend" id="confidence-legend"><span>Token confidence (DeepConf, k = {k}; the '
            f'stronger the orange, the less sure the model):</span>{swatches}'
            '<span>· hover, tap or focus a token for details</span></div>')


def card_attr(title: str, rows: list[tuple[str, str]], top: list[tuple[str, float, bool]] | None = None,
              top_label: str | None = None) -> str:
    """A `data-card` attribute for the page's detail card (escaped JSON)."""
    data: dict = {"title": title, "rows": rows}
    if top:
        data["top"] = [[t, round(p, 4), chosen] for t, p, chosen in top]
    if top_label:
        data["top_label"] = top_label
    return f'data-card="{escape(json.dumps(data, ensure_ascii=False, separators=(",", ":")), quote=True)}"'


def _token_span(step: StepRecord, focusable: bool) -> str:
    rows = [("probability", f"{step.prob:.1%}"), ("confidence", f"{step.confidence:.2f}"),
            ("entropy", f"{step.entropy:.2f} nats"), ("group confidence", f"{step.group_confidence:.2f}"),
            ("step", str(step.step))]
    top = [(visible(a.text), a.prob, a.token_id == step.token_id) for a in step.top[:5]]
    return (f'<span class="fl-tok" tabindex="{0 if focusable else -1}" style="background-color: '
            f'{token_color(step.confidence)}" {card_attr(visible(step.text), rows, top)}>'
            f"{escape(step.text, quote=True)}</span>")


class SpanCache:
    """A streaming row's rendered token spans, so each update renders only the new tokens (the
    colour scale is absolute, so a span never changes once drawn)."""

    def __init__(self) -> None:
        self.spans: list[str] = []

    def spans_for(self, steps: list[StepRecord]) -> list[str]:
        if len(self.spans) > len(steps):
            self.spans = []
        self.spans += [_token_span(s, i == 0) for i, s in enumerate(steps[len(self.spans):], start=len(self.spans))]
        return self.spans


def render_tokens(steps: list[StepRecord], mode: str = "confidence", live: bool = False,
                  cache: SpanCache | None = None, diverge_at: int | None = None) -> str:
    """One column's text: "plain", or "confidence" (coloured spans with detail cards). With
    `diverge_at`, a marker stands before the token of that step and what follows is underlined."""
    caret = CARET if live else ""
    if not steps:
        return f'<div class="fl-text fl-empty">…{caret}</div>'
    cut = diverge_at if diverge_at is not None and 0 <= diverge_at < len(steps) else None
    if mode == "plain":
        head = escape("".join(s.text for s in steps[:cut]), quote=True)
        tail = "" if cut is None else f'{DIVERGE}<span class="fl-plain">' \
                                      f'{escape("".join(s.text for s in steps[cut:]), quote=True)}</span>'
        body = head + tail
    else:
        spans = cache.spans_for(steps) if cache is not None else [_token_span(s, i == 0) for i, s in enumerate(steps)]
        body = "".join(spans) if cut is None else "".join(spans[:cut]) + DIVERGE + "".join(spans[cut:])
    return f'<div class="fl-text">{body}{caret}</div>'


def _fmt(value: float | None, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return MISSING
    return format(value, spec)


def _stop_text(row: RowResult, live: bool) -> str:
    if row.stop_reason is None:
        return "running…" if live else MISSING
    return row.stop_reason if row.stop_step is None else f"{row.stop_reason} @ step {row.stop_step}"


def render_stats(row: RowResult, live: bool = False) -> str:
    """Compact table: tokens, tokens/s, mean confidence, lowest group confidence, stop reason."""
    tps = tokens_per_second(row.steps) if live else row.tokens_per_s
    mean, lowest = confidence_summary(row)
    items = [
        ("tokens", str(len(row.token_ids))),
        ("tokens/s", _fmt(tps, ".1f")),
        ("mean confidence", _fmt(mean, ".2f")),
        ("lowest group confidence", _fmt(lowest, ".2f")),
        ("stop", _stop_text(row, live)),
    ]
    return table(items)


def table(items: list[tuple[str, str]]) -> str:
    cells = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v, quote=True)}</td></tr>" for k, v in items)
    return f'<table class="fl-stats">{cells}</table>'


def params_text(params: dict) -> str:
    """"alpha=0.1, source_layer=21" — a strategy's parameters as a run used them."""
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def column_heading(title: str, strategy: str | None, params: dict) -> str:
    """"### Feedback · residual (alpha=0.1, …)": the column names what produced it, so a screenshot
    explains itself."""
    if not strategy:
        return f"### {title}\n<span class='fl-note'>no feedback: the model as it is</span>"
    return f"### {title} · {strategy}\n<span class='fl-note'>{escape(params_text(params))}</span>"


def status_html(text: str, kind: str = "info") -> str:
    """The tab's one status line; `kind` "wait" stands out (waiting in line), "error" says it failed."""
    icon = {"error": "⚠ ", "stopped": "■ "}.get(kind, "")  # waiting gets a blinking dot (CSS)
    return f'<div class="fl-status fl-{kind}">{icon}{escape(text)}</div>'
