"""Serialisable run description (`RunConfig`) and outcome (`RunResult`), plain dataclasses."""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from feedback.core.bounds import Bound
from feedback.core.confidence import DEFAULT_K, DEFAULT_WINDOW
from feedback.core.patterns import key_fact_pattern
from feedback.core.sampling import TOP_P, SamplingConfig, check_temperature
from feedback.errors import FeedbackError
from feedback.strategies import get_strategy

MAX_NEW_TOKENS_CAP = 4096
MAX_ROWS = 64
MAX_PROMPT_CHARS = 100_000  # checked before tokenising, so a huge prompt costs nothing


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First step where two rows chose different tokens; if one is a prefix of the other, the
    step where the shorter one ended; None when they are identical."""
    diverged = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if diverged is None and len(a) != len(b):
        return min(len(a), len(b))
    return diverged


ROLES = ("system", "user", "assistant")
MAX_KEY_FACTS = 32

# The settings a row may have of its own instead of the run's, declared once: (RowSpec field, the
# RunConfig setting it stands in for, as a dotted path). A row's None is the run's value. RowSpec
# declares each field; what reads "which settings may a row override" reads this (the HTTP API's
# row schema, the page's column settings and History's CSV columns), and tests/core/test_records.py
# checks it against RowSpec and RunConfig.
ROW_OVERRIDES: tuple[tuple[str, str], ...] = (
    ("prompt", "prompt"),
    ("system_prompt", "system_prompt"),
    ("temperature", "sampling.temperature"),
    ("top_p", "sampling.top_p"),
    ("seed", "seed"),
    ("threshold", "deepconf.threshold"),
)


@dataclass
class RowSpec:
    """One row of a run: the baseline (no strategy) or a strategy with parameters, and optionally
    its own prompt, system prompt and earlier conversation turns (otherwise the run's), its own
    sampling temperature, top-p and seed (the other sampling settings are the run's), and a forced
    start of its reply (the replay of a branch)."""

    name: str = "baseline"
    strategy: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    seed_offset: int = 0  # rows with equal offsets share random draws (common random numbers)
    threshold: float | None = None  # this row's early-stop threshold; None: the run's DeepConf threshold
    prompt: str | None = None  # this row's prompt (its newest user turn); None: the run's
    system_prompt: str | None = None  # None: the run's
    messages: list[dict[str, str]] | None = None  # earlier turns, [{role, content}], before the prompt
    prefix: list[int] | None = None  # token ids the reply is forced to start with (marked as forced)
    temperature: float | None = None  # this row's sampling temperature (0: greedy); None: the run's
    chosen: int = 0  # how many of the prefix's last tokens a person chose (a branch); the rest replay text
    top_p: float | None = None  # this row's top-p; None: the run's
    seed: int | None = None  # this row's seed (its draws start from it, plus seed_offset); None: the run's

    def sampling(self, shared: SamplingConfig) -> SamplingConfig:
        """The run's sampling settings with this row's own temperature and top-p in place."""
        own = {
            path.removeprefix("sampling."): getattr(self, name)
            for name, path in ROW_OVERRIDES
            if path.startswith("sampling.") and getattr(self, name) is not None
        }
        return replace(shared, **own)

    def seed_for(self, run_seed: int) -> int:
        """The seed of this row's generator: its own seed or the run's, plus its offset."""
        return (run_seed if self.seed is None else self.seed) + self.seed_offset

    def validate(self, max_new_tokens: int) -> None:
        """Clear errors naming the row and the field."""
        where = f"row {self.name}"
        if self.strategy is not None:
            try:
                get_strategy(self.strategy)  # its parameters are checked against the model when it is built
            except FeedbackError as exc:
                raise FeedbackError(f"{where}: {exc}") from None
        if not isinstance(self.params, dict):
            raise FeedbackError(
                f"{where}: params must be a mapping of names to values, got {self.params!r:.80}"
            )
        if self.threshold is not None and (
            not isinstance(self.threshold, (int, float)) or not math.isfinite(self.threshold)
        ):
            raise FeedbackError(f"{where}: threshold must be a finite number, got {self.threshold!r}")
        if self.temperature is not None:
            if not isinstance(self.temperature, (int, float)):  # text is parsed by the door that takes it
                raise FeedbackError(f"{where}: temperature must be a number, got {self.temperature!r}")
            check_temperature(self.temperature, f"{where}: temperature")
        for name in ("top_p", "seed"):  # numbers only, as the library takes them (a door parses text first)
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise FeedbackError(f"{where}: {name} must be a number, got {value!r}")
        if self.top_p is not None:
            TOP_P.check(self.top_p, f"{where}: top_p")
            if self.top_p == 0.0:
                raise FeedbackError(f"{where}: top_p must be > 0 (1 = off)")
        if self.seed is not None:
            SEED.check(self.seed, f"{where}: seed")
        for name in ("prompt", "system_prompt"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or (name == "prompt" and not value.strip()):
                raise FeedbackError(
                    f"{where}: {name} is empty"
                    if isinstance(value, str)
                    else f"{where}: {name} must be text, got {value!r}"
                )
            if len(value) > MAX_PROMPT_CHARS:
                raise FeedbackError(
                    f"{where}: {name} is limited to {MAX_PROMPT_CHARS} characters, got {len(value)}"
                )
        if self.messages is not None:
            if not isinstance(self.messages, list):
                raise FeedbackError(
                    f"{where}: messages must be a list of {{role, content}}, got {self.messages!r}"
                )
            for i, m in enumerate(self.messages):
                if not isinstance(m, dict) or set(m) != {"role", "content"}:
                    raise FeedbackError(f"{where}: messages[{i}] must have exactly a role and a content")
                if m["role"] not in ROLES:
                    raise FeedbackError(
                        f"{where}: messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}"
                    )
                if not isinstance(m["content"], str):
                    raise FeedbackError(f"{where}: messages[{i}].content must be text")
            if sum(len(m["content"]) for m in self.messages) > MAX_PROMPT_CHARS:
                raise FeedbackError(f"{where}: messages are limited to {MAX_PROMPT_CHARS} characters in all")
        if self.prefix is not None:
            if not isinstance(self.prefix, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.prefix
            ):
                raise FeedbackError(f"{where}: prefix must be a list of token ids, got {self.prefix!r}")
            if len(self.prefix) > max_new_tokens:
                raise FeedbackError(
                    f"{where}: prefix has {len(self.prefix)} tokens but max_new_tokens is {max_new_tokens}"
                )
        if (
            not isinstance(self.chosen, int)
            or isinstance(self.chosen, bool)
            or not 0 <= self.chosen <= len(self.prefix or [])
        ):
            raise FeedbackError(
                f"{where}: chosen must be a whole number from 0 to the prefix's length "
                f"({len(self.prefix or [])}), got {self.chosen!r}"
            )


DEEPCONF_K = Bound("DeepConf k", 1, 1000, integer=True)  # top-k of the full distribution per token
DEEPCONF_WINDOW = Bound("window", 1, 100_000, integer=True)  # tokens in a group-confidence window
SEED = Bound("seed", 0, 2**63 - 1, integer=True)


def _check_integer(bound: Bound, value, name: str | None = None) -> None:
    """Refuse `value` unless it is an integer inside `bound`. The library takes numbers only (a door
    that takes text parses it first), so unlike `Bound.check` this accepts no text or 2.0."""
    if not isinstance(value, int) or not bound.lo <= value <= bound.hi:
        raise FeedbackError(
            f"{name or bound.name} must be an integer in [{bound.lo}, {bound.hi}], got {value!r}"
        )


@dataclass
class DeepConfConfig:
    k: int = DEFAULT_K
    window: int = DEFAULT_WINDOW
    threshold: float | None = None  # fixed early-stop threshold on group confidence; None = off

    def validate(self) -> DeepConfConfig:
        _check_integer(DEEPCONF_K, self.k)
        _check_integer(DEEPCONF_WINDOW, self.window, f"DeepConf {DEEPCONF_WINDOW.name}")
        if self.threshold is not None and (
            not isinstance(self.threshold, (int, float)) or not math.isfinite(self.threshold)
        ):
            raise FeedbackError(f"DeepConf threshold must be a finite number, got {self.threshold!r}")
        return self


def default_rows(strategy: str = "residual", params: dict | None = None) -> list[RowSpec]:
    return [RowSpec("baseline"), RowSpec("feedback", strategy, dict(params or {}))]


RESULT_NOTES = ("precision",)  # keys of a result's config that describe the run, not settings


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
    reference: str | None = None  # a reference answer: its perplexity under each row's prompt (quality)
    key_facts: list[str] = field(
        default_factory=list
    )  # texts (or /regex/) whose recall in each answer is measured
    quality: bool = (
        False  # also the metrics that take forward passes: self and prompt PPL (reference PPL: when set)
    )

    def validate(self) -> RunConfig:
        if not isinstance(self.prompt, str):
            raise FeedbackError(f"prompt must be text, got {self.prompt!r}")
        if not self.prompt.strip() and (not self.rows or any(r.prompt is None for r in self.rows)):
            raise FeedbackError("prompt is empty")
        if len(self.prompt) > MAX_PROMPT_CHARS:
            raise FeedbackError(f"prompt is limited to {MAX_PROMPT_CHARS} characters, got {len(self.prompt)}")
        if self.reference is not None and (
            not isinstance(self.reference, str)
            or not self.reference.strip()
            or len(self.reference) > MAX_PROMPT_CHARS
        ):
            raise FeedbackError(f"reference must be non-empty text of at most {MAX_PROMPT_CHARS} characters")
        if (
            not isinstance(self.key_facts, list)
            or len(self.key_facts) > MAX_KEY_FACTS
            or not all(isinstance(f, str) and f.strip() for f in self.key_facts)
        ):
            raise FeedbackError(f"key_facts must be a list of at most {MAX_KEY_FACTS} non-empty texts")
        for n, fact in enumerate(self.key_facts, start=1):  # a /pattern/ that cannot compile is refused now
            key_fact_pattern(fact, f"key fact {n}")
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_CAP:
            raise FeedbackError(
                f"max_new_tokens must be an integer in [1, {MAX_NEW_TOKENS_CAP}], got {self.max_new_tokens!r}"
            )
        _check_integer(SEED, self.seed)
        if not self.rows or len(self.rows) > MAX_ROWS:
            raise FeedbackError(f"a run needs 1 to {MAX_ROWS} rows, got {len(self.rows)}")
        names = [r.name for r in self.rows]
        if len(set(names)) != len(names):
            raise FeedbackError(f"row names must be unique, got {names}")
        for row in self.rows:
            row.validate(self.max_new_tokens)
        self.sampling.validate()
        self.deepconf.validate()
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        """A config from a dict: a request's, or a result's (whose notes on how it ran are left out)."""
        if not isinstance(data, dict):
            raise FeedbackError(f"invalid run config: expected a mapping, got {type(data).__name__}")
        data = {k: v for k, v in data.items() if k not in RESULT_NOTES}
        try:
            data["sampling"] = SamplingConfig(**data.get("sampling", {}))
            data["deepconf"] = DeepConfConfig(**data.get("deepconf", {}))
            if "rows" in data:
                data["rows"] = [RowSpec(**r) for r in data["rows"]]
            return cls(**data)
        except (TypeError, AttributeError) as exc:
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
    forced: bool = False  # the token was given (a branch's replay or choice), not chosen by the sampler
    part: str | None = None  # a prompt-level strategy's phase: "restate", "transition", "answer"
    chosen: bool = False  # a forced token a person chose (a branch's token), not one replayed before it


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


def answer_text(row: RowResult) -> str:
    """The part of a reply that answers: after a restatement (a prompt-level strategy's parts), else all."""
    if any(s.part for s in row.steps):
        return "".join(s.text for s in row.steps if s.part != "restate")
    return row.text


def tokens_per_second(steps: list[StepRecord]) -> float | None:
    """Decode speed of a row from its step times; step 0 (the prefill, time to first token) is left out."""
    seconds = sum(s.time_ms for s in steps[1:]) / 1000.0
    return (len(steps) - 1) / seconds if len(steps) > 1 and seconds > 0 else None


def confidence_summary(row: RowResult) -> tuple[float | None, float | None]:
    """(mean token confidence, lowest group confidence) of a row: its final metrics once it has
    them, else from its steps so far (a row still streaming)."""
    if row.metrics.get("mean") is not None:
        return row.metrics.get("mean"), row.metrics.get("lowest_group")
    if not row.steps:
        return None, None
    return (
        math.fsum(s.confidence for s in row.steps) / len(row.steps),
        min(s.group_confidence for s in row.steps),
    )


RUN_ID_HEX = 8  # a run id is a uuid4's first hex digits
RUN_ID_PATTERN = (
    f"^[0-9a-f]{{{RUN_ID_HEX}}}$"  # every id `_run_id` makes, and nothing else (the API's run_id)
)


def _run_id() -> str:
    return uuid.uuid4().hex[:RUN_ID_HEX]


@dataclass
class RunResult:
    config: dict[str, Any]
    rows: list[RowResult]
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    wall_seconds: float = 0.0
    memory: list[dict] = field(default_factory=list)
    first_divergence_step: int | None = None  # first step where row 0 and row 1 chose different tokens
    run_id: str = field(default_factory=_run_id)  # names the run in history, exports and /api/continue

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict) -> RunResult:
        """Rebuild a result from `to_dict()` output (history, exports, replay)."""

        def known(kind, d: dict) -> dict:  # extra keys (e.g. UI annotations) are ignored
            names = {f.name for f in fields(kind)}
            return {k: v for k, v in d.items() if k in names}

        rows = []
        for r in data["rows"]:
            steps = [
                StepRecord(**{**known(StepRecord, s), "top": [Alternative(**a) for a in s.get("top", [])]})
                for s in r["steps"]
            ]
            rows.append(RowResult(**{**known(RowResult, r), "steps": steps}))
        return cls(**{**known(cls, data), "rows": rows})

    def row(self, name: str) -> RowResult:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)
