"""Quality metrics per row of a run, beside DeepConf's confidence.

Cheap ones, from the tokens alone (always computed):
- `length` (tokens), `distinct_1` / `distinct_2` (unique unigrams / bigrams over all of them),
- `repeat_3gram_rate` (share of 3-grams that already occurred earlier in the answer),
- `longest_repeat` (tokens in the longest span that occurs twice),
- `key_fact_recall`, `key_facts_found` and `key_facts_total` when the run lists key facts (a plain
  text is found case-insensitively; one written /like this/ is a regular expression, every search
  time-limited, see `key_fact_metrics`).
Ones that take forward passes (`RunConfig.quality`):
- `self_ppl`: the row's answer scored teacher-forced by the plain model after the row's prompt;
- `prompt_ppl`: the row's prompt text (its newest user turn) scored by the plain model where it
  stands in the row's input (after the system prompt, earlier turns and the chat template's markers;
  without a template, the text alone with its first token unscored): how natural the wording reads
  to the model, the "normal vs strengthened prompt" comparison. The prefill already computes the
  model at those positions, so it scores them in the same forward (feedback/core/prefill_scores.py);
  a text the template rewrote, not found as typed, is scored on its own;
- `reference_ppl`: the run's reference answer scored after the row's prompt, with the row's
  strategy where one parallel pass scores it exactly (non-recurrent strategies), else by the plain
  model (`reference_ppl_with_strategy` says which).
"""

from __future__ import annotations

import math
import threading
import time

import torch

from feedback.core import patterns
from feedback.core.budget import PREFILL_CHUNK
from feedback.core.forward import window_nll_chunked, window_nll_parallel
from feedback.core.model import LoadedModel
from feedback.strategies import build_strategy, get_strategy

KEY_FACTS_TIMEOUT_S = 2 * patterns.MATCH_TIMEOUT_S  # every key-fact search of one run together


def distinct(ids: list[int], n: int) -> float | None:
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def repeat_rate(ids: list[int], n: int = 3) -> float | None:
    """Share of n-grams that already occurred earlier in the sequence."""
    seen, repeats, total = set(), 0, 0
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i : i + n])
        total += 1
        repeats += gram in seen
        seen.add(gram)
    return repeats / total if total else None


