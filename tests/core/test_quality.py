"""Quality metrics per row: hand-computed small cases, and the forward-pass ones against direct scoring."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from feedback.core import quality
from feedback.core.engine import run_to_end, start_run
from feedback.core.records import RowSpec, RunConfig


def test_distinct_and_repeats_by_hand():
    ids = [1, 2, 3, 1, 2, 3, 4]
    assert quality.distinct(ids, 1) == 4 / 7
    assert quality.distinct(ids, 2) == 4 / 6  # (1,2) (2,3) (3,1) (3,4); (1,2) and (2,3) twice
    assert quality.repeat_rate(ids, 3) == 1 / 5  # 3-grams: 123 231 312 123* 234
    assert quality.longest_repeat(ids) == 3
    assert quality.longest_repeat([7, 7, 7, 7]) == 3  # overlapping occurrences count
    assert quality.longest_repeat([1, 2, 3]) == 0
    assert quality.distinct([], 1) is None and quality.repeat_rate([1, 2], 3) is None


def test_key_facts_plain_and_regex():
    text = "The Eiffel Tower is in Paris, built in 1889."
    facts = ["paris", "/built in 18\\d\\d/", "London"]
    [m] = quality.key_fact_metrics([text], facts)
    assert m == {
        "key_facts_found": ["paris", "/built in 18\\d\\d/"],
        "key_facts_total": 3,
        "key_fact_recall": pytest.approx(2 / 3),
    }
    assert quality.key_fact_metrics([text, "x"], []) == [{}, {}]
    assert "key_fact_recall" not in quality.text_metrics([1, 2])


def test_a_backtracking_key_fact_costs_one_time_limit_and_is_judged_on_no_row():
    """32 catastrophic patterns over 8 answers took 129 s at 0.5 s a search; now every search of a
    run shares one limit, and a fact that runs out of time is left out of every row's recall."""
    texts = ["a" * 3000] * 8
    facts = ["/(.|.)+[~^]/"] * 31 + ["aaa"]
    t0 = time.perf_counter()
    found = quality.key_fact_metrics(texts, facts)
    assert time.perf_counter() - t0 < quality.KEY_FACTS_TIMEOUT_S + 1.0
    for m in found:
        assert m["key_facts_found"] == ["aaa"] and m["key_fact_recall"] == 1.0
        assert m["key_facts_unjudged"] == ["/(.|.)+[~^]/"] * 31 and m["key_facts_total"] == 32


def test_key_facts_stop_when_the_run_is_stopped():
    stop = threading.Event()
    stop.set()
    [m] = quality.key_fact_metrics(["abc"], ["/b/", "abc"], stop)
    assert m["key_facts_found"] == ["abc"] and m["key_facts_unjudged"] == ["/b/"]


def _direct_ppl(lm, ids: list[int], start: int) -> float:
    """exp(mean NLL) of ids[start:] from one plain full forward."""
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([ids])).logits[0].float()
    nll = torch.nn.functional.cross_entropy(
        logits[start - 1 : -1], torch.tensor(ids[start:]), reduction="none"
    )
    return math.exp(nll.double().mean().item())


def test_forward_pass_metrics_match_direct_scoring(tiny_lm):
    prompt_ids, answer = tiny_lm.encode("Tell me a story"), [100, 200, 300, 400]
    assert quality.self_ppl(tiny_lm, prompt_ids, answer) == pytest.approx(
        _direct_ppl(tiny_lm, prompt_ids + answer, len(prompt_ids)), rel=1e-4
    )
    text_ids = tiny_lm.tokenizer("a plain sentence to score")["input_ids"]
    assert quality.text_ppl(tiny_lm, "a plain sentence to score") == pytest.approx(
        _direct_ppl(tiny_lm, text_ids, 1), rel=1e-4
    )
    ref = [11, 22, 33]
    plain = _direct_ppl(tiny_lm, prompt_ids + ref, len(prompt_ids))
    assert quality.reference_ppl(tiny_lm, prompt_ids, ref, None, {}) == {
        "reference_ppl": pytest.approx(plain, rel=1e-4),
        "reference_ppl_with_strategy": True,
    }
    # a non-recurrent strategy at strength 0 scores like the plain model; a recurrent one falls back to it
    zero = quality.reference_ppl(tiny_lm, prompt_ids, ref, "deep_cache", {"lam": 0.0})
    assert zero["reference_ppl_with_strategy"] and zero["reference_ppl"] == pytest.approx(plain, rel=1e-4)
    strong = quality.reference_ppl(tiny_lm, prompt_ids, ref, "anchor", {"alpha": 0.8})
    assert strong["reference_ppl_with_strategy"] and strong["reference_ppl"] != pytest.approx(plain, rel=1e-3)
    recurrent = quality.reference_ppl(tiny_lm, prompt_ids, ref, "residual", {"alpha": 0.8})
    assert recurrent == {
        "reference_ppl": pytest.approx(plain, rel=1e-4),
        "reference_ppl_with_strategy": False,
    }


