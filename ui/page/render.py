"""HTML the server makes: a finished answer formatted from Markdown or as a word diff against column 1
(the Compare board shows them), detail-card data for the Perplexity tab's tokens, the metrics table,
column headings, legends and the status line. (The Compare columns' tokens are drawn by the page
from their events: `ui.compare.stream`.)

Everything that comes from the model or the user is HTML-escaped, in element content and in
attributes; the detail card's data is JSON in an attribute, and the page script puts it on screen as
text only. The one inline style taken from a caller (a column's colour) is checked against a strict
pattern first.
"""

from __future__ import annotations

import json
import math
import os
import re
from difflib import SequenceMatcher
from html import escape

from markdown_it import MarkdownIt

from feedback.core import quality
from feedback.core.records import (
    RowResult,
    StepRecord,
    confidence_summary,
    first_divergence,
    tokens_per_second,
)

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
CHOSEN_ROW = ("forced", "yes — chosen by you (branch)")
REPLAYED_ROW = ("forced", "replayed: the text before the branch")
# Parts of a prompt-level strategy's reply (restate): shown on the card and marked in the text.
PART_ROWS = {
    "restate": ("part", "restatement of the key facts (before the answer)"),
    "transition": ("part", "marker forced by the strategy: the answer starts"),
}
BEST_TITLE = "best of the columns"


def visible(text: str) -> str:
    """Token text with whitespace made visible, for cards ("∅" for an empty token)."""
    return "".join(_VISIBLE.get(ch, ch) for ch in text) if text else "∅"


def confidence_legend(k: int = 20) -> str:
    swatches = "".join(
        f'<span><span class="fl-swatch" style="background:{color}"></span>{escape(label)}</span>'
        for _, label, color in CONFIDENCE_BINS
    )
    return (
        f'<div class="fl-legend" id="confidence-legend"><span>Token confidence (DeepConf, k = {k}; the '
        f"stronger the orange, the less sure the model):</span>{swatches}"
        "<span>· hover, tap or focus a token for details</span></div>"
    )


def card_attr(
    title: str, rows: list[tuple[str, str]], top: list[tuple] | None = None, top_label: str | None = None
) -> str:
    """A `data-card` attribute for the page's detail card (escaped JSON).

    `top` entries are (text, prob, chosen) or (text, prob, chosen, token_id): the card script reads
    the first three; the token id is what a click on an alternative needs to branch from it."""
    data: dict = {"title": title, "rows": rows}
    if top:
        data["top"] = [[t, round(p, 4), chosen, *rest] for t, p, chosen, *rest in top]
    if top_label:
        data["top_label"] = top_label
    return f'data-card="{escape(json.dumps(data, ensure_ascii=False, separators=(",", ":")), quote=True)}"'


# ---- markdown view: the answer as formatted text ----


def _markdown_parser() -> MarkdownIt:
    """CommonMark with tables and strikethrough, as chat UIs render answers. Raw HTML in the text
    stays text (`html` off) and images are not drawn (a generated image link would make the page
    fetch an address the model wrote); markdown-it refuses javascript:/data: links itself."""
    return MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"]).disable("image")


_MARKDOWN = _markdown_parser()


# ---- diff view: a column's words against column 1's ----

_UNIT = re.compile(r"\S+\s*|\s+")  # a word with the whitespace after it (or leading whitespace)


def _joined(steps: list[StepRecord]) -> str:
    return "".join(s.text for s in steps)


def _diff_start(reference: list[StepRecord], steps: list[StepRecord]) -> int | None:
    """Character offset in the column's text where the word diff begins: the start of the word
    holding the first token where the two columns differ (so a word split across tokens is compared
    whole), or None when they chose the same tokens throughout."""
    div = first_divergence([s.token_id for s in reference], [s.token_id for s in steps])
    if div is None:
        return None
    head = _joined(steps[:div])
    pos = len(os.path.commonprefix([head, _joined(reference[:div])]))  # equal ids give equal text; be safe
    while pos > 0 and not head[pos - 1].isspace():
        pos -= 1
    return pos


def _inserted(text: str) -> str:
    """Words only in this column, highlighted; the whitespace after them stays plain."""
    words = text.rstrip()
    if not words:
        return escape(text, quote=True)
    return (
        f'<mark class="fl-ins" title="not in column 1">{escape(words, quote=True)}</mark>'
        f"{escape(text[len(words) :], quote=True)}"
    )


def _deleted(text: str) -> str:
    """Words of column 1 missing here, struck and on one line (they are not this column's text)."""
    words = " ".join(text.split())
    return f'<del class="fl-del" title="only in column 1">{escape(words, quote=True)}</del>' if words else ""


