"""anchor: in teacher-forced perplexity a window's first `prompt_tokens` tokens are its prompt and
are not pushed; validation messages."""

from __future__ import annotations

import numpy as np
import pytest

from feedback.errors import FeedbackError
from feedback.eval.perplexity import PPLConfig, token_nlls
from feedback.strategies import get_strategy

TEXT = "Rivers carry water from mountains to the sea, and the sea returns it as rain over the mountains."


def test_a_window_s_prompt_tokens_are_summarised_not_pushed(tiny_lm):
    ids = tiny_lm.tokenizer(TEXT)["input_ids"]
    k = 6
    base, fb = token_nlls(
        tiny_lm, ids, PPLConfig("anchor", {"alpha": 0.5, "prompt_tokens": k}, mode="parallel")
    )
    # NLL i is predicted at position i: positions 0..k-1 are the prompt, unchanged; every later one moves
    assert np.max(np.abs(fb[:k] - base[:k])) <= 1e-5
    assert np.all(np.abs(fb[k:] - base[k:]) > 1e-6)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"source_layer": 99}, "source_layer=99 is out of range"),
    ],
)
def test_anchor_validation_messages(params, message):
    with pytest.raises(FeedbackError, match=message):
        get_strategy("anchor")(params, 30)
