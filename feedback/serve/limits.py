"""What a shared server allows one request, declared once for every door.

The page, the Gradio API, the HTTP API and the batch runner read these caps from here: a request
over one is refused the same way wherever it comes in, naming the field. The library's own,
looser limits (a whole run, a local command line) stay beside the config they bound, such as
`records.MAX_NEW_TOKENS_CAP` or `deepthink.MAX_TRACES`; each cap here sits under its limit.
"""

from __future__ import annotations

import os

from feedback.core.bounds import TYPE_CEILING, Bound
from feedback.core.records import MAX_PROMPT_CHARS, SEED, RowResult, RunConfig, RunResult
from feedback.errors import FeedbackError
from feedback.eval.perplexity import BOOTSTRAP, MIN_WINDOW, TOKENS_PER_DOC
from feedback.eval.recall import DEPTH, ITEMS, LENGTH, NEW_TOKENS, parse_depths, parse_lengths
from feedback.strategies import build_strategy

# A run's length: shared servers bound how long one visitor holds the model.
SERVED_MAX_NEW_TOKENS = 1024
MAX_NEW_TOKENS = Bound("max new tokens", 1, SERVED_MAX_NEW_TOKENS, integer=True)
BOX_MAX_CHARS = (
    MAX_PROMPT_CHARS  # a prompt, system prompt, reference or follow-up typed into the page, as in a request
)
# Deep Think and calibration: traces (and warm-up traces) per side, and each trace's length.
SERVED_MAX_TRACES = 16
TRACES = Bound("traces per side", 1, SERVED_MAX_TRACES, integer=True)
WARMUP_TRACES = Bound("warm-up traces", 1, SERVED_MAX_TRACES, integer=True)
SERVED_TRACE_MAX_NEW_TOKENS = 512
TRACE_MAX_NEW_TOKENS = Bound("max new tokens", 1, SERVED_TRACE_MAX_NEW_TOKENS, integer=True)
# Perplexity, sweeps and tuning on the page.
SERVED_TEXT_MAX_CHARS = 200_000  # pasted text (page) and request text (API)
SERVED_MAX_DOCS = 40  # documents per request: a whole built-in split is 39-40
MAX_DOCS = Bound("max documents", 1, SERVED_MAX_DOCS, integer=True)
# Tokens scored per document (the rest is cut off). The cap, also the page's default, cuts nothing
# the default scoring budget could score: every token is fed in about two windows, so a document of
# over 75,000 tokens is refused by the budget anyway; a person lowers it for a shorter job.
SERVED_MAX_TOKENS_PER_DOC = 100_000
MAX_TOKENS_PER_DOC = TOKENS_PER_DOC.with_hi(SERVED_MAX_TOKENS_PER_DOC)
SERVED_MAX_POINTS = 24  # sweep grid points per request
SERVED_MAX_TRIALS = 24  # tuning trials per request
TRIALS = Bound("trials", 1, SERVED_MAX_TRIALS, integer=True)
UPLOAD_MAX_BYTES = 5_000_000  # a file given to the page; Gradio refuses larger ones before writing them
UPLOAD_BODY_MAX_BYTES = UPLOAD_MAX_BYTES + 64_000  # an upload request: the file and its multipart framing
# The runs this browser keeps (History, in local storage). The page sends them back with History's
# requests (the table, a reload, an export) and when it records a run.
HISTORY_MAX_BYTES = 3_000_000
# The HTTP API.
MAX_MESSAGES = 200  # earlier turns of one row's conversation
MAX_BODY_BYTES = 1_000_000  # a request body; larger ones are refused while they are read
# A request to the page's server (Gradio API) may carry a browser's run history besides what an
# HTTP API request carries, so it may be larger by that much and no more.
PAGE_MAX_BODY_BYTES = MAX_BODY_BYTES + HISTORY_MAX_BYTES
# Requests waiting for the model at once, from every door together (page, Gradio API, HTTP API):
# one first-come, first-served line; when it is full each door refuses (503 with Retry-After, or
# the page's message) until a place frees. FEEDBACK_QUEUE_SIZE / --queue-size change it.
MAX_WAITING = 16
QUEUE_SIZE_ENV = "FEEDBACK_QUEUE_SIZE"
# Runs that decode together: each request's rows join the model's running batch (one forward a step
# for all of them) while their caches fit the memory cap together, at most this many requests at
# once; the next ones wait in the line. FEEDBACK_SHARED_RUNS changes it; 1 serves one run at a time.
SHARED_RUNS = 8
SHARED_RUNS_ENV = "FEEDBACK_SHARED_RUNS"
API_WAIT_S = (
    300.0  # the longest an HTTP API request waits for the model before a 503 (a page waits until Stop)
)
# ZeroGPU (Hugging Face's shared GPUs): each page request asks for the GPU time its size needs
# (`spaces.GPU`'s duration, sized by `feedback.serve.gpu_time`), and at most this many seconds; one
# that needs more is refused before it waits, naming what to ask less of. ZeroGPU itself refuses a
# call over the visitor's per-call maximum ("illegal duration") and serves shorter requests first.
# FEEDBACK_GPU_DURATION_CAP changes it (the per-call maximum of the Space's visitors).
GPU_DURATION_CAP_S = 120
GPU_DURATION_CAP_ENV = "FEEDBACK_GPU_DURATION_CAP"
SERVED_MAX_ROWS = 8  # rows of one run (the library allows records.MAX_ROWS)
NAME_MAX_CHARS = 64  # a row's name, a run id
MAX_PARAMS = 32  # strategy parameters of one row or request
SHORT_TEXT_MAX_CHARS = 1000  # one key fact; the text a branch forces
# A row's answer text in a saved run that comes back (a reload, a follow-up). Continue puts the answer
# into the row's conversation, which the library holds to MAX_PROMPT_CHARS in all, so a longer one
# could never go on; and an answer of SERVED_MAX_NEW_TOKENS tokens is far shorter than this.
ANSWER_MAX_CHARS = MAX_PROMPT_CHARS
SMALL_SEED = Bound(
    "seed", 0, 2**31, integer=True
)  # a row's seed offset; a perplexity request's bootstrap seed
# A run's or a row's seed in a JSON body: past 2**53 a JSON number is not exact in most clients (a
# double), nor in schema tools that read the bound as one, so the HTTP API takes seeds up to there.
SERVED_SEED = SEED.with_hi(TYPE_CEILING)
# Perplexity requests: the window, stride and chunk (the model's context caps them anyway) and the
# bootstrap, whose library limit is far above what one request needs.
SERVED_MAX_WINDOW = 1_000_000
PPL_WINDOW = Bound("window", MIN_WINDOW, SERVED_MAX_WINDOW, integer=True)
PPL_STRIDE = Bound("stride", 1, SERVED_MAX_WINDOW, integer=True)
PPL_CHUNK = Bound("chunk", 1, SERVED_MAX_WINDOW, integer=True)
SERVED_MAX_BOOTSTRAP = 10_000
PPL_BOOTSTRAP = BOOTSTRAP.with_hi(SERVED_MAX_BOOTSTRAP)
# Long-context recall on the page (the Perplexity tab's Recall section): a small grid. Each prompt
# is one run of both rows; the scoring and decoding budgets hold the whole grid as well.
# Questions of one calibration request (the built-in set has 16); the decoded-token budget bounds the
# work, this the body.
SERVED_MAX_QUESTIONS = 64
# A calibration request that names no size: the built-in questions, this many traces per question per
# row of at most this many tokens (16 x 2 rows x 2 x 32 = 2,048 decoded tokens, an eighth of the
# default budget: 35-40 s on the 2-core dev CPU, where the library's own 8 x 64 takes the whole budget).
SERVED_CALIBRATION_SAMPLES = 2
SERVED_CALIBRATION_MAX_NEW_TOKENS = 32
SERVED_RECALL_MAX_ITEMS = 8
RECALL_ITEMS = ITEMS.with_hi(SERVED_RECALL_MAX_ITEMS)
SERVED_RECALL_MAX_LENGTH = 4096  # tokens of text (the embedded model's context is 8,192)
RECALL_LENGTH = LENGTH.with_hi(SERVED_RECALL_MAX_LENGTH)
SERVED_RECALL_MAX_VALUES = 5  # lengths, and depths, per request
SERVED_RECALL_MAX_NEW_TOKENS = 64  # an answer is a few words
RECALL_NEW_TOKENS = NEW_TOKENS.with_hi(SERVED_RECALL_MAX_NEW_TOKENS)
RECALL_GRID_CHARS = 200  # the lengths or depths box


