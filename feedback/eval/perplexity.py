"""Teacher-forced perplexity, baseline vs a feedback strategy, on the same tokens.

Modes, each named in the output:
- `parallel`: one pass over the text; exact for the baseline and non-recurrent strategies.
- `exact`: token by token with the KV cache, so a recurrent strategy sees its own fed-back states
  exactly as in generation (slow: one forward per token).
- `jacobi`: P parallel passes, the first clean, each later one injecting what the previous pass
  computed; an approximation of a recurrent strategy (exact for the first P-1 positions of a
  window), reported as approximate with P.
Texts longer than the window are scored in sliding windows with a stride: every token is scored
once, with at least `window - stride` tokens of context after the first window. The baseline's
window is prefilled in chunks on a KV cache, bounding the memory its logits take.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from feedback.core.bounds import Bound
from feedback.core.budget import EXACT_COST, Budget, scoring_cost
from feedback.core.forward import window_nll_chunked, window_nll_exact, window_nll_parallel
from feedback.core.model import LoadedModel
from feedback.errors import FeedbackError, check_stop
from feedback.eval.corpus import Document, fingerprint
from feedback.strategies import PromptStrategy, build_strategy, get_strategy

MODES = ("exact", "parallel", "jacobi")
PASSES = Bound(
    "jacobi passes", 2, 32, integer=True
)  # the first pass is clean, so one alone feeds nothing back
MIN_WINDOW = 2  # tokens per scoring window: a scored token needs one before it
BOOTSTRAP = Bound("bootstrap resamples", 0, 100_000, integer=True)  # 0: no confidence interval
# Each document cut to its first N tokens (None: whole): a scored token needs one before it.
TOKENS_PER_DOC = Bound("max tokens per document", MIN_WINDOW, None, integer=True)
RATE_PROBE_TOKENS = 128  # the timed forward of `scoring_rate`: long enough that per-call overhead is small


@dataclass
class PPLConfig:
    strategy: str | None = None
    params: dict = field(default_factory=dict)
    mode: str | None = None  # None: parallel for non-recurrent strategies, jacobi for recurrent ones
    passes: int = 3  # jacobi passes, the first one clean
    window: int = 1024  # tokens per scoring window (capped by the model context)
    chunk: int = 512  # baseline prefill chunk (tokens per forward within a window)
    stride: int = 512  # new tokens scored per window after the first
    max_docs: int | None = None
    max_tokens_per_doc: int | None = None
    bootstrap: int = 2000  # resamples for the 95% CI (`BOOTSTRAP` bounds it)
    seed: int = 0

    def resolved_mode(self) -> str:
        if self.strategy is None:
            return "parallel"
        cls = get_strategy(self.strategy)
        if issubclass(cls, PromptStrategy):
            raise FeedbackError(
                f"{self.strategy} is a prompt-level strategy: it changes the prompt, not the model, so "
                "text perplexity does not apply; score a reference answer after it instead "
                "(`python -m feedback qa`, or a reference in Compare's Evaluation)"
            )
        mode = self.mode or ("jacobi" if cls.recurrent else "parallel")
        if mode not in MODES:
            raise FeedbackError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "parallel" and cls.recurrent:
            raise FeedbackError(
                f"{self.strategy} is recurrent, so one parallel pass is not exact: "
                f"use --mode exact or --mode jacobi"
            )
        if mode == "jacobi" and not PASSES.lo <= self.passes <= PASSES.hi:
            raise FeedbackError(f"{PASSES.name} must be in [{PASSES.lo}, {PASSES.hi}], got {self.passes}")
        return mode

    def validate(self, context: int, num_layers: int | None = None) -> PPLConfig:
        """Checked, the window capped by the model's `context`; with `num_layers` the strategy is
        built, so its parameters are refused now rather than once the scoring starts."""
        self.resolved_mode()
        if self.strategy and num_layers is not None:
            build_strategy(self.strategy, self.params, num_layers)
        if not MIN_WINDOW <= self.window:
            raise FeedbackError(f"window must be at least {MIN_WINDOW} tokens, got {self.window}")
        self.window = min(self.window, context)
        if not 1 <= self.stride <= self.window:
            raise FeedbackError(f"stride must be in [1, window={self.window}], got {self.stride}")
        if not 1 <= self.chunk:
            raise FeedbackError(f"chunk must be at least 1 token, got {self.chunk}")
        if not BOOTSTRAP.lo <= self.bootstrap <= BOOTSTRAP.hi:
            raise FeedbackError(
                f"{BOOTSTRAP.name} must be in [{BOOTSTRAP.lo}, {BOOTSTRAP.hi}], got {self.bootstrap}"
            )
        if self.max_tokens_per_doc is not None:  # 0 would otherwise read as "no limit" where it is cut
            TOKENS_PER_DOC.check(self.max_tokens_per_doc)
        return self


def windows(n: int, size: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored target) per window so that targets 1..n-1 are each scored once."""
    if n <= size:
        return [(0, n, 1)]
    out, start, scored = [], 0, 1
    while True:
        end = min(start + size, n)
        out.append((start, end, scored))
        if end == n:
            return out
        scored = end
        start = max(0, min(start + stride, n - size))
        start = min(start, scored - 1)


