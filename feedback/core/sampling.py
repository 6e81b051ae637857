"""Next-token selection: greedy or sampled through transformers' own logits processors, seeded per row."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from feedback.core.bounds import Bound
from feedback.errors import FeedbackError

MIN_TEMPERATURE = 0.01  # below it logits / T leaves float range (1e-38 gave inf and a failed draw)
TEMPERATURE = Bound("temperature", 0.0, 10.0)  # 0 = greedy; otherwise at least MIN_TEMPERATURE
TOP_P = Bound("top_p", 0.0, 1.0)  # 1 = off; 0 is refused (nothing would be kept)
MIN_P = Bound("min_p", 0.0, 1.0)  # 0 = off
REPETITION_PENALTY = Bound("repetition_penalty", 0.01, 10.0)  # 1 = off
TOP_K = Bound("top_k", 0, 1_000_000, integer=True)  # 0 = off


@dataclass
class SamplingConfig:
    """Decoding settings shared by every row of a run. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingConfig":
        def finite(name: str, value: float, lo: float, hi: float) -> None:
            if not isinstance(value, (int, float)) or not math.isfinite(value) or not lo <= value <= hi:
                raise FeedbackError(f"{name} must be a finite number in [{lo}, {hi}], got {value!r}")

        finite("temperature", self.temperature, 0.0, 10.0)
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise FeedbackError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got "
                                f"{self.temperature!r}: dividing logits by a smaller one overflows to inf")
        finite("top_p", self.top_p, 0.0, 1.0)
        finite("min_p", self.min_p, 0.0, 1.0)
        finite("repetition_penalty", self.repetition_penalty, 0.01, 10.0)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise FeedbackError(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")
        if self.top_p == 0.0:
            raise FeedbackError("top_p must be > 0 (1 = off)")
        return self

    def to_dict(self) -> dict:
        return asdict(self)


def build_processors(cfg: SamplingConfig) -> LogitsProcessorList:
    """The transformers processors for these settings, in `generate`'s order."""
    procs = LogitsProcessorList()
    if cfg.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(float(cfg.repetition_penalty)))
    if cfg.greedy:
        return procs
    if cfg.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(float(cfg.temperature)))
    if cfg.top_k > 0:
        procs.append(TopKLogitsWarper(cfg.top_k))
    if cfg.top_p < 1.0:
        procs.append(TopPLogitsWarper(float(cfg.top_p)))
    if cfg.min_p > 0.0:
        procs.append(MinPLogitsWarper(float(cfg.min_p)))
    return procs


class Sampler:
    """Picks one token per live row. Each row owns a seeded generator, so a row's draws do not depend
    on which other rows share its batch."""

    def __init__(self, cfg: SamplingConfig, seeds: list[int], device: torch.device):
        self.cfg = cfg
        self.processors = build_processors(cfg)
        self.needs_history = cfg.repetition_penalty != 1.0
        self.generators: list[torch.Generator] = []
        if not cfg.greedy:
            for seed in seeds:
                gen = torch.Generator(device=device)
                gen.manual_seed(int(seed))
                self.generators.append(gen)

    def select_rows(self, keep: list[int]) -> None:
        """Keep the generators of these batch positions (rows that left the batch drop out)."""
        if self.generators:
            self.generators = [self.generators[i] for i in keep]

    def __call__(self, history: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
        """Token ids [B] from fp32 logits [B, V]; `history` [B, T] is needed for repetition penalty."""
        scores = self.processors(history, logits) if len(self.processors) else logits
        if self.cfg.greedy:
            return scores.argmax(dim=-1)
        probs = torch.softmax(scores, dim=-1)
        return torch.cat(
            [torch.multinomial(probs[i], 1, generator=gen) for i, gen in enumerate(self.generators)]
        )
