"""Engine mechanics and the exactness guarantees."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest
import torch

from feedback.core.engine import run_to_end, run_with_logits, start_run
from feedback.core.records import DeepConfConfig, RowSpec, RunConfig, RunResult
from feedback.core.sampling import SamplingConfig
from feedback.errors import FeedbackError

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "List three prime numbers and explain why they are prime.",
    "Translate 'good morning' into Spanish and German.",
]


def _generate_greedy(lm, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = lm.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=lm.tokenizer.eos_token_id,
        )
    new = out[0, len(ids) :].tolist()
    return new


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_baseline_equals_model_generate(embedded_lm, prompt):
    cfg = RunConfig(prompt=prompt, max_new_tokens=24, rows=[RowSpec("baseline")])
    result = run_to_end(embedded_lm, cfg)
    expected = _generate_greedy(embedded_lm, embedded_lm.encode(prompt), 24)
    assert result.rows[0].token_ids == expected


def test_strength_zero_feedback_has_baseline_logits(embedded_lm):
    seen: list[torch.Tensor] = []

    def observer(step, live, logits):
        if live == [0, 1]:
            seen.append(logits.clone())

    cfg = RunConfig(
        prompt=PROMPTS[2],
        max_new_tokens=20,
        rows=[RowSpec("baseline"), RowSpec("fb", "residual", {"alpha": 0.0})],
    )
    result = run_to_end(embedded_lm, cfg, observer=observer)
    assert len(seen) == 20
    for logits in seen:
        assert torch.max(torch.abs(logits[0] - logits[1])).item() <= 1e-5
    assert result.rows[0].token_ids == result.rows[1].token_ids
    assert result.first_divergence_step is None


def test_feedback_changes_logits_when_strength_nonzero(embedded_lm):
    diffs: list[float] = []
    cfg = RunConfig(
        prompt=PROMPTS[0],
        max_new_tokens=8,
        rows=[RowSpec("baseline"), RowSpec("fb", "residual", {"alpha": 0.5})],
    )
    run_to_end(
        embedded_lm,
        cfg,
        observer=lambda s, live, lg: diffs.append(
            (lg[0] - lg[1]).abs().max().item() if len(live) == 2 else 0.0
        ),
    )
    assert diffs[0] == 0.0  # the first token comes from the shared prefill
    assert max(diffs[1:]) > 1e-2


def test_row_batched_equals_row_alone(embedded_lm):
    rows = [
        RowSpec("baseline"),
        RowSpec("fb", "residual", {"alpha": 0.2}),
        RowSpec("fb2", "residual", {"alpha": 0.1, "target_layer": 3}),
    ]
    together = run_to_end(embedded_lm, RunConfig(prompt=PROMPTS[1], max_new_tokens=24, rows=rows))
    for i, spec in enumerate(rows):
        alone = run_to_end(embedded_lm, RunConfig(prompt=PROMPTS[1], max_new_tokens=24, rows=[spec]))
        assert alone.rows[0].token_ids == together.rows[i].token_ids, spec.name
        for a, b in zip(alone.rows[0].steps, together.rows[i].steps):
            assert a.confidence == pytest.approx(b.confidence, abs=1e-3)


def test_seeded_sampling_reproduces_and_matches_alone(embedded_lm):
    sampling = SamplingConfig(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, repetition_penalty=1.1)
    rows = [RowSpec("baseline"), RowSpec("fb", "residual", {"alpha": 0.1})]
    cfg = RunConfig(prompt=PROMPTS[1], max_new_tokens=16, seed=123, sampling=sampling, rows=rows)
    a = run_to_end(embedded_lm, cfg)
    b = run_to_end(embedded_lm, RunConfig.from_dict(cfg.to_dict()))
    assert [r.token_ids for r in a.rows] == [r.token_ids for r in b.rows]
    other = run_to_end(
        embedded_lm, RunConfig(prompt=PROMPTS[1], max_new_tokens=16, seed=124, sampling=sampling, rows=rows)
    )
    assert other.rows[0].token_ids != a.rows[0].token_ids
    alone = run_to_end(
        embedded_lm,
        RunConfig(prompt=PROMPTS[1], max_new_tokens=16, seed=123, sampling=sampling, rows=rows[:1]),
    )
    assert alone.rows[0].token_ids == a.rows[0].token_ids


def test_incremental_text_equals_full_decode(embedded_lm):
    cfg = RunConfig(
        prompt="Write the word 'café' and the emoji 🎉, then say 你好 in Chinese.",
        max_new_tokens=40,
        rows=[RowSpec("baseline")],
    )
    row = run_to_end(embedded_lm, cfg).rows[0]
    full = embedded_lm.tokenizer.decode(
        row.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    assert "".join(s.text for s in row.steps) == full == row.text


def test_step_records_are_consistent(embedded_lm):
    cfg = RunConfig(prompt=PROMPTS[0], max_new_tokens=12, deepconf=DeepConfConfig(k=20, window=4))
    result = run_to_end(embedded_lm, cfg)
    for row in result.rows:
        confs = []
        for s in row.steps:
            confs.append(s.confidence)
            assert len(s.top) == 5
            assert s.top[0].prob >= s.top[-1].prob
            assert s.prob == pytest.approx(torch.tensor(s.logprob).exp().item(), rel=1e-6)
            assert s.group_confidence == pytest.approx(sum(confs[-4:]) / len(confs[-4:]))
            assert s.entropy >= 0 and s.confidence > 0
            if s.token_id == s.top[0].token_id:  # greedy: the chosen token is the most probable
                assert s.prob == pytest.approx(s.top[0].prob, rel=1e-5)
        assert row.metrics["tokens"] == len(row.steps)
        assert row.stop_reason in ("eos", "max_tokens")


def test_eos_ends_row_and_max_tokens(embedded_lm):
    result = run_to_end(embedded_lm, RunConfig(prompt="Reply with just the word: yes", max_new_tokens=50))
    row = result.rows[0]
    assert row.stop_reason == "eos" and row.token_ids[-1] in embedded_lm.eos_token_ids
    assert row.stop_step == len(row.token_ids) - 1
    short = run_to_end(embedded_lm, RunConfig(prompt=PROMPTS[2], max_new_tokens=5)).rows[0]
    assert short.stop_reason == "max_tokens" and len(short.token_ids) == 5 and short.stop_step == 4


def test_early_stop_leaves_batch_and_others_unchanged(tiny_lm):
    """With a threshold only one row can fall under, that row stops at the first full window and the
    other row's tokens are exactly those of a run without early stopping."""
    rows = [
        RowSpec("baseline"),
        RowSpec("fb", "residual", {"alpha": 1.0, "source_layer": 3, "target_layer": 0}),
    ]
    plain = run_to_end(
        tiny_lm,
        RunConfig(
            prompt=PROMPTS[0], model="tiny", max_new_tokens=30, rows=rows, deepconf=DeepConfConfig(window=4)
        ),
    )
    live_sizes: list[int] = []
    # a threshold above every confidence stops every row at its first full window
    stopped = run_to_end(
        tiny_lm,
        RunConfig(
            prompt=PROMPTS[0],
            model="tiny",
            max_new_tokens=30,
            rows=rows,
            deepconf=DeepConfConfig(window=4, threshold=1e9),
        ),
        observer=lambda s, live, lg: live_sizes.append(len(live)),
    )
    for row in stopped.rows:
        assert row.stop_reason == "early_stop" and row.stop_step == 3 and len(row.token_ids) == 4
    assert len(live_sizes) == 4
    # A threshold between the two rows' first-window group confidences stops exactly one of them.
    g = [r.steps[3].group_confidence for r in plain.rows]
    if abs(g[0] - g[1]) < 1e-6:
        pytest.skip("rows have equal first-window confidence on this tiny model")
    low, high = sorted(range(2), key=lambda i: g[i])
    thr = (g[0] + g[1]) / 2
    live_sizes.clear()
    mixed = run_to_end(
        tiny_lm,
        RunConfig(
            prompt=PROMPTS[0],
            model="tiny",
            max_new_tokens=30,
            rows=rows,
            deepconf=DeepConfConfig(window=4, threshold=thr),
        ),
        observer=lambda s, live, lg: live_sizes.append(len(live)),
    )
    assert mixed.rows[low].stop_reason == "early_stop" and mixed.rows[low].stop_step == 3
    assert live_sizes[4:] and set(live_sizes[4:]) == {1}  # the stopped row left the batch
    survivor = mixed.rows[high]
    # the survivor goes on until its own window dips under the threshold or the end
    n = len(survivor.token_ids)
    assert survivor.token_ids == plain.rows[high].token_ids[:n]


