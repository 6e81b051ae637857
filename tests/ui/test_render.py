"""HTML rendering of tokens and stats: escaping, detail cards, the absolute colour scale, the
divergence marker, live mode."""
from __future__ import annotations

import json
import re
from html import escape
from html.parser import HTMLParser

import pytest

from feedback.records import Alternative, RowResult, StepRecord
from ui.render import (CONFIDENCE_BINS, column_heading, confidence_legend, render_stats, render_tokens, token_color)
from ui.theme import CSS, HEAD

HOSTILE = ['<img src=x onerror=alert(1)>', '"><script>alert(1)</script>', "' onmouseover='x"]


def make_step(step: int, text: str, confidence: float = 1.0, *, prob: float = 0.5,
              group: float | None = None, top: list[Alternative] | None = None,
              time_ms: float = 10.0) -> StepRecord:
    return StepRecord(step=step, token_id=100 + step, text=text, logprob=-0.7, prob=prob,
                      confidence=confidence, entropy=0.25,
                      group_confidence=confidence if group is None else group, top=top or [], time_ms=time_ms)


def make_row(steps: list[StepRecord], **kwargs) -> RowResult:
    return RowResult(name="baseline", strategy=None, params={}, token_ids=[s.token_id for s in steps],
                     steps=steps, **kwargs)


