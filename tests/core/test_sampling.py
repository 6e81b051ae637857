"""Sampling settings: every value the schema allows either decodes or is refused with a message;
no setting may overflow into inf/nan (1e-38 once did)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feedback.core.engine import run_to_end
from feedback.core.records import RowSpec, RunConfig
from feedback.core.sampling import MIN_TEMPERATURE, Sampler, SamplingConfig
from feedback.errors import FeedbackError


@pytest.mark.parametrize("temperature", [1e-38, 1e-10, 0.009])
def test_temperatures_below_the_floor_are_refused(temperature):
    with pytest.raises(FeedbackError, match=f"0 \\(greedy\\) or at least {MIN_TEMPERATURE:g}"):
        SamplingConfig(temperature=temperature).validate()
    SamplingConfig(temperature=0.0).validate()
    SamplingConfig(temperature=MIN_TEMPERATURE).validate()


tiny_or_edge = st.one_of(
    st.floats(min_value=0, max_value=1e-6),
    st.sampled_from([0.0, 1e-38, 5e-324, 1.0]),
    st.floats(min_value=0, max_value=1),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    temperature=st.one_of(tiny_or_edge, st.floats(min_value=0, max_value=10)),
    top_p=tiny_or_edge,
    min_p=tiny_or_edge,
    top_k=st.integers(0, 100_000),
    repetition_penalty=st.one_of(st.just(0.01), st.floats(min_value=0.01, max_value=10)),
)
def test_any_sampling_setting_decodes_or_is_refused(
    tiny_lm, temperature, top_p, min_p, top_k, repetition_penalty
):
    sampling = SamplingConfig(temperature, top_k, top_p, min_p, repetition_penalty)
    cfg = RunConfig(
        prompt="Name a colour.",
        model="tiny",
        max_new_tokens=3,
        sampling=sampling,
        rows=[RowSpec("baseline"), RowSpec("fb", "residual", {"alpha": 0.2})],
    )
    try:
        result = run_to_end(tiny_lm, cfg)
    except FeedbackError:
        return  # refused with a message: fine
    for row in result.rows:
        assert row.token_ids and all(math.isfinite(s.logprob) and 0 <= s.prob <= 1 for s in row.steps)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shared=st.sampled_from([0.0, 0.7]), row=st.one_of(tiny_or_edge, st.floats(min_value=0, max_value=10)))
def test_any_row_temperature_decodes_or_is_refused(tiny_lm, shared, row):
    cfg = RunConfig(
        prompt="Name a colour.",
        model="tiny",
        max_new_tokens=3,
        sampling=SamplingConfig(shared, 20),
        rows=[RowSpec("baseline"), RowSpec("own", "residual", {"alpha": 0.2}, temperature=row)],
    )
    try:
        result = run_to_end(tiny_lm, cfg)
    except FeedbackError as exc:
        assert str(exc).startswith("row own: temperature")
        return
    for r in result.rows:
        assert r.token_ids and all(math.isfinite(s.logprob) and 0 <= s.prob <= 1 for s in r.steps)


CPU = torch.device("cpu")


def test_a_greedy_run_without_row_temperatures_is_a_plain_argmax():
    sampler = Sampler(SamplingConfig(), [0, 1], CPU, [SamplingConfig(), SamplingConfig()])
    assert sampler.generators == [] and not sampler.edits_logits  # no draws, no copy of the logits
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sampler(None, logits), logits.argmax(dim=-1))


def test_each_row_draws_at_its_own_temperature_with_its_own_generator():
    cfg = SamplingConfig(temperature=0.8, top_k=10, repetition_penalty=1.2)
    mixed = Sampler(
        cfg,
        [5, 6, 7],
        CPU,
        [
            cfg,
            SamplingConfig(0.0, 10, repetition_penalty=1.2),
            SamplingConfig(1.5, 10, repetition_penalty=1.2),
        ],
    )
    alone = [
        Sampler(cfg, [5], CPU),
        Sampler(SamplingConfig(0.0, 10, repetition_penalty=1.2), [6], CPU),
        Sampler(SamplingConfig(1.5, 10, repetition_penalty=1.2), [7], CPU),
    ]
    gen = torch.Generator().manual_seed(2)
    history = torch.randint(0, 100, (3, 4), generator=gen)
    draws = []
    for _ in range(12):
        logits = torch.randn(3, 100, generator=gen)
        got = mixed(history, logits.clone())
        want = [s(history[i : i + 1], logits[i : i + 1].clone()) for i, s in enumerate(alone)]
        assert got.tolist() == torch.cat(want).tolist()
        draws.append(got.tolist())
    assert len({d[0] for d in draws}) > 1 and len({d[2] for d in draws}) > 1  # the sampled rows really draw


def test_rows_with_their_own_top_p_draw_as_they_would_alone():
    cfg = SamplingConfig(temperature=1.0)
    tight, loose = SamplingConfig(1.0, top_p=0.3), SamplingConfig(1.0, top_p=1.0)
    mixed = Sampler(cfg, [3, 3], CPU, [tight, loose])
    alone = [Sampler(tight, [3], CPU), Sampler(loose, [3], CPU)]
    gen = torch.Generator().manual_seed(4)
    kept = set()
    for _ in range(20):
        logits = torch.randn(2, 60, generator=gen)
        got = mixed(None, logits.clone())
        assert got.tolist() == [alone[i](None, logits[i : i + 1].clone()).item() for i in range(2)]
        kept.add(got[0].item() in logits[0].topk(8).indices.tolist())
    assert kept == {True}  # top-p 0.3 of a flat-ish distribution keeps only its head
