"""DeepConf metrics (feedback/core/confidence.py) against brute-force formulas written out here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feedback.core.confidence import (
    DEFAULT_WINDOW,
    GroupWindow,
    distribution_stats,
    group_means,
    trace_metrics,
)

FAST = settings(max_examples=120, deadline=None)


# ---------------------------------------------------------------- brute force references


def bf_log_softmax(row: list[float]) -> list[float]:
    """log-softmax in float64, plain python."""
    m = max(row)
    lse = m + math.log(math.fsum(math.exp(x - m) for x in row))
    return [x - lse for x in row]


def bf_confidence(row: list[float], k: int) -> float:
    lp = sorted(bf_log_softmax(row), reverse=True)[:k]
    return -math.fsum(lp) / len(lp)


def bf_entropy(row: list[float]) -> float:
    return -math.fsum(math.exp(x) * x for x in bf_log_softmax(row))


def bf_mean(xs) -> float:
    return math.fsum(xs) / len(xs)


def bf_windows(confs: list[float], w: int) -> list[float]:
    if not confs:
        return []
    if len(confs) < w:
        return [bf_mean(confs)]
    return [bf_mean(confs[i : i + w]) for i in range(len(confs) - w + 1)]


# ---------------------------------------------------------------- strategies

logit = st.floats(min_value=-30.0, max_value=30.0, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def logit_batches(draw, unique: bool = False):
    vocab = draw(st.integers(min_value=1, max_value=48))
    batch = draw(st.integers(min_value=1, max_value=3))
    rows = []
    for _ in range(batch):
        if unique:
            # distinct values 0.1 apart: the descending order is unambiguous, also in fp32
            ints = draw(st.lists(st.integers(-300, 300), min_size=vocab, max_size=vocab, unique=True))
            rows.append([i / 10 for i in ints])
        else:
            rows.append(draw(st.lists(logit, min_size=vocab, max_size=vocab)))
    return rows


sizes = st.integers(min_value=1, max_value=64)


# ---------------------------------------------------------------- distribution_stats


@FAST
@given(rows=logit_batches(), k=sizes, n_top=sizes)
def test_distribution_stats_matches_brute_force(rows, k, n_top):
    logits = torch.tensor(rows, dtype=torch.float32)
    vocab = logits.shape[1]
    stats = distribution_stats(logits, k=k, n_top=n_top)
    width = min(max(k, n_top), vocab)

    assert stats.logprobs.dtype == torch.float32 and stats.logprobs.shape == logits.shape
    assert stats.confidence.shape == (len(rows),)
    assert stats.entropy.shape == (len(rows),)
    assert stats.top_logprobs.shape == (len(rows), width)
    assert stats.top_ids.shape == (len(rows), width)

    for b, row in enumerate(rows):
        ref_lp = bf_log_softmax(row)
        np.testing.assert_allclose(stats.logprobs[b].double().numpy(), ref_lp, atol=2e-5, rtol=1e-5)
        assert stats.confidence[b].item() == pytest.approx(bf_confidence(row, k), abs=2e-5, rel=1e-5)
        assert stats.entropy[b].item() == pytest.approx(bf_entropy(row), abs=2e-5, rel=1e-5)

        top = stats.top_logprobs[b].tolist()
        ids = stats.top_ids[b].tolist()
        assert top == sorted(top, reverse=True)
        np.testing.assert_allclose(top, sorted(ref_lp, reverse=True)[:width], atol=2e-5, rtol=1e-5)
        # each id really is the token with that log-prob, and no token is listed twice
        assert len(set(ids)) == len(ids)
        assert all(0 <= i < vocab for i in ids)
        assert [stats.logprobs[b, i].item() for i in ids] == top


@FAST
@given(rows=logit_batches(unique=True), k=sizes, n_top=sizes)
def test_top_ids_match_brute_force_sort(rows, k, n_top):
    stats = distribution_stats(torch.tensor(rows, dtype=torch.float32), k=k, n_top=n_top)
    for b, row in enumerate(rows):
        width = min(max(k, n_top), len(row))
        expected = sorted(range(len(row)), key=lambda i: -row[i])[:width]
        assert stats.top_ids[b].tolist() == expected


@pytest.mark.parametrize("k,n_top", [(20, 5), (3, 10), (7, 7), (1, 1), (500, 2)])
def test_k_and_n_top_independent(k, n_top):
    torch.manual_seed(1)
    logits = torch.randn(2, 100) * 3
    stats = distribution_stats(logits, k=k, n_top=n_top)
    assert stats.top_ids.shape[1] == min(max(k, n_top), 100)
    for b in range(2):
        row = logits[b].double().tolist()
        assert stats.confidence[b].item() == pytest.approx(bf_confidence(row, k), abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@FAST
@given(rows=logit_batches(), k=sizes)
def test_low_precision_input_is_upcast(dtype, rows, k):
    low = torch.tensor(rows, dtype=torch.float32).to(dtype)
    stats = distribution_stats(low, k=k, n_top=3)
    for name in ("logprobs", "confidence", "entropy", "top_logprobs"):
        assert getattr(stats, name).dtype == torch.float32, name
    # the reference sees exactly the (rounded) low-precision values, computed in float64
    for b, row in enumerate(low.double().tolist()):
        assert stats.confidence[b].item() == pytest.approx(bf_confidence(row, k), abs=2e-5, rel=1e-5)
        assert stats.entropy[b].item() == pytest.approx(bf_entropy(row), abs=2e-5, rel=1e-5)


@pytest.mark.parametrize("vocab", [1, 2, 7, 100, 49152])
def test_uniform_distribution_gives_log_vocab(vocab):
    stats = distribution_stats(torch.zeros(1, vocab), k=20, n_top=5)
    assert stats.confidence.item() == pytest.approx(math.log(vocab), rel=1e-6, abs=1e-6)
    assert stats.entropy.item() == pytest.approx(math.log(vocab), rel=1e-5, abs=1e-6)


def test_peaked_distribution_is_more_confident_than_uniform():
    vocab = 1000
    uniform = torch.zeros(vocab)
    peaked = torch.zeros(vocab)
    peaked[123] = 25.0
    stats = distribution_stats(torch.stack([uniform, peaked]), k=20, n_top=5)
    c_uniform, c_peaked = stats.confidence.tolist()
    h_uniform, h_peaked = stats.entropy.tolist()
    assert c_peaked > c_uniform + 10
    assert h_peaked < 1e-3 < h_uniform
    assert stats.top_ids[1, 0].item() == 123
    assert stats.top_logprobs[1, 0].item() == pytest.approx(0.0, abs=1e-6)


def test_masked_logits_do_not_produce_nan_entropy():
    logits = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]])
    stats = distribution_stats(logits, k=2, n_top=2)
    assert stats.entropy.item() == pytest.approx(math.log(2))
    assert stats.confidence.item() == pytest.approx(math.log(2))


# ---------------------------------------------------------------- GroupWindow

confs = st.lists(st.floats(min_value=0.0, max_value=50.0, allow_nan=False), max_size=80)


@FAST
@given(
    values=confs,
    window=st.integers(min_value=1, max_value=12),
    threshold=st.floats(min_value=0.0, max_value=50.0, allow_nan=False),
)
def test_group_window_matches_brute_force(values, window, threshold):
    gw = GroupWindow(window)
    assert not gw.full
    assert math.isnan(gw.value)
    assert not gw.should_stop(threshold) and not gw.should_stop(None)
    for i, v in enumerate(values, start=1):
        got = gw.push(v)
        expected = bf_mean(values[max(0, i - window) : i])
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-9)
        assert gw.value == pytest.approx(expected, rel=1e-9, abs=1e-9)
        assert gw.full == (i >= window)
        assert gw.should_stop(None) is False
        if abs(expected - threshold) > 1e-7:  # away from float ties, the rule is exact
            assert gw.should_stop(threshold) == (i >= window and expected < threshold)


def test_group_window_full_flips_exactly_at_window():
    gw = GroupWindow(3)
    states = []
    for v in [10.0, 10.0, 10.0, 10.0]:
        gw.push(v)
        states.append(gw.full)
    assert states == [False, False, True, True]


def test_group_window_stop_rule_hand_case():
    gw = GroupWindow(2)
    gw.push(1.0)
    assert not gw.should_stop(5.0)  # mean 1 < 5 but the window is not full yet
    gw.push(2.0)
    assert gw.should_stop(5.0)  # full, mean 1.5
    assert not gw.should_stop(1.5)  # strict inequality
    assert not gw.should_stop(None)
    gw.push(9.0)  # window [2, 9] -> 5.5
    assert gw.value == 5.5
    assert not gw.should_stop(5.5)
    assert gw.should_stop(5.6)


@pytest.mark.parametrize("window", [0, -1, -32])
def test_group_window_rejects_small_window(window):
    with pytest.raises(ValueError):
        GroupWindow(window)


def test_group_window_default():
    assert GroupWindow().window == DEFAULT_WINDOW == 32


# ---------------------------------------------------------------- group_means


@FAST
@given(values=confs, window=st.integers(min_value=1, max_value=12))
def test_group_means_matches_brute_force(values, window):
    got = group_means(values, window)
    expected = bf_windows(values, window)
    assert len(got) == len(expected)
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9)


def test_group_means_edge_cases():
    assert group_means([], 4) == []
    assert group_means([1.0, 2.0, 6.0], 4) == [3.0]
    assert group_means([1.0, 2.0, 6.0], 3) == [3.0]
    assert group_means([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.5, 2.5, 3.5, 4.5]
    assert group_means([4.0, 8.0], 1) == [4.0, 8.0]


# ---------------------------------------------------------------- trace_metrics


@FAST
@given(
    values=confs.filter(bool),
    window=st.integers(min_value=1, max_value=12),
    tail=st.one_of(st.none(), st.integers(min_value=1, max_value=20)),
)
def test_trace_metrics_matches_brute_force(values, window, tail):
    m = trace_metrics(values, window=window, tail_tokens=tail)
    windows = bf_windows(values, window)
    keep = max(1, int(0.1 * len(windows)))
    tail_n = tail if tail is not None else window
    assert m.tokens == len(values)
    assert m.mean == pytest.approx(bf_mean(values), rel=1e-9, abs=1e-9)
    assert m.tail == pytest.approx(bf_mean(values[-tail_n:]), rel=1e-9, abs=1e-9)
    assert m.lowest_group == pytest.approx(min(windows), rel=1e-9, abs=1e-9)
    assert m.bottom10_group == pytest.approx(bf_mean(sorted(windows)[:keep]), rel=1e-9, abs=1e-9)
    assert m.lowest_group <= m.bottom10_group + 1e-9
    d = m.to_dict()
    assert set(d) == {"mean", "tail", "bottom10_group", "lowest_group", "tokens"}
    assert None not in d.values()


def test_trace_metrics_hand_case():
    m = trace_metrics([1.0, 2.0, 3.0, 4.0, 5.0], window=2)
    assert m.mean == 3.0
    assert m.lowest_group == 1.5
    assert m.bottom10_group == 1.5  # 4 windows -> keep max(1, int(0.4)) = 1
    assert m.tail == 4.5  # last `window` = 2 tokens
    assert m.tokens == 5
    assert trace_metrics([1.0, 2.0, 3.0, 4.0, 5.0], window=2, tail_tokens=3).tail == 4.0


def test_trace_metrics_bottom10_keeps_two_of_twenty_windows():
    values = [float(x) for x in range(21, 0, -1)]  # 21 tokens, window 2 -> 20 windows 20.5 .. 1.5
    m = trace_metrics(values, window=2)
    assert m.lowest_group == 1.5
    assert m.bottom10_group == 2.0  # mean of the two lowest windows (1.5, 2.5)
    assert m.tail == 1.5


def test_trace_metrics_uses_lowest_windows_not_first():
    m = trace_metrics([5.0, 5.0, 5.0, 1.0, 1.0], window=2)  # windows 5, 5, 3, 1
    assert m.lowest_group == 1.0
    assert m.bottom10_group == 1.0
    assert m.mean == 3.4


def test_trace_metrics_short_trace_uses_mean_of_all():
    m = trace_metrics([3.0, 5.0], window=32)
    assert (m.mean, m.tail, m.bottom10_group, m.lowest_group, m.tokens) == (4.0, 4.0, 4.0, 4.0, 2)


def test_trace_metrics_default_window_is_tail_length():
    values = [0.0] * 10 + [2.0] * DEFAULT_WINDOW
    assert trace_metrics(values).tail == 2.0


def test_trace_metrics_empty_trace():
    m = trace_metrics([], window=4)
    assert m.tokens == 0
    for name in ("mean", "tail", "bottom10_group", "lowest_group"):
        assert math.isnan(getattr(m, name)), name
    assert m.to_dict() == {
        "mean": None,
        "tail": None,
        "bottom10_group": None,
        "lowest_group": None,
        "tokens": 0,
    }
