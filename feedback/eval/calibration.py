"""Calibration: is the model's confidence worth trusting?

On a question set with gold answers, every question is sampled `samples` times per row — the
baseline and one strategy, as Deep Think's two sides, trace i of both sides sharing a seed — in one
engine run per question, every trace run to its end (no early stop: a stopped trace has no answer
to judge). Each trace is judged right or wrong as Deep Think and `qa` judge answers
(`voting.extract_answer`, `voting.answer_matches`), and carries the four DeepConf measures the engine
records for it (`core.confidence.trace_metrics`): mean confidence, tail confidence (mean of the last
`window` tokens), bottom-10 % group confidence, lowest group confidence. Then, per row and measure:

- AUROC: the probability that a right trace has a higher measure than a wrong one (0.5: no signal,
  1: the measure ranks every right trace above every wrong one). Ranks only, so it needs no mapping.
- The measures are not probabilities (they are −mean top-k log p, about 1 to 20), so each is mapped to
  [0, 1] by Platt scaling, p = σ(a·x + b) — temperature scaling (a = 1/T) with a bias, which a
  measure needs since its zero is arbitrary — fitted on the dev split of the questions (positions 0,
  2, 4, …) and scored on the test split (positions 1, 3, 5, …): ECE (equal-width bins: Σ n_b/N ·
  |accuracy_b − mean p_b|), adaptive ECE (the same over equal-mass bins), the Brier score (mean of
  (p − y)²) beside the Brier score of predicting the dev accuracy for every trace (a measure worth
  having beats it), and the reliability diagram's data (per bin: count, mean p, accuracy).
- How sure each test figure is: a 95% CI for the AUROC (a score interval on Hanley & McNeil's
  variance, `auroc_interval`) and for the ECE (a percentile bootstrap over the test traces with a
  fixed seed, `ece_interval`); none, and "too few traces to judge" with the count, from fewer than
  `MIN_JUDGED_TRACES` test traces or fewer than `MIN_PER_CLASS` right or wrong ones (`too_few`).
- `uncalibrated_minmax_ece`, labelled as such: ECE of the raw measure min–max scaled to [0, 1] over
  the dev traces' range. Not a probability; it shows how far off the raw scale is.
- The early-stop threshold of `voting.calibrate_threshold` for each η on the dev traces' lowest group
  confidences: pooled over the dev questions (one threshold for the row), with the share of traces
  it keeps and their accuracy against all traces' on dev and on test; and per dev question, as Deep
  Think calibrates from each question's own warm-up traces.

`from_deep_think` reads the same numbers from one Deep Think run's own traces (warm-up traces as dev,
the online traces that were not stopped as test), so the page needs no extra model work.

The maths is plain numpy, small functions, each tested against hand-computed values.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from feedback.core.bounds import Bound
from feedback.core.budget import Budget, dtype_bytes, generation_memory_mb
from feedback.core.engine import start_run
from feedback.core.model import LoadedModel
from feedback.core.records import (
    DEEPCONF_K,
    DEEPCONF_WINDOW,
    MAX_NEW_TOKENS_CAP,
    MAX_PROMPT_CHARS,
    MAX_ROWS,
    SEED,
    DeepConfConfig,
    RowResult,
    RowSpec,
    RunConfig,
    answer_text,
)
from feedback.core.sampling import SamplingConfig
from feedback.errors import FeedbackError, Stopped, check_stop
from feedback.eval.deepthink import SIDES, load_questions
from feedback.eval.qa import BUILTIN_QUESTIONS
from feedback.eval.voting import (
    answer_matches,
    calibrate_threshold,
    check_eta,
    compile_answer_regex,
    extract_answer,
)
from feedback.strategies import build_strategy

MEASURES = {
    "mean": "mean confidence (all tokens)",
    "tail": "tail confidence (mean of the last window of tokens)",
    "bottom10_group": "bottom-10% group confidence (mean of the lowest 10% of window means)",
    "lowest_group": "lowest group confidence (the lowest window mean; Deep Think's early-stop measure)",
}
# The fewest test traces a measure is judged by (an interval given): below this, or with fewer right
# or wrong traces than MIN_PER_CLASS, "too few traces to judge". 10, not more: the page's Deep Think
# has at most 16 online traces per side, and the intervals themselves show how little 10-20 say.
MIN_JUDGED_TRACES = 10
MIN_PER_CLASS = 2
Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval
ECE_RESAMPLES, ECE_SEED = 1000, 0
METRICS = {
    "auroc": "AUROC of the raw measure for correctness: the chance a right trace scores higher than a "
    "wrong one (0.5 = no signal, 1 = perfect ranking)",
    "auroc_ci95": "95% CI of the AUROC: a score interval on Hanley & McNeil's variance (every AUROC whose "
    "±1.96 standard errors reach the estimate); null when too_few",
    "ece": "expected calibration error of the Platt-scaled confidence on test, equal-width bins: "
    "Σ (bin share) × |bin accuracy − bin mean confidence| (0 = calibrated)",
    "ece_ci95": "95% CI of the ECE: percentile bootstrap over the test traces (Platt fit fixed; "
    f"{ECE_RESAMPLES} resamples, seed {ECE_SEED}), widened to hold the ECE itself; null when too_few",
    "too_few": f"why the test traces are too few to judge the measure by (fewer than {MIN_JUDGED_TRACES}, or "
    f"fewer than {MIN_PER_CLASS} right or {MIN_PER_CLASS} wrong ones), with the count; null when enough",
    "adaptive_ece": "the same over equal-mass bins (each bin holds as many traces)",
    "brier": "Brier score of the Platt-scaled confidence on test: mean (p − right)² (lower is better)",
    "brier_base_rate": "Brier score of predicting the dev accuracy for every test trace: a measure worth "
    "having has a lower Brier score than this",
    "uncalibrated_minmax_ece": "ECE of the raw measure min–max scaled to [0, 1] over the dev range: not a "
    "probability, uncalibrated; for comparison only",
}
DEFAULT_BINS = 10
BINS = Bound("bins", 2, 100, integer=True)
MAX_SAMPLES = MAX_ROWS // 2  # both rows' samples of a question decode in one engine run
SAMPLES = Bound("samples per question", 1, MAX_SAMPLES, integer=True)
MIN_QUESTIONS = 2  # one for dev, one for test
SPLIT_RULE = "dev: questions at even positions (0, 2, 4, ...); test: odd positions (1, 3, 5, ...)"


# ---------------------------------------------------------------- the maths (numpy, no fitting library)


def _labels(y) -> np.ndarray:
    y = np.asarray(y, dtype=float).reshape(-1)
    if not np.all((y == 0) | (y == 1)):
        raise FeedbackError("correctness labels must be 0/1 (or False/True)")
    return y


def _scores(x, y) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, dtype=float).reshape(-1)
    y = _labels(y)
    if x.shape != y.shape:
        raise FeedbackError(f"{len(x)} scores but {len(y)} labels")
    if not np.all(np.isfinite(x)):
        raise FeedbackError("scores must be finite numbers")
    return x, y


def _probabilities(p, y) -> tuple[np.ndarray, np.ndarray]:
    p, y = _scores(p, y)
    if np.any((p < 0) | (p > 1)):
        raise FeedbackError("probabilities must lie in [0, 1]")
    return p, y


def _bin(p: np.ndarray, y: np.ndarray, lo: float, hi: float) -> dict:
    n = len(p)
    return {
        "lo": lo,
        "hi": hi,
        "count": n,
        "confidence": float(p.mean()) if n else None,
        "accuracy": float(y.mean()) if n else None,
    }


def reliability_bins(p, y, bins: int = DEFAULT_BINS) -> list[dict]:
    """The reliability diagram's data over `bins` equal-width bins of [0, 1]: bin i holds
    i/bins <= p < (i+1)/bins (the last one also p = 1), with its count, mean confidence and accuracy
    (None for an empty bin)."""
    p, y = _probabilities(p, y)
    bins = BINS.check(bins)
    index = np.minimum(np.floor(p * bins).astype(int), bins - 1)
    return [_bin(p[index == i], y[index == i], i / bins, (i + 1) / bins) for i in range(bins)]


def equal_mass_bins(p, y, bins: int = DEFAULT_BINS) -> list[dict]:
    """Bins of (nearly) equal counts: the traces sorted by p (stable, so ties keep their order) and cut
    into min(bins, n) runs whose sizes differ by at most one; each bin's lo/hi are its smallest and
    largest p."""
    p, y = _probabilities(p, y)
    bins = BINS.check(bins)
    if len(p) == 0:
        return []
    order = np.argsort(p, kind="stable")
    return [
        _bin(p[g], y[g], float(p[g].min()), float(p[g].max()))
        for g in np.array_split(order, min(bins, len(p)))
    ]


def _gap(table: list[dict]) -> float | None:
    total = sum(b["count"] for b in table)
    if not total:
        return None
    return float(sum(b["count"] / total * abs(b["accuracy"] - b["confidence"]) for b in table if b["count"]))


def ece(p, y, bins: int = DEFAULT_BINS) -> float | None:
    """Expected calibration error over equal-width bins: Σ_b (n_b / n) |accuracy_b − mean p_b|; None
    without traces."""
    return _gap(reliability_bins(p, y, bins))


def adaptive_ece(p, y, bins: int = DEFAULT_BINS) -> float | None:
    """Expected calibration error over equal-mass bins (`equal_mass_bins`); None without traces."""
    return _gap(equal_mass_bins(p, y, bins))


def brier(p, y) -> float | None:
    """Mean squared error of the probabilities against the 0/1 outcomes; None without traces."""
    p, y = _probabilities(p, y)
    return float(np.mean((p - y) ** 2)) if len(p) else None


def average_ranks(x) -> np.ndarray:
    """1-based ranks of x, ties sharing the mean of the ranks they span ([5, 1, 5] -> [2.5, 1, 2.5])."""
    x = np.asarray(x, dtype=float).reshape(-1)
    order = np.argsort(x, kind="stable")
    _, start, counts = np.unique(x[order], return_index=True, return_counts=True)
    ranks = np.empty(len(x))
    ranks[order] = np.repeat(start + (counts + 1) / 2.0, counts)
    return ranks


def auroc(scores, y) -> float | None:
    """Area under the ROC curve of `scores` for the positives of `y` (Mann–Whitney U over both
    classes' sizes; a tie counts one half). None when either class is empty."""
    x, y = _scores(scores, y)
    pos = y == 1
    n1, n0 = int(pos.sum()), int((~pos).sum())
    if n1 == 0 or n0 == 0:
        return None
    return float((average_ranks(x)[pos].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def too_few(y) -> str | None:
    """Why these test traces' correctness labels are too few to judge a measure by ("too few traces
    to judge: 6 test traces ..."), or None when there are at least MIN_JUDGED_TRACES with at least
    MIN_PER_CLASS right and as many wrong ones."""
    y = _labels(y)
    n, right = len(y), int(y.sum())
    if n < MIN_JUDGED_TRACES:
        return (
            f"too few traces to judge: {n} test trace{'s' if n != 1 else ''} "
            f"(at least {MIN_JUDGED_TRACES} needed)"
        )
    if min(right, n - right) < MIN_PER_CLASS:
        return (
            f"too few traces to judge: {n} test traces, {right} right and {n - right} wrong (at least "
            f"{MIN_PER_CLASS} of each needed)"
        )
    return None


def _auroc_variance(a: np.ndarray, n1: int, n0: int) -> np.ndarray:
    """Hanley & McNeil's (1982) variance of an AUROC `a` from n1 right and n0 wrong traces,
    [a(1-a) + (n1-1)(Q1-a²) + (n0-1)(Q2-a²)] / (n1 n0) with Q1 = a/(2-a), Q2 = 2a²/(1+a), written
    so that it holds at a = 0 and 1 too."""
    return a * (1 - a) / (n1 * n0) * (1 + (n1 - 1) * (1 - a) / (2 - a) + (n0 - 1) * a / (1 + a))


def auroc_interval(scores, y) -> tuple[float, float] | None:
    """95% CI of `auroc(scores, y)`: every AUROC A in [0, 1] whose Hanley–McNeil interval
    A ± 1.96·SE(A) reaches the estimate (a score interval, as Wilson's for a proportion: unlike
    estimate ± 1.96·SE(estimate) it does not shrink to a point at a perfect 0 or 1). Found on a grid
    of step 1e-4 and widened to hold the estimate. None when `too_few`."""
    x, y = _scores(scores, y)
    if too_few(y):
        return None
    est = auroc(x, y)
    n1 = int(y.sum())
    grid = np.linspace(0.0, 1.0, 10_001)
    inside = grid[(grid - est) ** 2 <= Z95**2 * _auroc_variance(grid, n1, len(y) - n1)]
    lo, hi = (inside.min(), inside.max()) if inside.size else (est, est)
    return float(min(lo, est)), float(max(hi, est))


def ece_interval(
    p, y, bins: int = DEFAULT_BINS, resamples: int = ECE_RESAMPLES, seed: int = ECE_SEED
) -> tuple[float, float] | None:
    """95% CI of `ece(p, y, bins)`: the 2.5th and 97.5th percentiles of the ECE over `resamples`
    bootstrap resamples of the traces (with a fixed seed, so a report is reproducible), widened to
    hold the ECE itself (a resample's ECE is biased up, so the percentiles can sit above a small
    one). None when `too_few`."""
    p, y = _probabilities(p, y)
    bins = BINS.check(bins)
    if too_few(y):
        return None
    n = len(p)
    picks = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    index = np.minimum(np.floor(p * bins).astype(int), bins - 1)
    # ECE = Σ_b |Σ_{i in b} (y_i - p_i)| / n: one weighted count per (resample, bin)
    cell = (np.arange(resamples)[:, None] * bins + index[picks]).ravel()
    gaps = np.bincount(cell, weights=(y - p)[picks].ravel(), minlength=resamples * bins).reshape(
        resamples, bins
    )
    lo, hi = np.percentile(np.abs(gaps).sum(axis=1) / n, [2.5, 97.5])
    est = ece(p, y, bins)
    return float(min(lo, est)), float(max(hi, est))


def _pair(interval: tuple[float, float] | None) -> list[float] | None:
    return None if interval is None else list(interval)


def sigmoid(z) -> np.ndarray:
    """1 / (1 + e^−z) without overflow for large |z|."""
    z = np.asarray(z, dtype=float)
    out = np.empty_like(z)
    pos = z >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-z[pos]))
    e = np.exp(z[~pos])
    out[~pos] = e / (1.0 + e)
    return out


@dataclass(frozen=True)
class Platt:
    """p = σ(a·x + b): a measure x mapped to a probability of being right."""

    a: float
    b: float

    def __call__(self, x) -> np.ndarray:
        return sigmoid(self.a * np.asarray(x, dtype=float) + self.b)


def platt_targets(y) -> np.ndarray:
    """Platt's (1999) smoothed targets: (n₊ + 1)/(n₊ + 2) for a right trace, 1/(n₋ + 2) for a wrong
    one, so a fit on few traces, or on a dev split the measure separates, stays finite."""
    y = _labels(y)
    n1, n0 = y.sum(), len(y) - y.sum()
    return np.where(y == 1, (n1 + 1) / (n1 + 2), 1 / (n0 + 2))


def _cross_entropy(s: np.ndarray, t: np.ndarray) -> float:
    return float(np.sum(np.logaddexp(0.0, s) - t * s))


def fit_platt(x, y, smooth: bool = True, max_iter: int = 100, tol: float = 1e-10) -> Platt:
    """Logistic regression of the 0/1 outcomes `y` on one measure `x` by Newton's method (on x
    standardised, with step halving), against Platt's smoothed targets unless `smooth` is off.
    A constant measure gets a = 0 and b the log-odds of the (smoothed) accuracy."""
    x, y = _scores(x, y)
    if len(x) == 0:
        raise FeedbackError("Platt scaling needs at least one trace")
    t = platt_targets(y) if smooth else y
    mu, sd = float(x.mean()), float(x.std())
    if not sd > 1e-12 * max(1.0, abs(mu)):
        rate = min(max(float(t.mean()), 1e-12), 1 - 1e-12)
        return Platt(0.0, math.log(rate / (1 - rate)))
    design = np.column_stack([(x - mu) / sd, np.ones_like(x)])
    w = np.zeros(2)
    loss = _cross_entropy(design @ w, t)
    for _ in range(max_iter):
        p = sigmoid(design @ w)
        grad = design.T @ (p - t)
        hess = design.T @ (design * (p * (1 - p))[:, None]) + 1e-12 * len(x) * np.eye(2)
        step = np.linalg.solve(hess, grad)
        scale = 1.0
        while scale > 1e-8:
            trial = _cross_entropy(design @ (w - scale * step), t)
            if trial <= loss:
                break
            scale /= 2
        else:
            break  # no step lowers the loss: at the optimum to machine precision
        w, loss = w - scale * step, trial
        if np.max(np.abs(scale * step)) < tol:
            break
    c, d = w
    return Platt(float(c / sd), float(d - c * mu / sd))


def minmax_scale(x, lo: float, hi: float) -> np.ndarray:
    """x mapped linearly so lo -> 0 and hi -> 1, clipped to [0, 1] (0.5 everywhere when hi == lo).
    Not a probability: for the labelled, uncalibrated comparison only."""
    x = np.asarray(x, dtype=float)
    if not hi > lo:
        return np.full_like(x, 0.5)
    return np.clip((x - lo) / (hi - lo), 0.0, 1.0)


def kept_by_threshold(lowest, correct, threshold: float) -> dict:
    """What an early-stop threshold keeps of these traces: a trace whose lowest group confidence is
    below it would have been stopped (and never votes). Accuracy of the traces kept vs all."""
    x, y = _scores(lowest, correct)
    kept = x >= threshold
    n, k = len(x), int(kept.sum())
    return {
        "traces": n,
        "kept": k,
        "kept_share": k / n if n else None,
        "accuracy_all": float(y.mean()) if n else None,
        "accuracy_kept": float(y[kept].mean()) if k else None,
    }


# ---------------------------------------------------------------- per row: every number of the report


def _values(traces: list[dict], measure: str) -> tuple[np.ndarray, np.ndarray]:
    """A measure and the correctness of the traces that have it (an empty trace has none)."""
    have = [t for t in traces if t.get(measure) is not None and math.isfinite(t[measure])]
    return (
        np.array([t[measure] for t in have], dtype=float),
        np.array([bool(t["correct"]) for t in have], dtype=float),
    )


def _accuracy(traces: list[dict]) -> float | None:
    return sum(bool(t["correct"]) for t in traces) / len(traces) if traces else None


def measure_report(dev_x, dev_y, test_x, test_y, bins: int = DEFAULT_BINS) -> dict:
    """One measure of one row: Platt fitted on dev; AUROC on both splits; on test the calibrated
    ECE, adaptive ECE, Brier score (and the base rate's), the reliability bins, and the labelled
    uncalibrated min–max ECE; the AUROC's and ECE's 95% CIs, or `too_few`'s reason. Numbers that
    cannot be had (an empty split, one class, too few traces for an interval) are None."""
    dev_x, dev_y = _scores(dev_x, dev_y)
    test_x, test_y = _scores(test_x, test_y)
    platt = fit_platt(dev_x, dev_y) if len(dev_x) else None
    dev_accuracy = float(dev_y.mean()) if len(dev_y) else None
    test = {
        "traces": len(test_x),
        "accuracy": float(test_y.mean()) if len(test_y) else None,
        "auroc": auroc(test_x, test_y),
        "auroc_ci95": _pair(auroc_interval(test_x, test_y)),
        "too_few": too_few(test_y),
        "ece": None,
        "ece_ci95": None,
        "adaptive_ece": None,
        "brier": None,
        "brier_base_rate": None,
        "reliability": [],
        "uncalibrated_minmax_ece": None,
    }
    if platt is not None and len(test_x):
        p = platt(test_x)
        test |= {
            "ece": ece(p, test_y, bins),
            "ece_ci95": _pair(ece_interval(p, test_y, bins)),
            "adaptive_ece": adaptive_ece(p, test_y, bins),
            "brier": brier(p, test_y),
            "brier_base_rate": brier(np.full(len(test_y), dev_accuracy), test_y),
            "reliability": reliability_bins(p, test_y, bins),
            "uncalibrated_minmax_ece": ece(minmax_scale(test_x, dev_x.min(), dev_x.max()), test_y, bins),
        }
    return {
        "platt": None if platt is None else {"a": platt.a, "b": platt.b},
        "dev": {"traces": len(dev_x), "accuracy": dev_accuracy, "auroc": auroc(dev_x, dev_y)},
        "test": test,
    }


def threshold_report(dev: list[dict], test: list[dict], eta: float, threshold: float | None = None) -> dict:
    """The early-stop threshold for η from the dev traces' lowest group confidences (pooled), unless
    given: what it keeps on dev and on test; and per dev question, each with its own threshold."""
    check_eta(eta)
    dev_x, dev_y = _values(dev, "lowest_group")
    test_x, test_y = _values(test, "lowest_group")
    if threshold is None:
        threshold = calibrate_threshold(list(dev_x), eta) if len(dev_x) else None
    out = {"eta": eta, "threshold": threshold, "dev": None, "test": None, "per_question_dev": None}
    if threshold is None:
        return out
    out["dev"] = kept_by_threshold(dev_x, dev_y, threshold)
    out["test"] = kept_by_threshold(test_x, test_y, threshold)
    kept = right = total = right_all = 0
    for q in sorted({t.get("question", 0) for t in dev}):
        x, y = _values([t for t in dev if t.get("question", 0) == q], "lowest_group")
        if len(x):
            mask = x >= calibrate_threshold(list(x), eta)
            kept, right = kept + int(mask.sum()), right + int(y[mask].sum())
            total, right_all = total + len(x), right_all + int(y.sum())
    if total:
        out["per_question_dev"] = {
            "traces": total,
            "kept": kept,
            "kept_share": kept / total,
            "accuracy_all": right_all / total,
            "accuracy_kept": right / kept if kept else None,
        }
    return out


def side_too_few(side: dict) -> str | None:
    """A row's (one side of `summarise`) reason its test traces cannot judge its measures, from the
    first measure that has one (they differ only where a trace lacks a measure), or None."""
    return next((m["test"]["too_few"] for m in side["measures"].values() if m["test"]["too_few"]), None)


def summarise(
    traces: list[dict],
    etas: Sequence[float],
    bins: int = DEFAULT_BINS,
    thresholds: dict[str, float] | None = None,
) -> dict:
    """Per side: traces and accuracy per split, every measure's `measure_report`, and each η's
    `threshold_report`. `traces`: dicts with side, split ("dev"/"test"), question, correct and the
    measures. `thresholds`: a side's threshold to report instead of calibrating one (used for
    every η given)."""
    out = {}
    for side in dict.fromkeys(t["side"] for t in traces):
        dev = [t for t in traces if t["side"] == side and t["split"] == "dev"]
        test = [t for t in traces if t["side"] == side and t["split"] == "test"]
        measures = {}
        for m in MEASURES:
            dx, dy = _values(dev, m)
            tx, ty = _values(test, m)
            measures[m] = measure_report(dx, dy, tx, ty, bins)
        given = (thresholds or {}).get(side)
        out[side] = {
            "traces": {"dev": len(dev), "test": len(test)},
            "accuracy": {"dev": _accuracy(dev), "test": _accuracy(test)},
            "measures": measures,
            "thresholds": [threshold_report(dev, test, eta, given) for eta in etas],
        }
    return out


# ---------------------------------------------------------------- sampling traces through the engine


@dataclass
class CalibrationConfig:
    strategy: str = "residual"
    params: dict = field(default_factory=dict)
    samples: int = 8  # sampled traces per question per row
    max_new_tokens: int = 64
    temperature: float = 0.7
    top_p: float = 0.95
    seed: int = 0
    window: int = 16  # DeepConf group window: short answers need a short one, or every measure is the mean
    k: int = 20
    etas: list[float] = field(
        default_factory=lambda: [10.0, 90.0]
    )  # η: share of traces an early stop keeps, %
    bins: int = DEFAULT_BINS
    answer_regex: str | None = None
    chat_template: bool = True

    def validate(self, num_layers: int) -> list[str]:
        """Raise on bad values (naming the field); return warnings."""
        SAMPLES.check(self.samples)
        BINS.check(self.bins)
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_CAP:
            raise FeedbackError(
                f"max_new_tokens must be an integer in [1, {MAX_NEW_TOKENS_CAP}], got {self.max_new_tokens!r}"
            )
        SEED.check(self.seed)
        DEEPCONF_K.check(self.k)
        DEEPCONF_WINDOW.check(self.window)
        SamplingConfig(temperature=self.temperature, top_p=self.top_p).validate()
        if not self.etas:
            raise FeedbackError("give at least one eta")
        for eta in self.etas:
            check_eta(eta)
        compile_answer_regex(self.answer_regex)
        build_strategy(self.strategy, self.params, num_layers)
        warnings = []
        if self.window > self.max_new_tokens:
            warnings.append(
                f"window {self.window} > max_new_tokens {self.max_new_tokens}: every trace is shorter "
                "than the window, so its lowest and bottom-10% group confidences are its mean"
            )
        if self.temperature == 0 and self.samples > 1:
            warnings.append("temperature 0 is greedy: every sample of a question is the same trace")
        return warnings


def builtin_questions() -> Path:
    """The built-in question set (16, with gold answers): `qa.BUILTIN_QUESTIONS`."""
    return BUILTIN_QUESTIONS


def read_questions(source: str | Path | None) -> list[dict]:
    """`builtin` (or None): the built-in set; else a JSONL file of {"question", "answer"}."""
    return load_questions(builtin_questions() if source in (None, "builtin") else source)


def check_questions(questions: list[dict]) -> list[dict]:
    if not isinstance(questions, list) or len(questions) < MIN_QUESTIONS:
        raise FeedbackError(
            f"calibration needs at least {MIN_QUESTIONS} questions (one dev, one test), "
            f"got {len(questions) if isinstance(questions, list) else questions!r}"
        )
    for n, q in enumerate(questions, start=1):
        if not isinstance(q, dict) or not isinstance(q.get("question"), str) or not q["question"].strip():
            raise FeedbackError(f"question {n} needs a non-empty 'question' text")
        if len(q["question"]) > MAX_PROMPT_CHARS:
            raise FeedbackError(f"question {n} is limited to {MAX_PROMPT_CHARS} characters")
        if q.get("answer") is None or not str(q["answer"]).strip():
            raise FeedbackError(f"question {n} needs a gold 'answer'")
    return questions


def split_of(index: int) -> str:
    return "dev" if index % 2 == 0 else "test"


def prompt_tokens(lm: LoadedModel, questions: list[dict], cfg: CalibrationConfig) -> int:
    """The longest question's prompt tokens; refused, naming the question, when one would not fit the
    model's context with `max_new_tokens` after it."""
    longest = 0
    for n, q in enumerate(questions, start=1):
        size = len(lm.encode(q["question"], cfg.chat_template))
        if size + cfg.max_new_tokens > lm.context_length:
            raise FeedbackError(
                f"question {n} is {size} tokens; with max_new_tokens={cfg.max_new_tokens} it "
                f"exceeds the model context of {lm.context_length} tokens"
            )
        longest = max(longest, size)
    return longest


def decoded_tokens(questions: int, cfg: CalibrationConfig) -> int:
    """The most a calibration of `questions` questions decodes: every trace to max_new_tokens (the
    decoded-token budget's measure)."""
    return questions * len(SIDES) * cfg.samples * cfg.max_new_tokens


def check_budget(lm: LoadedModel, questions: list[dict], cfg: CalibrationConfig, budget: Budget) -> None:
    """Refuse, before any work, a calibration the budget does not allow: every trace's tokens, and
    the memory of one question's run (both rows' samples at once, the longest question)."""
    rows = len(SIDES) * cfg.samples
    budget.check_decoding(
        decoded_tokens(len(questions), cfg),
        f"{len(questions)} questions x {len(SIDES)} rows x {cfg.samples} samples x "
        f"{cfg.max_new_tokens} new tokens",
    )
    prompt = prompt_tokens(lm, questions, cfg)
    budget.check_memory(
        generation_memory_mb(lm.model.config, dtype_bytes(lm.dtype), rows, prompt, cfg.max_new_tokens),
        f"{rows} traces at once, {prompt} prompt + {cfg.max_new_tokens} new tokens",
    )


def _rows(cfg: CalibrationConfig) -> list[RowSpec]:
    """Both rows' samples; sample i of each row shares a seed (common random numbers)."""
    return [
        RowSpec(
            f"{side}-{i}",
            cfg.strategy if side == "feedback" else None,
            dict(cfg.params) if side == "feedback" else {},
            seed_offset=i,
        )
        for side in SIDES
        for i in range(cfg.samples)
    ]


def sample_question(
    lm: LoadedModel, question: str, cfg: CalibrationConfig, stop: threading.Event | None = None
) -> list[RowResult]:
    """One engine run: `samples` traces of the question per row, run to their end."""
    run_cfg = RunConfig(
        prompt=question,
        model=lm.name,
        chat_template=cfg.chat_template,
        max_new_tokens=cfg.max_new_tokens,
        seed=cfg.seed,
        sampling=SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p),
        deepconf=DeepConfConfig(cfg.k, cfg.window, None),
        rows=_rows(cfg),
    )
    run = start_run(lm, run_cfg, stop_event=stop)
    for _ in run:
        pass
    if stop is not None and stop.is_set():
        raise Stopped("the calibration was stopped")
    return run.result.rows


