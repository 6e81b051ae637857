"""Compare-tab values -> RunConfig (every bad value a clear FeedbackError), columns with their own
prompts, strategies and temperatures, follow-ups and branches prepared from the last run, a stored
run or a shared link restored into every control; the settings table itself (every entry round-trips,
each takes its declared bound)."""

from __future__ import annotations

import json
import re
import types
from types import SimpleNamespace

import gradio as gr
import pytest

from feedback.core import records, sampling
from feedback.core.records import RowResult, RowSpec, RunConfig, RunResult
from feedback.errors import FeedbackError
from feedback.serve import limits
from feedback.serve.limits import SERVED_MAX_NEW_TOKENS
from feedback.strategies import REGISTRY
from ui.compare import link, stream
from ui.compare.tab import CompareTab, parse_branch, record_run
from ui.compare.view import divergences, modified
from ui.page import deepconf, history
from ui.page import settings as compare_settings
from ui.page.controls import api_name
from ui.page.settings import (
    CALIBRATION,
    COLUMN,
    DEFAULT_COLUMNS,
    SHARED,
    Field,
    column_key,
    parse_key_facts,
    resolve,
    run_config,
)

SHARED_VALUES = dict(
    prompt="hi",
    system_prompt="",
    chat_template=True,
    model="embedded",
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.0,
    repetition_penalty=1.1,
    max_new_tokens=64,
    seed=3,
    k=20,
    window=16,
    threshold_mode="off",
    threshold=4.5,
    reference="",
    key_facts="",
)


def built(lm) -> CompareTab:
    return built_with_page(lm)[0]


def built_with_page(lm) -> tuple[CompareTab, gr.Blocks]:
    from feedback.serve.pool import ModelPool
    from ui.page.runner import ModelRunner

    pool = ModelPool.serving(lm)
    t = CompareTab(pool, ModelRunner(pool))
    with gr.Blocks() as demo:
        t.build(lm.num_layers, gr.BrowserState([]))
    return t, demo


def values(t: CompareTab, columns: int = 2, changes: dict[int, dict] | None = None, **shared) -> dict:
    """Every setting's value by name as the page starts, with the shared values `shared` and, per
    column, `changes[index][setting name]` ("deep_cache.lam" for a strategy parameter)."""
    out = t.initial_values() | SHARED_VALUES | shared | {"columns": columns}
    for index, change in (changes or {}).items():
        for name, value in change.items():
            out[column_key(index, api_name(*name.split(".")) if "." in name else name)] = value
    return out


def config(t: CompareTab, columns: int = 2, changes: dict | None = None, **shared) -> RunConfig:
    return run_config(values(t, columns, changes, **shared))


@pytest.fixture(scope="module")
def tab(embedded_lm) -> CompareTab:
    return built(embedded_lm)


def test_default_columns_make_the_baseline_and_a_feedback_row(tab):
    cfg = config(tab)
    assert (
        [r.name for r in cfg.rows]
        == [DEFAULT_COLUMNS[0][0], DEFAULT_COLUMNS[1][0]]
        == ["Baseline", "Feedback"]
    )
    assert (
        cfg.rows[0].strategy is None and cfg.rows[1].strategy == "residual" and "alpha" in cfg.rows[1].params
    )
    assert cfg.sampling.temperature == 0.7 and cfg.sampling.top_k == 40 and cfg.deepconf.threshold is None
    assert cfg.quality and all(
        r.prompt is None and r.seed_offset == 0 for r in cfg.rows
    )  # common random numbers
    assert config(tab, threshold_mode="fixed", threshold=7.5).deepconf.threshold == 7.5


