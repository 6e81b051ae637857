"""The API's request and response bodies, and how a request becomes the library's config.

Every bound here is read from where it is declared: the library's beside its config dataclass
(records, sampling, perplexity), the served caps in `feedback.serve.limits`. The constraints are the
OpenAPI schema and refuse a request before any work; the library validates again.

The schema says what the server takes. A value of another JSON type is refused, not converted
(`true` is no seed, `0` no boolean, `"5"` no number); text the library would find blank, a strategy
name outside the grammar, a prompt missing where no row has its own: the schema states each, and
the server refuses each (422). What a JSON schema cannot state — a text's length in tokens, the
budgets, a strategy's own parameters, two fields compared — the library refuses with 422 and an
`{"error": ...}` naming it; a run id this server does not hold is a 404.
"""

from __future__ import annotations

import re
import sys
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict, model_validator
from pydantic_core import PydanticCustomError

from feedback.core.bounds import Bound
from feedback.core.records import (
    DEEPCONF_K,
    DEEPCONF_WINDOW,
    MAX_KEY_FACTS,
    MAX_PROMPT_CHARS,
    ROW_OVERRIDES,
    RUN_ID_PATTERN,
    DeepConfConfig,
    RowResult,
    RowSpec,
    RunConfig,
    RunResult,
    default_rows,
)
from feedback.core.sampling import (
    MIN_P,
    MIN_TEMPERATURE,
    REPETITION_PENALTY,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    SamplingConfig,
    check_temperature,
)
from feedback.errors import FeedbackError
from feedback.eval.calibration import BINS, MIN_QUESTIONS, CalibrationConfig
from feedback.eval.perplexity import PASSES, PPLConfig
from feedback.serve.limits import (
    ANSWER_MAX_CHARS,
    MAX_MESSAGES,
    MAX_NEW_TOKENS,
    MAX_PARAMS,
    NAME_MAX_CHARS,
    PPL_BOOTSTRAP,
    PPL_CHUNK,
    PPL_STRIDE,
    PPL_WINDOW,
    SERVED_CALIBRATION_MAX_NEW_TOKENS,
    SERVED_CALIBRATION_SAMPLES,
    SERVED_MAX_NEW_TOKENS,
    SERVED_MAX_QUESTIONS,
    SERVED_MAX_ROWS,
    SERVED_SEED,
    SERVED_TEXT_MAX_CHARS,
    SHORT_TEXT_MAX_CHARS,
    SMALL_SEED,
    TRACE_MAX_NEW_TOKENS,
    TRACES,
)
from feedback.strategies import REGISTRY, SEP, PromptStrategy, get_strategy


def within(bound: Bound) -> dict:
    """A bound as pydantic's `ge`/`le`."""
    return {"ge": bound.lo, "le": bound.hi}


def _whole(value: Any) -> Any:
    # pydantic's lax mode reads true/false as 1/0 and "5" as 5; JSON Schema's integer is neither (3.0 is one)
    if isinstance(value, (bool, str)):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


def whole(**bounds) -> Any:
    """An integer field's type within `bounds` (`ge`, `le`): what JSON Schema calls an integer, and only
    that. The bounds come before the check so the schema states them (as minimum/maximum)."""
    return Annotated[int, Field(**bounds), Strict(False), BeforeValidator(_whole)]


def _temperature(value: float) -> float:
    try:
        return check_temperature(value)
    except FeedbackError as exc:
        raise PydanticCustomError("temperature", "{reason}", {"reason": str(exc)}) from None


# 0 is greedy; under MIN_TEMPERATURE logits / T overflows, so the schema leaves (0, MIN_TEMPERATURE) out
Temperature = Annotated[
    float,
    Field(**within(TEMPERATURE), json_schema_extra={"anyOf": [{"const": 0}, {"minimum": MIN_TEMPERATURE}]}),
    AfterValidator(_temperature),
]

