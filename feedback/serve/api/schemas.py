"""The API's request and response bodies, and how a request becomes the library's config.

Every bound here is read from where it is declared: the library's beside its config dataclass
(records, sampling, perplexity), the served caps in `feedback.serve.limits`. The constraints are the
OpenAPI schema and refuse a request before any work; the library validates again.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from feedback.core.bounds import Bound
from feedback.core.records import (DEEPCONF_K, DEEPCONF_WINDOW, MAX_KEY_FACTS, MAX_PROMPT_CHARS, SEED, DeepConfConfig,
                                   RowResult, RowSpec, RunConfig, RunResult, default_rows)
from feedback.core.sampling import MIN_P, MIN_TEMPERATURE, REPETITION_PENALTY, TEMPERATURE, TOP_K, TOP_P, SamplingConfig
from feedback.eval.calibration import BINS, MIN_QUESTIONS, CalibrationConfig
from feedback.eval.perplexity import PASSES, PPLConfig
from feedback.serve.limits import (MAX_MESSAGES, MAX_NEW_TOKENS, MAX_PARAMS, NAME_MAX_CHARS, PPL_BOOTSTRAP, PPL_CHUNK,
                                   PPL_STRIDE, PPL_WINDOW, SERVED_MAX_NEW_TOKENS, SERVED_MAX_QUESTIONS, SERVED_MAX_ROWS,
                                   SERVED_TEXT_MAX_CHARS, SHORT_TEXT_MAX_CHARS, SMALL_SEED)
from feedback.serve.limits import TRACE_MAX_NEW_TOKENS, TRACES

ParamValue = bool | int | float | str
Params = Annotated[dict[str, ParamValue], Field(default_factory=dict, max_length=MAX_PARAMS)]
Name = Annotated[str, Field(min_length=1, max_length=NAME_MAX_CHARS)]
TokenIds = list[Annotated[int, Field(ge=0)]]


def within(bound: Bound) -> dict:
    """A bound as pydantic's `ge`/`le`."""
    return {"ge": bound.lo, "le": bound.hi}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class SamplingIn(_Body):
    temperature: float = Field(SamplingConfig.temperature, **within(TEMPERATURE),
                               description=f"0 = greedy; otherwise at least {MIN_TEMPERATURE:g}")
    top_k: int = Field(SamplingConfig.top_k, **within(TOP_K), description="0 = off")
    # 0 would keep no token: refused, so the lower bound is exclusive
    top_p: float = Field(SamplingConfig.top_p, gt=TOP_P.lo, le=TOP_P.hi, description="1 = off")
    min_p: float = Field(SamplingConfig.min_p, **within(MIN_P), description="0 = off")
    repetition_penalty: float = Field(SamplingConfig.repetition_penalty, **within(REPETITION_PENALTY),
                                      description="1 = off")


class DeepConfIn(_Body):
    k: int = Field(DeepConfConfig.k, **within(DEEPCONF_K), description="top-k for token confidence")
    window: int = Field(DeepConfConfig.window, **within(DEEPCONF_WINDOW),
                        description="group confidence window (tokens)")
    threshold: float | None = Field(None, description="early stop when group confidence falls below; null = off")


# Every field that names a strategy takes a stack too.
STRATEGY_HELP = ("a strategy (GET /api/strategies), or several joined by '+', applied in that order (a stack, "
                 "e.g. inner_loop+deep_cache, whose params are named <strategy>.<param>)")


class MessageIn(_Body):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_PROMPT_CHARS)


class RowIn(_Body):
    name: Name
    strategy: str | None = Field(None, description=f"null for a plain baseline row; {STRATEGY_HELP}")
    params: Params
    seed_offset: int = Field(0, **within(SMALL_SEED), description="rows with equal offsets share random draws")
    threshold: float | None = Field(None, description="this row's early-stop threshold; null: the run's")
    prompt: str | None = Field(None, min_length=1, max_length=MAX_PROMPT_CHARS,
                               description="this row's own prompt (a prompt variant; its newest user turn); "
                                           "null: the run's")
    system_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description="null: the run's")
    messages: list[MessageIn] | None = Field(None, max_length=MAX_MESSAGES,
                                             description="this row's earlier conversation turns, before its prompt "
                                                         "(chat template only)")
    prefix: TokenIds | None = Field(
        None, max_length=SERVED_MAX_NEW_TOKENS,
        description="token ids the reply is forced to start with (a branch's replay); marked `forced` in the steps")
    chosen: int = Field(0, ge=0, le=SERVED_MAX_NEW_TOKENS,
                        description="how many of `prefix`'s last tokens a person chose (marked `chosen` in the "
                                    "steps); the rest replay earlier text")
    temperature: float | None = Field(None, **within(TEMPERATURE),
                                      description=f"this row's sampling temperature (0 = greedy; otherwise at least "
                                                  f"{MIN_TEMPERATURE:g}); null: the run's")
    top_p: float | None = Field(None, gt=TOP_P.lo, le=TOP_P.hi, description="this row's top-p (1 = off); null: the run's")
    seed: int | None = Field(None, **within(SEED), description="this row's seed; null: the run's")


