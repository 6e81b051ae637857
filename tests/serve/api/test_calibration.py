"""POST /calibrate's size when a request names none, costed by the function the server costs it with."""

from __future__ import annotations

import pytest

from feedback.core.budget import DEFAULT_DECODED_TOKENS, Budget
from feedback.errors import FeedbackError
from feedback.eval.calibration import decoded_tokens
from feedback.serve.api.calibration import config, prepare, questions_of
from feedback.serve.api.deps import ApiSettings
from feedback.serve.api.schemas import CalibrateIn
from feedback.serve.pool import ModelPool

# The README's /api/calibrate row: `{}` decodes at most this many tokens (an eighth of the default
# budget: 34 s on the 2-core dev CPU, where the library's own 8 x 64 takes the whole budget).
DEFAULT_REQUEST_TOKENS = 2_048


def test_a_request_that_names_no_size_decodes_at_most_the_stated_tokens():
    req = CalibrateIn()
    cost = decoded_tokens(len(questions_of(req)), config(req))
    assert cost <= DEFAULT_REQUEST_TOKENS <= DEFAULT_DECODED_TOKENS // 8


def test_the_server_costs_the_default_request_so(tiny_lm):
    """`prepare` (what the route runs before the request queues) admits `{}` on a budget of exactly
    `decoded_tokens` of it and refuses it on one fewer: that function is the server's own reckoning."""
    req, pool = CalibrateIn(), ModelPool.serving(tiny_lm)
    cost = decoded_tokens(len(questions_of(req)), config(req))
    prepare(req, pool, ApiSettings(budget=Budget(decoded_tokens=cost, memory_mb=None)))
    with pytest.raises(FeedbackError, match="FEEDBACK_BUDGET_DECODED_TOKENS"):
        prepare(req, pool, ApiSettings(budget=Budget(decoded_tokens=cost - 1, memory_mb=None)))