def judge(row: RowResult, index: int, question: dict, pattern=None) -> dict:
    """One trace as calibration sees it: its answer judged against the gold one, and its measures."""
    answer = extract_answer(answer_text(row), pattern, question["question"])
    side, _, sample = row.name.rpartition("-")
    m = row.metrics
    return {
        "question": index,
        "split": split_of(index),
        "side": side,
        "sample": int(sample),
        "answer": answer,
        "gold": str(question["answer"]),
        "correct": bool(answer_matches(answer, str(question["answer"]))),
        "tokens": len(row.token_ids),
        "stop_reason": row.stop_reason,
        **{k: m.get(k) for k in MEASURES},
        "text": row.text,
    }


def calibrate(
    lm: LoadedModel,
    questions: list[dict],
    cfg: CalibrationConfig,
    progress: Callable[[int, int, str], None] | None = None,
    stop: threading.Event | None = None,
    budget: Budget | None = None,
) -> dict:
    """Sample, judge and summarise (see the module's docstring); a JSON-serialisable report with every
    trace. `progress(done, total, question)` hears of each question; setting `stop` ends the work
    within a decode step (raising `Stopped`); with `budget`, a job it does not allow is refused first."""
    warnings = cfg.validate(lm.num_layers)
    check_questions(questions)
    if budget is not None:
        check_budget(lm, questions, cfg, budget)
    else:
        prompt_tokens(lm, questions, cfg)  # every question fits the context: refused now, not half way
    pattern = compile_answer_regex(cfg.answer_regex)
    started, traces = time.perf_counter(), []
    for i, q in enumerate(questions):
        check_stop(stop, "the calibration")
        traces += [judge(row, i, q, pattern) for row in sample_question(lm, q["question"], cfg, stop)]
        if progress:
            progress(i + 1, len(questions), q["question"])
    return {
        "config": asdict(cfg),
        "model": lm.name,
        "dtype": lm.dtype,
        "warnings": warnings,
        "questions": len(questions),
        "split": {"rule": SPLIT_RULE, "dev": len(questions[::2]), "test": len(questions[1::2])},
        "measures": MEASURES,
        "metrics": METRICS,
        "sides": summarise(traces, cfg.etas, cfg.bins),
        "traces": traces,
        "wall_seconds": time.perf_counter() - started,
    }


def from_deep_think(report: dict, bins: int = DEFAULT_BINS) -> dict | None:
    """The same numbers from one Deep Think report's own traces, when it had an expected answer (else
    None): its warm-up traces are dev (Platt fit; the threshold is the run's own), its online traces
    that were not stopped are test (a stopped trace has no finished answer)."""
    expected = (report.get("config") or {}).get("expected")
    if expected is None or not str(expected).strip():
        return None
    traces, skipped = [], {}
    for side in SIDES:
        skipped[side] = 0
        for t in report["sides"][side]["traces"]:
            if t["phase"] != "warmup" and t["stopped"]:
                skipped[side] += 1
                continue
            traces.append(
                {
                    "side": side,
                    "question": 0,
                    "split": "dev" if t["phase"] == "warmup" else "test",
                    "correct": bool(t["correct"]),
                    **{k: t.get(k) for k in MEASURES},
                }
            )
    eta = report["config"]["eta"]
    return {
        "expected": expected,
        "eta": eta,
        "stopped_left_out": skipped,
        "measures": MEASURES,
        "metrics": METRICS,
        "sides": summarise(traces, [eta], bins, thresholds=report.get("thresholds")),
    }