def test_stop_event_ends_within_one_step_and_frees_hooks(tiny_lm, hook_count):
    stop = threading.Event()
    run = start_run(tiny_lm, RunConfig(prompt=PROMPTS[0], model="tiny", max_new_tokens=200), stop_event=stop)
    steps = 0
    for event in run:
        steps += 1
        assert hook_count(tiny_lm.model) > 0
        if event.step == 5:
            stop.set()
    assert steps == 6
    assert all(r.stop_reason == "stopped" and r.stop_step == 5 for r in run.result.rows)
    assert hook_count(tiny_lm.model) == 0


def test_stop_from_another_thread(tiny_lm):
    run = start_run(tiny_lm, RunConfig(prompt=PROMPTS[0], model="tiny", max_new_tokens=400))
    events = []

    def consume():
        for ev in run:
            events.append(ev.step)
            if ev.step == 3:
                threading.Thread(target=run.stop).start()

    t = threading.Thread(target=consume)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive()
    assert len(events) < 400 and run.result.rows[0].stop_reason == "stopped"


def test_hooks_removed_on_failure_and_abandon(tiny_lm, hook_count):
    def boom(step, live, logits):
        if step == 2:
            raise RuntimeError("observer failed")

    with pytest.raises(RuntimeError, match="observer failed"):
        run_to_end(tiny_lm, RunConfig(prompt=PROMPTS[0], model="tiny", max_new_tokens=10), observer=boom)
    assert hook_count(tiny_lm.model) == 0
    run = start_run(tiny_lm, RunConfig(prompt=PROMPTS[0], model="tiny", max_new_tokens=10))
    it = iter(run)
    next(it)
    assert hook_count(tiny_lm.model) > 0
    it.close()  # a consumer that walks away (e.g. a closed browser tab)
    assert hook_count(tiny_lm.model) == 0


