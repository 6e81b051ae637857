"""Compare-tab values -> RunConfig (every bad value a clear FeedbackError), columns with their own
prompts and strategies, follow-ups and branches prepared from the last run, a stored run or a
shared link restored into every control."""
from __future__ import annotations

import json

import gradio as gr
import pytest

from feedback.core.records import RowSpec, RunConfig
from feedback.errors import FeedbackError
from feedback.serve.limits import SERVED_MAX_NEW_TOKENS
from ui import link
from ui.compare_tab import DEFAULT_COLUMNS, CompareTab, divergences, modified, parse_branch, parse_key_facts

SHARED = dict(prompt="hi", system_prompt="", chat_template=True, model="embedded", temperature=0.7, top_p=0.9,
              top_k=40, min_p=0.0, repetition_penalty=1.1, max_new_tokens=64, seed=3, k=20, window=16,
              threshold_mode="off", threshold=4.5, reference="", key_facts="")


def built(lm) -> CompareTab:
    from feedback.serve.pool import ModelPool
    from ui.runner import ModelRunner

    pool = ModelPool.serving(lm)
    t = CompareTab(pool, ModelRunner(pool))
    with gr.Blocks():
        t.build(lm.num_layers, gr.BrowserState([]))
    return t


def column_values(t: CompareTab, changes: dict[int, dict] | None = None) -> list:
    """Every column's input values as the page starts, with `changes[index][component name]`."""
    values = []
    for col in t.cols:
        named = {"name": col.name.value, "strategy": col.panel.strategy.value, "prompt": "", "system": ""}
        named |= (changes or {}).get(col.index, {})
        params = [named.get(f"{s}.{p}", comp.value) for (s, p), comp in zip(col.panel.keys, col.panel.components)]
        values += [named["name"], named["strategy"], named["prompt"], named["system"], *params]
    return values


def config(t: CompareTab, columns: int = 2, changes: dict | None = None, **shared) -> RunConfig:
    return t.config(**SHARED | shared, columns=columns, column_values=column_values(t, changes))


@pytest.fixture(scope="module")
def tab(embedded_lm) -> CompareTab:
    return built(embedded_lm)


def test_default_columns_make_the_baseline_and_a_feedback_row(tab):
    cfg = config(tab)
    assert [r.name for r in cfg.rows] == [DEFAULT_COLUMNS[0][0], DEFAULT_COLUMNS[1][0]] == ["Baseline", "Feedback"]
    assert cfg.rows[0].strategy is None and cfg.rows[1].strategy == "residual" and "alpha" in cfg.rows[1].params
    assert cfg.sampling.temperature == 0.7 and cfg.sampling.top_k == 40 and cfg.deepconf.threshold is None
    assert cfg.quality and all(r.prompt is None and r.seed_offset == 0 for r in cfg.rows)  # common random numbers
    assert config(tab, threshold_mode="fixed", threshold=7.5).deepconf.threshold == 7.5


def test_columns_carry_their_own_prompt_system_prompt_and_strategy(tab):
    changes = {1: {"strategy": "deep_cache", "deep_cache.lam": 0.3, "system": "Be terse."},
               2: {"name": "Strong", "strategy": "none", "prompt": "hi! Answer in one precise sentence."}}
    cfg = config(tab, columns=3, changes=changes, reference="Hello.", key_facts="hello\n\n/h+i/\n")
    assert [r.name for r in cfg.rows] == ["Baseline", "Feedback", "Strong"]
    assert cfg.rows[1].strategy == "deep_cache" and cfg.rows[1].params["lam"] == 0.3
    assert cfg.rows[1].system_prompt == "Be terse." and cfg.rows[1].prompt is None
    assert cfg.rows[2].prompt == "hi! Answer in one precise sentence." and cfg.rows[2].strategy is None
    assert cfg.reference == "Hello." and cfg.key_facts == ["hello", "/h+i/"]
    # an override equal to the shared prompt is no override; an empty shared prompt is fine when all have their own
    assert config(tab, changes={1: {"prompt": "hi"}}).rows[1].prompt is None
    own = {0: {"prompt": "a"}, 1: {"prompt": "b"}}
    assert [r.prompt for r in config(tab, changes=own, prompt="").rows] == ["a", "b"]