def check_recall_grid(lengths, depths) -> tuple[list[int], list[float]]:
    """A recall request's lengths and depths ("256, 1024" or lists) held to the served caps, each
    refusal naming the field."""
    for name, value in (("lengths", lengths), ("depths", depths)):
        if isinstance(value, str):
            _check_length(name, value, RECALL_GRID_CHARS)
    lengths, depths = parse_lengths(lengths), parse_depths(depths)
    for bound, values in ((RECALL_LENGTH, lengths), (DEPTH, depths)):
        if len(values) > SERVED_RECALL_MAX_VALUES:
            raise FeedbackError(
                f"{bound.name}: at most {SERVED_RECALL_MAX_VALUES} values here, got {len(values)} "
                "(`python -m feedback recall` takes more)"
            )
        for v in values:
            bound.check(v)
    return lengths, depths


def check_run(
    cfg: RunConfig, num_layers: int | None = None, max_rows: int = SERVED_MAX_ROWS, rows_name: str = "rows"
) -> RunConfig:
    """A run's config held to the served caps, whichever way it came in: a new request, a saved run
    sent back to continue or branch, a link, a run reloaded from History. Refused with a
    `FeedbackError` naming the field, before the run waits for the model. `max_rows` is the
    door's own (the page shows at most 4 columns, `rows_name`); with `num_layers` every row's
    strategy is built, so its parameters are checked against the model too."""
    cfg.validate()
    MAX_NEW_TOKENS.check(cfg.max_new_tokens)
    Bound(rows_name, 1, max_rows, integer=True).check(len(cfg.rows))
    for n, fact in enumerate(cfg.key_facts, start=1):
        _check_length(f"key fact {n}", fact, SHORT_TEXT_MAX_CHARS)
    for row in cfg.rows:
        _check_row(row, num_layers)
    return cfg