# What `str.strip()` removes, which is how the library tells blank text. Spelled out: a pattern's \s
# differs between regex dialects (ECMA and Rust leave out \x1c-\x1f, which Python counts).
SPACE = "".join(f"\\u{ord(c):04x}" for c in map(chr, range(sys.maxunicode + 1)) if c.isspace())
# Text that is not blank: "not whitespace alone" (a search for one other character reads the same,
# but schemathesis draws far fewer cases from a negated class).
NOT_BLANK = {"not": {"pattern": f"^[{SPACE}]*$"}}


def _not_blank(text: str) -> str:
    if not text.strip():
        raise PydanticCustomError("blank", "Text should hold more than whitespace")
    return text


def filled(max_chars: int) -> Any:
    """Text of at most `max_chars` characters that is not blank (as the schema says: NOT_BLANK)."""
    return Annotated[
        str, Field(max_length=max_chars, json_schema_extra=NOT_BLANK), AfterValidator(_not_blank)
    ]


def _strategy_grammar() -> dict:
    """The names a strategy field takes, exactly as the library reads them (`get_strategy`): one
    strategy, or a stack of two or more hidden-state strategies, each named once, joined by '+' (the
    library strips each name, so spaces around them do no harm)."""
    stackable = [re.escape(n) for n, cls in sorted(REGISTRY.items()) if not issubclass(cls, PromptStrategy)]
    space, sep = f"[{SPACE}]*", re.escape(SEP)
    member = f"{space}(?:{'|'.join(stackable)}){space}"
    # a member named twice: a pattern has no memory, but the names are few ([\s\S] is any character
    # in every regex dialect)
    twice = "|".join(
        f"(?:^|{sep}){space}{n}{space}{sep}(?:[\\s\\S]*{sep})?{space}{n}{space}(?:{sep}|$)" for n in stackable
    )
    return {
        "anyOf": [
            {"enum": sorted(REGISTRY)},
            {"pattern": f"^{member}(?:{sep}{member})+$", "not": {"pattern": twice}},
        ]
    }


STRATEGY_GRAMMAR = _strategy_grammar()


def _strategy(name: str) -> str:
    try:
        get_strategy(name)
    except FeedbackError as exc:
        raise PydanticCustomError("strategy", "{reason}", {"reason": str(exc)}) from None
    return name


# A request's strategy, checked at the door: it may go unused (`strategy` beside explicit rows) and
# must still be one the schema allows.
StrategyName = Annotated[str, Field(json_schema_extra=STRATEGY_GRAMMAR), AfterValidator(_strategy)]
# A row's: the library checks every row's, refusing it with the row's name.
RowStrategyName = Annotated[str, Field(json_schema_extra=STRATEGY_GRAMMAR)]
ParamValue = bool | int | float | str
# {} is every strategy's defaults (a default_factory is not shown in the schema, so the example says it)
Params = Annotated[dict[str, ParamValue], Field(default_factory=dict, max_length=MAX_PARAMS, examples=[{}])]
Name = Annotated[str, Field(min_length=1, max_length=NAME_MAX_CHARS)]
TokenIds = list[whole(ge=0)]


class _Body(BaseModel):
    # strict: a value of another JSON type is refused, not converted (integers: see `whole`)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class SamplingIn(_Body):
    temperature: Temperature = Field(
        SamplingConfig.temperature, description=f"0 = greedy; otherwise at least {MIN_TEMPERATURE:g}"
    )
    top_k: whole(**within(TOP_K)) = Field(SamplingConfig.top_k, description="0 = off")
    # 0 would keep no token: refused, so the lower bound is exclusive
    top_p: float = Field(SamplingConfig.top_p, gt=TOP_P.lo, le=TOP_P.hi, description="1 = off")
    min_p: float = Field(SamplingConfig.min_p, **within(MIN_P), description="0 = off")
    repetition_penalty: float = Field(
        SamplingConfig.repetition_penalty, **within(REPETITION_PENALTY), description="1 = off"
    )