def test_columns_carry_their_own_prompt_system_prompt_and_strategy(tab):
    changes = {
        1: {"strategy": "deep_cache", "deep_cache.lam": 0.3, "system": "Be terse."},
        2: {"name": "Strong", "strategy": "none", "prompt": "hi! Answer in one precise sentence."},
    }
    cfg = config(tab, columns=3, changes=changes, reference="Hello.", key_facts="hello\n\n/h+i/\n")
    assert [r.name for r in cfg.rows] == ["Baseline", "Feedback", "Strong"]
    assert cfg.rows[1].strategy == "deep_cache" and cfg.rows[1].params["lam"] == 0.3
    assert cfg.rows[1].system_prompt == "Be terse." and cfg.rows[1].prompt is None
    assert cfg.rows[2].prompt == "hi! Answer in one precise sentence." and cfg.rows[2].strategy is None
    assert cfg.reference == "Hello." and cfg.key_facts == ["hello", "/h+i/"]
    # an override equal to the shared prompt is no override; an empty shared prompt is fine when all have
    # their own
    assert config(tab, changes={1: {"prompt": "hi"}}).rows[1].prompt is None
    own = {0: {"prompt": "a"}, 1: {"prompt": "b"}}
    assert [r.prompt for r in config(tab, changes=own, prompt="").rows] == ["a", "b"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": None}, "prompt is empty"),
        ({"max_new_tokens": None}, "max new tokens must be a number"),
        ({"max_new_tokens": 2.5}, "max new tokens must be a whole number"),
        ({"max_new_tokens": SERVED_MAX_NEW_TOKENS + 1}, f"between 1 and {SERVED_MAX_NEW_TOKENS}"),
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_p": float("inf")}, "top-p must be finite"),
        ({"seed": -1}, "seed must be at least 0"),
        ({"window": 0}, "window"),
        ({"threshold_mode": "fixed", "threshold": None}, "threshold must be a number"),
        ({"columns": 5}, "columns must be between 2 and 4"),
        ({"columns": 1}, "columns must be between 2 and 4"),
    ],
)
def test_bad_values_are_refused_with_a_message(tab, change, message):
    columns = change.pop("columns", 2)
    with pytest.raises(FeedbackError, match=message):
        config(tab, columns=columns, **change)


def test_bad_columns_are_refused_naming_the_column(tab):
    with pytest.raises(FeedbackError, match="column names must be different"):
        config(tab, changes={1: {"name": "Baseline"}})
    for change, message in [
        ({"strategy": "nope"}, "unknown strategy"),
        ({"residual.alpha": 5.0}, r"alpha=5.0 is out of range \[-1.0, 1.0\]"),
    ]:
        with pytest.raises(FeedbackError, match=message):  # the engine refuses it before anything waits
            tab.prepare_compare(compare(tab, changes={1: change}))
    with pytest.raises(FeedbackError, match="row Column 3: prompt is limited"):
        config(tab, columns=3, changes={2: {"prompt": "x" * 100_001}})


def compare(t: CompareTab, changes: dict | None = None, **shared) -> dict:
    """prepare_compare's values: every setting's."""
    return values(t, changes=changes, **shared)


def test_prepare_refuses_context_and_model_errors_before_any_waiting(tab, embedded_lm):
    work = tab.prepare_compare(compare(tab, model=embedded_lm.name, max_new_tokens=8))
    assert work.label == "a Compare run" and len(work.engine_run.config.rows) == 2
    for change, message in [
        ({"prompt": "word " * 9000}, "exceeds the model context"),
        ({"model": "evil/model"}, "not in the allowlist"),
    ]:
        with pytest.raises(FeedbackError, match=message):
            tab.prepare_compare(compare(tab, **{"model": embedded_lm.name} | change))


def test_follow_ups_need_a_run_and_a_branch_request():
    t = CompareTab(pool=None, runner=None)
    with pytest.raises(FeedbackError, match="run a prompt first"):
        t.prepare_continue({"last": None, "message": "and then?"})
    with pytest.raises(FeedbackError, match="run a prompt first"):
        t.prepare_branch(
            {"last": None, "choice": '{"row": "a", "step": 1, "token_id": 2}', "all_columns": True}
        )
    assert parse_branch(json.dumps({"row": "Feedback", "step": 3, "token_id": 42})) == ("Feedback", 3, 42)
    for bad in (
        "",
        "{",
        '{"row": 1, "step": 2, "token_id": 3}',
        '{"row": "a", "step": true, "token_id": 3}',
        '{"row": "a"}',
    ):
        with pytest.raises(FeedbackError):
            parse_branch(bad)
    assert parse_key_facts(" a \n\n b\n") == ["a", "b"] and parse_key_facts(None) == []


def test_a_finished_run_continues_and_branches_from_the_last_result(tab, embedded_lm):
    from feedback.core.engine import run_to_end

    cfg = config(tab, max_new_tokens=4, temperature=0.0, model=embedded_lm.name)
    data = run_to_end(embedded_lm, cfg).to_dict()
    follow = tab.prepare_continue({"last": data, "message": "And then?"}).engine_run.config
    assert follow.prompt == "And then?" and follow.rows[1].messages[-1]["role"] == "assistant"
    alt = data["rows"][1]["steps"][2]["top"][1]["token_id"]
    request = json.dumps({"row": "Feedback", "step": 2, "token_id": alt})

    def branched(choice: str, all_columns: bool) -> RunConfig:
        values = {"last": data, "choice": choice, "all_columns": all_columns}
        return tab.prepare_branch(values).engine_run.config

    paired = branched(request, True)
    assert paired.rows[1].prefix == data["rows"][1]["token_ids"][:2] + [alt]
    assert paired.rows[0].prefix == data["rows"][0]["token_ids"][:2] + [alt]  # every column, paired
    alone = branched(request, False)
    assert alone.rows[0].prefix is None
    with pytest.raises(FeedbackError, match="unknown row"):
        branched(json.dumps({"row": "nope", "step": 2, "token_id": alt}), True)


