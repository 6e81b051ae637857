"""The quality metrics a run's prefill already pays for.

- Prompt perplexity scores a row's prompt text where it stands in the row's input (after the system
  prompt, earlier turns and the chat template's markers). The prefill forward computes the plain
  model's state at every prompt position anyway: asking the output head for the positions before the
  prompt text's tokens scores the prompt in the forward that already ran, instead of a second pass.
- Self-perplexity of a feedback row is its answer read by the plain model after its prompt. The plain
  prompt's keys and values are kept from the prefill (one copy per prompt, only where a feedback row
  needs it), so the answer alone is read after them, not the whole prompt again.

Only prefill sequences the plain model computed count ("plain groups"): a row whose strategy edits the
prompt's own states prefills on its own, and is scored from a plain sequence with the same tokens
when the run has one (the baseline beside it, usually), else by a separate pass.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch

from feedback.core.budget import PREFILL_CHUNK
from feedback.core.forward import continuation_nll, nll_of
from feedback.core.kvcache import cache_from, row_kv
from feedback.core.model import LoadedModel

Span = tuple[int, int]  # [start, end) token positions of a row's prompt ids


@dataclass
class PrefillScores:
    """What the prefill scores and keeps for the quality metrics, per prefill sequence (group)."""

    lengths: list[int]  # every group's prompt length; the prefill left-pads to the longest
    spans: dict[int, Span] = field(default_factory=dict)  # plain group -> tokens whose NLL is wanted
    keep_cache: set[int] = field(default_factory=set)  # plain groups a feedback row's self-PPL reads after
    nll: dict[int, torch.Tensor] = field(default_factory=dict)  # group -> NLL of each token (NaN: not scored)
    kept: dict[int, tuple[list, torch.Tensor]] = field(
        default_factory=dict
    )  # group -> (its keys/values, last logits)

    @classmethod
    def plan(cls, lengths: list[int], wanted: list[tuple[int, Span | None, bool]]) -> PrefillScores:
        """`wanted`: per row, (its plain group, the span of its prompt text or None, whether its
        self-PPL reads after the plain prompt). A group scores the hull of its rows' spans, from its
        second token on (the first has no context)."""
        plan = cls(list(lengths))
        for group, span, after in wanted:
            if span is not None and span[1] > max(span[0], 1):
                lo, hi = max(span[0], 1), span[1]
                old = plan.spans.get(group, (lo, hi))
                plan.spans[group] = (min(old[0], lo), max(old[1], hi))
            if after:
                plan.keep_cache.add(group)
        return plan

    @property
    def width(self) -> int:
        return max(self.lengths)

    def pad(self, group: int) -> int:
        return self.width - self.lengths[group]

    def positions(self, start: int, stop: int) -> list[int]:
        """Absolute positions in [start, stop) of the prefill batch whose logits a chunk keeps: those
        predicting a scored token of some group, and the chunk's last (the next token's logits)."""
        keep = {stop - 1}
        for group, (lo, hi) in self.spans.items():  # logits at p predict token p + 1
            first, last = self.pad(group) + lo - 1, self.pad(group) + hi - 1
            keep.update(range(max(first, start), min(last, stop)))
        return sorted(keep)

    def record(self, logits: torch.Tensor, kept: list[int], ids: torch.Tensor) -> None:
        """Score one chunk: `logits` [G, len(kept), V] at the absolute positions `kept` of the padded
        prompt batch `ids` [G, W]."""
        at = torch.tensor(kept)
        for group, (lo, hi) in self.spans.items():
            pad = self.pad(group)
            rows = ((at >= pad + lo - 1) & (at < pad + hi - 1)).nonzero()[:, 0]
            if not rows.numel():
                continue
            # `kept` holds every position of the group's range, so its rows are one run: a view, not a copy
            first, last = int(rows[0]), int(rows[-1]) + 1
            targets = at[first:last] + 1
            nll = self.nll.setdefault(
                group, torch.full((self.lengths[group],), math.nan, dtype=torch.float64)
            )
            nll[targets - pad] = (
                nll_of(logits[group, first:last], ids[group, targets.to(ids.device)]).double().cpu()
            )

    def keep(self, cache, last_logits: torch.Tensor) -> None:
        """After the prefill, before rows take their copies: the kept groups' keys and values (their
        padding cut off) and the logits after their last prompt token."""
        for group in self.keep_cache:
            self.kept[group] = (row_kv(cache, group, self.pad(group)), last_logits[group].float().clone())

    def prompt_ppl(self, group: int | None, span: Span | None) -> float | None:
        """The perplexity of `span`'s tokens of `group` as the prefill scored them; None where the
        prefill did not score them (the span has no token with context, or no plain group)."""
        if group is None or span is None or group not in self.nll:
            return None
        part = self.nll[group][max(span[0], 1) : span[1]]
        if not part.numel() or torch.isnan(part).any():
            return None
        return math.exp(part.mean().item())

    def self_ppl(
        self, lm: LoadedModel, group: int | None, answer: list[int], stop: threading.Event | None = None
    ) -> float | None:
        """The answer's perplexity under the plain model read after the kept prompt of `group`;
        None where that prompt was not kept."""
        if group not in self.kept or not answer:
            return None
        kv, last = self.kept[group]
        cache = cache_from(lm.model.config, kv, kv[0][0].shape[2] + len(answer))
        nll = continuation_nll(lm, cache, last, torch.tensor(answer, device=lm.device), PREFILL_CHUNK, stop)
        return math.exp(nll.double().mean().item())

    def release(self) -> None:
        self.kept.clear()
        self.nll.clear()

    def memory_mb(self, kv_bytes_per_token: int, vocab: int, logit_bytes: int = 4) -> float:
        """What scoring adds to a run's memory: the kept prompts' keys and values, and one chunk's
        logits for every group (with their log-softmax)."""
        kept = sum(self.lengths[g] for g in self.keep_cache) * kv_bytes_per_token
        logits = (
            (len(self.lengths) + 1) * min(self.width, PREFILL_CHUNK) * vocab * logit_bytes
            if self.spans
            else 0
        )
        return (kept + logits) / 2**20