class DeepConfIn(_Body):
    k: whole(**within(DEEPCONF_K)) = Field(DeepConfConfig.k, description="top-k for token confidence")
    window: whole(**within(DEEPCONF_WINDOW)) = Field(
        DeepConfConfig.window, description="group confidence window (tokens)"
    )
    threshold: float | None = Field(
        None, description="early stop when group confidence falls below; null = off"
    )


# Every field that names a strategy takes a stack too.
STRATEGY_HELP = (
    "a strategy (GET /api/strategies), or several joined by '+', applied in that order (a stack, "
    "e.g. inner_loop+deep_cache, whose params are named <strategy>.<param>)"
)


class MessageIn(_Body):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_PROMPT_CHARS)


OVERRIDDEN = dict(ROW_OVERRIDES)  # a row's field -> the run's setting it stands in for (a dotted path)


def own(name: str, what: str) -> str:
    """The description of a row's own value of a run setting (`name`, one of `ROW_OVERRIDES`): what
    it is, and that null leaves the run's."""
    return f"{what}; null: the run's `{OVERRIDDEN[name]}`"


class RowIn(_Body):
    """A `RowSpec` as the API takes it: the same fields (tests/serve/api/test_schemas.py compares
    them), each with its JSON type and served bounds; a row's own settings are `ROW_OVERRIDES`."""

    name: Name
    strategy: RowStrategyName | None = Field(
        None, description=f"null for a plain baseline row; {STRATEGY_HELP}"
    )
    params: Params
    seed_offset: whole(**within(SMALL_SEED)) = Field(
        0, description="rows with equal offsets share random draws"
    )
    threshold: float | None = Field(None, description=own("threshold", "this row's early-stop threshold"))
    prompt: filled(MAX_PROMPT_CHARS) | None = Field(
        None, description=own("prompt", "this row's own prompt (a prompt variant; its newest user turn)")
    )
    system_prompt: str | None = Field(
        None, max_length=MAX_PROMPT_CHARS, description=own("system_prompt", "this row's own system prompt")
    )
    messages: list[MessageIn] | None = Field(
        None,
        max_length=MAX_MESSAGES,
        description="this row's earlier conversation turns, before its prompt (chat template only)",
    )
    prefix: TokenIds | None = Field(
        None,
        max_length=SERVED_MAX_NEW_TOKENS,
        description="token ids the reply is forced to start with (a branch's replay); "
        "marked `forced` in the steps",
    )
    chosen: whole(ge=0, le=SERVED_MAX_NEW_TOKENS) = Field(
        0,
        description="how many of `prefix`'s last tokens a person chose (marked `chosen` in the steps); "
        "the rest replay earlier text",
    )
    temperature: Temperature | None = Field(
        None,
        description=own(
            "temperature",
            f"this row's sampling temperature (0 = greedy; otherwise at least {MIN_TEMPERATURE:g})",
        ),
    )
    top_p: float | None = Field(
        None, gt=TOP_P.lo, le=TOP_P.hi, description=own("top_p", "this row's top-p (1 = off)")
    )
    seed: whole(**within(SERVED_SEED)) | None = Field(None, description=own("seed", "this row's seed"))


