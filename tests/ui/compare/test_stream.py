"""The board's document: compact, append-only token events that say everything the page draws of a
run (headings, conversations, tokens with their card numbers, ends, formatted views, memory)."""

from __future__ import annotations

import json
import math
import re
from html import escape
from pathlib import Path

from feedback.core.records import Alternative, RowResult, RowSpec, RunConfig, StepRecord
from ui.compare import stream
from ui.compare.layout import board_js
from ui.compare.stream import BoardDoc, finished_doc, parse
from ui.page import charts, render

HOSTILE = ["<img src=x onerror=alert(1)>", '"><script>alert(1)</script>', "' onmouseover='x"]
BOARD_JS = Path(stream.__file__).with_name("board.js").read_text(encoding="utf-8")


def step(i: int, text: str, conf: float = 5.0, top: list[Alternative] | None = None, **kw) -> StepRecord:
    return StepRecord(
        step=i,
        token_id=100 + i,
        text=text,
        logprob=-0.7,
        prob=0.123456,
        confidence=conf,
        entropy=1.23456,
        group_confidence=conf + 0.5,
        top=top or [],
        time_ms=10.0,
        **kw,
    )


def config(*rows: RowSpec, prompt: str = "Why?") -> RunConfig:
    return RunConfig(
        prompt=prompt,
        rows=list(rows) or [RowSpec("Baseline"), RowSpec("Feedback", "residual", {"alpha": 0.1})],
    )


def test_a_document_begins_with_its_columns_and_only_grows() -> None:
    """Each streamed update begins with the one before, so Gradio sends only the new events, and
    one token costs about a hundred bytes, not the column again."""
    doc = BoardDoc("r1", config(), fresh=[0, 1])
    steps = [step(i, f" w{i}", top=[Alternative(7, " x", 0.2)]) for i in range(20)]
    shown = [doc.text]
    for i in range(20):
        doc.tokens(i % 2, steps[i : i + 1])
        shown.append(doc.text)
    assert all(later.startswith(earlier) for earlier, later in zip(shown, shown[1:]))
    assert len(shown[-1]) - len(shown[-2]) < 150
    kind, head = parse(doc.text)[0]
    assert kind == "run" and head["id"] == "r1" and head["fresh"] == [0, 1]
    assert [c["name"] for c in head["columns"]] == ["Baseline", "Feedback"]
    assert head["columns"][1] | {"turns": []} == {
        "name": "Feedback",
        "strategy": "residual",
        "params": "alpha=0.1",
        "color": charts.row_color(1),
        "badges": [],
        "turns": [],
    }


def test_a_token_carries_what_its_card_shows() -> None:
    top = [Alternative(100 + 3, " it", 0.654321), Alternative(9, " that", 0.2), Alternative(10, "\n", 0.1)]
    doc = BoardDoc("r", config(), fresh=[0, 1])
    doc.tokens(1, [step(0, "a"), step(1, "b"), step(2, "c"), step(3, " it", conf=float("nan"), top=top)])
    events = parse(doc.text)
    tokens = [e for e in events if e[0] == "t"]
    assert [t[:5] for t in tokens] == [["t", 1, i, 100 + i, t] for i, t in enumerate(["a", "b", "c", " it"])]
    last = tokens[-1]
    # confidence (NaN: none), group confidence, probability, entropy, alternatives' ids and probabilities,
    # flags
    assert last[5:] == [None, None, 0.1235, 1.235, [103, 9, 10], [0.6543, 0.2, 0.1], 0]
    assert [e for e in events if e[0] == "v"] == [["v", 103, " it"], ["v", 9, " that"], ["v", 10, "\n"]]
    doc.tokens(1, [step(4, "d", top=top)])  # an alternative's text is sent once per document
    assert [e for e in parse(doc.text) if e[0] == "v"] == [
        ["v", 103, " it"],
        ["v", 9, " that"],
        ["v", 10, "\n"],
    ]
    assert "NaN" not in doc.text and "Infinity" not in doc.text


def test_markers_say_forced_chosen_and_a_prompt_level_part() -> None:
    steps = [
        step(0, "a", forced=True),
        step(1, "b", forced=True, chosen=True),
        step(2, "c", part="restate"),
        step(3, "d", part="transition"),
        step(4, "e", part="answer"),
    ]
    doc = BoardDoc("r", config(), fresh=[0])
    doc.tokens(0, steps)
    flags = [e[-1] for e in parse(doc.text) if e[0] == "t"]
    assert flags == [stream.FORCED, stream.FORCED | stream.CHOSEN, stream.RESTATE, stream.TRANSITION, 0]
    # the board reads the same bits and the same card rows as the server's own cards
    assert "const FORCED = 1, CHOSEN = 2, RESTATE = 4, TRANSITION = 8;" in BOARD_JS
    config_js = json.loads(re.search(r"const CONFIG = (.*);\n", board_js()).group(1))
    assert config_js["chosen_row"] == list(render.CHOSEN_ROW) and config_js["replayed_row"] == list(
        render.REPLAYED_ROW
    )
    assert config_js["part_rows"] == {k: list(v) for k, v in render.PART_ROWS.items()}


