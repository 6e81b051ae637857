"""Sampling settings: every value the schema allows either decodes or is refused with a message;
no setting may overflow into inf/nan (1e-38 once did)."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feedback.core.engine import Engine
from feedback.core.records import RowSpec, RunConfig
from feedback.core.sampling import MIN_TEMPERATURE, SamplingConfig
from feedback.errors import FeedbackError


@pytest.mark.parametrize("temperature", [1e-38, 1e-10, 0.009])
def test_temperatures_below_the_floor_are_refused(temperature):
    with pytest.raises(FeedbackError, match=f"0 \\(greedy\\) or at least {MIN_TEMPERATURE:g}"):
        SamplingConfig(temperature=temperature).validate()
    SamplingConfig(temperature=0.0).validate()
    SamplingConfig(temperature=MIN_TEMPERATURE).validate()


tiny_or_edge = st.one_of(st.floats(min_value=0, max_value=1e-6), st.sampled_from([0.0, 1e-38, 5e-324, 1.0]),
                         st.floats(min_value=0, max_value=1))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(temperature=st.one_of(tiny_or_edge, st.floats(min_value=0, max_value=10)), top_p=tiny_or_edge,
       min_p=tiny_or_edge, top_k=st.integers(0, 100_000),
       repetition_penalty=st.one_of(st.just(0.01), st.floats(min_value=0.01, max_value=10)))
def test_any_sampling_setting_decodes_or_is_refused(tiny_lm, temperature, top_p, min_p, top_k, repetition_penalty):
    sampling = SamplingConfig(temperature, top_k, top_p, min_p, repetition_penalty)
    cfg = RunConfig(prompt="Name a colour.", model="tiny", max_new_tokens=3, sampling=sampling,
                    rows=[RowSpec("baseline"), RowSpec("fb", "residual", {"alpha": 0.2})])
    try:
        result = Engine(tiny_lm).run(cfg)
    except FeedbackError:
        return  # refused with a message: fine
    for row in result.rows:
        assert row.token_ids and all(math.isfinite(s.logprob) and 0 <= s.prob <= 1 for s in row.steps)