def test_a_run_reports_every_metric_per_row(embedded_lm):
    cfg = RunConfig(
        prompt="",
        max_new_tokens=20,
        quality=True,
        reference="The capital of France is Paris.",
        key_facts=["Paris", "/capital/"],
        rows=[
            RowSpec("plain", prompt="What is the capital of France?"),
            RowSpec(
                "strong",
                "anchor",
                {"alpha": 0.2},
                prompt="What is the capital of France? Answer precisely, in one sentence.",
            ),
        ],
    )
    result = run_to_end(embedded_lm, cfg)
    for spec, row in zip(cfg.rows, result.rows):
        m = row.metrics
        assert m["length"] == len(row.token_ids) and 0 < m["distinct_1"] <= 1
        assert {"repeat_3gram_rate", "longest_repeat", "mean", "lowest_group"} <= set(m)
        assert m["self_ppl"] == pytest.approx(
            quality.self_ppl(embedded_lm, embedded_lm.encode(spec.prompt), row.token_ids), rel=1e-5
        )
        ids, span = embedded_lm.encode_with_span(spec.prompt, spec.prompt)
        assert embedded_lm.tokenizer.decode(ids[span[0] : span[1]]) == spec.prompt
        assert m["prompt_ppl"] == pytest.approx(quality.span_ppl(embedded_lm, ids, span), rel=1e-5)
        assert m["reference_ppl"] > 1 and m["reference_ppl_with_strategy"]
        assert m["key_fact_recall"] == len(m["key_facts_found"]) / 2
    assert result.rows[0].metrics["key_fact_recall"] == 1.0  # "The capital of France is Paris."


def test_forward_metrics_are_off_unless_asked_and_skipped_when_stopped(tiny_lm):
    plain = run_to_end(tiny_lm, RunConfig(prompt="hi", model="tiny", max_new_tokens=3))
    assert "self_ppl" not in plain.rows[0].metrics and "distinct_1" in plain.rows[0].metrics
    run = start_run(tiny_lm, RunConfig(prompt="hi", model="tiny", max_new_tokens=30, quality=True))
    for _ in run:
        run.stop()
    assert "self_ppl" not in run.result.rows[0].metrics


def test_a_plain_row_scores_itself_from_its_own_steps(tiny_lm):
    """The baseline's self-perplexity comes from the log-probabilities it recorded while decoding
    (no second pass); it equals a teacher-forced pass, and only the prompt's own score runs a forward."""
    forwards = [0]
    handle = tiny_lm.model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        run = start_run(
            tiny_lm,
            RunConfig(
                prompt="Tell me about tea.",
                model="tiny",
                max_new_tokens=12,
                quality=True,
                rows=[RowSpec("baseline"), RowSpec("branch", prefix=[5, 6])],
            ),
        )
        for _ in run:
            forwards[0] = 0  # only the forwards after the last step count
    finally:
        handle.remove()
    assert forwards[0] == 0  # prompt_ppl came from the prefill; both rows are plain, forced tokens included
    for row in run.result.rows:
        want = quality.self_ppl(tiny_lm, tiny_lm.encode("Tell me about tea."), row.token_ids)
        assert row.metrics["self_ppl"] == pytest.approx(want, rel=1e-5)