def test_result_is_json_serialisable_and_config_round_trips(tiny_lm):
    cfg = RunConfig(
        prompt=PROMPTS[0], model="tiny", max_new_tokens=6, sampling=SamplingConfig(temperature=0.7), seed=5
    )
    result = run_to_end(tiny_lm, cfg)
    data = json.loads(result.to_json())
    assert data["config"]["model"] == "tiny" and data["config"]["dtype"] == "float32"
    row = data["rows"][1]
    assert {
        "name",
        "strategy",
        "token_ids",
        "text",
        "stop_reason",
        "stop_step",
        "steps",
        "metrics",
        "tokens_per_s",
    } <= set(row)
    assert {"token_id", "text", "logprob", "confidence", "entropy", "group_confidence", "top"} <= set(
        row["steps"][0]
    )
    again = RunConfig.from_dict(data["config"] | {"model": "tiny"})
    # the result records the resolved dtype, so replaying it pins what actually ran
    assert again == RunConfig.from_dict(cfg.to_dict() | {"model": "tiny", "dtype": "float32"})
    assert isinstance(result, RunResult) and result.memory and result.memory[0]["rss_mb"] > 0


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(prompt="   "), "prompt is empty"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=10**6), "max_new_tokens"),
        (dict(sampling=SamplingConfig(temperature=float("nan"))), "temperature"),
        (dict(sampling=SamplingConfig(top_p=1.5)), "top_p"),
        (dict(sampling=SamplingConfig(top_k=-1)), "top_k"),
        (dict(deepconf=DeepConfConfig(window=0)), "window"),
        (dict(deepconf=DeepConfConfig(threshold=float("inf"))), "threshold"),
        (dict(rows=[RowSpec("a"), RowSpec("a")]), "unique"),
        (dict(rows=[RowSpec("b"), RowSpec("f", "nope")]), "unknown strategy"),
        (dict(rows=[RowSpec("b"), RowSpec("f", "residual", {"alpha": 5})]), "alpha"),
        (dict(rows=[RowSpec("b"), RowSpec("f", "residual", {"target_layer": 99})]), "target_layer"),
        (dict(rows=[RowSpec("b"), RowSpec("f", "residual", {"beta": 1})]), "unknown parameter"),
        (dict(model="other-model"), "engine holds"),
    ],
)
def test_bad_config_is_refused_before_touching_the_model(tiny_lm, bad, message, hook_count):
    cfg = RunConfig(**({"prompt": "hi", "model": "tiny"} | bad))
    with pytest.raises(FeedbackError, match=message):
        start_run(tiny_lm, cfg)
    assert hook_count(tiny_lm.model) == 0


def test_prompt_longer_than_context_is_refused(tiny_lm):
    with pytest.raises(FeedbackError, match="exceeds the model context of 512"):
        start_run(tiny_lm, RunConfig(prompt="word " * 600, model="tiny", max_new_tokens=10))


def test_interleaved_runs_on_one_model_do_not_interfere(tiny_lm, hook_count):
    """Two runs stepping alternately on the same model (as two browser sessions would) give the
    same tokens as each run alone; a plain forward meanwhile is untouched by their hooks."""
    rows_a = [RowSpec("baseline"), RowSpec("fb", "residual", {"alpha": 0.9, "target_layer": 0})]
    rows_b = [
        RowSpec("fb", "residual", {"alpha": -0.7, "source_layer": 2, "target_layer": 1}),
        RowSpec("base"),
    ]
    cfg_a = RunConfig(prompt=PROMPTS[0], model="tiny", max_new_tokens=12, rows=rows_a)
    cfg_b = RunConfig(prompt=PROMPTS[1], model="tiny", max_new_tokens=12, rows=rows_b)
    alone = [run_to_end(tiny_lm, c) for c in (cfg_a, cfg_b)]
    ids = torch.tensor([tiny_lm.encode("plain")])
    with torch.inference_mode():
        clean = tiny_lm.model(input_ids=ids).logits
    run_a, run_b = start_run(tiny_lm, cfg_a), start_run(tiny_lm, cfg_b)
    it_a, it_b = iter(run_a), iter(run_b)
    for _ in range(12):
        next(it_a, None), next(it_b, None)
        with torch.inference_mode():
            assert torch.equal(tiny_lm.model(input_ids=ids).logits, clean)
    list(it_a), list(it_b)
    for got, want in zip((run_a.result, run_b.result), alone):
        assert [r.token_ids for r in got.rows] == [r.token_ids for r in want.rows]
    assert hook_count(tiny_lm.model) == 0


def test_run_resumed_on_different_threads(tiny_lm):
    """Gradio resumes a generator on whichever worker thread is free; results must not change."""
    cfg = RunConfig(
        prompt=PROMPTS[0],
        model="tiny",
        max_new_tokens=10,
        rows=[RowSpec("baseline"), RowSpec("fb", "residual", {"alpha": 0.5})],
    )
    want = run_to_end(tiny_lm, cfg)
    it = iter(start_run(tiny_lm, cfg))
    run_steps = []

    def step():
        run_steps.append(next(it, None))

    while True:
        t = threading.Thread(target=step)
        t.start()
        t.join()
        if run_steps[-1] is None:
            break
    got = [[e.records[r].token_id for e in run_steps[:-1] if r in e.records] for r in range(2)]
    assert got == [r.token_ids for r in want.rows]


