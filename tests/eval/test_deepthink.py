"""Deep Think: calibration per side, online early stop, votes, token accounting."""

from __future__ import annotations

import json
import threading

import pytest

from feedback import ASSETS
from feedback.core.engine import run_to_end
from feedback.core.records import DeepConfConfig, RowSpec, RunConfig
from feedback.core.sampling import SamplingConfig
from feedback.errors import FeedbackError, Stopped
from feedback.eval.deepthink import DeepThinkConfig, accuracy, deep_think, load_questions


def test_per_row_threshold_stops_only_that_row(tiny_lm):
    rows = [RowSpec("a"), RowSpec("b", threshold=1e9), RowSpec("c")]
    cfg = RunConfig(
        prompt="hello",
        model="tiny",
        max_new_tokens=12,
        deepconf=DeepConfConfig(window=3),
        rows=rows,
        sampling=SamplingConfig(temperature=0.8),
        seed=1,
    )
    res = run_to_end(tiny_lm, cfg)
    assert res.rows[1].stop_reason == "early_stop" and res.rows[1].stop_step == 2
    plain = run_to_end(tiny_lm, RunConfig(**{**cfg.__dict__, "rows": [RowSpec("a"), RowSpec("c")]}))
    assert [res.rows[0].token_ids, res.rows[2].token_ids] == [r.token_ids for r in plain.rows]
    with pytest.raises(FeedbackError, match="threshold must be a finite number"):
        RunConfig(prompt="x", rows=[RowSpec("a", threshold=float("nan"))]).validate()


def test_deep_think_mechanics_and_check_mode(tiny_lm):
    cfg = DeepThinkConfig(
        prompt="What is 2+2?",
        traces=3,
        warmup=3,
        eta=50,
        window=4,
        max_new_tokens=10,
        temperature=1.0,
        strategy="residual",
        params={"alpha": 0.3},
        check=True,
    )
    rep = deep_think(tiny_lm, cfg)
    json.dumps(rep)
    for side in ("baseline", "feedback"):
        s = rep["sides"][side]
        lows = s["warmup_lowest_groups"]
        assert len(lows) == 3 and s["threshold"] == pytest.approx(sorted(lows)[1])  # median for eta=50
        assert len(s["traces"]) == 6 and s["tokens_spent"] == sum(t["tokens"] for t in s["traces"])
        online = s["traces"][3:]
        for t in online:
            if t["stopped"]:
                assert t["stop_reason"] == "early_stop" and t["tokens"] >= 4  # never before the window fills
        assert s["stopped"] == sum(t["stopped"] for t in online)
        assert s["tokens_saved"] >= 0 and s["tokens_saved_method"].startswith("measured")
        assert s["votes"]["majority"]["voters"] <= 6 - s["stopped"]
    assert rep["thresholds"]["baseline"] != rep["thresholds"]["feedback"] or not cfg.shared_threshold


def test_expected_answer_marks_traces_and_votes(tiny_lm):
    cfg = DeepThinkConfig(
        prompt="What is 2+2?",
        traces=2,
        warmup=2,
        eta=90,
        window=4,
        max_new_tokens=6,
        answer_regex=r"(\w+)",
        expected="no-such-word",
    )
    rep = deep_think(tiny_lm, cfg)
    for side in ("baseline", "feedback"):
        s = rep["sides"][side]
        assert all(t["correct"] is False for t in s["traces"] if t["answer"] is not None)
        assert s["correct"] in (False, None) and set(s["votes"]) == {"lowest_group", "majority", "tail"}
        assert all(v["meaning"] for v in s["votes"].values())
    target = rep["sides"]["baseline"]["traces"][0]["answer"]
    again = deep_think(tiny_lm, DeepThinkConfig(**{**cfg.__dict__, "expected": target}))
    assert again["sides"]["baseline"]["traces"][0]["correct"] is True  # same seeds, same traces