def test_divergences_pair_every_column_with_the_first():
    from feedback.core.records import RowResult

    rows = [
        RowResult("a", None, {}, [1, 2, 3]),
        RowResult("b", None, {}, [1, 2, 4]),
        RowResult("c", None, {}, [1, 2, 3]),
    ]
    for r in rows:
        r.steps = [None] * len(r.token_ids)
    assert divergences(rows) == {1: 2}


def test_restore_sets_every_control_and_column_from_a_stored_run(tab, embedded_lm):
    from feedback.core.engine import run_to_end

    changes = {
        1: {"strategy": "soft_token", "soft_token.beta": 0.25, "soft_token.top_k": 8},
        2: {"name": "Terse", "strategy": "none", "prompt": "hi, briefly", "system": "Be terse."},
    }
    cfg = config(
        tab,
        columns=3,
        changes=changes,
        model=embedded_lm.name,
        threshold_mode="fixed",
        threshold=3.25,
        max_new_tokens=3,
        key_facts="hello",
    )
    data = run_to_end(embedded_lm, cfg).to_dict() | {"run_id": "r1"}
    out = tab.restore(data)
    s = tab.ui.settings
    expected = {
        s["prompt"]: "hi",
        s["chat_template"]: True,
        s["model"]: embedded_lm.name,
        s["temperature"]: 0.7,
        s["top_p"]: 0.9,
        s["top_k"]: 40,
        s["min_p"]: 0.0,
        s["repetition_penalty"]: 1.1,
        s["max_new_tokens"]: 3,
        s["seed"]: 3,
        s["k"]: 20,
        s["window"]: 16,
        s["threshold_mode"]: "fixed",
        s["threshold"]: 3.25,
        s["columns"]: 3,
        s["key_facts"]: "hello",
    }
    for comp, value in expected.items():
        assert out[comp] == value, comp.label
    cols = tab.ui.cols
    fb, terse = cols[1], cols[2]
    assert out[fb.panel.strategy] == "soft_token" and out[fb.panel.preset]["value"] == "custom"
    assert out[fb.panel.component("soft_token", "beta")] == 0.25
    assert out[fb.panel.groups["soft_token"]]["visible"] and not out[fb.panel.groups["residual"]]["visible"]
    assert "soft_token" in out[fb.heading] and "beta=0.25" in out[fb.heading]
    assert out[terse.box]["visible"] and not out[cols[3].box]["visible"]
    own = terse.settings
    assert (
        out[own["name"]] == "Terse"
        and out[own["prompt"]] == "hi, briefly"
        and out[own["system"]] == "Be terse."
    )
    assert out[terse.panel.strategy] == "none" and "prompt modified" in out[terse.heading]
    assert out[tab.ui.out.last]["run_id"] == "r1"
    events = stream.parse(out[tab.ui.out.board])  # the board draws the run whole: every token, its views
    (run,) = [e[1] for e in events if e[0] == "run"]
    assert run["id"] == "r1" and [c["name"] for c in run["columns"]] == [r["name"] for r in data["rows"]]
    assert run["fresh"] == [] and run["columns"][2]["badges"][0] == "prompt modified"
    for i, row in enumerate(data["rows"]):
        assert [e[3] for e in events if e[0] == "t" and e[1] == i] == row["token_ids"]
        assert [e[0] for e in events if e[0] in ("end", "md", "diff") and e[1] == i] == ["end", "md", "diff"]


def test_a_link_round_trips_every_setting(tab, embedded_lm):
    changes = {
        1: {"strategy": "anchor", "anchor.alpha": 0.3},
        3: {"name": "Four", "strategy": "none", "prompt": "hello there"},
    }
    data = tab.make_link(values(tab, 4, changes, model=embedded_lm.name, reference="Hi!") | {"view": "diff"})
    cfg, view = link.opened(data[tab.ui.link.data])
    assert (
        cfg == config(tab, columns=4, changes=changes, model=embedded_lm.name, reference="Hi!")
        and view == "diff"
    )
    out = tab.apply_config(cfg)
    s, four = tab.ui.settings, tab.ui.cols[3].settings
    assert out[s["columns"]] == 4 and out[four["name"]] == "Four" and out[four["prompt"]] == "hello there"
    assert out[tab.ui.cols[1].panel.component("anchor", "alpha")] == 0.3 and out[s["reference"]] == "Hi!"


def _link_of(**config) -> str:
    """Link data of a config as a stranger could make it: encoded without any check."""
    rows = config.pop("rows", [RowSpec("a"), RowSpec("b", "residual", {"alpha": 0.1})])
    return link.encode(RunConfig(**{"prompt": "hi", "max_new_tokens": 8, "rows": rows} | config))