# ---- long prompts: chunked prefill, budgets ----
CHUNKED_ROWS = [
    RowSpec("baseline"),
    RowSpec("residual", "residual", {"alpha": 0.3}),
    RowSpec("soft_token", "soft_token", {"beta": 0.3}),
    RowSpec("deep_cache", "deep_cache", {"lam": 0.3, "gate": -1.0, "theta": 20.0}),
    RowSpec("anchor", "anchor", {"alpha": 0.3}),
]


def _logits_per_step(lm, cfg) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    run_to_end(
        lm, cfg, observer=lambda step, live, logits: seen.append(logits.clone()) if len(live) == 5 else None
    )
    return seen


def test_a_prompt_prefilled_in_chunks_gives_every_strategy_the_same_state(tiny_lm, monkeypatch):
    """Each strategy reads the prompt during prefill (means, summaries, cache keys, the last
    distribution); prefilled in 7-token chunks it must end up where one whole-prompt forward does."""
    import feedback.core.engine as engine

    cfg = RunConfig(
        prompt="The river runs to the sea and the sea rises into clouds over the hills. " * 3,
        model="tiny",
        max_new_tokens=6,
        rows=CHUNKED_ROWS,
        chat_template=False,
    )
    whole = _logits_per_step(tiny_lm, cfg)
    monkeypatch.setattr(engine, "PREFILL_CHUNK", 7)
    chunked = _logits_per_step(tiny_lm, cfg)
    assert len(whole) == len(chunked) == 6
    for a, b in zip(whole, chunked):
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max(dim=1).values  # per row


