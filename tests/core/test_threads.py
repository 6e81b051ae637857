"""Decode steps at the thread count measured fastest for them, every other forward at all threads."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from feedback.core import linear, threads
from feedback.errors import FeedbackError


@pytest.fixture
def two_threads():
    """torch at 2 threads for the test (pytest-xdist workers run at 1), as it was afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_setting_is_a_count_or_auto(monkeypatch):
    for raw, want in (("", None), ("auto", None), (" AUTO ", None), ("3", 3)):
        monkeypatch.setenv(threads.ENV, raw)
        assert threads.setting() == want
    for raw in ("0", "-1", "two"):
        monkeypatch.setenv(threads.ENV, raw)
        with pytest.raises(FeedbackError, match="FEEDBACK_DECODE_THREADS must be a positive whole number"):
            threads.setting()


def test_decoding_switches_for_decode_steps_only_and_restores(two_threads):
    with threads.decoding(1, threads.DECODE_TOKENS):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with threads.decoding(1, threads.DECODE_TOKENS + 1):  # a prefill: all threads
        assert torch.get_num_threads() == 2
    with threads.decoding(None, 1):
        assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), threads.decoding(1, 1):
        raise RuntimeError("a failed forward")
    assert torch.get_num_threads() == 2


def test_the_count_is_measured_once_per_machine_and_model_and_a_given_one_wins(
    tiny_lm, tmp_path, monkeypatch, two_threads
):
    monkeypatch.setenv("FEEDBACK_CACHE", str(tmp_path))
    monkeypatch.delenv(threads.ENV, raising=False)
    calls = []
    monkeypatch.setattr(threads, "measure", lambda model: calls.append(1) or {1: 0.03, 2: 0.02})
    assert threads.chosen(tiny_lm.model) == 2 and threads.chosen(tiny_lm.model) == 2 and calls == [1]
    known = json.loads(linear.cache_file("threads-").read_text())
    assert known[threads.fingerprint(tiny_lm.model)] == {"threads": 2, "seconds": {"1": 0.03, "2": 0.02}}
    monkeypatch.setenv(threads.ENV, "1")
    assert threads.chosen(tiny_lm.model) == 1
    monkeypatch.delenv(threads.ENV)
    torch.set_num_threads(1)
    assert threads.chosen(tiny_lm.model) is None  # one thread anyway: nothing to choose


def test_measure_times_a_real_decode_step_at_each_count(tiny_lm, two_threads):
    seconds = threads.measure(tiny_lm.model)
    assert set(seconds) == {1, 2} and all(0 < s < 1 for s in seconds.values())
    assert torch.get_num_threads() == 2


def test_the_engine_decodes_at_the_decode_threads_and_prefills_at_all(tiny_lm, two_threads):
    from feedback.core.engine import run_to_end
    from feedback.core.records import RowSpec, RunConfig

    lm = dataclasses.replace(tiny_lm, decode_threads=1)
    seen = []
    handle = lm.layers[0].register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    try:
        run_to_end(
            lm,
            RunConfig(
                prompt="one two three " * 10,
                model=lm.name,
                max_new_tokens=4,
                rows=[RowSpec("b")],
                chat_template=False,
            ),
        )
    finally:
        handle.remove()
    assert seen[0] == 2 and seen[1:] == [1, 1, 1]  # the prefill, then three decode steps
    assert torch.get_num_threads() == 2