@pytest.mark.parametrize("change, message", [
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
])
def test_bad_values_are_refused_with_a_message(tab, change, message):
    columns = change.pop("columns", 2)
    with pytest.raises(FeedbackError, match=message):
        config(tab, columns=columns, **change)


def test_bad_columns_are_refused_naming_the_column(tab):
    with pytest.raises(FeedbackError, match="column names must be different"):
        config(tab, changes={1: {"name": "Baseline"}})
    for change, message in [({"strategy": "nope"}, "unknown strategy"),
                            ({"residual.alpha": 5.0}, r"alpha=5.0 is out of range \[-1.0, 1.0\]")]:
        with pytest.raises(FeedbackError, match=message):  # the engine refuses it before anything waits
            tab.prepare_compare(*compare_args(), *column_values(tab, {1: change}))
    with pytest.raises(FeedbackError, match="row Column 3: prompt is limited"):
        config(tab, columns=3, changes={2: {"prompt": "x" * 100_001}})


def compare_args(**change) -> list:
    """prepare_compare's leading arguments in order (the columns' values follow)."""
    v = SHARED | change
    return [v["prompt"], v["system_prompt"], v["chat_template"], v["model"], "confidence", v["temperature"],
            v["top_p"], v["top_k"], v["min_p"], v["repetition_penalty"], v["max_new_tokens"], v["seed"], v["k"],
            v["window"], v["threshold_mode"], v["threshold"], v["reference"], v["key_facts"], v.get("columns", 2)]


def test_prepare_refuses_context_and_model_errors_before_any_waiting(tab, embedded_lm):
    values = column_values(tab)
    work = tab.prepare_compare(*compare_args(model=embedded_lm.name, max_new_tokens=8), *values)
    assert work.label == "a Compare run" and len(work.engine_run.config.rows) == 2
    for change, message in [({"prompt": "word " * 9000}, "exceeds the model context"),
                            ({"model": "evil/model"}, "not in the allowlist")]:
        with pytest.raises(FeedbackError, match=message):
            tab.prepare_compare(*compare_args(**{"model": embedded_lm.name} | change), *values)


def test_follow_ups_need_a_run_and_a_branch_request():
    t = CompareTab(pool=None, runner=None)
    with pytest.raises(FeedbackError, match="run a prompt first"):
        t.prepare_continue(None, "and then?", "confidence")
    with pytest.raises(FeedbackError, match="run a prompt first"):
        t.prepare_branch(None, '{"row": "a", "step": 1, "token_id": 2}', True, "confidence")
    assert parse_branch(json.dumps({"row": "Feedback", "step": 3, "token_id": 42})) == ("Feedback", 3, 42)
    for bad in ("", "{", '{"row": 1, "step": 2, "token_id": 3}', '{"row": "a", "step": true, "token_id": 3}',
                '{"row": "a"}'):
        with pytest.raises(FeedbackError):
            parse_branch(bad)
    assert parse_key_facts(" a \n\n b\n") == ["a", "b"] and parse_key_facts(None) == []


def test_a_finished_run_continues_and_branches_from_the_last_result(tab, embedded_lm):
    from feedback.core.engine import Engine

    cfg = config(tab, max_new_tokens=4, temperature=0.0, model=embedded_lm.name)
    data = Engine(embedded_lm).run(cfg).to_dict()
    follow = tab.prepare_continue(data, "And then?", "confidence").engine_run.config
    assert follow.prompt == "And then?" and follow.rows[1].messages[-1]["role"] == "assistant"
    alt = data["rows"][1]["steps"][2]["top"][1]["token_id"]
    request = json.dumps({"row": "Feedback", "step": 2, "token_id": alt})
    branched = tab.prepare_branch(data, request, True, "confidence").engine_run.config
    assert branched.rows[1].prefix == data["rows"][1]["token_ids"][:2] + [alt]
    assert branched.rows[0].prefix == data["rows"][0]["token_ids"][:2] + [alt]  # every column, paired
    alone = tab.prepare_branch(data, request, False, "confidence").engine_run.config
    assert alone.rows[0].prefix is None
    with pytest.raises(FeedbackError, match="unknown row"):
        tab.prepare_branch(data, json.dumps({"row": "nope", "step": 2, "token_id": alt}), True, "confidence")