def test_a_long_prompt_reports_its_prefill_chunk_by_chunk_when_asked(tiny_lm, monkeypatch):
    import feedback.core.engine as engine

    monkeypatch.setattr(engine, "PREFILL_CHUNK", 8)
    cfg = RunConfig(
        prompt="The river runs to the sea and the sea rises. " * 3,
        model="tiny",
        max_new_tokens=3,
        rows=[RowSpec("a"), RowSpec("b", prompt="Short.")],
        chat_template=False,
    )
    quiet = list(start_run(tiny_lm, cfg))
    assert all(isinstance(e, engine.StepEvent) for e in quiet)  # not asked: steps only, as every door expects
    run = start_run(tiny_lm, cfg)
    run.prefill_events = True
    events = list(run)
    prefill = [e for e in events if isinstance(e, engine.PrefillEvent)]
    width = len(run.prompt_ids)
    assert [e.chunk for e in prefill] == list(range(1, -(-width // 8) + 1)) and prefill[-1].tokens == width
    assert all(e.chunks == len(prefill) and e.total == width for e in prefill)
    assert events[: len(prefill)] == prefill  # all before the first step
    assert [e.records[0].token_id for e in events[len(prefill) :]] == [e.records[0].token_id for e in quiet]


def test_stop_during_a_chunked_prefill_ends_the_run_before_any_token(tiny_lm, monkeypatch, hook_count):
    import feedback.core.engine as engine

    monkeypatch.setattr(engine, "PREFILL_CHUNK", 4)
    stop = threading.Event()
    forwards: list[int] = []

    def count(*_):
        forwards.append(1)
        if len(forwards) == 2:
            stop.set()  # Stop pressed while the prompt is still being read

    handle = tiny_lm.model.register_forward_pre_hook(count)
    try:
        cfg = RunConfig(
            prompt="word " * 40,
            model="tiny",
            max_new_tokens=5,
            chat_template=False,
            rows=[RowSpec("baseline"), RowSpec("fb", "residual", {"alpha": 0.2})],
        )
        result = run_to_end(tiny_lm, cfg, stop_event=stop)
    finally:
        handle.remove()
    assert len(forwards) == 2 and all(r.stop_reason == "stopped" and not r.steps for r in result.rows)
    assert hook_count(tiny_lm.model) == 0


def _stopping_at(lm, stop: threading.Event, when) -> tuple[list, list]:
    """Hooks on the first and last decoder layers: the first sets `stop` on the forward for which
    `when(hidden)` holds; both record the lengths of the forwards they see."""
    first, last = [], []

    def at_first(_module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        first.append(hidden.shape[1])
        if when(hidden):
            stop.set()

    handles = [
        lm.layers[0].register_forward_pre_hook(at_first, with_kwargs=True),
        lm.layers[-1].register_forward_pre_hook(
            lambda _m, args, kwargs: last.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
            with_kwargs=True,
        ),
    ]
    return handles, (first, last)


def test_stop_inside_a_prefill_chunk_ends_it_between_layers(tiny_lm, hook_count):
    """A 512-token chunk takes seconds on a CPU: a hang-up is seen inside its forward, not after it."""
    stop = threading.Event()
    handles, (first, last) = _stopping_at(tiny_lm, stop, lambda h: h.shape[1] > 100)
    try:
        cfg = RunConfig(
            prompt="word " * 300,
            model="tiny",
            max_new_tokens=4,
            chat_template=False,
            rows=[RowSpec("baseline"), RowSpec("fb", "residual", {"alpha": 0.2})],
        )
        result = run_to_end(tiny_lm, cfg, stop_event=stop)
    finally:
        for h in handles:
            h.remove()
    assert first == [301] and last == []  # the chunk's forward ended at its second layer
    assert all(r.stop_reason == "stopped" and not r.steps for r in result.rows)
    assert hook_count(tiny_lm.model) == 0


def test_stop_while_the_reference_is_scored_ends_it_between_layers(tiny_lm, hook_count):
    """The reference's perplexity is scored after decoding: a hang-up there ends it within a layer,
    and the run ends without that metric."""
    stop = threading.Event()
    handles, (first, last) = _stopping_at(tiny_lm, stop, lambda h: h.shape[1] > 100)
    try:
        cfg = RunConfig(
            prompt="Hi",
            model="tiny",
            max_new_tokens=3,
            chat_template=False,
            reference="ref " * 200,
            rows=[RowSpec("baseline"), RowSpec("fb", "deep_cache", {"lam": 0.1})],
        )
        result = run_to_end(tiny_lm, cfg, stop_event=stop)
    finally:
        for h in handles:
            h.remove()
    assert len([n for n in first if n > 100]) == 1 and all(n <= 100 for n in last)
    assert all(len(r.token_ids) == 3 and "reference_ppl" not in r.metrics for r in result.rows)
    assert hook_count(tiny_lm.model) == 0


def test_a_reference_longer_than_the_context_is_refused_before_any_work(tiny_lm, hook_count):
    forwards: list[int] = []
    handle = tiny_lm.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        cfg = RunConfig(
            prompt="Hi", model="tiny", max_new_tokens=3, chat_template=False, reference="ref " * 600
        )
        with pytest.raises(
            FeedbackError,
            match=r"reference is \d+ tokens; after row baseline's 1-token prompt it "
            r"exceeds the model context of 512 tokens",
        ):
            start_run(tiny_lm, cfg)
        restate = RunConfig(
            prompt="Hi",
            model="tiny",
            max_new_tokens=300,
            chat_template=False,
            reference="ref " * 300,
            rows=[RowSpec("r", "restate")],
        )
        with pytest.raises(FeedbackError, match=r"'s \d+-token prompt and reply it exceeds"):
            start_run(tiny_lm, restate)  # its reference follows its reply: 300 tokens at most
    finally:
        handle.remove()
    assert forwards == [] and hook_count(tiny_lm.model) == 0


def test_the_scoring_after_a_run_counts_against_the_budget(tiny_lm):
    from feedback.core.budget import Budget

    cfg = RunConfig(
        prompt="Hi",
        model="tiny",
        max_new_tokens=3,
        chat_template=False,
        reference="ref " * 200,
        quality=True,
        rows=[RowSpec("baseline"), RowSpec("fb", "deep_cache", {"lam": 0.1})],
    )
    run = start_run(tiny_lm, cfg)
    # each row: its prompt and the reference; quality: the prefill scores the prompt, the strategy
    # row's answer is read after the kept prompt (a plain row's self-perplexity comes from its decode)
    ref = len(run.reference_ids)
    assert run._scoring_after([r.prompt_ids for r in run.rows]) == 2 * (1 + ref) + 3 == 407
    with pytest.raises(
        FeedbackError,
        match=r"would score 407 token-forwards \(the quality metrics and the "
        r"reference answer, scored after the run\).*FEEDBACK_BUDGET_SCORED",
    ):
        start_run(tiny_lm, cfg, budget=Budget(scored_tokens=406))
    start_run(tiny_lm, cfg, budget=Budget(scored_tokens=407))
    # a row whose strategy edits the prompt's states, with no plain twin, reads its prompt twice more
    alone = RunConfig(
        prompt="Hi there",
        model="tiny",
        max_new_tokens=3,
        chat_template=False,
        quality=True,
        rows=[RowSpec("loop", "inner_loop", {})],
    )
    run = start_run(tiny_lm, alone)
    n = len(run.rows[0].prompt_ids)
    assert run._scoring_after([n * [0]]) == n + (n + 3)


def test_a_request_over_budget_is_refused_before_any_work(embedded_lm, hook_count):
    from feedback.core.budget import Budget

    forwards: list[int] = []
    handle = embedded_lm.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        rows = [RowSpec(f"r{i}") for i in range(4)]
        with pytest.raises(
            FeedbackError,
            match=r"would decode 4,096 tokens \(4 rows x 1024 new tokens\).*"
            "FEEDBACK_BUDGET_DECODED_TOKENS",
        ):
            start_run(
                embedded_lm,
                RunConfig(prompt="hi", max_new_tokens=1024, rows=rows),
                budget=Budget(decoded_tokens=2048),
            )
        with pytest.raises(
            FeedbackError,
            match=r"needs about [\d,]+ MB of memory \(\d+ prompt \+ 8 new tokens, 2 "
            r"rows\).*FEEDBACK_BUDGET_MEMORY_MB",
        ):
            start_run(
                embedded_lm, RunConfig(prompt="word " * 6000, max_new_tokens=8), budget=Budget(memory_mb=200)
            )
        start_run(
            embedded_lm, RunConfig(prompt="word " * 6000, max_new_tokens=8), budget=Budget(memory_mb=2000)
        )
    finally:
        handle.remove()
    assert forwards == [] and hook_count(embedded_lm.model) == 0


# ---- rows with their own prompts: left padding, one batched forward ----
VARIANTS = [
    "Hi.",
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea, in four rhyming lines, about waves, the moon and sailors far "
    "from home.",
]
# Greedy logits of a row batched with rows of other prompt lengths vs the row alone, SmolLM2-135M fp32
# on CPU: at most 6.7e-5 measured over five mixes of VARIANTS (logits of magnitude ~10-30). Not bitwise:
# the batch shape changes how the matrix products are blocked and summed, and a padded row's attention
# sums over a longer (masked) key row, so float32 rounding differs in the last bits.
PADDED_LOGIT_TOL = 2e-4
_alone_cache: dict = {}


def _alone(lm, spec: RowSpec, n: int):
    key = (spec.prompt, spec.strategy, tuple(sorted(spec.params.items())), n, lm.name)
    if key not in _alone_cache:
        _alone_cache[key] = run_with_logits(
            lm, RunConfig(prompt="", model=lm.name, max_new_tokens=n, rows=[spec])
        )
    result, seen = _alone_cache[key]
    return result.rows[0], seen[0]


@pytest.mark.parametrize("mix", [(0, 1, 2), (2, 0), (1, 2)])
def test_a_row_with_its_own_prompt_batched_equals_the_row_alone(embedded_lm, mix):
    rows = [RowSpec(f"v{p}", prompt=VARIANTS[p]) for p in mix]
    result, seen = run_with_logits(embedded_lm, RunConfig(prompt="", max_new_tokens=16, rows=rows))
    for i, spec in enumerate(rows):
        alone, alone_logits = _alone(embedded_lm, spec, 16)
        assert result.rows[i].token_ids == alone.token_ids, spec.name
        worst = max((a - b).abs().max().item() for a, b in zip(seen[i], alone_logits))
        assert worst <= PADDED_LOGIT_TOL, (spec.name, worst)


def test_strength_zero_reproduces_its_baseline_beside_padded_rows(embedded_lm):
    rows = [
        RowSpec("long", prompt=VARIANTS[2]),
        RowSpec("long0", "residual", {"alpha": 0.0}, prompt=VARIANTS[2]),
        RowSpec("short", prompt=VARIANTS[0]),
        RowSpec("short0", "anchor", {"alpha": 0.0}, prompt=VARIANTS[0]),
    ]
    result, seen = run_with_logits(embedded_lm, RunConfig(prompt="", max_new_tokens=12, rows=rows))
    for base, zero in ((0, 1), (2, 3)):
        assert result.rows[base].token_ids == result.rows[zero].token_ids
        for a, b in zip(seen[base], seen[zero]):
            assert (a - b).abs().max().item() <= 1e-5


def test_rows_with_the_same_prompt_share_one_prefill(tiny_lm):
    widths: list[int] = []
    handle = tiny_lm.model.register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(kw["input_ids"].shape), with_kwargs=True
    )
    try:
        rows = [
            RowSpec("a", prompt="one two three"),
            RowSpec("b", "residual", {"alpha": 0.3}, prompt="one two three"),
            RowSpec("c", prompt="four"),
        ]
        result = run_to_end(tiny_lm, RunConfig(prompt="", model="tiny", max_new_tokens=3, rows=rows))
    finally:
        handle.remove()
    assert widths[0][0] == 2  # two distinct prompts prefilled, three rows decoded
    assert all(w[0] == 3 for w in widths[1:])
    assert result.prompt_tokens == len(tiny_lm.encode("one two three"))


STRATEGY_ROWS = [
    ("residual", {"alpha": 0.6, "source_layer": 3, "target_layer": 1}),
    ("soft_token", {"beta": 0.5}),
    ("deep_cache", {"lam": 0.5, "gate": -1.0, "theta": 20.0}),
    ("anchor", {"alpha": 0.5}),
]


@pytest.mark.parametrize("chunk", [512, 5])
def test_each_strategy_acts_on_its_own_row_when_prompts_are_padded(tiny_lm, monkeypatch, chunk):
    """Every strategy reads its own row's real prompt tokens (not the padding, not position 0 of a
    padded row as its sink) and changes only its own row: each row of a padded batch gives the logits
    it gives alone, also when the padded prompts are prefilled in chunks."""
    import feedback.core.engine as engine

    # each strategy row a prompt of its own length (2, 4, 1, 3 sentences for four rows), so each is padded
    repeats = sorted(range(1, len(STRATEGY_ROWS) + 1), key=lambda k: (k % 2, k))
    rows = [RowSpec("baseline", prompt="Tell me about rivers, seas and the clouds above the hills.")] + [
        RowSpec(name, name, params, prompt="The river runs to the sea. " * k)
        for (name, params), k in zip(STRATEGY_ROWS, repeats, strict=True)
    ]
    monkeypatch.setattr(engine, "PREFILL_CHUNK", chunk)
    result, seen = run_with_logits(
        tiny_lm, RunConfig(prompt="", model="tiny", max_new_tokens=6, rows=rows, chat_template=False)
    )
    for i, spec in enumerate(rows):
        alone, alone_seen = run_with_logits(
            tiny_lm, RunConfig(prompt="", model="tiny", max_new_tokens=6, rows=[spec], chat_template=False)
        )
        assert result.rows[i].token_ids == alone.rows[0].token_ids, spec.name
        for a, b in zip(seen[i], alone_seen[0]):
            assert torch.allclose(a, b, atol=1e-4), (spec.name, (a - b).abs().max().item())


def test_a_forced_prefix_is_marked_and_decoding_continues_after_it(embedded_lm):
    prompt = "What is the capital of France?"
    prefix = embedded_lm.tokenizer(" Well, the capital", add_special_tokens=False)["input_ids"]
    row = run_to_end(
        embedded_lm, RunConfig(prompt=prompt, max_new_tokens=12, rows=[RowSpec("b", prefix=prefix)])
    ).rows[0]
    assert row.token_ids[: len(prefix)] == prefix
    assert [s.forced for s in row.steps] == [True] * len(prefix) + [False] * (len(row.steps) - len(prefix))
    expected = _generate_greedy(embedded_lm, embedded_lm.encode(prompt) + prefix, 12 - len(prefix))
    assert row.token_ids[len(prefix) :] == expected


def test_a_forced_end_of_sequence_ends_the_row(tiny_lm):
    eos = tiny_lm.eos_token_ids[0]
    row = run_to_end(
        tiny_lm, RunConfig(prompt="hi", model="tiny", max_new_tokens=10, rows=[RowSpec("b", prefix=[5, eos])])
    ).rows[0]
    assert row.token_ids == [5, eos] and row.stop_reason == "eos" and row.stop_step == 1


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [RowSpec("a"), RowSpec("long", prompt="word " * 600)],
            "row long: prompt is .* exceeds the model context",
        ),
        ([RowSpec("a"), RowSpec("empty", prompt="  ")], "row empty: prompt is empty"),
        (
            [RowSpec("a", messages=[{"role": "wizard", "content": "hi"}])],
            r"row a: messages\[0\].role must be one of",
        ),
        (
            [RowSpec("a", messages=[{"role": "user"}])],
            r"row a: messages\[0\] must have exactly a role and a content",
        ),
        ([RowSpec("a", prefix=[1, 10**6])], "row a: prefix token id 1000000 is outside the vocabulary"),
        ([RowSpec("a", prefix=[-1])], "row a: prefix must be a list of token ids"),
        ([RowSpec("a", prefix=[1] * 11)], "row a: prefix has 11 tokens but max_new_tokens is 10"),
        ([RowSpec(f"r{i}") for i in range(65)], "a run needs 1 to 64 rows, got 65"),
    ],
)
def test_bad_rows_are_refused_naming_the_row_before_any_work(tiny_lm, hook_count, rows, message):
    forwards: list[int] = []
    handle = tiny_lm.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(FeedbackError, match=message):
            start_run(tiny_lm, RunConfig(prompt="hi", model="tiny", max_new_tokens=10, rows=rows))
    finally:
        handle.remove()
    assert forwards == [] and hook_count(tiny_lm.model) == 0