def token_nlls(
    lm: LoadedModel,
    ids: list[int],
    cfg: PPLConfig,
    baseline_cache: dict | None = None,
    stop: threading.Event | None = None,
    on_window: Callable[[int, int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-token NLL (targets 1..n-1) for the baseline and, when a strategy is set, the feedback.
    `baseline_cache` (keyed by the window's tokens) lets sweeps compute each baseline once; `stop`
    is checked before every forward (every token in exact mode). `on_window(tokens, forwards)`
    hears after each window how many targets it scored and the token-forwards that took (counted
    as `scoring_work` counts them; a cached baseline costs none)."""
    mode = cfg.resolved_mode()
    per_pass = pass_cost(mode if cfg.strategy else None, cfg.passes)
    ids_t = torch.tensor(ids, device=lm.device)
    base, fb = [], []
    for start, end, scored in windows(len(ids), cfg.window, cfg.stride):
        check_stop(stop, "the perplexity evaluation")
        w = ids_t[start:end]
        keep = slice(scored - start - 1, None)  # NLL index i is the target at start + i + 1
        key = (tuple(ids[start:end]), scored - start)
        forwards = (end - start) * per_pass
        if baseline_cache is not None and key in baseline_cache:
            base.append(baseline_cache[key])
        else:
            base.append(window_nll_chunked(lm, w, cfg.chunk, stop)[keep])
            forwards += end - start
            if baseline_cache is not None:
                baseline_cache[key] = base[-1]
        if cfg.strategy:
            strategy = build_strategy(cfg.strategy, cfg.params, lm.num_layers)
            if mode == "exact":
                fb.append(window_nll_exact(lm, w, strategy, stop)[keep])
            else:
                fb.append(
                    window_nll_parallel(lm, w, strategy, cfg.passes if mode == "jacobi" else 1, stop)[keep]
                )
        if on_window:
            on_window(end - scored, forwards)
    to_np = lambda parts: torch.cat(parts).double().cpu().numpy()  # noqa: E731
    return to_np(base), (to_np(fb) if fb else None)


def block_length(x: np.ndarray) -> int:
    """Block length for a moving-block bootstrap of the mean of a correlated series: Politis and
    White's (2004) automatic choice with the correction of Patton, Politis and White (2009). The
    flat-top lag window runs to twice the lag after which the autocorrelations stay insignificant;
    b = (2·G² / D)^(1/3) · n^(1/3), D = (4/3)·g(0)² for overlapping blocks. 1 for short or
    uncorrelated series, at most n // 3."""
    n = x.size
    if n < 8:
        return 1
    x = x - x.mean()
    kn = max(5, math.ceil(math.log10(n)))
    lags = min(n - 1, math.ceil(math.sqrt(n)) + kn)
    acov = np.array([x[: n - k] @ x[k:] / n for k in range(lags + 1)])
    if acov[0] <= 0:
        return 1
    rho, bound = acov / acov[0], 2.0 * math.sqrt(math.log10(n) / n)
    m = next((m for m in range(1, lags - kn + 2) if np.all(np.abs(rho[m : m + kn]) < bound)), lags - kn + 1)
    big_m = min(2 * m, lags)
    k = np.arange(1, big_m + 1)
    t = k / big_m
    weight = np.where(t <= 0.5, 1.0, 2.0 * (1.0 - t))  # flat-top window
    g0 = acov[0] + 2.0 * np.sum(weight * acov[1 : big_m + 1])
    g = 2.0 * np.sum(weight * k * acov[1 : big_m + 1])
    if g0 <= 0 or g == 0:
        return 1
    b = (2.0 * g * g / ((4.0 / 3.0) * g0 * g0)) ** (1 / 3) * n ** (1 / 3)
    return int(min(max(1, round(b)), n // 3))


def _block_sums(x: np.ndarray, block: int, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Sums of `resamples` moving-block resamples of x (blocks of `block` consecutive tokens at
    random starts, laid end to end and cut to len(x))."""
    n = x.size
    count = math.ceil(n / block)
    starts = rng.integers(0, n - block + 1, size=(resamples, count))
    index = (starts[:, :, None] + np.arange(block)).reshape(resamples, -1)[:, :n]
    return x[index].sum(axis=1)


def paired_bootstrap(diffs: list[np.ndarray], resamples: int, seed: int) -> tuple[float, float, str]:
    """95% CI of the mean per-token NLL difference, and how it was resampled. With at least 10
    documents, documents are resampled (tokens within a document are correlated). With fewer,
    each document's tokens are resampled in moving blocks (length chosen per document from its own
    autocorrelation), documents kept apart: token-by-token resampling would treat correlated
    neighbours as independent and give intervals that are too narrow. Either way the interval
    covers the variation of these texts' tokens; from fewer than 10 documents it says nothing
    about how other texts would fare."""
    rng = np.random.default_rng(seed)
    if resamples == 0:
        return math.nan, math.nan, "none"
    if len(diffs) >= 10:
        sums = np.array([d.sum() for d in diffs])
        counts = np.array([d.size for d in diffs])
        pick = rng.integers(0, len(diffs), size=(resamples, len(diffs)))
        means = sums[pick].sum(axis=1) / counts[pick].sum(axis=1)
        method = "documents"
    else:
        blocks = [block_length(d) for d in diffs]
        total = sum(_block_sums(d, b, resamples, rng) for d, b in zip(diffs, blocks) if d.size)
        means = total / sum(d.size for d in diffs)
        method = (
            f"token blocks of {max(blocks, default=1)}"
            + (" or fewer" if len(set(blocks)) > 1 else "")
            + " (moving-block bootstrap within each of fewer than 10 documents: these texts only)"
        )
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi), method


def scoring_convention(lm: LoadedModel, cfg: PPLConfig) -> dict:
    """How the tokens were scored, so another implementation can reproduce the numbers exactly:
    each document tokenised on its own with the tokenizer's default special tokens (whether that
    adds a BOS is measured, not assumed), its first token unscored (nothing to condition on), every
    later token scored once, in windows of `window` tokens advancing by `stride`."""
    probe = "a"
    added = len(lm.tokenizer(probe)["input_ids"]) - len(
        lm.tokenizer(probe, add_special_tokens=False)["input_ids"]
    )
    return {
        "bos_added": added > 0,
        "special_tokens": "tokenizer default",
        "first_token_scored": False,
        "window": cfg.window,
        "stride": cfg.stride,
        "min_context_after_first_window": cfg.window - cfg.stride,
        "nll": "natural log, mean over scored tokens; PPL = exp(mean NLL)",
    }


def document_ids(lm: LoadedModel, docs: list[Document], cfg: PPLConfig) -> list[list[int]]:
    """Each document's token ids as scored (the tokenizer's default special tokens, see
    `scoring_convention`; cut to `max_tokens_per_doc`)."""
    docs = docs[: cfg.max_docs] if cfg.max_docs else docs
    out = []
    for doc in docs:
        ids = lm.tokenizer(doc.text)["input_ids"]
        out.append(ids[: cfg.max_tokens_per_doc] if cfg.max_tokens_per_doc else ids)
    return out


# ---- what a corpus job will cost, and how far it has come ----
def pass_cost(mode: str | None, passes: int) -> int:
    """Token-forwards per window token of one feedback evaluation in `mode` (None: no feedback):
    1 parallel, `passes` for Jacobi, EXACT_COST token by token; as `scoring_cost` counts them."""
    return scoring_cost(1, mode, passes, 1) - 1


@dataclass(frozen=True)
class Estimate:
    """What scoring some documents will take, known before any forward: the tokens (after the
    document and per-document limits), the tokens fed to the model (overlapping windows feed some
    twice), and the token-forwards in all, `window_tokens x (1 + passes x points)`: the baseline
    once, then each feedback point. With `rate` (token-forwards per second measured on this
    model, `scoring_rate`) also the time."""

    documents: int  # documents scored (those of at least 2 tokens)
    tokens: int  # tokens scored per evaluation (a document's first token is context only)
    window_tokens: int  # tokens fed per pass over every window
    points: int  # feedback evaluations (sweep points, tune trials); 0: the baseline only
    passes: int  # token-forwards per window token of one feedback evaluation (`pass_cost`)
    mode: str | None  # the feedback's scoring mode; None: the baseline only
    forwards: int  # what the scoring budget counts
    how: str
    rate: float | None = None

    @property
    def seconds(self) -> float | None:
        return self.forwards / self.rate if self.rate else None

    def at(self, rate: float) -> Estimate:
        return dataclasses.replace(self, rate=rate)


def estimate(token_counts: list[int], cfg: PPLConfig, points: int = 1) -> Estimate:
    """The `Estimate` of scoring documents of these lengths (as `document_ids` cut them): the
    baseline once and the strategy at `points` settings, every window in full (`cfg` validated)."""
    scored = [n for n in token_counts if n >= 2]
    if not scored:  # refused with the cost, before the request waits
        raise FeedbackError("no document has at least 2 tokens")
    window_tokens = sum(end - start for n in scored for start, end, _ in windows(n, cfg.window, cfg.stride))
    mode = cfg.resolved_mode() if cfg.strategy else None
    points = points if mode else 0
    how = f"{window_tokens:,} window tokens, baseline" + (
        f" + {points} x {mode}"
        + (f" ({cfg.passes} passes)" if mode == "jacobi" else "")
        + (f" (x{EXACT_COST}: token by token)" if mode == "exact" else "")
        if mode
        else " only"
    )
    return Estimate(
        len(scored),
        sum(n - 1 for n in scored),
        window_tokens,
        points,
        pass_cost(mode, cfg.passes),
        mode,
        scoring_cost(window_tokens, mode, cfg.passes, points),
        how,
    )


def scoring_work(token_counts: list[int], cfg: PPLConfig, feedback_points: int = 1) -> tuple[int, str]:
    """(token-forwards, how) of scoring documents of these lengths, as a budget checks them
    (`estimate`)."""
    est = estimate(token_counts, cfg, feedback_points)
    return est.forwards, est.how


def fitting_docs(token_counts: list[int], cfg: PPLConfig, points: int, limit: int) -> int:
    """How many of these documents (the first ones) can be scored within `limit` token-forwards
    (0: not even the first): what a refusal over the budget offers instead."""
    fit = 0
    for k in range(1, len(token_counts) + 1):
        if any(n >= 2 for n in token_counts[:k]):
            if estimate(token_counts[:k], cfg, points).forwards > limit:
                break
            fit = k
    return fit


def fitting_cap(token_counts: list[int], cfg: PPLConfig, points: int, limit: int) -> int | None:
    """The largest per-document token limit at which these documents can be scored within
    `limit` token-forwards (None: not even MIN_WINDOW tokens each). The cost grows with the
    limit, so a bisection finds it in some 20 estimates, no forward."""

    def fits(cap: int) -> bool:
        return estimate([min(n, cap) for n in token_counts], cfg, points).forwards <= limit

    lo, hi = MIN_WINDOW, max(token_counts, default=0)
    if hi < MIN_WINDOW or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def seconds_left(forwards: int, done: int, elapsed: float, rate: float | None) -> float | None:
    """Seconds a job of `forwards` token-forwards has left with `done` of them done in `elapsed`
    seconds: at the pace so far once some work is done (it has the machine's load and the real
    windows in it), before that at the measured `rate`; None when neither is known."""
    pace = done / elapsed if done > 0 and elapsed > 0 else rate
    return max(0.0, forwards - done) / pace if pace else None


_RATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> token-forwards per second


def measured_rate(lm: LoadedModel) -> float | None:
    """This model's `scoring_rate` if it has been measured, else None (measuring needs the model)."""
    return _RATES.get(lm.model)


def scoring_rate(lm: LoadedModel, stop: threading.Event | None = None) -> float:
    """Token-forwards per second of a baseline scoring forward on this model, measured once per
    model (a short warm-up, then one timed window of RATE_PROBE_TOKENS tokens: well under a
    second on a small CPU model) and kept while the model lives: the clock of an `Estimate`."""
    rate = _RATES.get(lm.model)
    if rate is None:
        n = min(RATE_PROBE_TOKENS, lm.context_length)
        ids = torch.arange(n, device=lm.device)  # any ids time alike; these are in every vocabulary
        window_nll_chunked(lm, ids[:8], n, stop).sum().item()  # first-call costs stay out of the timing
        started = time.perf_counter()
        window_nll_chunked(lm, ids, n, stop).sum().item()  # .item(): waits for an accelerator to finish
        rate = _RATES[lm.model] = n / max(time.perf_counter() - started, 1e-6)
    return rate


@dataclass(frozen=True)
class ScoringProgress:
    """Where a corpus job stands, reported after every window scored (one to a few forwards:
    often enough to show movement within a point, rarely enough to cost nothing)."""

    document: int  # the document being scored, from 1, of `documents` in this evaluation
    documents: int
    tokens: int  # tokens scored so far in this evaluation, of `total`
    total: int
    forwards: int  # token-forwards done so far in the whole job (an `Estimate`'s unit)
    point: int = 1  # the evaluation under way (a sweep point, a tune trial), from 1, of `points`
    points: int = 1
    stage: str = ""  # what an evaluation is in this job: "point", "trial", "test"; "" for one alone


@dataclass
class Tally:
    """Counts a job's scoring as it goes and reports a `ScoringProgress` to `report` after every
    window. One tally runs through a whole job (a sweep's points, a tune's trials and its test),
    so token-forwards count from the job's start; the caller sets `point` (and `stage`) between
    evaluations, `begin` starts one."""

    report: Callable[[ScoringProgress], None]
    points: int = 1
    stage: str = ""
    point: int = 1
    forwards: int = 0
    document: int = 0
    documents: int = 0
    tokens: int = 0
    total: int = 0

    def begin(self, documents: int, total: int) -> None:
        self.documents, self.total, self.tokens, self.document = documents, total, 0, 0

    def window(self, tokens: int, forwards: int) -> None:
        self.tokens += tokens
        self.forwards += forwards
        self.report(
            ScoringProgress(
                self.document,
                self.documents,
                self.tokens,
                self.total,
                self.forwards,
                self.point,
                self.points,
                self.stage,
            )
        )


def evaluate(
    lm: LoadedModel,
    docs: list[Document],
    cfg: PPLConfig,
    progress: Callable[[int, int, str], None] | None = None,
    baseline_cache: dict | None = None,
    token_detail: bool = False,
    stop: threading.Event | None = None,
    budget: Budget | None = None,
    tally: Tally | None = None,
) -> dict:
    """Baseline and feedback perplexity over documents, with ΔPPL % and its paired 95% CI.
    With `token_detail`, each per-document entry also holds its tokens and both per-token NLLs.
    Setting `stop` ends the evaluation (raising `Stopped`) within one forward. With `budget`, a
    request that would score more than it allows is refused before any forward pass. `progress`
    hears of every document scored, `tally` of every window (progress within a document)."""
    cfg.validate(lm.context_length, lm.num_layers)
    mode = cfg.resolved_mode()
    if cfg.strategy:
        build_strategy(cfg.strategy, cfg.params, lm.num_layers)  # validate parameters before the work
    docs = docs[: cfg.max_docs] if cfg.max_docs else docs
    all_ids = document_ids(lm, docs, cfg)
    if budget is not None:
        budget.check_scoring(*scoring_work([len(ids) for ids in all_ids], cfg))
    started = time.perf_counter()
    if tally is not None:
        tally.begin(len(docs), sum(len(ids) - 1 for ids in all_ids if len(ids) >= 2))
    per_doc, base_all, fb_all = [], [], []
    for i, (doc, ids) in enumerate(zip(docs, all_ids)):
        if len(ids) < 2:
            continue
        if tally is not None:
            tally.document = i + 1
        base, fb = token_nlls(lm, ids, cfg, baseline_cache, stop, tally.window if tally is not None else None)
        entry = {"name": doc.name, "tokens": int(base.size), "baseline_ppl": float(np.exp(base.mean()))}
        if token_detail:
            # the first token has no prediction to score (no BOS is added); it is kept for display
            entry |= {
                "first_token_text": lm.tokenizer.decode([ids[0]]),
                "token_texts": [lm.tokenizer.decode([t]) for t in ids[1:]],
                "baseline_nll": base.tolist(),
            }
            if fb is not None:
                entry["feedback_nll"] = fb.tolist()
        if fb is not None:
            entry["feedback_ppl"] = float(np.exp(fb.mean()))
            entry["delta_pct"] = 100.0 * (entry["feedback_ppl"] / entry["baseline_ppl"] - 1.0)
            fb_all.append(fb)
        base_all.append(base)
        per_doc.append(entry)
        if progress:
            progress(i + 1, len(docs), doc.name)
    if not base_all:
        raise FeedbackError("no document has at least 2 tokens")
    base_cat = np.concatenate(base_all)
    strategy_values = build_strategy(cfg.strategy, cfg.params, lm.num_layers).values if cfg.strategy else {}
    result = {
        "model": lm.name,
        "dtype": lm.dtype,
        "precision": lm.precision,
        "config": asdict(cfg) | {"params": strategy_values},
        "mode": mode,
        "approximate": mode == "jacobi",
        "passes": cfg.passes if mode == "jacobi" else (1 if mode == "parallel" else None),
        "scoring": scoring_convention(lm, cfg),
        "corpus_fingerprint": fingerprint(docs),
        "documents": len(per_doc),
        "tokens": int(base_cat.size),
        "baseline_ppl": float(np.exp(base_cat.mean())),
        "per_doc": per_doc,
    }
    if fb_all:
        diffs = [f - b for f, b in zip(fb_all, base_all)]
        fb_cat = np.concatenate(fb_all)
        lo, hi, method = paired_bootstrap(diffs, cfg.bootstrap, cfg.seed)
        mean_diff = float(np.concatenate(diffs).mean())
        result |= {
            "feedback_ppl": float(np.exp(fb_cat.mean())),
            "delta_pct": 100.0 * math.expm1(mean_diff),
            "mean_nll_diff": mean_diff,
            # the CI of the mean NLL difference, mapped to ΔPPL %: exp(d) - 1
            "ci95": [100.0 * math.expm1(lo), 100.0 * math.expm1(hi)],
            "ci95_nll_diff": [lo, hi],
            "ci_method": method,
        }
    result["wall_seconds"] = time.perf_counter() - started
    return result


def surprise_diff(result: dict) -> dict:
    """Per-token detail of the first document of an `evaluate(..., token_detail=True)` result (the
    UI's surprise chart): tokens, both NLLs, and both perplexities."""
    doc = result["per_doc"][0]
    out = {
        "first_token": doc.get("first_token_text", ""),
        "tokens": doc["token_texts"],
        "baseline_nll": doc["baseline_nll"],
        "mode": result["mode"],
        "baseline_ppl": doc["baseline_ppl"],
    }
    if "feedback_nll" in doc:
        out |= {"feedback_nll": doc["feedback_nll"], "feedback_ppl": doc["feedback_ppl"]}
    return out
