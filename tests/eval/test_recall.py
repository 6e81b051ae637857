"""Long-context key-fact recall (feedback/eval/recall.py): the generator is seeded and puts each fact
at the asked depth of a text of the asked length; the exact match suits the templates; McNemar and
the bootstrap on hand-made data; an end-to-end run of the tiny model (mechanics, not recall)."""

from __future__ import annotations

import math
import threading

import pytest

from feedback.core.budget import Budget
from feedback.core.records import RowSpec
from feedback.errors import FeedbackError, Stopped
from feedback.eval.recall import (
    CITIES,
    FIRST_NAMES,
    KINDS,
    MONTHS,
    RecallConfig,
    candidates,
    evaluate_recall,
    is_right,
    make_fact,
    mcnemar_exact,
    plan,
    summarise,
)

ROWS = [RowSpec("baseline"), RowSpec("deep_cache", "deep_cache", {"lam": 0.5, "theta": 5.0})]


def test_the_generator_is_seeded_and_places_each_fact_at_its_depth_and_length(tiny_lm):
    cfg = RecallConfig(items=4, lengths=[128, 400], depths=[0, 30, 75, 100], seed=3)
    first = plan(tiny_lm, cfg)
    again = plan(tiny_lm, RecallConfig(items=4, lengths=[128, 400], depths=[0, 30, 75, 100], seed=3))
    assert [i.prompt for i in first] == [i.prompt for i in again]  # reproducible
    other = plan(tiny_lm, RecallConfig(items=4, lengths=[128], depths=[50], seed=4))
    assert [i.fact for i in other] != [i.fact for i in first if i.length == 128 and i.depth == 30]
    assert len(first) == 4 * 2 * 4 and [i.fact.kind for i in first[:4]] == list(KINDS)
    for inst in first:
        assert abs(inst.tokens - inst.length) <= 2, (inst.length, inst.tokens)  # the document alone
        assert len(tiny_lm.tokenizer(inst.document, add_special_tokens=False)["input_ids"]) == inst.tokens
        assert abs(inst.depth_actual - inst.depth) <= 5, (inst.length, inst.depth, inst.depth_actual)
        assert all(inst.document.count(s) == 1 for s in inst.fact.sentences)  # the two-hop fact's bridge too
        assert inst.fact.answer in inst.fact.sentences[0] and inst.prompt.endswith(inst.fact.question)
        assert inst.prompt_tokens > inst.tokens
    # the same fact and filler at every length and depth of an item: the shorter text's filler is a prefix
    item0 = [i for i in first if i.item == 0]
    assert len({i.fact for i in item0}) == 1
    short, long = (next(i for i in item0 if i.length == n and i.depth == 100) for n in (128, 400))
    assert long.document.startswith(short.document[:200])


def test_a_length_beyond_the_context_is_refused_naming_the_field(tiny_lm):
    with pytest.raises(FeedbackError, match="lengths: 512 tokens is beyond the model's context of 512"):
        plan(tiny_lm, RecallConfig(items=1, lengths=[128, 512], depths=[50]))
    with pytest.raises(
        FeedbackError,
        match="lengths: 480 tokens of text .* exceeds the model context of 512 .*"
        "the longest length that fits is about 4",
    ):
        plan(tiny_lm, RecallConfig(items=1, lengths=[480], depths=[50], max_new_tokens=24))
    for cfg, message in [
        (RecallConfig(items=0), "items must be between 1"),
        (RecallConfig(depths="0, 120"), "depths must be between 0 and 100, got 120"),
        (RecallConfig(lengths="256, x"), "lengths must be a number, got 'x'"),
        (RecallConfig(lengths="10"), "lengths must be at least 64"),
        (RecallConfig(split="train"), "split must be dev or test"),
    ]:
        with pytest.raises(FeedbackError, match=message):
            cfg.validate()