def test_a_conversation_needs_the_chat_template(tiny_lm):
    with pytest.raises(FeedbackError, match="needs the chat template"):
        start_run(
            tiny_lm,
            RunConfig(
                prompt="and now?",
                model="tiny",
                chat_template=False,
                rows=[RowSpec("a", messages=[{"role": "user", "content": "hi"}])],
            ),
        )


def test_hooks_never_outlive_a_failed_run_with_padded_rows(tiny_lm, hook_count):
    rows = [
        RowSpec("a", prompt="short"),
        RowSpec("b", "deep_cache", {"lam": 0.5}, prompt="a longer prompt here"),
        RowSpec("c", "soft_token", {"beta": 0.5}, prompt="mid length one"),
    ]

    def boom(step, live, logits):
        if step == 1:
            raise RuntimeError("failed mid-run")

    with pytest.raises(RuntimeError, match="failed mid-run"):
        run_to_end(tiny_lm, RunConfig(prompt="", model="tiny", max_new_tokens=8, rows=rows), observer=boom)
    assert hook_count(tiny_lm.model) == 0


# ---- a row's own temperature: only its temperature differs from the run's sampling settings ----
SHARED = dict(top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.1)


def _tokens(lm, sampling: SamplingConfig, rows: list[RowSpec], seed: int = 7) -> dict[str, list[int]]:
    result = run_to_end(
        lm,
        RunConfig(
            prompt=PROMPTS[3], model="tiny", max_new_tokens=16, seed=seed, sampling=sampling, rows=rows
        ),
    )
    return {r.name: r.token_ids for r in result.rows}


