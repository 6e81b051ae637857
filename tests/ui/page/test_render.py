"""HTML the server renders: the diff and Markdown views of finished answers, the metrics table and
best marks, quality metrics, column headings, legends, escaping everywhere. (The Compare columns'
tokens are events drawn by the page: tests/ui/compare/test_stream.py.)"""

from __future__ import annotations

import random
import re
import time
from html import escape
from html.parser import HTMLParser

import pytest

from feedback.core.records import Alternative, RowResult, StepRecord
from ui.page import render
from ui.page.render import best_marks, column_heading, diff_html, diff_legend, md_text, render_metrics

HOSTILE = ["<img src=x onerror=alert(1)>", '"><script>alert(1)</script>', "' onmouseover='x"]


def make_step(
    step: int,
    text: str,
    confidence: float = 1.0,
    *,
    prob: float = 0.5,
    group: float | None = None,
    top: list[Alternative] | None = None,
    time_ms: float = 10.0,
) -> StepRecord:
    return StepRecord(
        step=step,
        token_id=100 + step,
        text=text,
        logprob=-0.7,
        prob=prob,
        confidence=confidence,
        entropy=0.25,
        group_confidence=confidence if group is None else group,
        top=top or [],
        time_ms=time_ms,
    )


def make_row(steps: list[StepRecord], **kwargs) -> RowResult:
    return RowResult(
        name="baseline",
        strategy=None,
        params={},
        token_ids=[s.token_id for s in steps],
        steps=steps,
        **kwargs,
    )


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


def test_column_heading_names_strategy_and_parameters() -> None:
    assert column_heading("Baseline", None, {}).startswith(
        '<h3 class="fl-heading fl-colhead" title="Baseline">Baseline</h3>'
    )
    heading = column_heading("Feedback", "residual", {"alpha": 0.1, "source_layer": 21, "target_layer": 9})
    # one line of heading, two of note, each with its full text as the tooltip (cut short on a phone)
    assert heading.startswith(
        '<h3 class="fl-heading fl-colhead" title="Feedback · residual — alpha=0.1, '
        'source_layer=21, target_layer=9">Feedback · residual'
    )
    assert "alpha=0.1, source_layer=21, target_layer=9" in heading
    assert "&lt;b&gt;" in column_heading("Feedback", "x", {"k": "<b>"})


@pytest.mark.parametrize(
    "name",
    [
        "[md](javascript:alert(1))",
        "<img src=x onerror=alert(1)>",
        '"><svg onload=alert(1)>',
        "**bold** `code` # h1",
    ],
)
def test_a_column_name_is_text_in_its_heading(name: str) -> None:
    """Headings are HTML with the name escaped: no Markdown reads it, so no link, tag or handler."""
    heading = column_heading(name, "residual", {"alpha": 0.1})
    assert "<a" not in heading and "<img" not in heading and "<svg" not in heading and "href" not in heading
    assert escape(name, quote=True) in heading


def test_md_text_makes_text_literal_inside_markdown() -> None:
    assert md_text("[x](javascript:alert(1))") == r"\[x\]\(javascript\:alert\(1\)\)"
    # bare URLs and addresses, which Markdown would link by itself
    assert (
        md_text("see https://example.org or me@example.org")
        == r"see https\://example\.org or me\@example\.org"
    )
    assert md_text("`a` <b> & it's") == r"\`a\` &lt;b&gt; &amp; it's"


def stats(html: str) -> dict[str, str]:
    return dict(re.findall(r'<tr><th scope="row">(.*?)</th><td[^>]*>(.*?)</td></tr>', html))


def render_stats(row: RowResult, live: bool = False, best: set[str] | None = None) -> str:
    """The metrics table of one column."""
    return render_metrics([row], [live], [best or set()])


def test_stats_final_row_uses_metrics() -> None:
    row = make_row(
        [make_step(0, "a", 1.0, time_ms=500.0), make_step(1, "b", 3.0)],
        stop_reason="early_stop",
        stop_step=1,
        tokens_per_s=42.25,
        metrics={"mean": 2.0, "lowest_group": 1.5},
    )
    values = stats(render_stats(row))
    assert values == {
        "tokens": "2",
        "tokens/s": "42.2",
        "mean confidence": "2.00",
        "lowest group confidence": "1.50",
        "stop": "early_stop @ step 1",
    }