def check_saved_run(
    result: RunResult,
    vocab_size: int,
    num_layers: int | None = None,
    max_rows: int = SERVED_MAX_ROWS,
    rows_name: str = "rows",
    served: bool = True,
) -> RunConfig:
    """A saved run that comes back — reloaded from History, or sent to continue or branch — held to
    what a new request is held to, refused with a `FeedbackError` naming the field. A saved run is
    the client's word, not a record of this server's: its config goes through `check_run` (with
    `served=False`, the library's own limits, as a command line's new run), and each row's answer
    must be one the model could have given it: one answer per row of the config, in order; its
    token ids whole numbers in the vocabulary (`vocab_size`), no more of them than max_new_tokens
    (a branch's forced tokens are among them; a conversation's earlier turns are text in the row's
    messages, not ids); its text within ANSWER_MAX_CHARS (a served cap, so not on the command
    line); its step records, when it has them, one per token. Returns the config."""
    cfg = RunConfig.from_dict(result.config)
    cfg = check_run(cfg, num_layers, max_rows, rows_name) if served else cfg.validate()
    answers, specs = [getattr(r, "name", None) for r in result.rows], [r.name for r in cfg.rows]
    if answers != specs:
        raise FeedbackError(
            f"{rows_name}: the run's answers are for {str(answers)[:200]} but its settings' "
            f"{rows_name} are {str(specs)[:200]}"
        )
    for row in result.rows:
        _check_answer(row, cfg.max_new_tokens, vocab_size, served)
    return cfg


