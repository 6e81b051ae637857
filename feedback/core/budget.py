"""What one request may cost a shared server, checked before any work starts.

Three budgets, each a setting with a default sized for a small shared machine:
- scored tokens: token-forwards of teacher-forced scoring (perplexity, sweeps): every token of every
  window, once for the baseline and once per feedback pass (Jacobi passes count each; a token-by-
  token `exact` pass counts EXACT_COST, as it measured ~11x slower per token than a parallel one);
- decoded tokens: rows x new tokens of generation (Compare, the API, Deep Think's traces);
- memory: the key/value cache a generation holds (rows x (prompt + new tokens)) plus the attention
  scratch of one prefill chunk, in MB; it caps how long a prompt a request may bring.
The page, the Gradio API and the HTTP API use the same budgets (`Budget.from_env()`); the command
line and the batch runner are the owner's own jobs and unlimited unless the variables are set.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import psutil

from feedback.errors import FeedbackError

# a token-by-token pass costs ~11x a parallel pass per token (docs/results/RESULTS.md: 255 vs 22.6 tok/s)
EXACT_COST = 10
PREFILL_CHUNK = 512  # prompt tokens per prefill forward (bounds the attention scratch of long prompts)
ENV = {
    "scored_tokens": "FEEDBACK_BUDGET_SCORED_TOKENS",
    "decoded_tokens": "FEEDBACK_BUDGET_DECODED_TOKENS",
    "memory_mb": "FEEDBACK_BUDGET_MEMORY_MB",
}
# Served defaults: about 5 minutes of work on the 2-core development CPU (parallel scoring ran ~500
# token-forwards/s; a 2-row decode step ~0.12 s), and a quarter of the memory free at start.
DEFAULT_SCORED_TOKENS = 150_000
DEFAULT_DECODED_TOKENS = 16_384


def default_memory_mb() -> int:
    return max(512, int(psutil.virtual_memory().available / 2**20 / 4))


MEMORY_CAP_ENV = "FEEDBACK_MEMORY_CAP_MB"


def memory_cap_mb(device) -> float:
    """What one run's key/value cache may take, for every run (command line and batch runs too, not
    only served requests): FEEDBACK_MEMORY_CAP_MB, else 80 % of the memory free now on the run's
    device (the cache is allocated whole when the run starts, so a run that cannot fit is refused
    before any work rather than failing part way)."""
    raw = os.environ.get(MEMORY_CAP_ENV, "").strip()
    if raw:
        try:
            value = float(raw.replace("_", ""))
        except ValueError:
            raise FeedbackError(f"{MEMORY_CAP_ENV} must be a number of MB, got {raw!r}") from None
        if value <= 0:
            raise FeedbackError(f"{MEMORY_CAP_ENV} must be positive, got {raw!r}")
        return value
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        if not torch.cuda.is_initialized():
            # ZeroGPU's main process holds the model "on CUDA" without ever starting CUDA, and must
            # not start it: there the request's memory budget is the check before the GPU function
            return math.inf
        free, _ = torch.cuda.mem_get_info(device)
        return 0.8 * free / 2**20
    return 0.8 * psutil.virtual_memory().available / 2**20


def check_fits(mb: float, how: str, device) -> None:
    """Refuse a run whose cache would not fit the memory cap, saying what it needs and how to fit."""
    cap = memory_cap_mb(device)
    if mb > cap:
        raise FeedbackError(
            f"this run needs about {_fmt(mb)} MB for its key/value cache ({how}); the memory cap is "
            f"{_fmt(cap)} MB ({MEMORY_CAP_ENV}, default 80 % of free memory): use fewer rows, a shorter "
            "prompt or fewer new tokens"
        )


def _fmt(n: float) -> str:
    return f"{n:,.0f}"


@dataclass(frozen=True)
class Budget:
    """Per-request limits; None = unlimited."""

    scored_tokens: int | None = DEFAULT_SCORED_TOKENS
    decoded_tokens: int | None = DEFAULT_DECODED_TOKENS
    memory_mb: int | None = None  # None here; `from_env` fills in the served default

    @classmethod
    def unlimited(cls) -> Budget:
        return cls(None, None, None)

    @classmethod
    def from_env(cls, served: bool = True) -> Budget:
        """The FEEDBACK_BUDGET_* settings; unset ones take the served defaults (`served`) or none.
        0 or "none" means unlimited."""
        defaults = (
            {
                "scored_tokens": DEFAULT_SCORED_TOKENS,
                "decoded_tokens": DEFAULT_DECODED_TOKENS,
                "memory_mb": default_memory_mb(),
            }
            if served
            else {k: None for k in ENV}
        )
        values = {}
        for field, var in ENV.items():
            raw = os.environ.get(var, "").strip().lower()
            if not raw:
                values[field] = defaults[field]
                continue
            if raw in ("0", "none", "unlimited"):
                values[field] = None
                continue
            try:
                values[field] = int(raw.replace("_", ""))
            except ValueError:
                raise FeedbackError(
                    f"{var} must be a whole number (0 or none = unlimited), got {raw!r}"
                ) from None
            if values[field] < 0:
                raise FeedbackError(f"{var} must not be negative, got {raw!r}")
        return cls(**values)

    def check_scoring(self, cost: int, how: str) -> None:
        if self.scored_tokens is not None and cost > self.scored_tokens:
            raise FeedbackError(
                f"this request would score {_fmt(cost)} token-forwards ({how}); the server's budget is "
                f"{_fmt(self.scored_tokens)} per request ({ENV['scored_tokens']}): score less text, fewer "
                "points or passes, or use parallel mode"
            )

    def check_decoding(self, cost: int, how: str) -> None:
        if self.decoded_tokens is not None and cost > self.decoded_tokens:
            raise FeedbackError(
                f"this request would decode {_fmt(cost)} tokens ({how}); the server's budget is "
                f"{_fmt(self.decoded_tokens)} per request ({ENV['decoded_tokens']}): ask for fewer rows, "
                "traces or new tokens"
            )

    def check_memory(self, mb: float, how: str) -> None:
        if self.memory_mb is not None and mb > self.memory_mb:
            raise FeedbackError(
                f"this request needs about {_fmt(mb)} MB of memory ({how}); the server allows "
                f"{_fmt(self.memory_mb)} MB per request ({ENV['memory_mb']}): use a shorter prompt, "
                "fewer rows or fewer new tokens"
            )


def scoring_cost(window_tokens: int, mode: str | None, passes: int, feedback_points: int) -> int:
    """Token-forwards of scoring `window_tokens` (the summed lengths of every window): the baseline
    once, then `feedback_points` feedback evaluations in `mode` (None: no feedback)."""
    if mode is None or feedback_points == 0:
        return window_tokens
    per_pass = {"parallel": 1, "jacobi": passes, "exact": EXACT_COST}[mode]
    return window_tokens * (1 + per_pass * feedback_points)


def kv_bytes_per_token(model_config, dtype_bytes: int) -> int:
    """Key/value cache bytes one token of one row takes, from the model's configuration."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * dtype_bytes


def generation_memory_mb(
    model_config, dtype_bytes: int, rows: int, prompt_tokens: int, new_tokens: int
) -> float:
    """The cache of `rows` rows of prompt + new tokens, and eager attention's fp32 scores for one
    prefill chunk (the largest transient of a run)."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    total = prompt_tokens + new_tokens
    cache = rows * total * kv_bytes_per_token(model_config, dtype_bytes)
    scratch = min(prompt_tokens, PREFILL_CHUNK) * total * cfg.num_attention_heads * 4
    return (cache + scratch) / 2**20


def dtype_bytes(dtype_name: str) -> int:
    return 4 if dtype_name == "float32" else 2