def test_the_colour_scale_is_the_servers_absolute_one() -> None:
    config_js = json.loads(re.search(r"const CONFIG = (.*);\n", board_js()).group(1))
    assert config_js["bins"] == [
        [None if b == math.inf else b, color] for b, _, color in render.CONFIDENCE_BINS
    ]
    bounds = [b for b, _ in config_js["bins"][:-1]]
    assert bounds == sorted(bounds) and config_js["bins"][-1][0] is None  # lower confidence, stronger colour
    legend = render.confidence_legend()
    assert all(escape(label) in legend for _, label, _ in render.CONFIDENCE_BINS)


def test_hostile_text_stays_data_and_the_board_writes_it_as_text() -> None:
    """Names, prompts and tokens travel as JSON strings; the board puts them on the page with
    textContent. Its only HTML is the server's: the static legend and the escaped finished views."""
    spec = RowSpec(
        HOSTILE[0],
        messages=[{"role": "user", "content": HOSTILE[1]}, {"role": "assistant", "content": HOSTILE[2]}],
    )
    doc = BoardDoc("r", config(spec, RowSpec("b", prompt=HOSTILE[2]), prompt=HOSTILE[1]), fresh=[0, 1])
    row = RowResult(
        HOSTILE[0],
        None,
        {},
        steps=[step(0, HOSTILE[1], top=[Alternative(1, HOSTILE[2], 0.5)])],
        stop_reason="eos",
        stop_step=0,
    )
    doc.replay(0, row)
    doc.diff(0, stream.diffs([row, row])[0])
    events = parse(doc.text)
    head = events[0][1]["columns"]
    assert head[0]["name"] == HOSTILE[0] and head[0]["turns"][0] == ["user", HOSTILE[1], False]
    assert head[1]["turns"] == [["user", HOSTILE[2], True]]
    assert [e[4] for e in events if e[0] == "t"] == [HOSTILE[1]] and ["v", 1, HOSTILE[2]] in events
    for kind in ("md", "diff"):
        (html,) = [e[2] for e in events if e[0] == kind]
        assert "<img" not in html and "<script" not in html
    assert BOARD_JS.count("innerHTML") == 2
    assert "legend.innerHTML = CONFIG.diff_legend" in BOARD_JS and "c.alt.innerHTML = html" in BOARD_JS


def test_conversation_bubbles_show_only_what_a_column_was_asked_beyond_the_shared_question() -> None:
    assert stream.column_head(0, RowSpec("a"), config())["turns"] == []
    own = stream.column_head(1, RowSpec("b", prompt="In one word?"), config())
    assert own["turns"] == [["user", "In one word?", True]] and own["badges"] == ["prompt modified"]
    chat = RowSpec(
        "c",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
        ],
    )
    assert stream.column_head(0, chat, config(prompt="And then?"))["turns"] == [
        ["system", "Be brief.", False],
        ["user", "Hi", False],
        ["assistant", "Hello!", False],
        ["user", "And then?", True],
    ]


def test_an_end_keeps_what_the_page_showed() -> None:
    doc = BoardDoc("r", config(), fresh=[0, 1])
    doc.tokens(1, [step(i, "x") for i in range(6)])
    cut = RowResult(
        "Feedback", "residual", {}, steps=[step(i, "x") for i in range(4)], stop_reason="stopped", stop_step=3
    )
    doc.end(1, cut)
    assert parse(doc.text)[-1] == ["end", 1, "stopped", 3, 4] and doc.shown[1] == 4


def test_a_finished_run_is_drawn_from_the_same_events_it_streamed() -> None:
    rows = [
        RowResult(
            "Baseline",
            None,
            {},
            steps=[step(i, f" {w}") for i, w in enumerate("the cat sat".split())],
            stop_reason="eos",
            stop_step=2,
        ),
        RowResult(
            "Feedback",
            "residual",
            {"alpha": 0.1},
            steps=[step(0, " the"), step(1, " dog")],
            stop_reason="max_tokens",
            stop_step=1,
        ),
    ]
    rows[1].steps[1].token_id = 999
    whole = parse(finished_doc("r", config(), rows).text)
    assert whole[0][1]["fresh"] == []  # nothing of it draws chart points: its chart is drawn whole
    live = BoardDoc("r", config(), fresh=[])
    for i, row in enumerate(rows):
        live.tokens(i, row.steps[:1])
    for i, row in enumerate(rows):
        live.tokens(i, row.steps[1:])
        live.end(i, row)
        live.markdown(i, row)
    for i, html in enumerate(stream.diffs(rows)):
        live.diff(i, html)
    assert sorted(map(json.dumps, parse(live.text))) == sorted(map(json.dumps, whole))
    (diff,) = [e[2] for e in whole if e[0] == "diff" and e[1] == 1]
    assert "fl-ins" in diff and "dog" in diff
    assert [e[2] for e in whole if e[0] == "md"] == [render.markdown_html(r.steps) for r in rows]


def test_memory_points_follow_the_charts_series() -> None:
    doc = BoardDoc("r", config(), fresh=[0], memory_keys=["rss_mb", "cuda_allocated_mb"])
    doc.memory({"t": 1.5, "rss_mb": 900.0, "cuda_allocated_mb": 12.0, "cuda_peak_mb": 99.0})
    doc.done()
    events = parse(doc.text)
    assert events[0][1]["memory"] == ["rss_mb", "cuda_allocated_mb"]
    assert events[1] == ["m", 1.5, 900.0, 12.0] and events[2][0] == "done" and events[2][1] > 1.7e9
    assert stream.empty_doc() == "" and parse(stream.empty_doc(config()))[0][1]["id"] == "empty"