@pytest.mark.parametrize(
    "config, message",
    [
        ({"rows": [RowSpec("a"), RowSpec("b", "bogus")]}, "row b: unknown strategy 'bogus'"),
        ({"rows": [RowSpec(f"r{i}") for i in range(64)]}, "columns must be between 1 and 4, got 64"),
        ({"max_new_tokens": 4096}, "max new tokens must be between 1 and 1024, got 4096"),
        ({"reference": "ref " * 25_000}, "reference is 25001 tokens; .* exceeds the model context"),
        (
            {"rows": [RowSpec("a"), RowSpec("b", "residual", {"alpha": 1e9})]},
            r"row 'b': .*alpha=1000000000.0 is out of range",
        ),
    ],
)
def test_a_link_over_any_limit_is_refused_on_open_naming_the_field(tab, embedded_lm, config, message):
    """A link is a request a stranger wrote: opened, it is checked as Generate would check it, and
    one over a limit restores nothing ("not applied", naming the field), not "Settings restored"."""
    request = SimpleNamespace(
        query_params={link.PARAM: _link_of(model=embedded_lm.name, **config)}, session_hash="s"
    )
    with pytest.warns(UserWarning, match="not applied"):  # the page's toast
        out = tab.open_link(request)
    assert set(out) == {tab.ui.link.note}
    note = out[tab.ui.link.note]
    assert note.startswith("⚠ This link's settings were not applied")
    assert re.search(message, note.replace("\\", "")), note


def test_a_link_opens_in_its_token_view_and_a_history_reload_lets_go_of_it(tab, embedded_lm):
    cfg = RunConfig(
        prompt="hi",
        model=embedded_lm.name,
        max_new_tokens=8,
        rows=[RowSpec("a"), RowSpec("b", "residual", {"alpha": 0.1})],
    )
    data = link.encode(cfg, "diff")
    out = tab.open_link(SimpleNamespace(query_params={link.PARAM: data}, session_hash="s"))
    assert (
        out[tab.ui.out.view] == "diff"
        and out[tab.ui.link.data] == data
        and "restored" in out[tab.ui.link.note]
    )
    assert link.opened(link.encode(cfg)) == (cfg, "confidence")  # the usual view: nothing added to the link
    stored = RunResult(
        config=cfg.to_dict(), rows=[RowResult(r.name, r.strategy, dict(r.params)) for r in cfg.rows]
    )
    reloaded = tab.restore(stored.to_dict(), "diff")
    assert (
        reloaded[tab.ui.link.note] == "" and reloaded[tab.ui.link.data] == ""
    )  # the page script drops ?cfg=
    with pytest.raises(FeedbackError, match="token view must be one of"):
        link.encode(cfg, "fancy")


def test_a_link_note_shows_what_the_link_said_as_text(tab, embedded_lm):
    request = SimpleNamespace(
        query_params={link.PARAM: _link_of(model="[x](javascript:alert(1))")}, session_hash="s"
    )
    note = tab.open_link(request)[tab.ui.link.note]
    assert "](javascript" not in note and r"\[x\]\(javascript\:alert\(1\)\)" in note


def test_bad_links_are_refused_with_a_message():
    good = link.encode(RunConfig(prompt="hi", rows=[RowSpec("a"), RowSpec("b", "residual", {"alpha": 0.1})]))
    assert link.decode(good).rows[1].params == {"alpha": 0.1}
    for bad in ("", "!!!", good[:-5], good + "AAAA", link.encode(RunConfig(prompt="hi"))[:10]):
        with pytest.raises(FeedbackError, match="link"):
            link.decode(bad)
    import base64
    import zlib

    def pack(obj) -> str:
        return base64.urlsafe_b64encode(zlib.compress(json.dumps(obj).encode())).decode().rstrip("=")

    for obj, message in [
        ({"v": 2, "config": {}}, "version"),
        ({"v": 1, "config": {"prompt": "hi", "rows": [{"name": "a", "prefix": [1]}]}}, "columns"),
        ({"v": 1, "config": {"prompt": "hi", "seed": -1, "rows": [{"name": "a"}]}}, "seed"),
        ({"v": 1, "config": {"prompt": "hi", "nope": 1}}, "could not be read"),
    ]:
        with pytest.raises(FeedbackError, match=message):
            link.decode(pack(obj))
    bomb = base64.urlsafe_b64encode(zlib.compress(b"{" * 5_000_000)).decode()
    with pytest.raises(FeedbackError):
        link.decode(bomb)
    with pytest.raises(FeedbackError, match="too large for a link"):
        link.encode(RunConfig(prompt=" ".join(str(i * 7919 % 10007) for i in range(9000))))