def test_the_exact_match_wants_the_gold_value_and_nothing_else_of_its_kind():
    import random

    rng = random.Random(0)
    number, name, date, hop = (make_fact(kind, rng) for kind in KINDS)
    assert is_right(number, f"The code is {number.answer}.") and is_right(number, f"{int(number.answer):,}")
    assert not is_right(number, f"It is {number.answer} or 12345.") and not is_right(number, "I don't know.")
    first, last = name.answer.split()
    rival = next(n for n in FIRST_NAMES if n != first)
    assert is_right(name, f"The lead engineer is {name.answer}.") and not is_right(
        name, last
    )  # the whole name
    assert not is_right(name, f"{name.answer} or {rival} {last}")
    month, day, year = date.answer.replace(",", "").split()
    assert is_right(date, date.answer) and is_right(date, f"It opened on the {day}th of {month} {year}.")
    assert not is_right(date, f"{month} {day}") and not is_right(date, f"{month} {int(day) + 1}, {year}")
    assert candidates("date", f"{year}-{MONTHS.index(month) + 1:02d}-{int(day):02d}") == {date.answer}
    other = next(c for c in CITIES if c != hop.answer)
    assert is_right(hop, f"In {hop.answer}.") and not is_right(hop, f"{other} or {hop.answer}")


def test_mcnemar_is_the_exact_binomial_test_on_the_discordant_pairs():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)  # all 5 discordant pairs one way: 2 * 0.5^5
    assert mcnemar_exact(9, 1) == pytest.approx(2 * (1 + 10) / 1024)  # 2 * P(X <= 1), X ~ Bin(10, 1/2)
    assert mcnemar_exact(3, 3) == 1.0 and mcnemar_exact(4, 5) == 1.0  # capped at 1
    assert mcnemar_exact(30, 70) == pytest.approx(
        2 * sum(math.comb(100, k) for k in range(31)) / 2**100
    )  # scipy.stats.binomtest(30, 100).pvalue: 7.85e-05
    assert mcnemar_exact(30, 70) == pytest.approx(7.85e-05, rel=1e-2)


def record(item: int, length: int, depth: float, base: tuple[bool, float], fb: tuple[bool, float]) -> dict:
    def row(right, lp):
        return {"right": right, "gold_logprob": lp, "gold_scored_with_strategy": True}

    return {"item": item, "length": length, "depth": depth, "rows": {"baseline": row(*base), "fb": row(*fb)}}


def test_the_grids_the_counts_and_the_tests_from_hand_made_records():
    recs = [
        record(0, 256, 0.0, (True, -2.0), (True, -1.5)),
        record(1, 256, 0.0, (False, -4.0), (True, -3.5)),
        record(0, 256, 100.0, (True, -2.0), (False, -1.5)),
        record(1, 256, 100.0, (True, -3.0), (True, -2.5)),
        record(0, 1024, 0.0, (False, -5.0), (True, -4.5)),
    ]
    res = summarise(recs, ["baseline", "fb"], [256, 1024], [0.0, 100.0], resamples=500, seed=1)
    assert res["accuracy"]["baseline"] == [[0.5, 1.0], [0.0, None]]
    assert res["accuracy"]["fb"] == [[1.0, 0.5], [1.0, None]]
    assert res["difference"]["fb"] == [[0.5, -0.5], [1.0, None]] and res["counts"] == [[2, 2], [1, 0]]
    m = res["tests"]["fb"]["mcnemar"]
    assert (m["baseline_only_right"], m["strategy_only_right"]) == (1, 2) and m["p"] == 1.0
    g = res["tests"]["fb"]["gold_logprob"]
    assert g["mean_diff"] == pytest.approx(0.5) and g["ci95"] == pytest.approx(
        [0.5, 0.5]
    )  # every difference 0.5
    assert "fewer than 10 items (2)" in g["method"] and g["instances"] == 5
    assert res["rows"]["baseline"]["accuracy"] == 0.6 and res["rows"]["fb"][
        "mean_gold_logprob"
    ] == pytest.approx(-2.7)
    # 12 items: whole items resampled; the interval holds the mean and has width
    many = [record(i, 256, 0.0, (True, -2.0), (True, -2.0 + 0.1 * (i % 4))) for i in range(12)]
    g = summarise(many, ["baseline", "fb"], [256], [0.0], resamples=2000, seed=0)["tests"]["fb"][
        "gold_logprob"
    ]
    assert (
        g["method"].startswith("items resampled (12 items") and g["ci95"][0] < g["mean_diff"] < g["ci95"][1]
    )
    assert g["ci95"][1] - g["ci95"][0] > 0.01
    one = summarise(recs[:1], ["baseline", "fb"], [256], [0.0])["tests"]["fb"]["gold_logprob"]
    assert one["ci95"] is None and one["method"] == "one prompt: no interval"  # not a zero-width "interval"
    # a recurrent strategy's gold answer was scored by the plain model: no bootstrap
    flat = [record(0, 256, 0.0, (True, -2.0), (True, -2.0))]
    flat[0]["rows"]["fb"]["gold_scored_with_strategy"] = False
    g = summarise(flat, ["baseline", "fb"], [256], [0.0])["tests"]["fb"]["gold_logprob"]
    assert g["mean_diff"] is None and "plain model" in g["method"]