def test_a_columns_speed_says_how_it_was_measured() -> None:
    """A column re-run alone decoded one row a step, its neighbours all of theirs together: its
    tokens/s is marked (alone) and both cells say what their figure means."""
    steps = [make_step(0, "a", time_ms=500.0), make_step(1, "b", time_ms=100.0)]
    batched, alone = (
        make_row(steps, tokens_per_s=4.6),
        make_row(steps, tokens_per_s=9.9, metrics={"rerun_alone": True}),
    )
    html = render_metrics([batched, alone])
    assert (
        stats(render_stats(alone))["tokens/s"] == "9.9 (alone)"
        and stats(render_stats(batched))["tokens/s"] == "4.6"
    )
    assert escape(render.RERUN_RATE_NOTE, quote=True) in html and escape(render.RATE_NOTE, quote=True) in html


def test_stats_live_computed_from_steps() -> None:
    steps = [
        make_step(0, "a", 1.0, group=1.0, time_ms=900.0),
        make_step(1, "b", 2.0, group=1.5, time_ms=20.0),
        make_step(2, "c", 4.0, group=0.5, time_ms=30.0),
    ]
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


# ---- diff view ----


class TextWithoutDeletions(HTMLParser):
    """The text a reader sees in the column, minus the struck words of column 1."""

    def __init__(self) -> None:
        super().__init__()
        self.depth, self.parts = 0, []

    def handle_starttag(self, tag, attrs) -> None:
        self.depth += tag == "del"

    def handle_endtag(self, tag) -> None:
        self.depth -= tag == "del"

    def handle_data(self, data: str) -> None:
        if not self.depth:
            self.parts.append(data)


def shown_text(html: str) -> str:
    parser = TextWithoutDeletions()
    parser.feed(html)
    parser.close()
    return "".join(parser.parts)


def word_steps(words: list[str], ids: dict[str, int]) -> list[StepRecord]:
    """Steps whose token ids follow their text (equal text, equal id), as a tokenizer's would."""
    return [
        StepRecord(
            step=i,
            token_id=ids.setdefault(w, len(ids)),
            text=w,
            logprob=-0.1,
            prob=0.9,
            confidence=5.0,
            entropy=0.1,
            group_confidence=5.0,
            top=[],
            time_ms=1.0,
        )
        for i, w in enumerate(words)
    ]


def test_diff_marks_inserted_replaced_and_missing_words() -> None:
    ids: dict[str, int] = {}
    ref = word_steps(["The", " cat", " sat", " on", " the", " mat", "."], ids)
    col = word_steps(["The", " cat", " lay", " on", " a", " big", " mat", "."], ids)
    html = diff_html(ref, col)
    assert html == (
        "The cat "
        '<del class="fl-del" title="only in column 1">sat</del>'
        '<mark class="fl-ins" title="not in column 1">lay</mark> on '
        '<del class="fl-del" title="only in column 1">the</del>'
        '<mark class="fl-ins" title="not in column 1">a big</mark> mat.'
    )
    assert shown_text(html) == "The cat lay on a big mat."


def test_diff_is_plain_before_the_first_different_token() -> None:
    """Everything up to the word holding the first different token is plain text."""
    ids: dict[str, int] = {}
    ref = word_steps(["a", " b", " c", " x", " y"], ids)
    col = word_steps(["a", " b", " c", " y"], ids)
    html = diff_html(ref, col)
    before, _ = html.split("<del")
    assert before == "a b c " and shown_text(html) == "a b c y"


def test_diff_compares_a_word_split_across_tokens_whole() -> None:
    ids: dict[str, int] = {}
    ref = word_steps(["Hello", " Par", "is", "!"], ids)
    col = word_steps(["Hello", " Par", "king", "!"], ids)
    html = diff_html(ref, col)
    assert ">Paris!</del>" in html and ">Parking!</mark>" in html
    assert shown_text(html) == "Hello Parking!"


def test_diff_of_the_reference_itself_or_an_identical_column_is_plain() -> None:
    ids: dict[str, int] = {}
    ref = word_steps(["x", " <y>"], ids)
    assert diff_html(ref, ref) == "x &lt;y&gt;"
    assert diff_html(ref, word_steps(["x", " <y>"], ids)) == diff_html(ref, ref)
    assert shown_text(diff_html(ref, [])) == ""  # an empty answer: column 1's words, struck


