"""The CPU threads a decode step runs on: the count measured fastest for it on this machine.

A decode step is a few hundred small ops and ~120 products of one row or a few, bound by reading the
weights. With idle threads asleep (OMP_WAIT_POLICY=PASSIVE, the package's default: spinning threads
cost a shared CPU far more), every op that runs in parallel first wakes them. Measured on the
development machine (AMD EPYC, 2 vCPU, gemv products): a bare 1-row step took 32.0 ms at 1 thread and
39.7 at 2, while a 200-token prefill, which is arithmetic, took 505 ms at 1 and 330 at 2. So forwards
of at most DECODE_TOKENS tokens (decode steps: one token per row) run at the count measured fastest
for a bare 1-row step — 1 or all of torch's threads, timed in turn on the clock at load — and every
larger forward (a prefill, a perplexity window) at all of them. The choice is cached per machine and
model shape beside the linear kernels' (`kernels/`).

`FEEDBACK_DECODE_THREADS`: a number of threads for decode steps, or `auto` (unset: measured).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

ENV = "FEEDBACK_DECODE_THREADS"
DECODE_TOKENS = 16  # a forward of more tokens runs at all threads
STEPS, ROUNDS = 6, 3  # bare steps per timing, and timings per candidate (in turn; the best kept)


def setting() -> int | None:
    """FEEDBACK_DECODE_THREADS as a count, or None for auto (measured); anything else refused."""
    from feedback.errors import FeedbackError

    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise FeedbackError(f"{ENV} must be a positive whole number or auto, got {raw!r}")
    return int(raw)


def bare_step_seconds(
    model: nn.Module,
    ids: torch.Tensor,
    rows: int,
    steps: int,
    threads: int | None,
    clock: Callable[[], float],
    engine_cache: bool = False,
) -> float:
    """Mean `clock` time of `steps` bare greedy decode steps of `rows` rows (no sampling, metrics,
    hooks or records) after a prefill of `ids` on a fresh cache (transformers' `DynamicCache`, or
    with `engine_cache` the engine's, `kvcache.run_cache`, whose decode steps take the compiled
    calls); the steps at `threads` (`decoding`)."""
    from transformers import DynamicCache

    from feedback.core import kvcache

    with torch.inference_mode():
        if engine_cache:
            cache = kvcache.run_cache(model.config, ids.shape[1] + steps + 1)
        else:
            cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, cache=cache, use_cache=True)
        cache.batch_repeat_interleave(rows)
        tok = out.logits[:, -1].argmax(-1).repeat(rows)[:, None]
        with decoding(threads, rows):
            start = clock()
            for _ in range(steps):
                tok = model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1)[:, None]
            return (clock() - start) / steps


def measure(model: nn.Module, clock: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """Seconds of a bare 1-row decode step (`bare_step_seconds`, STEPS steps after 8 prompt tokens)
    at 1 thread and at all of torch's: each the best of ROUNDS timings, the candidates in turn each
    round (a passing load hits both)."""
    candidates = sorted({1, torch.get_num_threads()})
    ids = torch.arange(1, 9)[None]
    best = dict.fromkeys(candidates, float("inf"))
    for n in candidates:
        bare_step_seconds(model, ids, 1, STEPS, n, clock)  # warm-up: allocator, kernels, the thread pool
    for _ in range(ROUNDS):
        for n in candidates:
            best[n] = min(best[n], bare_step_seconds(model, ids, 1, STEPS, n, clock))
    return best


def fingerprint(model: nn.Module) -> str:
    """What a measured count holds for besides the machine: the model's type, sizes and weights' dtype."""
    c = model.config.get_text_config()
    dtype = next(model.parameters()).dtype
    kinds = sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__})
    return f"{c.model_type}-h{c.hidden_size}-l{c.num_hidden_layers}-v{c.vocab_size}-{dtype}-{'+'.join(kinds)}"


def chosen(model: nn.Module) -> int | None:
    """The decode threads for `model` here: FEEDBACK_DECODE_THREADS, else the count measured
    fastest (`measure`), remembered per machine and `fingerprint`; None where torch runs one thread
    anyway."""
    from feedback.core.linear import cache_file, remembered

    given = setting()
    if given is not None:
        return given
    if torch.get_num_threads() == 1:
        return None

    def timed(keys: list[str]) -> dict:
        seconds = measure(model)
        return {
            keys[0]: {
                "threads": min(seconds, key=seconds.get),
                "seconds": {str(n): s for n, s in seconds.items()},
            }
        }

    key = fingerprint(model)
    return int(remembered(cache_file("threads-"), [key], timed)[key]["threads"])


@contextlib.contextmanager
def decoding(threads: int | None, tokens: int) -> Iterator[None]:
    """torch at `threads` for a forward of `tokens` tokens when it is a decode step (at most
    DECODE_TOKENS), as it was otherwise and afterwards."""
    before = torch.get_num_threads()
    if threads is None or tokens > DECODE_TOKENS or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