def test_divergences_pair_every_column_with_the_first():
    from feedback.core.records import RowResult

    rows = [RowResult("a", None, {}, [1, 2, 3]), RowResult("b", None, {}, [1, 2, 4]), RowResult("c", None, {}, [1, 2, 3])]
    for r in rows:
        r.steps = [None] * len(r.token_ids)
    assert divergences(rows) == {1: 2}


def test_restore_sets_every_control_and_column_from_a_stored_run(tab, embedded_lm):
    from feedback.core.engine import Engine

    changes = {1: {"strategy": "soft_token", "soft_token.beta": 0.25, "soft_token.top_k": 8},
               2: {"name": "Terse", "strategy": "none", "prompt": "hi, briefly", "system": "Be terse."}}
    cfg = config(tab, columns=3, changes=changes, model=embedded_lm.name, threshold_mode="fixed", threshold=3.25,
                 max_new_tokens=3, key_facts="hello")
    data = Engine(embedded_lm).run(cfg).to_dict() | {"run_id": "r1"}
    out = tab.restore(data, "plain")
    expected = {tab.prompt: "hi", tab.chat: True, tab.model: embedded_lm.name, tab.temperature: 0.7, tab.top_p: 0.9,
                tab.top_k: 40, tab.min_p: 0.0, tab.rep: 1.1, tab.max_new: 3, tab.seed: 3, tab.k: 20, tab.window: 16,
                tab.thr_mode: "fixed", tab.threshold: 3.25, tab.ncols: 3, tab.key_facts: "hello"}
    for comp, value in expected.items():
        assert out[comp] == value, comp.label
    fb, terse = tab.cols[1], tab.cols[2]
    assert out[fb.panel.strategy] == "soft_token" and out[fb.panel.preset]["value"] == "custom"
    assert out[fb.panel.component("soft_token", "beta")] == 0.25
    assert out[fb.panel.groups["soft_token"]]["visible"] and not out[fb.panel.groups["residual"]]["visible"]
    assert "soft_token" in out[fb.heading] and "beta=0.25" in out[fb.heading]
    assert out[terse.box]["visible"] and not out[tab.cols[3].box]["visible"]
    assert out[terse.name] == "Terse" and out[terse.prompt] == "hi, briefly" and out[terse.system] == "Be terse."
    assert out[terse.panel.strategy] == "none" and "prompt modified" in out[terse.heading]
    assert out[tab.last]["run_id"] == "r1" and "fl-tok" not in out[tab.cols[0].text]  # the plain view asked for


def test_a_link_round_trips_every_setting(tab, embedded_lm):
    changes = {1: {"strategy": "anchor", "anchor.alpha": 0.3}, 3: {"name": "Four", "strategy": "none",
                                                                  "prompt": "hello there"}}
    values = column_values(tab, changes)
    data = tab.make_link(*(SHARED | {"model": embedded_lm.name, "reference": "Hi!"}).values(), 4, *values)
    cfg = link.decode(data[tab.link_data])
    assert cfg == config(tab, columns=4, changes=changes, model=embedded_lm.name, reference="Hi!")
    out = tab.apply_config(cfg)
    assert out[tab.ncols] == 4 and out[tab.cols[3].name] == "Four" and out[tab.cols[3].prompt] == "hello there"
    assert out[tab.cols[1].panel.component("anchor", "alpha")] == 0.3 and out[tab.reference] == "Hi!"


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

    for obj, message in [({"v": 2, "config": {}}, "version"), ({"v": 1, "config": {"prompt": "hi", "rows": [
            {"name": "a", "prefix": [1]}]}}, "columns"), ({"v": 1, "config": {"prompt": "hi", "seed": -1,
                                                                              "rows": [{"name": "a"}]}}, "seed"),
            ({"v": 1, "config": {"prompt": "hi", "nope": 1}}, "could not be read")]:
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
    other = RowSpec("c", system_prompt="Be terse.",
                    messages=[{"role": "user", "content": "Q, precisely"}, {"role": "assistant", "content": "A3"}])
    assert modified(same, first) == []  # its own answer differs, its question does not
    assert modified(other, first) == ["prompt", "system prompt"]
    assert modified(RowSpec("d", prompt="own")) == ["prompt"] and modified(RowSpec("e")) == []