def test_diff_of_a_prefix() -> None:
    """A column that stopped early lacks column 1's last words: they show as missing."""
    ids: dict[str, int] = {}
    ref = word_steps(["one", " two", " three"], ids)
    short = word_steps(["one", " two"], ids)
    assert diff_html(ref, short).endswith('<del class="fl-del" title="only in column 1">three</del>')
    assert diff_html(short, ref).endswith('<mark class="fl-ins" title="not in column 1">three</mark>')


def test_diff_escapes_hostile_text_and_reconstructs_it() -> None:
    ids: dict[str, int] = {}
    ref = word_steps(["ok", " " + HOSTILE[1], " end"], ids)
    col = word_steps(["ok", " " + HOSTILE[0], " " + HOSTILE[2], " end"], ids)
    html = diff_html(ref, col)
    assert "<img" not in html and "<script" not in html
    tags = parse(html)
    assert {tag for tag, _ in tags} <= {"mark", "del"}
    assert all(set(attrs) <= {"class", "title"} for _, attrs in tags)
    assert shown_text(html) == "".join(s.text for s in col)


def test_diff_reconstructs_long_texts_quickly() -> None:
    rng = random.Random(7)
    vocab = ["the", "a", "cat", "dog", "sat", "\n", "and", "then", "<b>", "&", "  ", "mat."]
    ids: dict[str, int] = {}
    ref = word_steps([rng.choice(vocab) + rng.choice([" ", "", "\n"]) for _ in range(1000)], ids)
    col = word_steps([s.text if rng.random() < 0.7 else rng.choice(vocab) for s in ref], ids)
    start = time.perf_counter()
    html = diff_html(ref, col)
    assert time.perf_counter() - start < 2.0
    assert shown_text(html) == "".join(s.text for s in col)


def test_diff_legend_names_both_marks() -> None:
    legend = diff_legend()
    assert 'class="fl-ins"' in legend and 'class="fl-del"' in legend and "column 1" in legend


# ---- quality metrics and best marks in the stats table ----