def longest_repeat(ids: list[int]) -> int:
    """Length of the longest span that occurs at least twice (occurrences may overlap)."""

    def repeats(length: int) -> bool:
        seen = set()
        for i in range(len(ids) - length + 1):
            gram = tuple(ids[i : i + length])
            if gram in seen:
                return True
            seen.add(gram)
        return False

    lo, hi = 0, max(0, len(ids) - 1)
    while lo < hi:  # the largest length with a repeat (having one at length L implies one at L-1)
        mid = (lo + hi + 1) // 2
        if repeats(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def key_fact_metrics(texts: list[str], facts: list[str], stop: threading.Event | None = None) -> list[dict]:
    """Each answer's key-fact recall, for a run's answers together (`texts`, one per row).

    Plain facts are found case-insensitively. /…/ facts are searched fact by fact over every
    answer, each search time-limited (`patterns.MATCH_TIMEOUT_S`) and all of them together limited to
    KEY_FACTS_TIMEOUT_S: a fact whose search runs out of time on any answer, or for which no time
    or no caller is left (`stop`), is judged on none of them, so every row's recall counts the
    same facts. Such facts are listed as `key_facts_unjudged` and left out of the recall."""
    if not facts:
        return [{} for _ in texts]
    found: list[list[str]] = [[] for _ in texts]
    unjudged: list[str] = []
    deadline = time.monotonic() + KEY_FACTS_TIMEOUT_S
    for n, fact in enumerate(facts, start=1):
        pattern = patterns.key_fact_pattern(fact, f"key fact {n}")
        hits: list[bool] = []
        for text in texts:
            if pattern is None:
                hits.append(fact.casefold() in text.casefold())
                continue
            left = deadline - time.monotonic()
            hit = (
                None
                if left <= 0 or (stop is not None and stop.is_set())
                else patterns.search(pattern, text, min(patterns.MATCH_TIMEOUT_S, left))
            )
            if hit is None:
                break
            hits.append(hit)
        if len(hits) < len(texts):
            unjudged.append(fact)
            continue
        for row, hit in zip(found, hits):
            if hit:
                row.append(fact)
    judged = len(facts) - len(unjudged)
    out = []
    for row in found:
        m = {
            "key_facts_found": row,
            "key_facts_total": len(facts),
            "key_fact_recall": len(row) / judged if judged else None,
        }
        if unjudged:
            m["key_facts_unjudged"] = list(unjudged)
        out.append(m)
    return out


def text_metrics(ids: list[int]) -> dict:
    """The cheap metrics of one answer's tokens."""
    return {
        "length": len(ids),
        "distinct_1": distinct(ids, 1),
        "distinct_2": distinct(ids, 2),
        "repeat_3gram_rate": repeat_rate(ids, 3),
        "longest_repeat": longest_repeat(ids),
    }


# Which way each comparable metric is better, so a view can mark the best column without knowing
# the metrics' meaning. Keys absent here (length, key_facts_found, …) are never ranked.
HIGHER_IS_BETTER: dict[str, bool] = {
    "distinct_1": True,
    "distinct_2": True,
    "key_fact_recall": True,
    "mean": True,
    "lowest_group": True,
    "repeat_3gram_rate": False,
    "longest_repeat": False,
    "self_ppl": False,
    "prompt_ppl": False,
    "reference_ppl": False,
}


def _rankable(value) -> bool:
    """A finite number (not a bool): only these take part in a comparison."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def best_rows(rows_metrics: list[dict]) -> dict[str, set[int]]:
    """For each ranked metric, the indexes of the rows holding its best value (ties: all of them).

    A metric counts only where at least two rows have a value and the values are not all equal:
    marking every column "best" would tell the reader nothing. Missing or None values are ignored."""
    best: dict[str, set[int]] = {}
    for key, higher in HIGHER_IS_BETTER.items():
        values = {i: m[key] for i, m in enumerate(rows_metrics) if _rankable(m.get(key))}
        if len(values) < 2 or len(set(values.values())) == 1:
            continue
        target = (max if higher else min)(values.values())
        best[key] = {i for i, v in values.items() if v == target}
    return best


def _ppl(nll: torch.Tensor) -> float | None:
    return float(math.exp(nll.double().mean().item())) if nll.numel() else None


def ppl_from_logprobs(logprobs: list[float]) -> float | None:
    """Perplexity from per-token log-probabilities (None for none)."""
    return math.exp(-math.fsum(logprobs) / len(logprobs)) if logprobs else None


@torch.inference_mode()
def sequence_nll(lm: LoadedModel, ids: list[int], stop: threading.Event | None = None) -> torch.Tensor:
    """Plain-model NLL of ids[1:] given what precedes each, prefilled in chunks on a KV cache;
    `stop` is looked at between chunks and between decoder layers (raising `Stopped`)."""
    return window_nll_chunked(lm, torch.tensor(ids, device=lm.device), PREFILL_CHUNK, stop)


def self_ppl(
    lm: LoadedModel, prompt_ids: list[int], answer_ids: list[int], stop: threading.Event | None = None
) -> float | None:
    """The answer's perplexity under the plain model after the row's full input."""
    if not answer_ids:
        return None
    return span_ppl(lm, prompt_ids + answer_ids, (len(prompt_ids), len(prompt_ids) + len(answer_ids)), stop)


def span_ppl(
    lm: LoadedModel, ids: list[int], span: tuple[int, int], stop: threading.Event | None = None
) -> float | None:
    """The perplexity of ids[span[0]:span[1]] after what precedes them (a first token at position 0
    is unscored), by the plain model."""
    nll = sequence_nll(lm, ids, stop)  # nll[i] scores token i + 1
    return _ppl(nll[max(span[0], 1) - 1 : span[1] - 1])


def text_ppl(lm: LoadedModel, text: str, stop: threading.Event | None = None) -> float | None:
    """A text's perplexity on its own under the plain model (None for a single token)."""
    ids = list(lm.tokenizer(text)["input_ids"])
    return _ppl(sequence_nll(lm, ids, stop)) if len(ids) >= 2 else None


def reference_ppl(
    lm: LoadedModel,
    prompt_ids: list[int],
    reference_ids: list[int],
    strategy: str | None,
    params: dict,
    stop: threading.Event | None = None,
) -> dict:
    """The reference answer's perplexity after this prompt, with the strategy when one parallel
    pass scores it exactly; `stop` ends the scoring within a chunk or a decoder layer."""
    if not reference_ids:
        return {"reference_ppl": None, "reference_ppl_with_strategy": False}
    ids = prompt_ids + reference_ids
    split = len(prompt_ids) - 1
    if strategy and not get_strategy(strategy).recurrent:
        values = dict(params)
        if "prompt_tokens" in {p.name for p in get_strategy(strategy).params}:
            values["prompt_tokens"] = max(2, len(prompt_ids))  # anchor: the real prompt is what it summarises
        built = build_strategy(strategy, values, lm.num_layers)
        nll = window_nll_parallel(lm, torch.tensor(ids, device=lm.device), built, 1, stop)
        return {"reference_ppl": _ppl(nll[split:]), "reference_ppl_with_strategy": True}
    return {
        "reference_ppl": _ppl(sequence_nll(lm, ids, stop)[split:]),
        "reference_ppl_with_strategy": strategy is None,
    }