def _check_answer(row: RowResult, max_new_tokens: int, vocab_size: int, served: bool) -> None:
    where = f"row {str(row.name)[:NAME_MAX_CHARS]!r}"
    ids = row.token_ids
    if not isinstance(ids, list):
        raise FeedbackError(f"{where}: token_ids must be a list of token ids, got {type(ids).__name__}")
    if len(ids) > max_new_tokens:
        raise FeedbackError(
            f"{where}: token_ids has {len(ids):,} tokens but max_new_tokens is {max_new_tokens}"
        )
    vocab = f"the vocabulary (0–{vocab_size - 1})"
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):  # 1e12 comes as a float, true as a bool
            raise FeedbackError(f"{where}: token_ids[{i}] must be a whole number in {vocab}, got {t!r:.40}")
        if not 0 <= t < vocab_size:  # (one of thousands of digits could not even be printed)
            shown = t if abs(t) < 10**30 else "a number of over 30 digits"
            raise FeedbackError(f"{where}: token_ids[{i}] = {shown} is outside {vocab}")
    if not isinstance(row.text, str):
        raise FeedbackError(f"{where}: text must be text, got {type(row.text).__name__}")
    if served:
        _check_length(f"{where}: text", row.text, ANSWER_MAX_CHARS)
    if not isinstance(row.steps, list) or row.steps and len(row.steps) != len(ids):
        got = len(row.steps) if isinstance(row.steps, list) else type(row.steps).__name__
        raise FeedbackError(f"{where}: steps must hold one record per token ({len(ids)}) or none, got {got}")


def _check_length(name: str, text: str | None, limit: int) -> None:
    if text is not None and len(text) > limit:
        raise FeedbackError(f"{name} is limited to {limit:,} characters here, got {len(text):,}")


def _check_row(row, num_layers: int | None) -> None:
    where = f"row {str(row.name)[:NAME_MAX_CHARS]!r}"
    if not isinstance(row.name, str) or not 1 <= len(row.name) <= NAME_MAX_CHARS:
        raise FeedbackError(
            f"a row's name must be text of 1 to {NAME_MAX_CHARS} characters, got {row.name!r:.80}"
        )
    if len(row.params) > MAX_PARAMS:
        raise FeedbackError(f"{where}: params are limited to {MAX_PARAMS}, got {len(row.params)}")
    if row.messages is not None and len(row.messages) > MAX_MESSAGES:
        raise FeedbackError(
            f"{where}: messages are limited to {MAX_MESSAGES} earlier turns, got {len(row.messages)}"
        )
    if row.strategy is not None and num_layers is not None:
        try:
            build_strategy(row.strategy, row.params, num_layers)
        except FeedbackError as exc:
            raise FeedbackError(f"{where}: {exc}") from None


def queue_size_setting(flag: int | None = None) -> int:
    """How many requests may wait for the model at once: `flag` (--queue-size), else
    FEEDBACK_QUEUE_SIZE, else MAX_WAITING; refused naming the setting unless a whole number >= 0."""
    raw = flag if flag is not None else os.environ.get(QUEUE_SIZE_ENV, "").strip() or MAX_WAITING
    return Bound(f"the queue size ({QUEUE_SIZE_ENV} / --queue-size)", 0, None, integer=True).check(raw)


def shared_runs_setting() -> int:
    """How many runs may decode together: FEEDBACK_SHARED_RUNS, else SHARED_RUNS; refused naming
    the setting unless a whole number of at least 1."""
    raw = os.environ.get(SHARED_RUNS_ENV, "").strip() or SHARED_RUNS
    return Bound(f"the runs decoding together ({SHARED_RUNS_ENV})", 1, None, integer=True).check(raw)


def gpu_duration_cap_setting() -> int:
    """The most GPU seconds one request may ask for on ZeroGPU: FEEDBACK_GPU_DURATION_CAP, else
    GPU_DURATION_CAP_S; refused naming the setting unless a whole number of at least 1."""
    raw = os.environ.get(GPU_DURATION_CAP_ENV, "").strip() or GPU_DURATION_CAP_S
    return Bound(f"the GPU duration cap ({GPU_DURATION_CAP_ENV})", 1, None, integer=True).check(raw)