def _word_diff(ref_text: str, text: str) -> str:
    """HTML of `text` with its word differences from `ref_text`. Words are compared without the
    whitespace around them, and this column's own words and whitespace are what is shown, so the
    output minus its <del> elements is exactly `text`."""
    ref_units, units = _UNIT.findall(ref_text), _UNIT.findall(text)
    ops = SequenceMatcher(
        None, [u.rstrip() for u in ref_units], [u.rstrip() for u in units], autojunk=False
    ).get_opcodes()
    parts = []
    for tag, i1, i2, j1, j2 in ops:
        own = "".join(units[j1:j2])
        if tag == "equal":
            parts.append(escape(own, quote=True))
            continue
        if tag in ("delete", "replace"):
            parts.append(_deleted("".join(ref_units[i1:i2])))
        if tag in ("insert", "replace"):
            parts.append(_inserted(own))
    return "".join(parts)


def markdown_html(steps: list[StepRecord]) -> str:
    """A finished answer formatted from Markdown (code fences, lists, tables), as HTML."""
    return _MARKDOWN.render(_joined(steps))


def diff_html(reference: list[StepRecord], steps: list[StepRecord]) -> str:
    """A finished column's text with its word-level differences from the reference column (column
    1), from the first token where the two differ; before it the text is plain. The reference
    column itself (or one that chose the same tokens) is plain text: the caller says why."""
    text = _joined(steps)
    cut = None if reference is steps else _diff_start(reference, steps)
    if cut is None:
        return escape(text, quote=True)
    return escape(text[:cut], quote=True) + _word_diff(_joined(reference)[cut:], text[cut:])


def diff_legend() -> str:
    """What the diff view's marks mean."""
    return (
        '<div class="fl-legend" id="diff-legend"><span>Differences from column 1, from the first token '
        'where they part:</span><span><mark class="fl-ins">words</mark> only in this column</span>'
        '<span><del class="fl-del">words</del> only in column 1</span></div>'
    )