def cells(html: str) -> dict[str, dict]:
    """label -> {"text", "class", "title"} of each value cell, as a browser sees it."""

    class Cells(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.rows: dict[str, dict] = {}
            self.where: str | None = None
            self.label = ""

        def handle_starttag(self, tag, attrs) -> None:
            if tag in ("th", "td"):
                self.where = tag
                if tag == "td":
                    self.rows[self.label] = {
                        "text": "",
                        **{k: v for k, v in attrs if k in ("class", "title")},
                    }
                else:
                    self.label = ""

        def handle_endtag(self, tag) -> None:
            if tag in ("th", "td"):
                self.where = None

        def handle_data(self, data: str) -> None:
            if self.where == "th":
                self.label += data
            elif self.where == "td":
                self.rows[self.label]["text"] += data

    parser = Cells()
    parser.feed(html)
    return parser.rows


METRICS = {
    "mean": 2.0,
    "lowest_group": 1.5,
    "length": 2,
    "distinct_1": 0.875,
    "distinct_2": 2 / 3,
    "repeat_3gram_rate": 0.125,
    "longest_repeat": 3,
    "self_ppl": 4.567,
    "prompt_ppl": 20.0,
    "reference_ppl": 8.25,
    "reference_ppl_with_strategy": False,
    "key_facts_found": ["Paris"],
    "key_facts_total": 2,
    "key_fact_recall": 0.5,
}


def test_stats_show_quality_metrics_after_the_existing_items() -> None:
    row = make_row([make_step(0, "a")], stop_reason="eos", metrics=dict(METRICS))
    row.strategy = "residual"
    got = cells(render_stats(row))
    assert list(got)[:5] == ["tokens", "tokens/s", "mean confidence", "lowest group confidence", "stop"]
    assert {k: v["text"] for k, v in list(got.items())[5:]} == {
        "distinct-1": "0.88",
        "distinct-2": "0.67",
        "repeated 3-grams": "12.5%",
        "longest repeat (tokens)": "3",
        "self-PPL": "4.57",
        "prompt PPL": "20.00",
        "reference PPL": "8.25 (plain model)",
        "key facts": "1/2",
    }
    assert "plain model" in got["reference PPL"]["title"] and got["key facts"]["title"] == "found: Paris"
    assert not any("class" in c for c in got.values())  # nothing is best without `best`


def test_stats_reference_ppl_marker_only_for_a_strategy_scored_without_it() -> None:
    for strategy, with_strategy in ((None, False), ("anchor", True)):
        row = make_row([], metrics={"reference_ppl": 3.0, "reference_ppl_with_strategy": with_strategy})
        row.strategy = strategy
        assert cells(render_stats(row))["reference PPL"] == {"text": "3.00"}


def test_stats_without_quality_metrics_show_none_and_key_fact_totals_are_recovered() -> None:
    assert len(cells(render_stats(make_row([], metrics={"mean": 1.0, "lowest_group": 1.0})))) == 5
    old = {"key_facts_found": ["a", "b"], "key_fact_recall": 2 / 3}  # a result from before the total was kept
    assert cells(render_stats(make_row([], metrics=old)))["key facts"]["text"] == "2/3"
    none = cells(render_stats(make_row([], metrics={"key_facts_found": [], "key_fact_recall": 0.0})))
    assert none["key facts"] == {"text": "0 found", "title": "none found"}


def test_key_facts_that_ran_out_of_time_are_shown_as_not_judged() -> None:
    metrics = {
        "key_facts_found": ["Paris"],
        "key_facts_total": 3,
        "key_fact_recall": 0.5,
        "key_facts_unjudged": ["/(a+)+$/"],
    }
    got = cells(render_stats(make_row([], metrics=metrics)))["key facts"]
    assert got["text"] == "1/2 (1 not judged)"
    assert got["title"] == "found: Paris; not judged (the pattern's search ran out of time): /(a+)+$/"


def test_stats_mark_the_best_values() -> None:
    row = make_row([make_step(0, "a")], metrics=dict(METRICS))
    got = cells(render_stats(row, best={"mean", "self_ppl", "key_fact_recall"}))
    for label in ("mean confidence", "self-PPL", "key facts"):
        assert got[label]["class"] == "fl-best" and "best of the columns" in got[label]["title"]
        assert got[label]["text"].endswith(" ★")
    assert got["key facts"]["title"] == "found: Paris; best of the columns"
    assert "class" not in got["distinct-1"] and "class" not in got["lowest group confidence"]


def test_stats_escape_hostile_key_facts() -> None:
    metrics = {"key_facts_found": HOSTILE, "key_facts_total": 3, "key_fact_recall": 1.0}
    html = render_stats(make_row([], metrics=metrics), best={"key_fact_recall"})
    assert "<img" not in html and "<script" not in html
    assert cells(html)["key facts"]["title"] == "found: " + ", ".join(HOSTILE) + "; best of the columns"


def test_best_marks_per_row_with_live_confidence() -> None:
    finished = make_row([make_step(0, "a")], metrics={"mean": 3.0, "lowest_group": 1.0, "self_ppl": 5.0})
    streaming = make_row(
        [make_step(0, "a", 2.0, group=2.0), make_step(1, "b", 4.0, group=2.0)]
    )  # mean 3, low 2
    other = make_row([], metrics={"mean": 1.0, "lowest_group": 0.5, "self_ppl": 4.0})
    assert best_marks([finished, streaming, other]) == [{"mean"}, {"mean", "lowest_group"}, {"self_ppl"}]
    assert best_marks([finished]) == [set()]


# ---- column headings ----


def test_column_heading_colour_dot_and_modified_badges() -> None:
    heading = column_heading(
        "Feedback", "residual", {"alpha": 0.1}, color="#D55E00", modified=["prompt", "system prompt"]
    )
    first, note = heading.split("</h3>")
    assert first.startswith(
        '<h3 class="fl-heading fl-colhead" title="Feedback · residual — alpha=0.1">'
        '<span class="fl-dot" style="background:#D55E00" aria-hidden="true"></span>Feedback'
    )
    assert first.endswith(
        '<span class="fl-badge">prompt modified</span> <span class="fl-badge">system prompt modified</span>'
    )
    assert note == '<span class="fl-note fl-colnote" title="alpha=0.1">alpha=0.1</span>'
    assert column_heading("B", None, {}, "rgb(0, 114, 178)").startswith(
        '<h3 class="fl-heading fl-colhead" title="B"><span class="fl-dot" style="background:rgb'
    )
    assert column_heading("Baseline", None, {}) == column_heading("Baseline", None, {}, None, [])


@pytest.mark.parametrize(
    "color", ["red;background-image:url(x)", '"><img src=x>', "url(javascript:x)", "#12345z"]
)
def test_column_heading_refuses_unsafe_colours(color: str) -> None:
    assert "fl-dot" not in column_heading("A", None, {}, color=color)


def test_column_heading_escapes_hostile_names() -> None:
    heading = column_heading(HOSTILE[0], HOSTILE[1], {}, modified=[HOSTILE[2], "<b>x</b>"])
    assert "<img" not in heading and "<script" not in heading and "<b>" not in heading
    assert {tag for tag, _ in parse(heading)} == {"h3", "span"}


# ---- markdown view ----


def test_markdown_view_formats_a_finished_answer() -> None:
    text = ["Use ", "`ls`", ":\n\n", "```python\n", "print(1 < 2)\n", "```\n", "\n- one\n- **two**\n"]
    html = render.markdown_html([make_step(i, t) for i, t in enumerate(text)])
    tags = [tag for tag, _ in parse(html)]
    assert {"code", "pre", "ul", "li", "strong"} <= set(tags)
    assert "```" not in html and "print(1 &lt; 2)" in html


@pytest.mark.parametrize(
    "hostile",
    HOSTILE + ["[x](javascript:alert(1))", "![t](https://evil.example/p.png)", "<iframe src=//evil>"],
)
def test_markdown_view_keeps_html_links_and_images_harmless(hostile: str) -> None:
    html = render.markdown_html([make_step(0, hostile)])
    tags = parse(html)
    assert {tag for tag, _ in tags} <= {"div", "p", "a", "em", "strong", "code"}
    assert not any(name.startswith("on") for _, attrs in tags for name in attrs)
    assert not any((attrs.get("href") or "").startswith("javascript") for _, attrs in tags)


def test_the_metrics_table_has_a_column_per_column_and_a_row_per_metric() -> None:
    plain = make_row([make_step(0, "a", 1.0)], stop_reason="eos", metrics={"self_ppl": 3.0})
    fb = make_row(
        [make_step(0, "a", 2.0), make_step(1, "b", 3.0)], metrics={"self_ppl": 2.0, "extra_layer_passes": 4}
    )
    fb.name = "<b>fb</b>"
    html = render_metrics([plain, fb], [False, True], render.best_marks([plain, fb]), ["#1f77b4", "red;x:y"])
    heads = re.findall(r'<th scope="col">(.*?)</th>', html)
    assert heads[0] == "metric" and heads[1].endswith("baseline") and heads[2] == "&lt;b&gt;fb&lt;/b&gt;"
    assert "background:#1f77b4" in heads[1] and "fl-dot" not in heads[2]  # an unsafe colour draws no dot
    rows = {
        label: re.findall(r"<td[^>]*>(.*?)</td>", cells_html)
        for label, cells_html in re.findall(r'<tr><th scope="row">(.*?)</th>(.*?)</tr>', html)
    }
    assert rows["tokens"] == ["1", "2"] and rows["stop"] == ["eos", "running…"]
    assert rows["extra layer passes / token"] == ["—", "4"]  # only column 2 has it
    assert rows["self-PPL"][1].startswith("2.00") and "★" in rows["self-PPL"][1]  # the lower self-PPL is best


def test_a_data_table_escapes_its_cells_keeps_row_ids_and_says_when_empty():
    html = render.data_table(["name", "output"], [["<b>x</b>", None], ["y", 3]], "fl-history", ['a"1', "b"])
    assert "<td>&lt;b&gt;x&lt;/b&gt;</td><td></td>" in html and "<td>3</td>" in html
    assert re.findall(r'<tr data-id="([^"]*)">', html) == ["a&quot;1", "b"]
    assert '<th scope="col">name</th>' in html and 'class="fl-table fl-history"' in html
    empty = render.data_table(["name", "output"], [], empty="no runs")
    assert '<td colspan="2" class="fl-table-empty">no runs</td>' in empty
