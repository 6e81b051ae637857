"""Serialisable run description (`RunConfig`) and outcome (`RunResult`), plain dataclasses."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from feedback.confidence import DEFAULT_K, DEFAULT_WINDOW
from feedback.errors import FeedbackError
from feedback.sampling import SamplingConfig

MAX_NEW_TOKENS_CAP = 4096
SERVED_MAX_NEW_TOKENS = 1024  # the UI's and the HTTP API's cap: shared servers bound a run's length
MAX_ROWS = 64
MAX_PROMPT_CHARS = 100_000  # checked before tokenising, so a huge prompt costs nothing


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First step where two rows chose different tokens; if one is a prefix of the other, the
    step where the shorter one ended; None when they are identical."""
    diverged = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if diverged is None and len(a) != len(b):
        return min(len(a), len(b))
    return diverged


@dataclass
class RowSpec:
    """One row of a run: the baseline (no strategy) or a strategy with parameters."""

    name: str = "baseline"
    strategy: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    seed_offset: int = 0  # rows with equal offsets share random draws (common random numbers)
    threshold: float | None = None  # this row's early-stop threshold; None: the run's DeepConf threshold


@dataclass
class DeepConfConfig:
    k: int = DEFAULT_K
    window: int = DEFAULT_WINDOW
    threshold: float | None = None  # fixed early-stop threshold on group confidence; None = off

    def validate(self) -> "DeepConfConfig":
        if not isinstance(self.k, int) or not 1 <= self.k <= 1000:
            raise FeedbackError(f"DeepConf k must be an integer in [1, 1000], got {self.k!r}")
        if not isinstance(self.window, int) or not 1 <= self.window <= 100_000:
            raise FeedbackError(f"DeepConf window must be an integer in [1, 100000], got {self.window!r}")
        if self.threshold is not None and (
            not isinstance(self.threshold, (int, float)) or not math.isfinite(self.threshold)
        ):
            raise FeedbackError(f"DeepConf threshold must be a finite number, got {self.threshold!r}")
        return self


def default_rows(strategy: str = "residual", params: dict | None = None) -> list[RowSpec]:
    return [RowSpec("baseline"), RowSpec("feedback", strategy, dict(params or {}))]


@dataclass
class RunConfig:
    """Everything that determines a run; replaying it reproduces the run."""

    prompt: str
    model: str = "embedded"
    dtype: str = "auto"
    chat_template: bool = True
    system_prompt: str | None = None
    max_new_tokens: int = 128
    seed: int = 0
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    deepconf: DeepConfConfig = field(default_factory=DeepConfConfig)
    rows: list[RowSpec] = field(default_factory=default_rows)

    def validate(self) -> "RunConfig":
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise FeedbackError("prompt is empty")
        if len(self.prompt) > MAX_PROMPT_CHARS:
            raise FeedbackError(f"prompt is limited to {MAX_PROMPT_CHARS} characters, got {len(self.prompt)}")
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_CAP:
            raise FeedbackError(f"max_new_tokens must be an integer in [1, {MAX_NEW_TOKENS_CAP}], "
                                f"got {self.max_new_tokens!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise FeedbackError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not self.rows or len(self.rows) > MAX_ROWS:
            raise FeedbackError(f"a run needs 1 to {MAX_ROWS} rows, got {len(self.rows)}")
        names = [r.name for r in self.rows]
        if len(set(names)) != len(names):
            raise FeedbackError(f"row names must be unique, got {names}")
        for row in self.rows:
            if row.threshold is not None and (not isinstance(row.threshold, (int, float))
                                              or not math.isfinite(row.threshold)):
                raise FeedbackError(f"row {row.name}: threshold must be a finite number, got {row.threshold!r}")
        self.sampling.validate()
        self.deepconf.validate()
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        data = dict(data)
        try:
            data["sampling"] = SamplingConfig(**data.get("sampling", {}))
            data["deepconf"] = DeepConfConfig(**data.get("deepconf", {}))
            if "rows" in data:
                data["rows"] = [RowSpec(**r) for r in data["rows"]]
            return cls(**data)
        except TypeError as exc:
            raise FeedbackError(f"invalid run config: {exc}") from None


@dataclass
class Alternative:
    token_id: int
    text: str
    prob: float


@dataclass
class StepRecord:
    """What one row produced at one decode step."""

    step: int
    token_id: int
    text: str  # the text this token adds to the row's output (incrementally detokenised)
    logprob: float  # chosen token, raw (untempered) distribution
    prob: float
    confidence: float  # DeepConf token confidence
    entropy: float
    group_confidence: float  # mean confidence of the last `window` tokens so far
    top: list[Alternative]
    time_ms: float  # wall time of the batched step that produced it


@dataclass
class RowResult:
    name: str
    strategy: str | None
    params: dict[str, Any]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str | None = None  # eos | max_tokens | early_stop | stopped
    stop_step: int | None = None
    steps: list[StepRecord] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    decode_seconds: float = 0.0
    tokens_per_s: float = 0.0


@dataclass
class RunResult:
    config: dict[str, Any]
    rows: list[RowResult]
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    wall_seconds: float = 0.0
    memory: list[dict] = field(default_factory=list)
    first_divergence_step: int | None = None  # first step where row 0 and row 1 chose different tokens

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict) -> "RunResult":
        """Rebuild a result from `to_dict()` output (history, exports, replay)."""
        def known(kind, d: dict) -> dict:  # extra keys (e.g. UI annotations) are ignored
            names = {f.name for f in fields(kind)}
            return {k: v for k, v in d.items() if k in names}

        rows = []
        for r in data["rows"]:
            steps = [StepRecord(**{**known(StepRecord, s), "top": [Alternative(**a) for a in s.get("top", [])]})
                     for s in r["steps"]]
            rows.append(RowResult(**{**known(RowResult, r), "steps": steps}))
        return cls(**{**known(cls, data), "rows": rows})

    def row(self, name: str) -> RowResult:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)