def test_a_greedy_row_in_a_sampled_run_equals_the_greedy_row_alone(tiny_lm):
    rows = [
        RowSpec("hot"),
        RowSpec("cold", temperature=0.0, seed_offset=1),
        RowSpec("cold-fb", "residual", {"alpha": 0.2}, temperature=0.0, prompt=PROMPTS[0]),
    ]
    mixed = _tokens(tiny_lm, SamplingConfig(temperature=0.9, **SHARED), rows)
    greedy = SamplingConfig(temperature=0.0, **SHARED)
    assert mixed["cold"] == _tokens(tiny_lm, greedy, [RowSpec("cold")])["cold"]
    assert mixed["cold-fb"] == _tokens(tiny_lm, greedy, [rows[2]])["cold-fb"]
    # the sampled row beside them draws as it does alone, and differs from greedy (the test can fail)
    assert (
        mixed["hot"] == _tokens(tiny_lm, SamplingConfig(temperature=0.9, **SHARED), [RowSpec("hot")])["hot"]
    )
    assert mixed["hot"] != mixed["cold"]


def test_a_sampled_row_in_a_greedy_run_equals_it_alone_at_that_temperature(tiny_lm):
    rows = [
        RowSpec("plain"),
        RowSpec("warm", temperature=0.7, seed_offset=3),
        RowSpec("warmer", temperature=1.3),
    ]
    mixed = _tokens(tiny_lm, SamplingConfig(temperature=0.0, **SHARED), rows)
    for name, temperature in (("warm", 0.7), ("warmer", 1.3)):
        spec = next(r for r in rows if r.name == name)
        alone = _tokens(
            tiny_lm,
            SamplingConfig(temperature=temperature, **SHARED),
            [RowSpec(name, seed_offset=spec.seed_offset)],
        )
        assert mixed[name] == alone[name]
    assert mixed["plain"] == _tokens(tiny_lm, SamplingConfig(**SHARED), [RowSpec("plain")])["plain"]
    assert mixed["warm"] != mixed["plain"] and mixed["warm"] != mixed["warmer"]