def test_a_tiny_run_of_the_baseline_and_a_strategy_end_to_end(tiny_lm):
    cfg = RecallConfig(items=1, lengths=[96], depths=[0, 100], max_new_tokens=3, bootstrap=100)
    heard = []
    res = evaluate_recall(tiny_lm, cfg, ROWS, on_instance=heard.append)
    assert [(h["done"], h["total"], h["depth"]) for h in heard] == [(1, 2, 0.0), (2, 2, 100.0)]
    assert res["instances"] == 2 and list(res["rows"]) == ["baseline", "deep_cache"]
    assert set(res["accuracy"]) == {"baseline", "deep_cache"} and len(res["accuracy"]["baseline"][0]) == 2
    for rec in res["items"]:
        for row in rec["rows"].values():
            assert (
                math.isfinite(row["gold_logprob"])
                and row["gold_logprob"] < 0
                and row["gold_scored_with_strategy"]
            )
            assert 1 <= row["tokens"] <= 3 and isinstance(row["right"], bool)
    tests = res["tests"]["deep_cache"]
    assert tests["mcnemar"]["p"] <= 1.0 and tests["gold_logprob"]["instances"] == 2
    # a strong strategy changes the gold answer's score; the same settings give the same result
    assert (
        res["items"][0]["rows"]["deep_cache"]["gold_logprob"]
        != res["items"][0]["rows"]["baseline"]["gold_logprob"]
    )
    again = evaluate_recall(tiny_lm, cfg, ROWS)
    assert [r["rows"] for r in again["items"]] == [r["rows"] for r in res["items"]]


def test_a_stack_is_a_row_like_any_strategy(tiny_lm):
    stack = RowSpec("stack", "inner_loop+deep_cache", {"inner_loop.beta": 0.6, "deep_cache.lam": 0.5})
    cfg = RecallConfig(items=1, lengths=[96], depths=[50], max_new_tokens=2, bootstrap=50)
    res = evaluate_recall(tiny_lm, cfg, [ROWS[0], stack])
    assert (
        list(res["rows"]) == ["baseline", "stack"] and res["tests"]["stack"]["gold_logprob"]["instances"] == 1
    )
    row = res["items"][0]["rows"]["stack"]
    assert (
        row["gold_scored_with_strategy"]
        and row["gold_logprob"] != res["items"][0]["rows"]["baseline"]["gold_logprob"]
    )


def test_the_budget_and_stop_end_a_job_before_or_between_prompts(tiny_lm):
    cfg = RecallConfig(items=2, lengths=[96], depths=[50], max_new_tokens=2)
    with pytest.raises(FeedbackError, match="FEEDBACK_BUDGET_SCORED_TOKENS.*It fits with items 1"):
        evaluate_recall(tiny_lm, cfg, ROWS, budget=Budget(scored_tokens=500, decoded_tokens=None))
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        evaluate_recall(tiny_lm, cfg, ROWS, stop=stop)
    with pytest.raises(FeedbackError, match="first row must be the baseline"):
        evaluate_recall(tiny_lm, cfg, ROWS[1:])
