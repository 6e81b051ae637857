"""soft_token: in generation the prompt's prefill runs clean and its last distribution feeds the first
decoded token; validation messages."""

from __future__ import annotations

import pytest
import torch

from feedback.core.engine import run_to_end
from feedback.core.records import RowSpec, RunConfig
from feedback.errors import FeedbackError
from feedback.strategies import get_strategy


def test_the_prefill_runs_clean_and_feeds_the_first_decoded_token(tiny_lm):
    seen = []
    cfg = RunConfig(
        prompt="one two three four five",
        model="tiny",
        max_new_tokens=4,
        rows=[RowSpec("b"), RowSpec("f", "soft_token", {"beta": 0.5})],
    )
    run_to_end(tiny_lm, cfg, observer=lambda s, live, lg: seen.append(lg.clone()))
    assert torch.equal(seen[0][0], seen[0][1])  # the first token's logits come from the clean prefill
    assert not torch.equal(seen[1][0], seen[1][1])  # the next input already carries the feedback


@pytest.mark.parametrize(
    "params, message",
    [
        ({"top_k": 0}, "top_k=0 is out of range"),
        ({"tau": 0}, "tau=0.0 is out of range"),
    ],
)
def test_soft_token_validation_messages(params, message):
    with pytest.raises(FeedbackError, match=message):
        get_strategy("soft_token")(params, 30)