def _fmt(value: float | None, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return MISSING
    return format(value, spec)


def _stop_text(row: RowResult, live: bool) -> str:
    if row.stop_reason is None:
        return "running…" if live else MISSING
    return row.stop_reason if row.stop_step is None else f"{row.stop_reason} @ step {row.stop_step}"


# Quality metrics shown as plain numbers: (metrics key, label, format). Reference PPL and key
# facts need more than a number and have their own items.
QUALITY_ITEMS = (
    ("distinct_1", "distinct-1", ".2f"),
    ("distinct_2", "distinct-2", ".2f"),
    ("repeat_3gram_rate", "repeated 3-grams", ".1%"),
    ("longest_repeat", "longest repeat (tokens)", ".0f"),
    ("self_ppl", "self-PPL", ".2f"),
    ("prompt_ppl", "prompt PPL", ".2f"),
)
PLAIN_MODEL_NOTE = "scored by the plain model: this strategy cannot score a given text exactly in one pass"


def _reference_item(row: RowResult, best: set[str]) -> tuple:
    """Reference PPL, saying so when the row's strategy could not take part in scoring it."""
    m = row.metrics
    value = _fmt(m["reference_ppl"], ".2f")
    if row.strategy and m.get("reference_ppl_with_strategy") is False and value != MISSING:
        return "reference PPL", f"{value} (plain model)", "reference_ppl" in best, PLAIN_MODEL_NOTE
    return "reference PPL", value, "reference_ppl" in best


def _key_facts_item(m: dict, best: set[str]) -> tuple:
    """Key facts as found/total, naming the ones found on hover. Older results lack the total:
    it is recovered from the recall when that is not zero."""
    found = list(m.get("key_facts_found") or [])
    total, recall = m.get("key_facts_total"), m.get("key_fact_recall")
    if total is None and recall:
        total = round(len(found) / recall)
    unjudged = list(m.get("key_facts_unjudged") or [])
    if total is not None:
        total -= len(unjudged)  # recall counts only the facts judged on every column
    value = f"{len(found)}/{total}" if total is not None else f"{len(found)} found"
    note = "found: " + ", ".join(found) if found else "none found"
    if unjudged:
        value += f" ({len(unjudged)} not judged)"
        note += "; not judged (the pattern's search ran out of time): " + ", ".join(unjudged)
    return "key facts", value, "key_fact_recall" in best, note


def _quality_items(row: RowResult, best: set[str]) -> list[tuple]:
    """The row's quality metrics that it has (a run computes only the ones asked for)."""
    m = row.metrics
    items: list[tuple] = [
        (label, _fmt(m[key], spec), key in best) for key, label, spec in QUALITY_ITEMS if key in m
    ]
    if "reference_ppl" in m:
        items.append(_reference_item(row, best))
    if "key_fact_recall" in m:
        items.append(_key_facts_item(m, best))
    return items


def stat_items(row: RowResult, live: bool = False, best: set[str] | None = None) -> list[tuple]:
    """A column's metrics as (label, value[, best[, note]]): tokens, tokens/s, mean confidence,
    lowest group confidence, stop reason, then the quality metrics the row has. Metric keys in
    `best` (see `best_marks`) are marked as the best of the columns."""
    best = best or set()
    tps = tokens_per_second(row.steps) if live else row.tokens_per_s
    mean, lowest = confidence_summary(row)
    items = [
        ("tokens", str(len(row.token_ids))),
        _speed_item(row, tps),
        ("mean confidence", _fmt(mean, ".2f"), "mean" in best),
        ("lowest group confidence", _fmt(lowest, ".2f"), "lowest_group" in best),
        ("stop", _stop_text(row, live)),
    ]
    m = row.metrics
    if m.get("extra_layer_passes"):
        items.append(("extra layer passes / token", str(m["extra_layer_passes"])))
    if m.get("restatement_tokens") is not None:
        items.append(("restatement tokens", str(m["restatement_tokens"])))
    return items + _quality_items(row, best)


RATE_NOTE = (
    "this column's tokens over the time of the steps that made them; each step decodes every running "
    "column at once, so a column's rate rises when others stop"
)
RERUN_RATE_NOTE = (
    "measured when this column was re-run alone (one column a step); the other columns' rates come "
    "from their run, where every step decoded all of them together"
)


def _speed_item(row: RowResult, tps: float | None) -> tuple:
    """tokens/s, said how it was measured: in its batched run, or alone (a re-run column)."""
    if row.metrics.get("rerun_alone"):
        return "tokens/s", f"{_fmt(tps, '.1f')} (alone)", False, RERUN_RATE_NOTE
    return "tokens/s", _fmt(tps, ".1f"), False, RATE_NOTE


def data_table(
    headers: list[str],
    rows: list[list],
    elem_class: str = "",
    row_ids: list[str] | None = None,
    empty: str = "nothing to show",
) -> str:
    """A read-only table of text cells (escaped), its header kept in view while its box scrolls.
    Drawn as HTML rather than a `gr.Dataframe`: Gradio's Dataframe keeps every row it ever drew
    alive in its scroller's cache (a new key per row per update), so a table redrawn again and again
    (History, opened after each run) grew the page by its whole size each time."""

    def tr(row: list, row_id: str | None) -> str:
        attr = "" if row_id is None else f' data-id="{escape(str(row_id), quote=True)}"'
        return (
            f"<tr{attr}>" + "".join(f"<td>{escape('' if v is None else str(v))}</td>" for v in row) + "</tr>"
        )

    head = "".join(f'<th scope="col">{escape(str(h))}</th>' for h in headers)
    body = "".join(tr(row, i) for row, i in zip(rows, row_ids or [None] * len(rows)))
    if not rows:
        body = f'<tr><td colspan="{len(headers)}" class="fl-table-empty">{escape(empty)}</td></tr>'
    return (
        f'<div class="fl-table {escape(elem_class, quote=True)}"><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table></div>"
    )


def render_metrics(
    rows: list[RowResult],
    running: list[bool] | None = None,
    best: list[set[str]] | None = None,
    colors: list[str | None] | None = None,
) -> str:
    """One table for every column: a row per metric, a column per column (headed by its name and
    chart colour), so a metric reads across the columns. A metric a column lacks shows "—".
    `running`: which columns still stream; `best`: each column's best marks."""
    running = running or [False] * len(rows)
    best = best or [set()] * len(rows)
    colors = colors or [None] * len(rows)
    per = [{item[0]: item[1:] for item in stat_items(r, live, b)} for r, live, b in zip(rows, running, best)]
    labels = list(dict.fromkeys(label for items in per for label in items))
    head = "".join(f'<th scope="col">{color_dot(c)}{escape(r.name)}</th>' for r, c in zip(rows, colors))
    body = "".join(
        f'<tr><th scope="row">{escape(label)}</th>'
        + "".join(_stat_cell(*items.get(label, (MISSING,))) for items in per)
        + "</tr>"
        for label in labels
    )
    return (
        f'<div class="fl-metrics"><table class="fl-stats"><thead><tr><th scope="col">metric</th>{head}</tr>'
        f"</thead><tbody>{body}</tbody></table></div>"
    )


def best_marks(rows: list[RowResult]) -> list[set[str]]:
    """Per row, the metric keys where it is the best of the columns: `render_metrics`'s `best`.
    Confidence comes from the steps while a row streams, like the table shows it."""
    summaries = [row.metrics | dict(zip(("mean", "lowest_group"), confidence_summary(row))) for row in rows]
    winners = quality.best_rows(summaries)
    return [{key for key, indexes in winners.items() if i in indexes} for i in range(len(rows))]


def _stat_cell(value: str, best: bool = False, note: str | None = None) -> str:
    """One value cell; a best value gets a class, a star and a title saying so, a note a title."""
    if best:
        note = f"{note}; {BEST_TITLE}" if note else BEST_TITLE
    cls = ' class="fl-best"' if best else ""
    title = f' title="{escape(note, quote=True)}"' if note else ""
    star = ' <span class="fl-star" aria-hidden="true">★</span>' if best else ""
    return f"<td{cls}{title}>{escape(value, quote=True)}{star}</td>"


def params_text(params: dict) -> str:
    """ "alpha=0.1, source_layer=21" — a strategy's parameters as a run used them."""
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


# A CSS colour as the charts name them: #hex, a name, or rgb()/hsl() with numbers only. Anything
# else (which could smuggle more CSS into the style attribute) draws no dot.
_SAFE_COLOR = re.compile(r"#[0-9a-fA-F]{3,8}|[a-zA-Z]{3,20}|(?:rgb|hsl)a?\([0-9.,%\s]{1,60}\)")


def color_dot(color: str | None) -> str:
    """A dot in the column's chart colour, tying the column to its lines in the charts."""
    if not color or not _SAFE_COLOR.fullmatch(color):
        return ""
    return f'<span class="fl-dot" style="background:{escape(color, quote=True)}" aria-hidden="true"></span>'


def modified_badges(modified: list[str] | None) -> str:
    """Badges naming what a column overrides of the run ("prompt modified"), so a column whose
    input differs is not mistaken for a pure strategy comparison."""
    return "".join(
        f' <span class="fl-badge">{escape(what, quote=True)} modified</span>' for what in modified or []
    )


def setting_badges(settings: list[str] | None) -> str:
    """Badges for a column's own settings that are not the run's ("temperature 0")."""
    return "".join(f' <span class="fl-badge">{escape(text, quote=True)}</span>' for text in settings or [])


def column_heading(
    title: str,
    strategy: str | None,
    params: dict,
    color: str | None = None,
    modified: list[str] | None = None,
    settings: list[str] | None = None,
) -> str:
    """ "● Feedback · residual" over "alpha=0.1, …": the column names what produced it, so a
    screenshot explains itself; badges say what it overrides (`modified`) and its own `settings`
    ("temperature 0"). HTML (it goes into a gr.HTML): a column's name comes from the user, or from
    a link a stranger made, so it is text, escaped, and never read as Markdown (no links)."""
    head = f"{color_dot(color)}{escape(title, quote=True)}"
    if strategy:
        head += f" · {escape(strategy, quote=True)}"
    note = escape(params_text(params), quote=True) if strategy else "no feedback: the model as it is"
    # One line of heading and two of note, whatever the column: the texts below then start at the
    # same height in every column (side by side on a phone too); the full text is the tooltip.
    full = escape(
        " · ".join(x for x in (title, strategy) if x) + " — " + params_text(params) if strategy else title,
        quote=True,
    )
    return (
        f'<h3 class="fl-heading fl-colhead" title="{full}">{head}{modified_badges(modified)}'
        f'{setting_badges(settings)}</h3><span class="fl-note fl-colnote" title="{note}">{note}</span>'
    )


# ':' and '@' too: escaped, "https\://a\.b" and "me\@a\.b" are no longer bare URLs or addresses,
# which Markdown's autolinking would otherwise turn into links
_MARKDOWN_SPECIALS = re.compile(r"([\\`*_{}\[\]()#+\-.!|~>:@])")


def md_text(text) -> str:
    """Any text (a model's answer, a column name, a model name from a link) as literal text inside
    Markdown: HTML-escaped and every Markdown character backslash-escaped, so it can make no link
    (not even an autolinked URL), image, code span or heading."""
    return _MARKDOWN_SPECIALS.sub(r"\\\1", escape(str(text), quote=False))


def status_html(text: str, kind: str = "info") -> str:
    """The tab's one status line; `kind` "wait" stands out (waiting in line), "error" says it failed."""
    icon = {"error": "⚠ ", "stopped": "■ "}.get(kind, "")  # waiting gets a blinking dot (CSS)
    return f'<div class="fl-status fl-{kind}">{icon}{escape(text)}</div>'
