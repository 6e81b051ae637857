"""Next-token selection: greedy or sampled through transformers' own logits processors, seeded per row."""

from __future__ import annotations

import math
from dataclasses import asdict, astuple, dataclass

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

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
    """Decoding settings of a run (a row may have its own temperature and top-p). temperature 0 means
    greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> SamplingConfig:
        def finite(bound: Bound, value: float) -> None:
            # numbers only, as the library takes them (a door that takes text parses it first)
            if (
                not isinstance(value, (int, float))
                or not math.isfinite(value)
                or not bound.lo <= value <= bound.hi
            ):
                raise FeedbackError(
                    f"{bound.name} must be a finite number in [{bound.lo}, {bound.hi}], got {value!r}"
                )

        finite(TEMPERATURE, self.temperature)
        check_temperature(self.temperature)  # the floor above 0
        finite(TOP_P, self.top_p)
        finite(MIN_P, self.min_p)
        finite(REPETITION_PENALTY, self.repetition_penalty)
        if not isinstance(self.top_k, int) or not TOP_K.lo <= self.top_k <= TOP_K.hi:
            raise FeedbackError(
                f"top_k must be an integer in [{TOP_K.lo}, {TOP_K.hi}] (0 = off), got {self.top_k!r}"
            )
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


def check_temperature(value, name: str = TEMPERATURE.name) -> float:
    """A temperature inside `TEMPERATURE` that is 0 (greedy) or at least MIN_TEMPERATURE, else a
    `FeedbackError` naming the field (`name`)."""
    value = TEMPERATURE.check(value, name)
    if 0.0 < value < MIN_TEMPERATURE:
        raise FeedbackError(
            f"{name} must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {value!r}: "
            "dividing logits by a smaller one overflows to inf"
        )
    return value


class Sampler:
    """Picks one token per live row. Each row owns a seeded generator, so a row's draws do not depend
    on which other rows share its batch.

    Rows may have sampling settings of their own (`row_configs`, one per row; a row's own temperature
    or top-p). Rows with equal settings are picked together: when every row has the same settings one
    set of processors acts on the whole batch (a greedy run without overrides is an argmax, as fast as
    it was); otherwise each group goes through its own processors, a greedy group by argmax."""

    def __init__(
        self,
        cfg: SamplingConfig,
        seeds: list[int],
        device: torch.device,
        row_configs: list[SamplingConfig] | None = None,
    ):
        self.cfg = cfg
        configs = row_configs or [cfg] * len(seeds)
        self.keys = [astuple(c) for c in configs]  # a row's settings, as a key its group is found by
        self.groups = {key: (build_processors(c), c.greedy) for key, c in zip(self.keys, configs)}
        self.needs_history = any(c.repetition_penalty != 1.0 for c in configs)
        self.generators: list[torch.Generator] = []
        if not all(c.greedy for c in configs):
            for seed in seeds:
                gen = torch.Generator(device=device)
                gen.manual_seed(int(seed))
                self.generators.append(gen)

    @property
    def edits_logits(self) -> bool:
        """Whether any processor acts on the logits (the caller then hands in a copy)."""
        return any(len(procs) for procs, _ in self.groups.values())

    def select_rows(self, keep: list[int]) -> None:
        """Keep the generators and settings of these batch positions (rows that left drop out)."""
        self.keys = [self.keys[i] for i in keep]
        if self.generators:
            self.generators = [self.generators[i] for i in keep]

    def __call__(self, history: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
        """Token ids [B] from fp32 logits [B, V]; `history` [B, T] is needed for repetition penalty."""
        if len(set(self.keys)) == 1:
            return self._pick(self.keys[0], list(range(logits.shape[0])), history, logits)
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for key in dict.fromkeys(self.keys):  # each group once, in row order
            rows = [i for i, k in enumerate(self.keys) if k == key]
            idx = torch.tensor(rows, device=logits.device)
            tokens[idx] = self._pick(key, rows, None if history is None else history[idx], logits[idx])
        return tokens

    def _pick(
        self, key: tuple, rows: list[int], history: torch.Tensor | None, logits: torch.Tensor
    ) -> torch.Tensor:
        """Tokens for the batch positions `rows` (their logits and history given), all with one group's
        settings."""
        procs, greedy = self.groups[key]
        scores = procs(history, logits) if len(procs) else logits
        if greedy:
            return scores.argmax(dim=-1)
        probs = torch.softmax(scores, dim=-1)
        return torch.cat(
            [torch.multinomial(probs[j], 1, generator=self.generators[i]) for j, i in enumerate(rows)]
        )