def test_a_stopped_deep_think_raises_stopped_within_a_step(tiny_lm):
    stop = threading.Event()
    steps: list[str] = []

    def progress(message):
        steps.append(message)
        stop.set()

    cfg = DeepThinkConfig(prompt="Name a colour.", traces=2, warmup=2, window=4, max_new_tokens=30)
    with pytest.raises(Stopped, match="warm-up"):
        deep_think(tiny_lm, cfg, progress=progress, stop=stop)
    assert len(steps) == 1 and steps[0].startswith("warm-up: step 1 of 30")


def test_shared_threshold_and_upper_bound(tiny_lm):
    cfg = DeepThinkConfig(
        prompt="Name a colour.", traces=2, warmup=2, eta=90, window=4, max_new_tokens=8, shared_threshold=True
    )
    rep = deep_think(tiny_lm, cfg)
    assert rep["thresholds"]["baseline"] == rep["thresholds"]["feedback"]
    assert rep["sides"]["baseline"]["tokens_saved_method"].startswith("upper bound")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"traces": 65}, r"traces must be in \[1, 64\]"),
        ({"warmup": 0}, "warmup must be in"),
        ({"eta": 0}, "eta"),
        ({"eta": 150}, "eta"),
        ({"answer_regex": "(oops"}, "does not compile"),
        ({"strategy": "nope"}, "unknown strategy"),
    ],
)
def test_bad_deep_think_input(tiny_lm, change, message):
    with pytest.raises(FeedbackError, match=message):
        DeepThinkConfig(prompt="q", **change).validate(tiny_lm.num_layers)


def test_window_larger_than_max_tokens_warns(tiny_lm):
    warnings = DeepThinkConfig(prompt="q", window=64, max_new_tokens=16).validate(tiny_lm.num_layers)
    assert warnings and "no early stop can happen" in warnings[0]


def test_questions_file_and_accuracy(tiny_lm, tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "What is 1+1?", "answer": 2}\n')
    qs = load_questions(path)
    res = accuracy(tiny_lm, qs, DeepThinkConfig(prompt="", traces=2, warmup=2, window=4, max_new_tokens=6))
    assert res["questions"] == 1
    for side in ("baseline", "feedback"):
        assert set(res["accuracy"][side]) == {
            "single",
            "majority",
            "deepconf",
            "tokens_spent",
            "tokens_saved",
        }
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x", "answer": 1}\n{nope\n')
    with pytest.raises(FeedbackError, match="bad.jsonl:2: not valid JSON"):
        load_questions(bad)


def test_builtin_questions_are_well_formed():
    qs = load_questions(ASSETS / "questions.jsonl")
    assert len(qs) >= 12 and all(str(q["answer"]).strip() for q in qs)


def test_deep_think_on_the_embedded_model(embedded_lm):
    cfg = DeepThinkConfig(
        prompt="What is 3 + 4? Give the answer as a number.",
        traces=2,
        warmup=2,
        eta=90,
        window=8,
        max_new_tokens=24,
        strategy="deep_cache",
    )
    rep = json.loads(json.dumps(deep_think(embedded_lm, cfg)))
    assert set(rep["sides"]) == {"baseline", "feedback"}
    for s in rep["sides"].values():
        assert len(s["traces"]) == 4 and all(t["text"] for t in s["traces"])
        assert {"majority", "lowest_group", "tail"} == set(s["votes"])


def test_deep_think_over_budget_is_refused_before_any_trace(tiny_lm):
    from feedback.core.budget import Budget
    from feedback.eval.deepthink import check_budget

    cfg = DeepThinkConfig(prompt="What is 2+2?", traces=8, warmup=4, max_new_tokens=64, check=True)
    with pytest.raises(
        FeedbackError, match=r"would decode 2,560 tokens \(2 sides x 20 traces x 64 new tokens\)"
    ):
        deep_think(tiny_lm, cfg, budget=Budget(decoded_tokens=2000))
    check_budget(tiny_lm, cfg, Budget(decoded_tokens=2000), warm_up_only=True)  # 2 x 4 x 64 = 512 fits
    with pytest.raises(FeedbackError, match="memory"):
        check_budget(tiny_lm, cfg, Budget(memory_mb=0))