class TagCollector(HTMLParser):
    """Records every start tag and its attributes, as a browser would see them."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def parse(html: str) -> list[tuple[str, dict[str, str | None]]]:
    collector = TagCollector()
    collector.feed(html)
    collector.close()
    return collector.tags


def hostile_steps() -> list[StepRecord]:
    alts = [Alternative(token_id=i, text=t, prob=0.1) for i, t in enumerate(HOSTILE)]
    return [make_step(i, t, confidence=1.0 + i, top=alts) for i, t in enumerate(HOSTILE)]


def cards(html: str) -> list[dict]:
    return [json.loads(a["data-card"]) for tag, a in parse(html) if tag == "span" and "data-card" in a]


@pytest.mark.parametrize("mode", ["plain", "confidence"])
def test_hostile_text_is_escaped(mode: str) -> None:
    html = render_tokens(hostile_steps(), mode=mode)
    assert "<img" not in html and "<script" not in html
    tags = parse(html)
    assert {tag for tag, _ in tags} <= {"div", "span"}
    for _, attrs in tags:
        assert set(attrs) <= {"class", "style", "tabindex", "data-card"}
    assert len(cards(html)) == (len(HOSTILE) if mode == "confidence" else 0)


def test_hostile_text_round_trips_through_the_card_data() -> None:
    """The card data decodes back to the raw strings (the page script shows them as text only)."""
    found = cards(render_tokens(hostile_steps()))
    assert [c["title"] for c in found] == [t.replace(" ", "·") for t in HOSTILE]
    assert [a[0] for a in found[0]["top"]] == [t.replace(" ", "·") for t in HOSTILE]
    assert "textContent" in HEAD and "innerHTML" not in HEAD


def test_card_has_probability_confidence_and_top5() -> None:
    probs = [0.4, 0.2, 0.1, 0.05, 0.03, 0.01]
    top = [Alternative(token_id=100 + 7 if i == 0 else i, text=f"alt{i}", prob=p) for i, p in enumerate(probs)]
    step = make_step(7, "hello", confidence=2.5, prob=0.4, group=1.75, top=top)
    (card,) = cards(render_tokens([step]))
    rows = dict(card["rows"])
    assert rows == {"probability": "40.0%", "confidence": "2.50", "entropy": "0.25 nats",
                    "group confidence": "1.75", "step": "7"}
    assert [t for t, _, _ in card["top"]] == [f"alt{i}" for i in range(5)]
    assert [chosen for _, _, chosen in card["top"]] == [True, False, False, False, False]


def test_only_the_first_token_is_in_the_tab_order() -> None:
    spans = [a for tag, a in parse(render_tokens([make_step(i, "x") for i in range(4)])) if tag == "span"]
    assert [a["tabindex"] for a in spans] == ["0", "-1", "-1", "-1"]  # arrow keys move between tokens
    assert "ArrowRight" in HEAD and "focusin" in HEAD and '"click"' in HEAD


def test_whitespace_tokens_visible_in_card_but_kept_in_text() -> None:
    html = render_tokens([make_step(0, " "), make_step(1, "\n")])
    assert [c["title"] for c in cards(html)] == ["·", "↵"]
    assert ">\n</span>" in html and "> </span>" in html


def test_colour_scale_is_absolute_and_stronger_for_lower_confidence() -> None:
    """The same confidence gets the same colour in every run, whatever the other tokens are."""
    alone = render_tokens([make_step(0, "a", 4.5)])
    mixed = render_tokens([make_step(0, "a", 4.5), make_step(1, "b", 12.0), make_step(2, "c", 1.0)])
    colour = re.findall(r"background-color: ([^\"]+)", alone)[0]
    assert re.findall(r"background-color: ([^\"]+)", mixed)[0] == colour == token_color(4.5)
    alphas = [float(re.findall(r"([\d.]+)\)$", token_color(c))[0]) if "rgba" in token_color(c) else 0.0
              for c in (2.0, 4.5, 6.0, 8.0, 15.0)]
    assert alphas == sorted(alphas, reverse=True) and alphas[-1] == 0.0
    assert token_color(float("nan")) == "transparent"
    legend = confidence_legend()
    assert all(escape(label) in legend for _, label, _ in CONFIDENCE_BINS) and "k = 20" in legend


def test_divergence_marker_sits_before_the_first_different_token() -> None:
    steps = [make_step(i, f"t{i}") for i in range(4)]
    for mode in ("confidence", "plain"):
        html = render_tokens(steps, mode=mode, diverge_at=2)
        before, after = html.split("differs from here")
        assert "t1" in before and "t2" not in before and "t2" in after
        assert "differs from here" not in render_tokens(steps, mode=mode)
        assert "differs from here" not in render_tokens(steps, mode=mode, diverge_at=9)
    assert ".fl-diverge ~ .fl-tok" in CSS  # everything after it is underlined


def test_plain_mode_preserves_newlines_and_spacing() -> None:
    html = render_tokens([make_step(0, "a  b"), make_step(1, "\n\n"), make_step(2, "c & d")], mode="plain")
    assert html == '<div class="fl-text">a  b\n\nc &amp; d</div>'
    assert "<br" not in html and "pre-wrap" in CSS


def test_caret_only_when_live() -> None:
    steps = [make_step(0, "a")]
    for mode in ("plain", "confidence"):
        assert render_tokens(steps, mode=mode, live=True).endswith('<span class="fl-caret"></span></div>')
        assert "fl-caret" not in render_tokens(steps, mode=mode)
    assert "@keyframes" in CSS and ".fl-caret" in CSS


def test_empty_steps_placeholder() -> None:
    assert "fl-empty" in render_tokens([])
    assert "fl-caret" in render_tokens([], live=True)


def test_column_heading_names_strategy_and_parameters() -> None:
    assert column_heading("Baseline", None, {}).startswith("### Baseline\n")
    heading = column_heading("Feedback", "residual", {"alpha": 0.1, "source_layer": 21, "target_layer": 9})
    assert heading.startswith("### Feedback · residual") and "alpha=0.1, source_layer=21, target_layer=9" in heading
    assert "&lt;b&gt;" in column_heading("Feedback", "x", {"k": "<b>"})


def stats(html: str) -> dict[str, str]:
    return dict(re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", html))


def test_stats_final_row_uses_metrics() -> None:
    row = make_row([make_step(0, "a", 1.0, time_ms=500.0), make_step(1, "b", 3.0)],
                   stop_reason="early_stop", stop_step=1, tokens_per_s=42.25,
                   metrics={"mean": 2.0, "lowest_group": 1.5})
    values = stats(render_stats(row))
    assert values == {"tokens": "2", "tokens/s": "42.2", "mean confidence": "2.00",
                      "lowest group confidence": "1.50", "stop": "early_stop @ step 1"}


def test_stats_live_computed_from_steps() -> None:
    steps = [make_step(0, "a", 1.0, group=1.0, time_ms=900.0),
             make_step(1, "b", 2.0, group=1.5, time_ms=20.0),
             make_step(2, "c", 4.0, group=0.5, time_ms=30.0)]
    values = stats(render_stats(make_row(steps), live=True))
    assert values["tokens"] == "3"
    assert values["tokens/s"] == "40.0"  # 2 tokens in 50 ms; step 0 (prefill) excluded
    assert values["mean confidence"] == "2.33" and values["lowest group confidence"] == "0.50"
    assert values["stop"] == "running…"


def test_stats_missing_values_and_escaping() -> None:
    values = stats(render_stats(make_row([make_step(0, "a")]), live=True))
    assert values["tokens/s"] == "—"
    empty = stats(render_stats(make_row([])))
    assert empty["mean confidence"] == "—" and empty["stop"] == "—"
    html = render_stats(make_row([], stop_reason="<script>x</script>"))
    assert "<script" not in html and not any(tag == "script" for tag, _ in parse(html))