def test_rows_leaving_the_batch_keep_their_own_temperature(tiny_lm):
    # a row forced to end at its first step leaves the batch: the others' temperatures and
    # generators must move with their rows, not stay at their old batch positions
    eos = tiny_lm.eos_token_ids[0]
    rows = [RowSpec("cold", temperature=0.0), RowSpec("gone", prefix=[eos]), RowSpec("hot", temperature=0.8)]
    mixed = _tokens(tiny_lm, SamplingConfig(temperature=0.5, **SHARED), rows)
    assert mixed["gone"] == [eos]
    assert mixed["cold"] == _tokens(tiny_lm, SamplingConfig(**SHARED), [RowSpec("cold")])["cold"]
    assert (
        mixed["hot"] == _tokens(tiny_lm, SamplingConfig(temperature=0.8, **SHARED), [RowSpec("hot")])["hot"]
    )


def test_a_row_with_its_own_seed_and_top_p_draws_as_a_run_with_them(tiny_lm):
    sampling = SamplingConfig(temperature=1.0, **SHARED)
    rows = [RowSpec("run's"), RowSpec("own seed", seed=11, seed_offset=2), RowSpec("own top-p", top_p=0.5)]
    mixed = _tokens(tiny_lm, sampling, rows)
    assert (
        mixed["own seed"]
        == _tokens(tiny_lm, sampling, [RowSpec("own seed", seed_offset=2)], seed=11)["own seed"]
    )
    assert (
        mixed["own top-p"]
        == _tokens(tiny_lm, replace(sampling, top_p=0.5), [RowSpec("own top-p")])["own top-p"]
    )
    assert mixed["own seed"] != mixed["run's"]  # another seed draws other tokens (the test can fail)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("top_p", 0.0, "top_p must be > 0"),
        ("top_p", 1.5, "top_p must be between"),
        ("top_p", "0.5", "top_p must be a number"),
        ("seed", -1, "seed must be at least 0"),
        ("seed", 1.5, "seed must be a whole number"),
        ("seed", True, "seed must be a number"),
    ],
)
def test_a_bad_row_top_p_or_seed_is_refused_naming_the_row_and_field(field, value, message):
    cfg = RunConfig(prompt="hi", rows=[RowSpec("a"), RowSpec("b", **{field: value})])
    with pytest.raises(FeedbackError, match=f"row b: {message}"):
        cfg.validate()


@pytest.mark.parametrize(
    "temperature, message",
    [
        (-0.1, "must be between 0 and 10"),
        (10.5, "must be between 0 and 10"),
        (float("nan"), "must be finite"),
        (0.005, "must be 0 \\(greedy\\) or at least 0.01"),
        ("0.7", "must be a number"),
        (True, "must be a number"),
    ],
)
def test_a_bad_row_temperature_is_refused_naming_the_row_and_field(temperature, message):
    cfg = RunConfig(prompt="hi", rows=[RowSpec("a"), RowSpec("hot", temperature=temperature)])
    with pytest.raises(FeedbackError, match=f"^row hot: temperature {message}"):
        cfg.validate()


def test_a_row_temperature_is_saved_and_a_saved_run_without_it_loads():
    cfg = RunConfig(prompt="hi", rows=[RowSpec("a"), RowSpec("hot", temperature=0.7)])
    data = json.loads(json.dumps(cfg.to_dict()))
    assert [r["temperature"] for r in data["rows"]] == [None, 0.7]
    assert RunConfig.from_dict(data).rows[1].temperature == 0.7
    for row in data["rows"]:
        del row["temperature"]  # a run saved before rows had a temperature
    old = RunConfig.from_dict(data).validate()
    assert [r.temperature for r in old.rows] == [None, None]


def test_one_row_stopped_mid_run_ends_at_that_step_and_the_others_go_on(tiny_lm):
    rows = [RowSpec("a"), RowSpec("b", "residual", {"alpha": 0.2}), RowSpec("c", prompt=PROMPTS[1])]
    cfg = RunConfig(prompt=PROMPTS[0], model="tiny", max_new_tokens=12, rows=rows)
    whole = run_to_end(tiny_lm, cfg)
    run = start_run(tiny_lm, cfg)
    for event in run:
        if event.step == 3:
            run.stop_row(1)
    got = {r.name: r for r in run.result.rows}
    # asked after step 3 was shown, it ends with the step in flight: within one step of the click
    assert (got["b"].stop_reason, got["b"].stop_step, len(got["b"].token_ids)) == ("stopped", 4, 5)
    assert got["b"].token_ids == whole.rows[1].token_ids[:5]
    for i in (0, 2):  # the others run on exactly as they would have
        assert run.result.rows[i].token_ids == whole.rows[i].token_ids
        assert run.result.rows[i].stop_reason == whole.rows[i].stop_reason != "stopped"
    with pytest.raises(FeedbackError, match="row 5 is not in this run"):
        run.stop_row(5)
