"""HTML rendering of tokens and stats: escaping, tooltips, colour scale, live mode."""
from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

from feedback.records import Alternative, RowResult, StepRecord
from ui.render import CSS, confidence_hue, confidence_range, render_stats, render_tokens

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


@pytest.mark.parametrize("mode", ["plain", "confidence"])
def test_hostile_text_is_escaped(mode: str) -> None:
    html = render_tokens(hostile_steps(), mode=mode)
    assert "<img" not in html and "<script" not in html
    tags = parse(html)
    assert {tag for tag, _ in tags} <= {"div", "span"}
    for _, attrs in tags:
        assert set(attrs) <= {"class", "style", "title"}
    expected_spans = len(HOSTILE) if mode == "confidence" else 0
    assert sum(tag == "span" for tag, _ in tags) == expected_spans


def test_hostile_text_round_trips_through_the_title() -> None:
    """The tooltip decodes back to the raw strings: escaped, not mangled."""
    titles = [attrs["title"] for tag, attrs in parse(render_tokens(hostile_steps())) if tag == "span"]
    assert titles and all(s in titles[0] for s in ["<img␠src=x␠onerror=alert(1)>", '"><script>'])


def test_tooltip_has_probability_confidence_and_top5() -> None:
    probs = [0.4, 0.2, 0.1, 0.05, 0.03, 0.01]
    top = [Alternative(token_id=i, text=f"alt{i}", prob=p) for i, p in enumerate(probs)]
    step = make_step(7, "hello", confidence=2.5, prob=0.4, group=1.75, top=top)
    (title,) = [a["title"] for tag, a in parse(render_tokens([step])) if tag == "span"]
    assert "40.0%" in title and "2.500" in title and "1.750" in title and "0.250" in title
    assert "step 7" in title
    assert [f"alt{i}" in title for i in range(6)] == [True] * 5 + [False]
    assert "20.0%" in title and "3.0%" in title


def test_whitespace_tokens_visible_in_tooltip_but_kept_in_text() -> None:
    html = render_tokens([make_step(0, " "), make_step(1, "\n")])
    titles = [a["title"] for tag, a in parse(html) if tag == "span"]
    assert titles[0].startswith("␠") and titles[1].startswith("\\n")
    assert ">\n</span>" in html and "> </span>" in html


def hues(html: str) -> list[float]:
    return [float(h) for h in re.findall(r"hsla\(([\d.]+),", html)]


def test_colour_scale_monotonic_in_confidence() -> None:
    confs = [0.3, 5.0, 1.0, 2.0, 4.0]
    found = hues(render_tokens([make_step(i, "x", c) for i, c in enumerate(confs)]))
    by_conf = [h for _, h in sorted(zip(confs, found))]
    assert by_conf == sorted(by_conf) and by_conf[0] < by_conf[-1]
    scale = [confidence_hue(c, (0.0, 10.0)) for c in range(11)]
    assert scale == sorted(scale) and scale[0] < scale[-1]


def test_explicit_range_is_used_and_clamped() -> None:
    found = hues(render_tokens([make_step(0, "a", -1.0), make_step(1, "b", 1.0), make_step(2, "c", 9.0)],
                               conf_range=(0.0, 2.0)))
    assert found[0] == confidence_hue(0.0, (0.0, 2.0)) and found[2] == confidence_hue(2.0, (0.0, 2.0))
    assert found[0] < found[1] < found[2]


def test_equal_confidences_do_not_divide_by_zero() -> None:
    assert len(hues(render_tokens([make_step(0, "a", 1.0), make_step(1, "b", 1.0)]))) == 2


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


def test_confidence_range_spans_all_rows() -> None:
    rows = [make_row([make_step(0, "a", 2.0), make_step(1, "b", 3.0)]), make_row([make_step(0, "c", 0.5)])]
    assert confidence_range(rows) == (0.5, 3.0)
    assert confidence_range([]) == (0.0, 1.0)
    assert confidence_range([make_row([])]) == (0.0, 1.0)


def stats(html: str) -> dict[str, str]:
    return dict(re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", html))


def test_stats_final_row_uses_metrics() -> None:
    row = make_row([make_step(0, "a", 1.0, time_ms=500.0), make_step(1, "b", 3.0)],
                   stop_reason="early_stop", stop_step=1, tokens_per_s=42.25,
                   metrics={"mean": 2.0, "lowest_group": 1.5})
    values = stats(render_stats(row))
    assert values == {"tokens": "2", "tokens/s": "42.2", "mean confidence": "2.000",
                      "lowest group confidence": "1.500", "stop": "early_stop @ step 1"}


def test_stats_live_computed_from_steps() -> None:
    steps = [make_step(0, "a", 1.0, group=1.0, time_ms=900.0),
             make_step(1, "b", 2.0, group=1.5, time_ms=20.0),
             make_step(2, "c", 4.0, group=0.5, time_ms=30.0)]
    values = stats(render_stats(make_row(steps), live=True))
    assert values["tokens"] == "3"
    assert values["tokens/s"] == "40.0"  # 2 tokens in 50 ms; step 0 (prefill) excluded
    assert values["mean confidence"] == "2.333" and values["lowest group confidence"] == "0.500"
    assert values["stop"] == "running…"


def test_stats_missing_values_and_escaping() -> None:
    values = stats(render_stats(make_row([make_step(0, "a")]), live=True))
    assert values["tokens/s"] == "—"
    empty = stats(render_stats(make_row([])))
    assert empty["mean confidence"] == "—" and empty["stop"] == "—"
    html = render_stats(make_row([], stop_reason="<script>x</script>"))
    assert "<script" not in html and not any(tag == "script" for tag, _ in parse(html))