class _RunFields(_Body):
    """What a run is, shared by new requests and the saved runs that follow-ups send back."""

    prompt: str = Field("", max_length=MAX_PROMPT_CHARS,
                        description="every row's prompt, unless a row has its own (may be empty only then)")
    model: str | None = Field(None, description="a name from GET /api/models; null: the default")
    chat_template: bool = RunConfig.chat_template
    system_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    max_new_tokens: int = Field(RunConfig.max_new_tokens, **within(MAX_NEW_TOKENS))
    seed: int = Field(RunConfig.seed, **within(SEED))
    sampling: SamplingIn = Field(default_factory=SamplingIn)
    deepconf: DeepConfIn = Field(default_factory=DeepConfIn)
    reference: str | None = Field(None, min_length=1, max_length=MAX_PROMPT_CHARS,
                                  description="a reference answer: its perplexity after each row's prompt")
    key_facts: list[Annotated[str, Field(min_length=1, max_length=SHORT_TEXT_MAX_CHARS)]] = Field(
        default_factory=list, max_length=MAX_KEY_FACTS,
        description="texts (or /regular expressions/) each answer should contain: recall per row")
    quality: bool = Field(RunConfig.quality,
                          description="also self-perplexity and prompt perplexity per row (forward passes)")


class GenerateIn(_RunFields):
    strategy: str = Field("residual", description=f"the feedback row's strategy: {STRATEGY_HELP}")
    params: Params
    rows: list[RowIn] | None = Field(None, min_length=1, max_length=SERVED_MAX_ROWS,
                                     description="explicit rows; overrides strategy/params (default: "
                                                 "baseline + one feedback row)")
    steps: bool = Field(True, description="include per-token step records in the result")


class SavedConfigIn(_RunFields):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    dtype: str = RunConfig.dtype
    rows: list[RowIn] = Field(min_length=1, max_length=SERVED_MAX_ROWS)