def test_a_feedback_row_reads_only_its_answer_after_the_kept_prompt(tiny_lm):
    """After the last step, a baseline + feedback run forwards the feedback row's answer alone
    (the plain prompt's keys and values are kept from the prefill): no token of the prompt is read
    again, and the metrics equal separate teacher-forced passes."""
    prompt = "Tell me about tea and the long history of its trade between continents."
    read: list[int] = []
    handle = tiny_lm.model.register_forward_pre_hook(
        lambda _m, args, kwargs: read.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        run = start_run(
            tiny_lm,
            RunConfig(
                prompt=prompt,
                model="tiny",
                max_new_tokens=10,
                quality=True,
                rows=[RowSpec("baseline"), RowSpec("fb", "residual", {"alpha": 0.5})],
            ),
        )
        for _ in run:
            read.clear()
    finally:
        handle.remove()
    answer = run.result.rows[1].token_ids
    assert read == [len(answer) - 1]  # its first token was scored by the prefill's last logits
    ids, span = tiny_lm.encode_with_span(prompt, prompt)
    for row in run.result.rows:
        assert row.metrics["self_ppl"] == pytest.approx(
            quality.self_ppl(tiny_lm, ids, row.token_ids), rel=1e-5
        )
        assert row.metrics["prompt_ppl"] == pytest.approx(quality.span_ppl(tiny_lm, ids, span), rel=1e-5)


def test_prompt_ppl_is_read_in_place_in_every_prefill_shape(tiny_lm):
    """Rows with different prompts (a left-padded prefill), a system prompt, no chat template, a
    strategy that edits the prompt's states with and without a plain twin: each row's prompt PPL is
    its text's tokens scored after what precedes them in its own input."""
    short, long = (
        "Why is the sky blue?",
        "Explain, step by step and with care, why the sky looks blue at noon.",
    )
    rows = [
        RowSpec("a", prompt=short),
        RowSpec("b", prompt=long, system_prompt="Be brief."),
        RowSpec("c", "inner_loop", {}, prompt=short),
        RowSpec("d", "inner_loop", {}, prompt=long + " Now."),
    ]
    for template in (True, False):
        result = run_to_end(
            tiny_lm,
            RunConfig(
                prompt="",
                model="tiny",
                max_new_tokens=4,
                quality=True,
                chat_template=template,
                rows=rows if template else [RowSpec("a", prompt=short), RowSpec("b", prompt=long)],
            ),
        )
        for spec, row in zip(rows, result.rows):
            system = spec.system_prompt if template else None
            ids, span = tiny_lm.encode_with_span(spec.prompt, spec.prompt, template, system)
            assert row.metrics["prompt_ppl"] == pytest.approx(quality.span_ppl(tiny_lm, ids, span), rel=1e-4)
            assert row.metrics["self_ppl"] == pytest.approx(
                quality.self_ppl(tiny_lm, ids, row.token_ids), rel=1e-4
            )


def test_the_prompt_text_span(embedded_lm):
    """The span is the newest user turn's text (not an earlier turn's, not the template's markers);
    a rewritten prompt (restate) still finds the typed text inside it; an empty text has none."""
    history = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    ids, span = embedded_lm.encode_with_span("Hi there", "Hi there", True, None, history)
    tail = embedded_lm.tokenizer.decode(ids[span[1] :])
    assert embedded_lm.tokenizer.decode(ids[span[0] : span[1]]) == "Hi there" and "Hello!" not in tail
    assert ids == embedded_lm.encode("Hi there", True, None, history)
    ids, span = embedded_lm.encode_with_span("Name a colour.\n\nRestate it first.", "Name a colour. ")
    assert embedded_lm.tokenizer.decode(ids[span[0] : span[1]]) == "Name a colour."
    assert embedded_lm.encode_with_span("", "")[1] is None


def test_key_facts_total_is_kept():
    [m] = quality.key_fact_metrics(["nothing here"], ["a fact", "another"])
    assert m["key_facts_total"] == 2 and m["key_fact_recall"] == 0.0 and m["key_facts_found"] == []


def test_metric_directions():
    assert {k for k, up in quality.HIGHER_IS_BETTER.items() if up} == {
        "distinct_1",
        "distinct_2",
        "key_fact_recall",
        "mean",
        "lowest_group",
    }
    assert {k for k, up in quality.HIGHER_IS_BETTER.items() if not up} == {
        "repeat_3gram_rate",
        "longest_repeat",
        "self_ppl",
        "prompt_ppl",
        "reference_ppl",
    }


def test_best_rows_by_hand():
    rows = [
        {"distinct_1": 0.8, "self_ppl": 3.0, "mean": 5.0, "longest_repeat": 2, "length": 10},
        {"distinct_1": 0.9, "self_ppl": 2.5, "mean": 5.0, "longest_repeat": 4, "length": 12},
        {"distinct_1": 0.9, "self_ppl": None, "mean": 5.0, "longest_repeat": 2, "length": 99},
    ]
    assert quality.best_rows(rows) == {
        "distinct_1": {1, 2},  # a tie: both
        "self_ppl": {1},  # lower is better; None ignored
        "longest_repeat": {0, 2},
    }  # mean: all equal, no best; length: not ranked


def test_best_rows_needs_two_differing_values():
    assert quality.best_rows([]) == {} and quality.best_rows([{"self_ppl": 2.0}]) == {}
    assert quality.best_rows([{"self_ppl": 2.0}, {"self_ppl": None}, {}]) == {}
    assert quality.best_rows([{"reference_ppl": float("nan")}, {"reference_ppl": 3.0}]) == {}
    assert quality.best_rows([{"key_fact_recall": 0.0}, {"key_fact_recall": 0.5}]) == {"key_fact_recall": {1}}
    assert quality.best_rows([{"repeat_3gram_rate": 0.0}, {"repeat_3gram_rate": 0.25}]) == {
        "repeat_3gram_rate": {0}
    }