# A run needs a prompt unless every row brings its own
PROMPT_RULE = {
    "anyOf": [
        {"required": ["prompt"], "properties": {"prompt": NOT_BLANK}},
        {
            "required": ["rows"],
            "properties": {
                "rows": {
                    "type": "array",
                    "items": {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                }
            },
        },
    ]
}


class _RunFields(_Body):
    """What a run is, shared by new requests and the saved runs that follow-ups send back."""

    model_config = ConfigDict(json_schema_extra=PROMPT_RULE)
    prompt: str = Field(
        "",
        max_length=MAX_PROMPT_CHARS,
        examples=["Why is the sky blue?"],
        description="every row's prompt, unless a row has its own (may be empty only then)",
    )
    model: str | None = Field(None, description="a name from GET /api/models; null: the default")
    chat_template: bool = RunConfig.chat_template
    system_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    max_new_tokens: whole(**within(MAX_NEW_TOKENS)) = RunConfig.max_new_tokens
    seed: whole(**within(SERVED_SEED)) = RunConfig.seed
    sampling: SamplingIn = Field(default_factory=SamplingIn)
    deepconf: DeepConfIn = Field(default_factory=DeepConfIn)
    reference: filled(MAX_PROMPT_CHARS) | None = Field(
        None, description="a reference answer: its perplexity after each row's prompt"
    )
    key_facts: list[filled(SHORT_TEXT_MAX_CHARS)] = Field(
        default_factory=list,
        max_length=MAX_KEY_FACTS,
        description="texts (or /regular expressions/) each answer should contain: recall per row",
    )
    quality: bool = Field(
        RunConfig.quality, description="also self-perplexity and prompt perplexity per row (forward passes)"
    )

    @model_validator(mode="after")
    def _a_prompt_for_every_row(self):
        # as PROMPT_RULE states it, and as the library has it (RunConfig.validate)
        rows = getattr(self, "rows", None)
        if not self.prompt.strip() and not (rows and all(r.prompt is not None for r in rows)):
            raise PydanticCustomError("prompt_empty", "prompt is empty: give a prompt, or every row its own")
        return self


class GenerateIn(_RunFields):
    strategy: StrategyName = Field("residual", description=f"the feedback row's strategy: {STRATEGY_HELP}")
    params: Params
    rows: list[RowIn] | None = Field(
        None,
        min_length=1,
        max_length=SERVED_MAX_ROWS,
        description="explicit rows; overrides strategy/params (default: baseline + one feedback row)",
    )
    steps: bool = Field(True, description="include per-token step records in the result")


class SavedConfigIn(_RunFields):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    dtype: str = RunConfig.dtype
    rows: list[RowIn] = Field(min_length=1, max_length=SERVED_MAX_ROWS)


class SavedRowIn(BaseModel):
    """A row's answer as the server gave it: its ids whole numbers (JSON Schema's integers: 3.0 is one,
    true and "3" are not), the vocabulary and the run's max_new_tokens checked once the model is
    known (`check_saved_run`)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    name: Name
    strategy: str | None = None
    params: Params
    token_ids: TokenIds = Field(max_length=SERVED_MAX_NEW_TOKENS)
    text: str = Field(max_length=ANSWER_MAX_CHARS)


class SavedRunIn(BaseModel):
    """A RunResult as /generate returned it (its steps, metrics and memory are ignored: send it with
    `steps: false`, or its `run_id`, to stay well under the body limit)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    run_id: str | None = Field(None, max_length=NAME_MAX_CHARS)
    config: SavedConfigIn
    rows: list[SavedRowIn] = Field(min_length=1, max_length=SERVED_MAX_ROWS)


def one_of(a: str, a_type: str, b: str, b_type: str) -> dict:
    """Exactly one of `a` and `b` given (null counts as not given), as the library's
    "give either ..." refusal has it."""
    return {
        "anyOf": [
            {"required": [a], "properties": {a: {"type": a_type}, b: {"type": "null"}}},
            {"required": [b], "properties": {b: {"type": b_type}, a: {"type": "null"}}},
        ]
    }


def _given_one(body: BaseModel, a: str, b: str) -> None:
    """Refused at the door, as `one_of` states it, before anything is looked up."""
    if (getattr(body, a) is None) == (getattr(body, b) is None):
        raise PydanticCustomError("one_of", "give either {a} or {b}", {"a": a, "b": b})


RUN_RULE = one_of("run", "object", "run_id", "string")


class FollowUpIn(_Body):
    model_config = ConfigDict(json_schema_extra=RUN_RULE)
    run: SavedRunIn | None = Field(None, description="the earlier RunResult (or give run_id)")
    # what this server names its runs; one it does not hold (any more) is a 404
    run_id: str | None = Field(
        None,
        pattern=RUN_ID_PATTERN,
        description="the run_id of a run this server produced recently (it keeps the last 64)",
    )
    steps: bool = Field(True, description="include per-token step records in the result")

    @model_validator(mode="after")
    def _one_run(self):
        _given_one(self, "run", "run_id")
        return self


class ContinueIn(FollowUpIn):
    message: filled(MAX_PROMPT_CHARS) = Field(description="the next user message", examples=["And of Italy?"])


class BranchIn(FollowUpIn):
    model_config = ConfigDict(
        json_schema_extra={"allOf": [RUN_RULE, one_of("token_id", "integer", "token_text", "string")]}
    )
    row: str = Field(min_length=1, max_length=NAME_MAX_CHARS, description="the row whose token is replaced")
    step: whole(ge=0, le=SERVED_MAX_NEW_TOKENS) = Field(description="the step at which the token is forced")
    token_id: whole(ge=0) | None = Field(None, description="the token forced at `step` (or give token_text)")
    token_text: str | None = Field(
        None,
        min_length=1,
        max_length=SHORT_TEXT_MAX_CHARS,
        description="text forced at `step`, as its tokens (or give token_id)",
    )
    all_rows: bool = Field(
        True,
        description="every row continues from `row`'s text up to `step` and the "
        "forced token (paired); false: only `row`, the others decode afresh",
    )
    matching_only: bool = Field(
        False,
        description="with `all_rows`: branch only the rows whose answer matched "
        "`row`'s up to `step`; the others are replayed as they were",
    )

    @model_validator(mode="after")
    def _one_token(self):
        _given_one(self, "token_id", "token_text")
        return self


class PPLIn(_Body):
    # at least 2 tokens, which a schema cannot count (the library refuses fewer); the example has them, so
    # a client (or a fuzzer) starting from it varies one field of a body the server takes
    text: str = Field(
        min_length=1,
        max_length=SERVED_TEXT_MAX_CHARS,
        examples=["The quick brown fox jumps over the lazy dog. The dog sleeps."],
    )
    model: str | None = None
    strategy: StrategyName | None = Field(
        None, description=f"null: baseline perplexity only; {STRATEGY_HELP}"
    )
    params: Params
    mode: Literal["exact", "parallel", "jacobi"] | None = Field(
        None, description="null: parallel for non-recurrent strategies, jacobi for recurrent ones"
    )
    passes: whole(**within(PASSES)) = Field(PPLConfig.passes, description="jacobi passes")
    window: whole(**within(PPL_WINDOW)) = Field(
        PPLConfig.window, description="tokens per scoring window (capped by the context)"
    )
    stride: whole(**within(PPL_STRIDE)) = Field(PPLConfig.stride, description="at most `window`")
    chunk: whole(**within(PPL_CHUNK)) = PPLConfig.chunk
    bootstrap: whole(**within(PPL_BOOTSTRAP)) = Field(
        PPLConfig.bootstrap, description="bootstrap resamples for the 95% CI"
    )
    seed: whole(**within(SMALL_SEED)) = PPLConfig.seed
    token_detail: bool = Field(False, description="also return per-token NLLs of both sides")


class QuestionIn(_Body):
    question: filled(MAX_PROMPT_CHARS)
    answer: filled(SHORT_TEXT_MAX_CHARS) | int | float = Field(
        description="the gold answer, matched as Deep Think matches votes"
    )


class CalibrateIn(_Body):
    questions: list[QuestionIn] | None = Field(
        None,
        min_length=MIN_QUESTIONS,
        max_length=SERVED_MAX_QUESTIONS,
        description="questions with gold answers, split dev (even positions) / test (odd); "
        "null: the built-in 16",
    )
    model: str | None = None
    strategy: StrategyName = Field(
        CalibrationConfig.strategy, description=f"the feedback row's strategy: {STRATEGY_HELP}"
    )
    params: Params
    # the served defaults, smaller than the library's: a request that names no size is small
    samples: whole(**within(TRACES)) = Field(
        SERVED_CALIBRATION_SAMPLES, description="sampled traces per question per row (baseline and feedback)"
    )
    max_new_tokens: whole(**within(TRACE_MAX_NEW_TOKENS)) = SERVED_CALIBRATION_MAX_NEW_TOKENS
    temperature: Temperature = Field(
        CalibrationConfig.temperature,
        description=f"0 = greedy (every sample the same); otherwise at least {MIN_TEMPERATURE:g}",
    )
    top_p: float = Field(CalibrationConfig.top_p, gt=TOP_P.lo, le=TOP_P.hi)
    seed: whole(**within(SERVED_SEED)) = CalibrationConfig.seed
    window: whole(**within(DEEPCONF_WINDOW)) = Field(
        CalibrationConfig.window, description="DeepConf group window (tokens)"
    )
    k: whole(**within(DEEPCONF_K)) = Field(
        CalibrationConfig.k, description="DeepConf top-k for token confidence"
    )
    etas: list[Annotated[float, Field(gt=0, le=100)]] = Field(
        default_factory=lambda: CalibrationConfig().etas,
        min_length=1,
        max_length=8,
        description="η, % of traces the early-stop threshold keeps: one threshold report each",
    )
    bins: whole(**within(BINS)) = Field(CalibrationConfig.bins, description="reliability diagram bins")
    answer_regex: str | None = Field(
        None,
        max_length=SHORT_TEXT_MAX_CHARS,
        description="the answer's pattern (its first group); null: Deep Think's rules",
    )
    chat_template: bool = CalibrationConfig.chat_template
    traces: bool = Field(False, description="also return every trace (text, answer, correctness, measures)")


class ErrorOut(BaseModel):
    error: str
    details: list[dict[str, Any]] | None = None


ERRORS = {
    code: {"model": ErrorOut, "description": text}
    for code, text in [
        (400, "malformed JSON"),
        (401, "missing or wrong API key"),
        (413, "request body too large"),
        (422, "invalid values"),
        (503, "the model is busy; see Retry-After"),
    ]
}
NOT_FOUND = {404: {"model": ErrorOut, "description": "no recent run with that run_id on this server"}}
# A route that streams answers 200 as one JSON document, or as NDJSON lines or Server-Sent Events
STREAMED = {
    200: {
        "description": "the result, or its events streamed",
        "content": {"application/json": {}, "application/x-ndjson": {}, "text/event-stream": {}},
    }
}


def to_config(req: GenerateIn, model: str) -> RunConfig:
    """The request as a `RunConfig`, through the same validation as the UI's runs."""
    rows = (
        [RowSpec(**r.model_dump()) for r in req.rows]
        if req.rows
        else default_rows(req.strategy, dict(req.params))
    )
    return RunConfig(
        prompt=req.prompt,
        model=model,
        chat_template=req.chat_template,
        system_prompt=req.system_prompt,
        max_new_tokens=req.max_new_tokens,
        seed=req.seed,
        sampling=SamplingConfig(**req.sampling.model_dump()),
        deepconf=DeepConfConfig(**req.deepconf.model_dump()),
        rows=rows,
        reference=req.reference,
        key_facts=list(req.key_facts),
        quality=req.quality,
    ).validate()


def saved_result(run: SavedRunIn) -> RunResult:
    """A RunResult sent back by a client, as far as a follow-up needs it."""
    rows = [RowResult(r.name, r.strategy, dict(r.params), list(r.token_ids), r.text) for r in run.rows]
    return RunResult(
        config=run.config.model_dump(), rows=rows, **({"run_id": run.run_id} if run.run_id else {})
    )