class SavedRowIn(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    name: Name
    strategy: str | None = None
    params: Params
    token_ids: TokenIds = Field(max_length=SERVED_MAX_NEW_TOKENS)
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class SavedRunIn(BaseModel):
    """A RunResult as /generate returned it (its steps, metrics and memory are ignored: send it with
    `steps: false`, or its `run_id`, to stay well under the body limit)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    run_id: str | None = Field(None, max_length=NAME_MAX_CHARS)
    config: SavedConfigIn
    rows: list[SavedRowIn] = Field(min_length=1, max_length=SERVED_MAX_ROWS)


class FollowUpIn(_Body):
    run: SavedRunIn | None = Field(None, description="the earlier RunResult (or give run_id)")
    run_id: str | None = Field(None, min_length=1, max_length=NAME_MAX_CHARS,
                               description="the run_id of a run this server produced recently")
    steps: bool = Field(True, description="include per-token step records in the result")


class ContinueIn(FollowUpIn):
    message: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS, description="the next user message")


class BranchIn(FollowUpIn):
    row: str = Field(min_length=1, max_length=NAME_MAX_CHARS, description="the row whose token is replaced")
    step: int = Field(ge=0, le=SERVED_MAX_NEW_TOKENS, description="the step at which the token is forced")
    token_id: int | None = Field(None, ge=0, description="the token forced at `step` (or give token_text)")
    token_text: str | None = Field(None, min_length=1, max_length=SHORT_TEXT_MAX_CHARS,
                                   description="text forced at `step`, as its tokens (or give token_id)")
    all_rows: bool = Field(True, description="every row continues from `row`'s text up to `step` and the "
                                             "forced token (paired); false: only `row`, the others decode afresh")
    matching_only: bool = Field(False, description="with `all_rows`: branch only the rows whose answer matched "
                                                   "`row`'s up to `step`; the others are replayed as they were")


class PPLIn(_Body):
    text: str = Field(min_length=1, max_length=SERVED_TEXT_MAX_CHARS)
    model: str | None = None
    strategy: str | None = Field(None, description=f"null: baseline perplexity only; {STRATEGY_HELP}")
    params: Params
    mode: Literal["exact", "parallel", "jacobi"] | None = Field(
        None, description="null: parallel for non-recurrent strategies, jacobi for recurrent ones")
    passes: int = Field(PPLConfig.passes, **within(PASSES), description="jacobi passes")
    window: int = Field(PPLConfig.window, **within(PPL_WINDOW),
                        description="tokens per scoring window (capped by the context)")
    stride: int = Field(PPLConfig.stride, **within(PPL_STRIDE))
    chunk: int = Field(PPLConfig.chunk, **within(PPL_CHUNK))
    bootstrap: int = Field(PPLConfig.bootstrap, **within(PPL_BOOTSTRAP),
                           description="bootstrap resamples for the 95% CI")
    seed: int = Field(PPLConfig.seed, **within(SMALL_SEED))
    token_detail: bool = Field(False, description="also return per-token NLLs of both sides")




class QuestionIn(_Body):
    question: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    answer: Annotated[str, Field(min_length=1, max_length=SHORT_TEXT_MAX_CHARS)] | int | float = Field(
        description="the gold answer, matched as Deep Think matches votes")


class CalibrateIn(_Body):
    questions: list[QuestionIn] | None = Field(
        None, min_length=MIN_QUESTIONS, max_length=SERVED_MAX_QUESTIONS,
        description="questions with gold answers, split dev (even positions) / test (odd); null: the built-in 16")
    model: str | None = None
    strategy: str = Field(CalibrationConfig.strategy, description=f"the feedback row's strategy: {STRATEGY_HELP}")
    params: Params
    samples: int = Field(CalibrationConfig.samples, **within(TRACES),
                         description="sampled traces per question per row (baseline and feedback)")
    max_new_tokens: int = Field(CalibrationConfig.max_new_tokens, **within(TRACE_MAX_NEW_TOKENS))
    temperature: float = Field(CalibrationConfig.temperature, **within(TEMPERATURE),
                               description=f"0 = greedy (every sample the same); otherwise at least {MIN_TEMPERATURE:g}")
    top_p: float = Field(CalibrationConfig.top_p, gt=TOP_P.lo, le=TOP_P.hi)
    seed: int = Field(CalibrationConfig.seed, **within(SEED))
    window: int = Field(CalibrationConfig.window, **within(DEEPCONF_WINDOW), description="DeepConf group window (tokens)")
    k: int = Field(CalibrationConfig.k, **within(DEEPCONF_K), description="DeepConf top-k for token confidence")
    etas: list[Annotated[float, Field(gt=0, le=100)]] = Field(
        default_factory=lambda: CalibrationConfig().etas, min_length=1, max_length=8,
        description="η, % of traces the early-stop threshold keeps: one threshold report each")
    bins: int = Field(CalibrationConfig.bins, **within(BINS), description="reliability diagram bins")
    answer_regex: str | None = Field(None, max_length=SHORT_TEXT_MAX_CHARS,
                                     description="the answer's pattern (its first group); null: Deep Think's rules")
    chat_template: bool = CalibrationConfig.chat_template
    traces: bool = Field(False, description="also return every trace (text, answer, correctness, measures)")


class ErrorOut(BaseModel):
    error: str
    details: list[dict[str, Any]] | None = None


ERRORS = {code: {"model": ErrorOut, "description": text} for code, text in [
    (400, "malformed JSON"), (401, "missing or wrong API key"), (413, "request body too large"),
    (422, "invalid values"), (503, "the model is busy; see Retry-After")]}


def to_config(req: GenerateIn, model: str) -> RunConfig:
    """The request as a `RunConfig`, through the same validation as the UI's runs."""
    rows = ([RowSpec(**r.model_dump()) for r in req.rows] if req.rows
            else default_rows(req.strategy, dict(req.params)))
    return RunConfig(prompt=req.prompt, model=model, chat_template=req.chat_template, system_prompt=req.system_prompt,
                     max_new_tokens=req.max_new_tokens, seed=req.seed,
                     sampling=SamplingConfig(**req.sampling.model_dump()),
                     deepconf=DeepConfConfig(**req.deepconf.model_dump()), rows=rows, reference=req.reference,
                     key_facts=list(req.key_facts), quality=req.quality).validate()


def saved_result(run: SavedRunIn) -> RunResult:
    """A RunResult sent back by a client, as far as a follow-up needs it."""
    rows = [RowResult(r.name, r.strategy, dict(r.params), list(r.token_ids), r.text) for r in run.rows]
    return RunResult(config=run.config.model_dump(), rows=rows, **({"run_id": run.run_id} if run.run_id else {}))