def test_modified_badges_follow_a_column_into_its_conversation():
    first = RowSpec("a", messages=[{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A1"}])
    same = RowSpec("b", messages=[{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A2"}])
    other = RowSpec(
        "c",
        system_prompt="Be terse.",
        messages=[{"role": "user", "content": "Q, precisely"}, {"role": "assistant", "content": "A3"}],
    )
    assert modified(same, first) == []  # its own answer differs, its question does not
    assert modified(other, first) == ["prompt", "system prompt"]
    assert modified(RowSpec("d", prompt="own")) == ["prompt"] and modified(RowSpec("e")) == []


# ---- the settings table ----
def sample(setting, control, index: int | None = None):
    """A valid value for `setting` that differs from its control's first value."""
    first = control.value
    if setting.bound is not None:
        b = setting.bound
        number = min(int(b.lo) + 7, int(b.hi)) if b.integer else b.lo + (b.hi - b.lo) / 4
        return number if isinstance(control, gr.Number) else f"{number:g}"  # a text box: as typed
    if isinstance(control, gr.Checkbox):
        return not first
    if isinstance(control, (gr.Radio, gr.Dropdown)):
        options = [c[1] for c in control.choices]
        return next((o for o in options if o != first), first)
    if isinstance(control, gr.Number):
        return first + 1
    return f"{setting.name} text" + ("" if index is None else f" {index}")


def strategy_sample(index: int) -> str:
    """Another strategy than the column's default (its parameters as their controls start)."""
    return next(name for name in sorted(REGISTRY) if name != DEFAULT_COLUMNS[index][1])


def every_setting_changed(t: CompareTab) -> tuple[dict, dict]:
    """(the event's values with every setting of the table changed from its first value, the
    control -> value each restore should show)."""
    out, expected = t.initial_values(), {}
    for s in SHARED:
        control = t.ui.settings[s.name]
        out[s.name] = expected[control] = sample(s, control)
    for col in t.ui.cols:
        for s in COLUMN:
            control = col.settings[s.name]
            if isinstance(s, Field):
                out[column_key(col.index, s.name)] = expected[control] = sample(s, control, col.index)
            else:  # the strategy panel: another strategy, its parameters as they are
                out[column_key(col.index, "strategy")] = expected[control.strategy] = strategy_sample(
                    col.index
                )
    return out, expected


def test_every_setting_round_trips_through_a_config_a_stored_run_and_a_link(tab):
    changed, expected = every_setting_changed(tab)
    assert changed["columns"] == compare_settings.MAX_COLUMNS and changed["threshold_mode"] == "fixed"
    cfg = run_config(changed)
    for s in SHARED:  # each value went to its own place in the config
        if s.path:
            assert resolve(cfg, s.path) == s.value(changed, compare_settings.Scope(changed)), s.name
    assert all(row.temperature == 2.5 for row in cfg.rows)
    restored = tab.apply_config(cfg)
    stored = RunResult(
        config=cfg.to_dict(), rows=[RowResult(r.name, r.strategy, dict(r.params)) for r in cfg.rows]
    )
    entry = history.valid(history.add_run(None, stored.to_dict()))[0][0]  # as History reads it back
    reloaded = tab.restore(entry["result"], "plain")
    opened = tab.apply_config(link.decode(tab.make_link(changed | {"view": "plain"})[tab.ui.link.data]))
    for control, value in expected.items():
        for out in (restored, reloaded, opened):
            assert out[control] == value, (control.label, control.elem_id)
    for col in tab.ui.cols:  # the strategy's parameters come back as the column had them
        strategy = changed[column_key(col.index, "strategy")]
        for p in REGISTRY[strategy].params:
            assert (
                opened[col.panel.component(strategy, p.name)]
                == changed[column_key(col.index, api_name(strategy, p.name))]
            )


def test_swapped_numbers_land_in_their_own_fields(tab):
    cfg = config(tab, top_p=0.9, top_k=40, k=20, window=16)
    assert (cfg.sampling.top_p, cfg.sampling.top_k) == (0.9, 40)
    assert (cfg.deepconf.k, cfg.deepconf.window) == (20, 16)
    swapped = config(tab, top_p=0.4, top_k=9, k=16, window=20)
    assert (swapped.sampling.top_p, swapped.sampling.top_k, swapped.deepconf.k, swapped.deepconf.window) == (
        0.4,
        9,
        16,
        20,
    )


DECLARED_BOUNDS = {
    ("shared", "temperature"): sampling.TEMPERATURE,
    ("shared", "top_p"): sampling.TOP_P,
    ("shared", "top_k"): sampling.TOP_K,
    ("shared", "min_p"): sampling.MIN_P,
    ("shared", "repetition_penalty"): sampling.REPETITION_PENALTY,
    ("shared", "max_new_tokens"): limits.MAX_NEW_TOKENS,
    ("shared", "seed"): records.SEED,
    ("shared", "k"): records.DEEPCONF_K,
    ("shared", "window"): records.DEEPCONF_WINDOW,
    ("shared", "columns"): compare_settings.COLUMNS,
    ("column", "temperature"): sampling.TEMPERATURE,
    ("column", "top_p"): sampling.TOP_P,
    ("column", "seed"): records.SEED,
    ("calibration", "eta"): deepconf.ETA,
    ("calibration", "warmup"): limits.WARMUP_TRACES,
}
ENTRIES = (
    [("shared", s) for s in SHARED]
    + [("column", s) for s in COLUMN]
    + [("calibration", s) for s in CALIBRATION]
)


@pytest.mark.parametrize("table, setting", ENTRIES, ids=[f"{t}-{s.name}" for t, s in ENTRIES])
def test_each_setting_takes_the_declared_bound(table, setting):
    assert setting.bound is DECLARED_BOUNDS.get((table, setting.name))  # None: it has no range to declare


def test_the_controls_show_their_bounds(tab):
    for table, s in ENTRIES:
        if s.bound is None:
            continue
        control = {
            "shared": tab.ui.settings,
            "column": tab.ui.cols[1].settings,
            "calibration": tab.ui.calibration.settings,
        }[table][s.name]
        if isinstance(control, gr.Number):  # the range said; the handler checks it, naming the setting
            assert s.bound.info in control.info and (control.minimum, control.maximum) == (None, None), s.name
        elif s.bound.integer:  # a text box (it may be empty) says its range
            assert f"whole number, {s.bound.lo} or more" in control.info, s.name
        else:
            assert f"{s.bound.hi:g}" in control.info, s.name


EMPTY_COLUMN = {
    "name": "",
    "strategy": "none",
    "prompt": "",
    "system": "",
    "temperature": "",
    "top_p": "",
    "seed": "",
}


def test_a_column_temperature_is_read_checked_and_named():
    scope = compare_settings.Scope({"prompt": "hi"}, 1)
    spec = compare_settings.row_spec(EMPTY_COLUMN, scope)
    assert spec.temperature is None and spec.name == "Feedback"  # empty: the shared temperature
    assert compare_settings.row_spec(EMPTY_COLUMN | {"name": "x", "temperature": "0"}, scope).temperature == 0
    for bad, message in [
        ("11", "column 2: temperature must be between 0 and 10"),
        ("warm", "column 2: temperature must be a number, got 'warm'"),
        ("0.001", r"column 2: temperature must be 0 \(greedy\) or at least 0.01"),
    ]:
        with pytest.raises(FeedbackError, match=message):
            compare_settings.row_spec(EMPTY_COLUMN | {"name": "x", "temperature": bad}, scope)
    assert "temperature 0.5" in compare_settings.badges(RowSpec("a", temperature=0.5))
    assert compare_settings.badges(RowSpec("a")) == []
    assert (
        "temperature" in link.ROW_FIELDS
        and ("temperature", "sampling.temperature") in compare_settings.OVERRIDES
    )


def test_a_column_top_p_and_seed_are_read_checked_and_named():
    scope = compare_settings.Scope({"prompt": "hi"}, 2)
    spec = compare_settings.row_spec(EMPTY_COLUMN, scope)
    assert (spec.top_p, spec.seed) == (None, None)  # empty: the shared ones
    spec = compare_settings.row_spec(EMPTY_COLUMN | {"top_p": "0.8", "seed": "42"}, scope)
    assert (spec.top_p, spec.seed) == (0.8, 42)
    for change, message in [
        ({"top_p": "0"}, "column 3: top_p must be above 0"),
        ({"top_p": "1.2"}, "column 3: top_p must be between 0 and 1"),
        ({"seed": "-3"}, "column 3: seed must be at least 0"),
        ({"seed": "1.5"}, "column 3: seed must be a whole number"),
    ]:
        with pytest.raises(FeedbackError, match=message):
            compare_settings.row_spec(EMPTY_COLUMN | change, scope)
    assert compare_settings.badges(RowSpec("a", top_p=0.8, seed=42)) == ["top-p 0.8", "seed 42"]
    assert {("top_p", "sampling.top_p"), ("seed", "seed")} <= set(compare_settings.OVERRIDES)
    assert {"top_p", "seed"} <= set(link.ROW_FIELDS)


def test_a_column_at_temperature_0_in_a_sampled_run_gives_its_greedy_text(tiny_lm):
    """Through the page's own compare handler: column 2 at temperature 0 while the run samples at
    1.0 decodes exactly what it decodes in an all-greedy run; column 1 samples."""
    t, demo = built_with_page(tiny_lm)
    handler = next(fn.fn for fn in demo.fns.values() if fn.api_name == "compare")
    base = t.initial_values() | {"prompt": "Say hi.", "model": tiny_lm.name, "max_new_tokens": 8, "seed": 5}

    def run(**change) -> tuple[dict, dict]:
        updates = list(handler(types.SimpleNamespace(session_hash=f"t{len(change)}"), **base | change))
        final = updates[-1]
        return final[t.ui.out.run_json.data], final

    greedy, _ = run(temperature=0.0)
    sampled, page = run(temperature=1.0, c2_temperature="0")  # as the page's text box sends it
    assert (
        sampled["config"]["sampling"]["temperature"] == 1.0
        and sampled["config"]["rows"][1]["temperature"] == 0
    )
    assert sampled["rows"][1]["token_ids"] == greedy["rows"][1]["token_ids"]
    assert sampled["rows"][1]["text"] == greedy["rows"][1]["text"]
    assert sampled["rows"][0]["token_ids"] != greedy["rows"][0]["token_ids"]  # column 1 did sample
    heads = next(e[1]["columns"] for e in stream.parse(page[t.ui.out.board]) if e[0] == "run")
    assert "temperature 0" in heads[1]["badges"] and not any("temperature" in b for b in heads[0]["badges"])


def test_one_column_rerun_with_new_settings_and_one_column_stopped_while_the_others_go_on(tiny_lm):
    """Through the page's own handlers: re-run column 2 alone with a changed strategy (column 1
    keeps its answer; column 2 equals a whole run with the new settings), then stop column 2 of a
    streaming run while column 1 runs on."""
    t, demo = built_with_page(tiny_lm)
    fns = {fn.api_name: fn.fn for fn in demo.fns.values() if fn.api_name}
    base = t.initial_values() | {
        "prompt": "Say hi.",
        "model": tiny_lm.name,
        "max_new_tokens": 10,
        "c2_strategy": "residual",
        "c2_residual_alpha": 0.1,
    }
    request = types.SimpleNamespace(session_hash="rerun")
    first = list(fns["compare"](request, **base))[-1][t.ui.out.run_json.data]
    stronger = base | {
        "c2_residual_alpha": 0.5,
        "prompt": "Something else.",
    }  # the shared prompt is the run's
    updates = list(fns["rerun"](request, **stronger | {"last": first, "column": "2"}))
    again = updates[-1][t.ui.out.run_json.data]
    assert again["rows"][0] == first["rows"][0] and again["config"]["rows"][1]["params"]["alpha"] == 0.5
    whole = list(fns["compare"](request, **base | {"c2_residual_alpha": 0.5}))[-1][t.ui.out.run_json.data]
    assert again["rows"][1]["token_ids"] == whole["rows"][1]["token_ids"] != first["rows"][1]["token_ids"]
    assert "Re-ran Feedback alone" in updates[-1][t.ui.run.status]
    with pytest.raises(gr.Error, match="nothing to re-run yet"):
        list(fns["rerun"](request, **base | {"last": None, "column": "2"}))
    with pytest.raises(gr.Error, match="column 3 was not in the last run"):
        list(fns["rerun"](request, **base | {"last": first, "column": "3"}))

    assert t.stop_column("2", request) == "Column 2 is not running."
    assert t.stop_column("", request).startswith(
        "Not stopped: choose a column (1 to 4)"
    )  # a message, no traceback
    long = base | {"max_new_tokens": 40, "threshold_mode": "off"}
    updates = fns["compare"](request, **long)
    said, last, board = None, None, ""
    for update in updates:
        board = update.get(t.ui.out.board, board)
        if said is None and "step" in str(update.get(t.ui.run.status, "")):
            shown = sum(1 for e in stream.parse(board) if e[0] == "t" and e[1] == 1)
            said = t.stop_column(f"2 {shown}", request)  # as the page sends it: the tokens it showed
        last = update.get(t.ui.out.run_json.data) or last
    assert said == "Stopping column 2…"
    rows = last["rows"]
    assert rows[1]["stop_reason"] == "stopped" and rows[0]["stop_reason"] != "stopped"
    # the column keeps what the page showed at the click, however far the decode got before it stopped
    assert len(rows[1]["token_ids"]) == shown < len(rows[0]["token_ids"])
    column_2 = [e for e in stream.parse(board) if e[1:2] == [1]]
    assert (
        len([e for e in column_2 if e[0] == "t"]) >= shown
        and ["end", 1, "stopped"] == [e[:3] for e in column_2 if e[0] == "end"][0]
        and [e[4] for e in column_2 if e[0] == "end"] == [shown]
    )


def two_columns_shown(run_id: str) -> dict:
    """A run of a baseline and a feedback column, as the page's `last` holds it."""
    cfg = RunConfig(prompt="hi", rows=[RowSpec("Baseline"), RowSpec("Feedback", "residual", {"alpha": 0.1})])
    return RunResult(
        config=cfg.to_dict(),
        rows=[RowResult(r.name, r.strategy, dict(r.params)) for r in cfg.rows],
        run_id=run_id,
    ).to_dict()


def test_rating_a_column_stores_it_with_the_run_in_history(tab):
    last = two_columns_shown("r9")
    hist = history.add_run(None, last)
    out = tab.rate_column(hist, last, "2 better")
    entry = history.valid(out[tab.hist])[0][0]
    assert entry["ratings"] == {"Feedback": {"verdict": "better", "note": ""}}
    assert "Rated Feedback: better" in out[tab.ui.run.status]
    for request, given, message in [
        ("2 great", last, "verdict"),
        ("3 tie", last, "column 3 was not in the last run"),
        ("1 tie", None, "run a prompt first"),
        ("x", last, "choose a column"),
    ]:
        with pytest.warns(UserWarning, match=message):
            refused = tab.rate_column(hist, given, request)
        assert tab.hist not in refused and "Not rated" in refused[tab.ui.run.status]


def test_ratings_clicked_before_the_run_s_record_reached_the_page_are_kept_whichever_is_answered_last(tab):
    """The run's record (asked as the run ends) and ratings clicked as soon as it is shown are each
    sent with the history the page held before the run: the page keeps the last answer it gets, and
    whichever that is, it holds the run and every rating (the record carries those given first)."""
    before = history.add_run(None, two_columns_shown("r1"))  # an older run
    last = two_columns_shown("r2")

    def ratings(hist: list) -> dict:
        entries = {e["id"]: e for e in history.valid(hist)[0]}
        assert list(entries) == ["r2", "r1"]
        return {column: rating["verdict"] for column, rating in entries["r2"].get("ratings", {}).items()}

    # the record answered first: a rating with the old history records the run too
    assert ratings(record_run(before, last, None)) == {}
    first = tab.rate_column(before, last, "2 better", None)
    assert ratings(first[tab.hist]) == {"Feedback": "better"}
    # a second rating sent before the first's answer came back, then the record answered last
    second = tab.rate_column(before, last, "1 worse", first[tab.ui.out.rated])
    assert ratings(second[tab.hist]) == {"Baseline": "worse", "Feedback": "better"}
    assert ratings(record_run(before, last, second[tab.ui.out.rated])) == {
        "Baseline": "worse",
        "Feedback": "better",
    }
    # once the page holds the run, the record changes nothing, and a note added in History stays
    noted = history.rate(second[tab.hist], "r2", "Feedback", "better", "clearer")
    assert record_run(noted, last, second[tab.ui.out.rated]) == noted
    third = tab.rate_column(noted, last, "1 tie", second[tab.ui.out.rated])
    assert history.valid(third[tab.hist])[0][0]["ratings"]["Feedback"]["note"] == "clearer"
    # another run's ratings are not carried over to the next run shown
    assert (
        ratings(record_run(before, two_columns_shown("r2"), {"run_id": "r1", "ratings": {"Baseline": "tie"}}))
        == {}
    )


def test_a_rating_clicked_while_a_column_re_runs_is_kept_and_said_in_a_toast(tab):
    """The status line is the running job's (it would overwrite a note there at its next update):
    the rating is kept with the run on the page before the re-run, and a toast says so."""
    last = two_columns_shown("r7")
    request = types.SimpleNamespace(session_hash="rating-while-running")
    job = tab.runner.jobs.begin(request.session_hash, "compare")
    try:
        out = tab.rate_column(history.add_run(None, last), last, "2 worse", req=request)
    finally:
        tab.runner.jobs.end(job)
    assert history.valid(out[tab.hist])[0][0]["ratings"] == {"Feedback": {"verdict": "worse", "note": ""}}
    assert tab.ui.run.status not in out


def test_a_long_prompt_shows_its_reading_in_the_status_line(tab, embedded_lm):
    from feedback.core.engine import PrefillEvent
    from ui.compare.work import CompareWork

    cfg = config(tab, model=embedded_lm.name)
    work = CompareWork(tab.served(cfg), tab.show_run)
    view = work.progress_view([PrefillEvent(3, 9, 1536, 4475)], 12.0)
    assert view.status.text == "Generating… reading the prompt: 1,536 of 4,475 tokens (chunk 3 of 9) (12 s)"
    assert work.progress_view([], 13.0).status.text.startswith("Generating… reading the prompt")
