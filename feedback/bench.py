"""`python -m feedback bench`: the engine's speed ratios against their targets, measured in one run.

Ratios, not absolute timings, are the point, and each is measured the same way: the two sides run
in turn (A B A B …) for several rounds, so a drift in machine load hits both alike; each side is
timed in CPU time of this process (every thread), which a neighbour's load disturbs far less than
wall time; a ratio is taken per round, and the bench reports their median with the lowest and
highest beside it (`spread`). The load average before and after is stated. Reported, never asserted.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from feedback import ASSETS
from feedback.core import linear, threads
from feedback.core.engine import run_to_end
from feedback.core.model import LoadedModel, load_model, set_fast_matmul
from feedback.core.records import RowSpec, RunConfig, first_divergence
from feedback.errors import FeedbackError

BENCH_PROMPT = "Write a detailed, step-by-step explanation of how a refrigerator keeps food cold."
TARGETS = {
    "baseline_vs_generate": (">=", 1.0),
    "side_by_side_overhead": ("<=", 1.05),
    "feedback_row_overhead": ("<=", 1.03),
    "cold_start_s": ("<=", 3.0),
    "mixed_prompts_overhead": ("<=", 1.10),
    "rows4_vs_forward4": ("<=", 1.05),
    "quality_overhead": ("<=", 1.05),
    # decode step of N plain rows on one prompt ÷ one row (the KV cache and attention grow with both)
    "rows16_ctx1024_vs_row1": ("<=", 4.0),
    "rows8_ctx1024_vs_row1": ("<=", 3.0),
    "rows8_ctx256_vs_row1": ("<=", 3.0),
    "rows8_ctx16_vs_row1": ("<=", 3.0),
    # the engine's prefill of a 4,096-token prompt ÷ one forward of it through transformers' SDPA
    "prefill_4k_vs_sdpa": ("<=", 1.10),
    "quality_overhead_4k": ("<=", 1.05),
    # 8 HTTP clients of a 64-token baseline + feedback request each (`concurrency`): CPU per generated
    # token with their runs decoding together ÷ served one at a time, all sent at once or 0.5 s apart
    "shared_8x64_together_vs_one_by_one": ("<=", 0.35),
    "shared_8x64_staggered_vs_one_by_one": ("<=", 0.35),
    # a request sent while others decode: time to its first step ÷ its solo prefill + 2 solo steps
    "ttft_mid_run_8x64_vs_solo": ("<=", 1.0),
    # a bare decode step of two rows (a baseline and a feedback row) ÷ one row
    "raw_batch2_vs_batch1": ("<=", 1.25),
}
SCALING = ((16, 1024), (8, 1024), (8, 256), (8, 16))  # (rows, prompt tokens) of the rowsN_ctxT ratios
DEEPTHINK = (16, 256)  # (traces, prompt tokens) of the Deep Think throughput
# `--quick`: the same measurements on smaller shapes (a check that every part runs, in seconds), named
# by their own shapes, so their ratios are never read against the full shapes' targets.
QUICK_SCALING = ((16, 128), (8, 16))
QUICK_DEEPTHINK = (8, 32)
PREFILL, QUICK_PREFILL = 4096, 256  # prompt tokens of the prefill ratios
SHORT_PROMPT = "How does a fridge work?"


def _median(fn, repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


@dataclass
class Ratio:
    """A / B measured in `rounds` rounds, A then B in each: the median of the per-round ratios, their
    lowest and highest, and each side's median cost (CPU seconds)."""

    median: float
    low: float
    high: float
    a: float
    b: float
    rounds: int


def ratio(a: Callable[[], float], b: Callable[[], float], rounds: int) -> Ratio:
    """Time a and b in turn (a b a b ...); each returns its own cost in CPU seconds."""
    return ratio_of([(a(), b()) for _ in range(max(1, rounds))])


def ratio_of(pairs: list[tuple[float, float]]) -> Ratio:
    """The Ratio of (A, B) pairs measured one pair a round."""
    per_round = [x / y for x, y in pairs]
    return Ratio(
        statistics.median(per_round),
        min(per_round),
        max(per_round),
        statistics.median(x for x, _ in pairs),
        statistics.median(y for _, y in pairs),
        len(pairs),
    )


def _cpu() -> float:
    """CPU seconds of this process, every thread (torch's workers included)."""
    return time.process_time()


def step_marks(
    lm: LoadedModel,
    rows: list[RowSpec],
    tokens: int,
    prompt: str = BENCH_PROMPT,
    chat_template: bool = True,
    clock: Callable[[], float] = _cpu,
) -> list[float]:
    """`clock` read at each forward of a run: the engine hands its observer every forward's logits,
    so the clock is read there. The first mark carries the prefill; each later one a decode step."""
    marks: list[float] = []
    run_to_end(
        lm,
        RunConfig(
            prompt=prompt, model=lm.name, max_new_tokens=tokens, rows=rows, chat_template=chat_template
        ),
        observer=lambda step, live, logits: marks.append(clock()),
    )
    if len(marks) < 2:
        raise FeedbackError("the run stopped after its first token: no decode step to time")
    return marks


def mean_step_s(marks: list[float]) -> float:
    """The mean decode step between a run's marks (`step_marks`), the prefill's left out."""
    return (marks[-1] - marks[0]) / (len(marks) - 1)


def _engine_step_s(
    lm: LoadedModel, rows: list[RowSpec], tokens: int, prompt: str = BENCH_PROMPT, chat_template: bool = True
) -> float:
    """Mean CPU time of the decode steps after the first."""
    return mean_step_s(step_marks(lm, rows, tokens, prompt, chat_template))


def _engine_run(lm: LoadedModel, tokens: int) -> tuple[float, list[int]]:
    """The mean CPU time of a one-row greedy run's decode steps (the prefill and first token left
    out: `step_marks`), and its tokens."""
    marks: list[float] = []
    result = run_to_end(
        lm,
        RunConfig(prompt=BENCH_PROMPT, model=lm.name, max_new_tokens=tokens, rows=[RowSpec("baseline")]),
        observer=lambda step, live, logits: marks.append(_cpu()),
    )
    return mean_step_s(marks), result.rows[0].token_ids


class _TokenMarks:
    """A `generate` streamer that only reads the clock each time tokens come: first the prompt,
    then one token per decode step."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def put(self, value) -> None:
        self.marks.append(_cpu())

    def end(self) -> None:
        pass


def _generate_run(lm: LoadedModel, tokens: int) -> tuple[float, list[int]]:
    """The mean CPU time of `model.generate`'s decode steps on the same prompt, greedy (the prefill
    and first token left out, as for the engine), and its tokens."""
    ids = torch.tensor([lm.encode(BENCH_PROMPT)], device=lm.device)
    marks = _TokenMarks()
    with torch.inference_mode():
        out = lm.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            do_sample=False,
            pad_token_id=lm.tokenizer.eos_token_id,
            streamer=marks,
        )
    return mean_step_s(marks.marks[1:]), out[0, ids.shape[1] :].tolist()


def _raw_step_s(
    lm: LoadedModel, batch: int, tokens: int, clock: Callable[[], float] = _cpu, engine_cache: bool = False
) -> float:
    """A bare batched forward per step on a real cache (`threads.bare_step_seconds`: transformers'
    own, or with `engine_cache` the engine's, whose decode steps take the compiled calls), in CPU
    seconds (or by another `clock`); decode steps at the model's decode threads, as the engine's."""
    ids = torch.tensor([lm.encode(BENCH_PROMPT)], device=lm.device)
    return threads.bare_step_seconds(lm.model, ids, batch, tokens - 1, lm.decode_threads, clock, engine_cache)


def _decode_threads(lm: LoadedModel) -> int:
    """The threads the model's decode steps run on (measured fastest: `core.threads`)."""
    return lm.decode_threads or torch.get_num_threads()


def prompt_of(lm: LoadedModel, tokens: int) -> str:
    """A prompt of about `tokens` tokens (no chat template): Python Language Reference text, which
    ships with CPython, so every machine measures the same prompt."""
    from pydoc_data.topics import topics

    text = " ".join(topics[name] for name in sorted(topics))
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    return lm.tokenizer.decode(ids)


def scaling(lm: LoadedModel, tokens: int, repeats: int, shapes=SCALING) -> dict[str, Ratio]:
    """Decode step of N plain rows ÷ one row on the same T-token prompt."""
    out = {}
    for rows, ctx in shapes:
        prompt = prompt_of(lm, ctx)
        many = [RowSpec(f"r{i}") for i in range(rows)]
        out[f"rows{rows}_ctx{ctx}_vs_row1"] = ratio(
            lambda many=many, prompt=prompt: _engine_step_s(lm, many, tokens, prompt, False),
            lambda many=many, prompt=prompt: _engine_step_s(lm, many[:1], tokens, prompt, False),
            repeats,
        )
    return out


def deepthink_throughput(
    lm: LoadedModel, tokens: int, repeats: int, traces: int = DEEPTHINK[0], ctx: int = DEEPTHINK[1]
) -> dict[str, Ratio]:
    """Deep Think's shape: `traces` sampled traces of one `ctx`-token prompt, decoded as one batched
    run, against the same traces run one by one (each with its own seed offset, so the same tokens):
    the speedup in trace-tokens per CPU second."""
    from feedback.core.sampling import SamplingConfig

    prompt = prompt_of(lm, ctx)
    rows = [RowSpec(f"t{i}", seed_offset=i) for i in range(traces)]
    sampling = SamplingConfig(temperature=0.7, top_p=0.95)

    def per_token(specs_list: list[list[RowSpec]]) -> float:
        """CPU seconds per trace-token of these runs, one after another."""
        t, n = _cpu(), 0
        for specs in specs_list:
            res = run_to_end(
                lm,
                RunConfig(
                    prompt=prompt, max_new_tokens=tokens, rows=specs, chat_template=False, sampling=sampling
                ),
            )
            n += sum(len(r.token_ids) for r in res.rows)
        return (_cpu() - t) / n

    # speedup = separate cost per token ÷ batched cost per token
    return {
        f"deepthink{traces}_speedup": ratio(
            lambda: per_token([[spec] for spec in rows]), lambda: per_token([rows]), repeats
        )
    }


def _prefill_s(lm: LoadedModel, prompts: list[str]) -> float:
    """CPU seconds of the engine reading these prompts (one row each) and taking one token."""
    rows = [RowSpec(f"p{i}", prompt=p) for i, p in enumerate(prompts)]
    t = _cpu()
    run_to_end(lm, RunConfig(prompt="", max_new_tokens=1, rows=rows, chat_template=False))
    return _cpu() - t


def _sdpa_forward_s(lm: LoadedModel, prompt: str) -> float:
    """CPU seconds of one forward of the prompt's tokens through transformers' own SDPA attention,
    the last position's logits only (as a prefill needs)."""
    ids = torch.tensor([lm.encode(prompt, chat_template=False)], device=lm.device)
    kept = lm.model.config._attn_implementation
    lm.model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            t = _cpu()
            lm.model(input_ids=ids, logits_to_keep=1)
            return _cpu() - t
    finally:
        lm.model.set_attn_implementation(kept)


def prefill(lm: LoadedModel, tokens: int, repeats: int, new_tokens: int = 64) -> dict[str, Ratio]:
    """A long prompt's prefill: the engine ÷ one SDPA forward of the same tokens, and four rows with
    four different prompts of that length ÷ one row; and the quality metrics' cost after that prompt
    in a run of `new_tokens`."""
    texts = prompt_of(lm, 5 * tokens)
    ids = lm.tokenizer(texts, add_special_tokens=False)["input_ids"]
    prompts = [lm.tokenizer.decode(ids[i * tokens : (i + 1) * tokens]) for i in range(4)]
    name = f"prefill_{tokens // 1024}k" if tokens >= 1024 else f"prefill_{tokens}"
    quality = f"quality_overhead_{name.removeprefix('prefill_')}"
    return {
        f"{name}_vs_sdpa": ratio(
            lambda: _prefill_s(lm, prompts[:1]), lambda: _sdpa_forward_s(lm, prompts[0]), repeats
        ),
        f"{name}_rows4_vs_row1": ratio(
            lambda: _prefill_s(lm, prompts), lambda: _prefill_s(lm, prompts[:1]), repeats
        ),
        # the quality metrics after a long prompt: a baseline + feedback run with them ÷ without
        quality: _quality_overhead(lm, new_tokens, repeats, prompts[0], chat_template=False),
    }


def batch_invariance(lm: LoadedModel, tokens: int = 24) -> dict:
    """How far a row's logits move with its batch: two identical rows (bitwise?), and one row in a
    2-row and a 16-row batch against the same row alone (max |Δ logit| over the run)."""

    def logits(rows):
        seen = []
        run_to_end(
            lm,
            RunConfig(prompt=SHORT_PROMPT, max_new_tokens=tokens, rows=rows),
            observer=lambda step, live, lg: seen.append(lg.clone()),
        )
        return seen

    alone, two = logits([RowSpec("a")]), logits([RowSpec("a"), RowSpec("b")])
    sixteen = logits([RowSpec(f"r{i}") for i in range(16)])
    gap = lambda batch: max((a[0] - b[0]).abs().max().item() for a, b in zip(alone, batch))  # noqa: E731
    return {
        "identical_rows_bitwise_equal": all(torch.equal(lg[0], lg[1]) for lg in two),
        "rows2_vs_alone_max_abs": gap(two),
        "rows16_vs_alone_max_abs": gap(sixteen),
    }


def _quality_overhead(
    lm: LoadedModel, tokens: int, repeats: int, prompt: str = BENCH_PROMPT, chat_template: bool = True
) -> Ratio:
    """CPU time of a baseline + feedback run with the forward-pass quality metrics (self and prompt
    perplexity) ÷ the same run without them."""

    def run(quality: bool) -> float:
        rows = [RowSpec("baseline"), RowSpec("feedback", "residual", {})]
        t = _cpu()
        run_to_end(
            lm,
            RunConfig(
                prompt=prompt, max_new_tokens=tokens, rows=rows, quality=quality, chat_template=chat_template
            ),
        )
        return _cpu() - t

    return ratio(lambda: run(True), lambda: run(False), repeats)


def sync(device: torch.device) -> None:
    """Wait for the GPU, so a wall clock read after it measures the work, not its queueing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_clock(device: torch.device) -> Callable[[], float]:
    """A wall clock read once `device` has done the work queued on it (on CPU, at once)."""

    def read() -> float:
        sync(device)
        return time.perf_counter()

    return read


CPU = torch.device("cpu")


def copy_bandwidth_gbs(device: torch.device = CPU, clock: Callable[[], float] | None = None) -> float:
    """Memory bandwidth of `device` from a large copy (bytes read + written per second of `clock`,
    by default the device's wall clock; `_cpu`: per CPU-second), best of five after a warm-up:
    256 MiB on CPU, 1 GiB on a GPU."""
    n = (256 if device.type == "cuda" else 64) * 2**20
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    clock, best = clock or device_clock(device), float("inf")
    for _ in range(5):
        t = clock()
        dst.copy_(src)
        best = min(best, clock() - t)
    return 2 * n * src.element_size() / best / 1e9


def weight_bytes(lm: LoadedModel) -> int:
    """Bytes of weights a one-row step reads: parameters and buffers (quantised weights and their
    scales are buffers; of an int4 layer's two layouts, the one its one-row product reads), tied
    tensors (embedding = lm_head) once; the input embedding table left out where the output head
    does not read it (a quantised head: a step reads one row of the table a token)."""
    table = lm.model.get_input_embeddings().weight
    head = getattr(lm.model.get_output_embeddings(), "weight", None)
    seen: set[int] = set() if head is table else {table.data_ptr()}
    tensors: list[torch.Tensor] = []
    for module in lm.model.modules():
        if isinstance(module, linear.WeightOnlyLinear):
            tensors += module.read(1)
        else:
            tensors += [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    total = 0
    for t in tensors:
        if t.data_ptr() not in seen and t.dtype != torch.int64:  # position tables are not weights
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _cold_start_s(dtype: str) -> float:
    """load_model() from the prepared cache in a fresh process (interpreter and imports excluded)."""
    code = (
        "import time; from feedback.core.model import load_model; t = time.perf_counter(); "
        f"load_model('embedded', dtype={dtype!r}); print(time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def measure(
    tokens: int = 64,
    repeats: int = 5,
    dtype: str = "auto",
    lm: LoadedModel | None = None,
    quick: bool = False,
) -> dict:
    lm = lm or load_model("embedded", dtype=dtype)
    load_before = _load()
    base, fb = RowSpec("baseline"), RowSpec("feedback", "residual", {})
    _engine_step_s(lm, [base, fb], 8)  # warm-up (allocator, kernels)
    gen_tokens, eng_tokens = [], []

    def side(fn, seen: list) -> float:
        cost, ids = fn(lm, tokens)
        seen.append(ids)
        return cost

    four = [base] + [RowSpec(f"alpha{a}", "residual", {"alpha": a}) for a in (0.05, 0.1, 0.2)]
    ratios: dict[str, Ratio] = {
        # generate's decode step ÷ the engine's, CPU time, in-process, the same greedy run, the two in
        # turn (the prefill and first token left out of both; above 1: the engine is faster)
        "baseline_vs_generate": ratio(
            lambda: side(_generate_run, gen_tokens), lambda: side(_engine_run, eng_tokens), repeats
        ),
        "side_by_side_overhead": ratio(
            lambda: _engine_step_s(lm, [base, fb], tokens), lambda: _raw_step_s(lm, 2, tokens), repeats
        ),
        "feedback_row_overhead": ratio(
            lambda: _engine_step_s(lm, [base, fb], tokens),
            lambda: _engine_step_s(lm, [base, RowSpec("baseline2")], tokens),
            repeats,
        ),
        "two_rows_vs_two_generations": ratio(
            lambda: _engine_step_s(lm, [base, fb], tokens),
            lambda: 2 * _engine_step_s(lm, [base], tokens),
            repeats,
        ),
        # rows with their own prompts: left-padded into one batch (mask and position ids every step)
        "mixed_prompts_overhead": ratio(
            lambda: _engine_step_s(
                lm, [RowSpec("short", prompt=SHORT_PROMPT), RowSpec("long", prompt=BENCH_PROMPT)], tokens
            ),
            lambda: _engine_step_s(lm, [RowSpec("a"), RowSpec("b")], tokens),
            repeats,
        ),
        "rows4_vs_forward4": ratio(
            lambda: _engine_step_s(lm, four, tokens), lambda: _raw_step_s(lm, 4, tokens), repeats
        ),
        "raw_batch2_vs_batch1": ratio(
            lambda: _raw_step_s(lm, 2, tokens), lambda: _raw_step_s(lm, 1, tokens), repeats
        ),
        "quality_overhead": _quality_overhead(lm, 2 * tokens, repeats),
    }
    ratios |= scaling(lm, max(4, tokens // 4), repeats, QUICK_SCALING if quick else SCALING)
    # three rounds at most: a 4,096-token prefill takes ~15 CPU seconds a side
    ratios |= prefill(lm, QUICK_PREFILL if quick else PREFILL, min(repeats, 3), 16 if quick else 64)
    deep_shape = QUICK_DEEPTHINK if quick else DEEPTHINK
    ratios |= deepthink_throughput(lm, max(4, tokens // 4), repeats, *deep_shape)
    invariance = batch_invariance(lm, max(4, tokens // 4))
    bandwidth = copy_bandwidth_gbs()
    weights = weight_bytes(lm)
    # the roofline is about time on the clock: the fastest of a few bare one-row steps, wall time
    wall_step = min(_raw_step_s(lm, 1, tokens, time.perf_counter) for _ in range(max(1, repeats)))
    return {
        "model": lm.name,
        "dtype": lm.dtype,
        "device": str(lm.device),
        "tokens": tokens,
        "rounds": repeats,
        "threads": torch.get_num_threads(),
        "decode_threads": _decode_threads(lm),
        "cpu": linear.cpu_name(),
        # the fp32 linear kernels: the rows gemv takes per shape, else the one kernel in use
        "linear_kernels": linear.kernel_summary(lm.kernels, lm.linear_kernel),
        "timing": "CPU time, sides interleaved per round",
        "load_average": {"before": load_before, "after": _load()},
        "same_tokens_as_generate": gen_tokens == eng_tokens,
        **{key: r.median for key, r in ratios.items()},
        "spread": {key: [r.low, r.high] for key, r in ratios.items()},
        "cold_start_s": _cold_start_s(lm.dtype),
        "quality_tokens": 2 * tokens,
        # the weights read once at the copy bandwidth ÷ a bare one-row step's wall time
        "roofline_fraction": weights / (bandwidth * 1e9) / wall_step,
        "raw_step_wall_ms": wall_step * 1e3,
        # each ratio's two sides, medians: a decode step's CPU ms, or a whole run's (generate, quality), or
        # CPU ms per trace-token (Deep Think)
        "sides_cpu_ms": {key: {"a": r.a * 1e3, "b": r.b * 1e3} for key, r in ratios.items()},
        "weights_mb": weights / 2**20,
        "bandwidth_gbs": bandwidth,
        "attention": lm.model.config._attn_implementation,
        "deepthink_shape": list(deep_shape),
        "batch_invariance": invariance,
    }


def api_overhead(lm: LoadedModel, tokens: int = 64, repeats: int = 3) -> dict:
    """One baseline + feedback run through the HTTP API on a local server (streamed as NDJSON and
    parsed by the client, or whole) against the same run on the engine in-process. The server runs
    in this process, so CPU time counts the engine, the server and the client alike."""
    import httpx

    from feedback.serve.api import local_server
    from feedback.serve.pool import ModelPool

    rows = [RowSpec("baseline"), RowSpec("feedback", "residual", {})]
    body = {
        "prompt": BENCH_PROMPT,
        "max_new_tokens": tokens,
        "rows": [{"name": r.name, "strategy": r.strategy} for r in rows],
    }
    seen: dict[str, list] = {}

    def timed(name: str, fn) -> float:
        t = _cpu()
        seen[name] = fn()
        return _cpu() - t

    def direct() -> list:
        return [
            r.token_ids
            for r in run_to_end(lm, RunConfig(prompt=BENCH_PROMPT, max_new_tokens=tokens, rows=rows)).rows
        ]

    with (
        local_server(ModelPool.serving(lm)) as url,
        httpx.Client(base_url=url + "/api", timeout=600) as client,
    ):

        def streamed() -> list:
            with client.stream("POST", "/generate/stream", json=body) as r:
                events = [json.loads(line) for line in r.iter_lines() if line]
            return [row["token_ids"] for row in events[-1]["result"]["rows"]]

        def whole() -> list:
            return [row["token_ids"] for row in client.post("/generate", json=body).json()["rows"]]

        whole()  # warm-up: first request, server threads
        out = {
            "api_stream_vs_engine": ratio(
                lambda: timed("stream", streamed), lambda: timed("engine", direct), repeats
            ),
            "api_generate_vs_engine": ratio(
                lambda: timed("generate", whole), lambda: timed("engine", direct), repeats
            ),
        }
    return {
        **{k: r.median for k, r in out.items()},
        "spread": {k: [r.low, r.high] for k, r in out.items()},
        "api_same_tokens": seen["stream"] == seen["engine"] == seen["generate"],
    }


# `concurrency`: one chat question per client, of different lengths (each its own prompt length, so
# runs join the batch with different sequence lengths)
CONCURRENCY_PROMPTS = (
    "Why is the sky blue?",
    "What is 17 * 23?",
    "Name three planets of the solar system.",
    "How do vaccines teach the immune system to recognise a virus?",
    "Write a four-line poem about a lighthouse in winter.",
    "Explain how a bicycle stays upright while it moves, and why it falls over once it stops.",
    "Give three tips for writing readable Python code.",
    "What is the difference between weather and climate, and why does it matter when people point "
    "to one cold winter as proof that the climate is not warming?",
)
CONCURRENCY = (8, 0.5)  # (clients, seconds between their arrivals in the staggered pattern)
QUICK_CONCURRENCY = (4, 0.1)  # --quick: fewer and shorter requests (tokens: at most 16)


@dataclass
class Sent:
    """One client's request, client side: when it was sent, its first `step` event and its `done`
    event arrived (perf_counter seconds), and each row's token ids from the result."""

    sent: float
    first_step: float
    done: float
    token_ids: list[list[int]]

    @property
    def ttft(self) -> float:
        return self.first_step - self.sent


def send_all(url: str, bodies: list[dict], stagger_s: float = 0.0) -> tuple[float, list[Sent]]:
    """Each body POSTed to /api/generate/stream by its own client thread, the i-th `i * stagger_s`
    seconds after the first; the CPU seconds of this process (server and clients) until every stream
    has ended, and each request's `Sent`. Only the `done` and `error` lines are parsed: the client's
    own share of the CPU time stays small."""
    import httpx

    clients = [httpx.Client(base_url=url + "/api", timeout=600) for _ in bodies]
    out: list[Sent | None] = [None] * len(bodies)
    errors: list[BaseException] = []
    go, origin = threading.Event(), [0.0]

    def one(i: int) -> None:
        go.wait()
        time.sleep(max(0.0, origin[0] + i * stagger_s - time.perf_counter()))
        sent, first, result = time.perf_counter(), None, None
        try:
            with clients[i].stream("POST", "/generate/stream", json=bodies[i]) as r:
                if r.status_code != 200:
                    raise FeedbackError(f"request {i}: HTTP {r.status_code}: {r.read().decode()[:200]}")
                for line in r.iter_lines():
                    if line.startswith('{"event": "step"'):
                        first = first or time.perf_counter()
                    elif line.startswith('{"event": "done"'):
                        result = json.loads(line)["result"]
                    elif line.startswith('{"event": "error"'):
                        raise FeedbackError(f"request {i}: {json.loads(line)['error']}")
            if result is None or first is None:
                raise FeedbackError(f"request {i}: the stream ended without a step and its result")
            out[i] = Sent(sent, first, time.perf_counter(), [row["token_ids"] for row in result["rows"]])
        except BaseException as exc:  # noqa: BLE001 (raised in the caller's thread)
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    try:
        cpu = _cpu()
        origin[0] = time.perf_counter()
        go.set()
        for t in threads:
            t.join()
        cpu = _cpu() - cpu
    finally:
        for c in clients:
            c.close()
    if errors:
        raise errors[0]
    return cpu, out


def _mid_run(sent: list[Sent]) -> list[int]:
    """The requests sent while another one was decoding (past its first step, before its end): the
    ones that join a running batch."""
    return [
        i
        for i, s in enumerate(sent)
        if any(o.first_step < s.sent < o.done for j, o in enumerate(sent) if j != i)
    ]


def _generated(sent: list[Sent]) -> int:
    """Tokens generated by these requests, every row of each."""
    return sum(len(ids) for s in sent for ids in s.token_ids)


def _solo(lm: LoadedModel, config: RunConfig) -> tuple[float, float, list[list[int]]]:
    """The run alone on the engine: its prefill (wall seconds), its mean decode step (wall seconds,
    the step records' time_ms after the first, which carries the prefill) and its rows' tokens."""
    result = run_to_end(lm, config)
    steps = max((r.steps for r in result.rows), key=len)
    step_s = statistics.mean(s.time_ms for s in steps[1:]) / 1e3 if len(steps) > 1 else 0.0
    return result.prefill_seconds, step_s, [r.token_ids for r in result.rows]


def concurrency(
    lm: LoadedModel,
    clients: int = CONCURRENCY[0],
    tokens: int = 64,
    rounds: int = 3,
    stagger_s: float = CONCURRENCY[1],
) -> dict:
    """`clients` HTTP clients at once, through the real API on a local server in this process, each a
    baseline + feedback (residual) request of `tokens` greedy tokens on its own chat question, sent
    all together and `stagger_s` apart; served with the runs decoding together (a pool of
    `shared_runs=clients`) and one run at a time (`shared_runs=1`, the line before sharing). Per round
    all sent together go to the shared server, then to the one-by-one server; the staggered ones to
    the one-by-one server, then to the shared one; then every request runs alone on the engine (the
    reference). Reports, as ratios over the rounds (median, lowest and highest):

    - CPU seconds of this process per generated token, shared ÷ one by one, each pattern;
    - the staggered requests sent while another was decoding: the worst time from sending to the
      first `step` event ÷ that request's solo prefill + 2 solo decode steps (wall time), shared,
      and one by one beside it (no target: it waits in line);
    - per request, whether every row's tokens equal its solo run's, in every round and pattern."""
    from feedback.core.sharing import decoder_for
    from feedback.serve.api import local_server
    from feedback.serve.api.schemas import GenerateIn, to_config
    from feedback.serve.pool import ModelPool

    prompts = [CONCURRENCY_PROMPTS[i % len(CONCURRENCY_PROMPTS)] for i in range(clients)]
    rows = [{"name": "baseline", "strategy": None}, {"name": "feedback", "strategy": "residual"}]
    bodies = [{"prompt": p, "max_new_tokens": tokens, "rows": rows} for p in prompts]
    configs = [to_config(GenerateIn(**b), lm.name) for b in bodies]
    load_before = _load()
    shape = f"{clients}x{tokens}"
    keys = {
        "together": f"shared_{shape}_together_vs_one_by_one",
        "staggered": f"shared_{shape}_staggered_vs_one_by_one",
    }
    ttft_key, ttft_alone_key = f"ttft_mid_run_{shape}_vs_solo", f"ttft_mid_run_{shape}_one_by_one_vs_solo"
    pairs: dict[str, list[tuple[float, float]]] = {k: [] for k in [*keys.values(), ttft_key, ttft_alone_key]}
    equal = {way: [True] * clients for way in ("shared", "one_by_one")}
    most_rows = {"together": 0, "staggered": 0}
    generated = {}
    decoder = decoder_for(lm)

    def ttft_pair(sent: list[Sent], solo) -> tuple[float, float] | None:
        """(time to first step, solo prefill + 2 solo steps) of the mid-run request worst off."""
        late = [(sent[i].ttft, solo[i][0] + 2 * solo[i][1]) for i in _mid_run(sent)]
        return max(late, key=lambda p: p[0] / p[1]) if late else None

    with (
        local_server(ModelPool.serving(lm, clients)) as shared_url,
        local_server(ModelPool.serving(lm, 1)) as alone_url,
    ):
        urls = {"shared": shared_url, "one_by_one": alone_url}
        warm = [b | {"max_new_tokens": 4} for b in bodies[:2]]
        for url in urls.values():  # warm-up: server threads, the decode loop, rows joining
            send_all(url, warm)
        for _ in range(max(1, rounds)):
            cost, sent = {}, {}
            for pattern, gap in (("together", 0.0), ("staggered", stagger_s)):
                # shared first, then last: the solo runs follow the staggered shared requests, whose
                # time to first step they are the measure of
                ways = ("shared", "one_by_one") if pattern == "together" else ("one_by_one", "shared")
                for way in ways:
                    cpu, sent[pattern, way] = send_all(urls[way], bodies, gap)
                    cost[pattern, way] = cpu / _generated(sent[pattern, way])
                    if way == "shared":  # each run joins once: (its run, the rows beside it then)
                        beside = max((b for _, b in list(decoder.joins)[-clients:]), default=0)
                        most_rows[pattern] = max(most_rows[pattern], beside + len(rows))
                pairs[keys[pattern]].append((cost[pattern, "shared"], cost[pattern, "one_by_one"]))
                generated[pattern] = _generated(sent[pattern, "shared"])
            solo = [_solo(lm, c) for c in configs]
            for (_, way), out in sent.items():
                for i, s in enumerate(out):
                    equal[way][i] &= s.token_ids == solo[i][2]
            for key, way in ((ttft_key, "shared"), (ttft_alone_key, "one_by_one")):
                if (pair := ttft_pair(sent["staggered", way], solo)) is not None:
                    pairs[key].append(pair)
    ratios = {k: ratio_of(v) for k, v in pairs.items() if v}
    return {
        "cpu": linear.cpu_name(),
        "threads": torch.get_num_threads(),
        "decode_threads": _decode_threads(lm),
        "device": str(lm.device),
        "model": lm.name,
        "dtype": lm.dtype,
        "clients": clients,
        "tokens": tokens,
        "stagger_s": stagger_s,
        "rounds": max(1, rounds),
        "timing": "CPU time of this process (server and clients) per generated token, shared and one by "
        "one in turn per round; time to first step: wall time, client side",
        "load_average": {"before": load_before, "after": _load()},
        **{k: r.median for k, r in ratios.items()},
        "spread": {k: [r.low, r.high] for k, r in ratios.items()},
        # each ratio's sides, medians: CPU ms per generated token, or wall ms (time to first step ÷
        # solo prefill + 2 solo steps)
        "sides_ms": {k: {"a": r.a * 1e3, "b": r.b * 1e3} for k, r in ratios.items()},
        "tokens_equal_solo": equal["shared"],
        "tokens_equal_solo_one_by_one": equal["one_by_one"],
        "generated_tokens": generated,
        "most_rows_together": most_rows,
    }


# The ways this machine can run the model, exact first: (label, load_model keywords)
MODES = (
    ("fp32 exact (linear kernels measured here, the default)", {"dtype": "float32"}),
    ("fp32 exact (oneDNN linear)", {"dtype": "float32", "linear_kernel": "onednn"}),
    ("fp32 exact (PyTorch's MKL linear)", {"dtype": "float32", "linear_kernel": "aten"}),
    ("fp32 exact (transformers' own layers)", {"dtype": "float32", "lean_layers": False}),
    ("fp32 weights, oneDNN bf16 matmuls", {"dtype": "float32", "fast_matmul": True}),
    ("bf16 weights", {"dtype": "bfloat16"}),
    ("int8 weights and head (bf16 activations)", {"dtype": "float32", "load_in_8bit": True}),
    ("int4 weights, int8 head (bf16 activations)", {"dtype": "float32", "load_in_4bit": True}),
)
MODE_PPL_TOKENS = (
    512  # tokens per built-in test document for ΔPPL (the 512-token protocol of docs/results/RESULTS.md)
)


def _greedy_replies(lm: LoadedModel, prompts: list[str], tokens: int) -> list[list[int]]:
    return [
        run_to_end(lm, RunConfig(prompt=p, max_new_tokens=tokens, rows=[RowSpec("b")])).rows[0].token_ids
        for p in prompts
    ]


def _test_nlls(lm: LoadedModel, docs: int | None) -> list:
    """Per-token NLL of every built-in test document's first MODE_PPL_TOKENS tokens (plain model)."""
    from feedback.core.quality import sequence_nll
    from feedback.eval.corpus import builtin

    out = []
    for doc in builtin("test")[:docs]:
        ids = lm.tokenizer(doc.text)["input_ids"][:MODE_PPL_TOKENS]
        if len(ids) >= 2:
            out.append(sequence_nll(lm, ids).double().cpu().numpy())
    return out


def fast_modes(tokens: int = 16, repeats: int = 3, reply_tokens: int = 64, docs: int | None = None) -> dict:
    """Each mode of `MODES`: a bare decode step of 1 row on the engine's cache (CPU ms; the compiled
    calls where the mode's layers take them), a 2-row step ÷ 1-row (`pair_vs_row`), the weights read
    per 1-row step against the copy bandwidth (fastest wall-time step), greedy agreement with the
    exact default over the 8 example prompts, and ΔPPL on the built-in test split against it (paired
    95 % CI over documents)."""
    import numpy as np

    from feedback.eval.perplexity import paired_bootstrap

    examples = json.loads((ASSETS / "examples.json").read_text())
    prompts = [e["prompt"] for e in examples][:8]
    bandwidth = copy_bandwidth_gbs()
    out: dict = {"bandwidth_gbs": bandwidth, "modes": {}}
    ref_replies = ref_nlls = None
    for label, kwargs in MODES:
        lm = load_model("embedded", **kwargs)
        _raw_step_s(lm, 2, 4, engine_cache=True)  # warm-up
        pair = ratio(
            lambda lm=lm: _raw_step_s(lm, 2, tokens, engine_cache=True),
            lambda lm=lm: _raw_step_s(lm, 1, tokens, engine_cache=True),
            repeats,
        )
        wall = min(_raw_step_s(lm, 1, tokens, time.perf_counter, engine_cache=True) for _ in range(repeats))
        replies, nlls = _greedy_replies(lm, prompts, reply_tokens), _test_nlls(lm, docs)
        ref_replies, ref_nlls = ref_replies or replies, ref_nlls or nlls
        diffs = [a - b for a, b in zip(nlls, ref_nlls)]
        mean = sum(d.sum() for d in diffs) / sum(d.size for d in diffs)
        lo, hi, _ = paired_bootstrap(diffs, 2000, 0) if any(np.any(d) for d in diffs) else (0.0, 0.0, "")
        stored = weight_bytes(lm)
        out["modes"][label] = {
            "precision": lm.precision,
            "step_ms_row1": pair.b * 1e3,
            "step_ms_row2": pair.a * 1e3,
            "pair_vs_row": pair.median,
            "pair_vs_row_spread": [pair.low, pair.high],
            "weights_mb": stored / 2**20,
            "wall_step_ms": wall * 1e3,
            "bandwidth_fraction": stored / (bandwidth * 1e9) / wall,
            "replies_equal": sum(a == b for a, b in zip(replies, ref_replies)),
            "replies": len(prompts),
            "tokens_equal_before_first_difference": sum(_agree(a, b) for a, b in zip(replies, ref_replies)),
            "tokens": sum(len(r) for r in ref_replies),
            "delta_ppl_pct": 100 * math.expm1(mean),
            "delta_ppl_ci_pct": [100 * math.expm1(lo), 100 * math.expm1(hi)],
            "test_tokens": int(sum(d.size for d in nlls)),
        }
        lm = None  # one mode's model at a time
    set_fast_matmul(False)
    return out


def _modes_text(modes: dict) -> str:
    lines = [
        f"modes (copy bandwidth {modes['bandwidth_gbs']:.1f} GB/s; agreement and ΔPPL against the first):"
    ]
    for label, m in modes["modes"].items():
        lines.append(
            f"  {label:40} 1 row {m['step_ms_row1']:6.1f} ms CPU, pair_vs_row {m['pair_vs_row']:.2f} "
            f"[{m['pair_vs_row_spread'][0]:.2f}–{m['pair_vs_row_spread'][1]:.2f}], "
            f"{m['weights_mb']:.0f} MB at {m['bandwidth_fraction']:.2f} of bandwidth "
            f"({m['wall_step_ms']:.1f} ms wall); greedy replies equal {m['replies_equal']}/{m['replies']} "
            f"({m['tokens_equal_before_first_difference']}/{m['tokens']} tokens before the first "
            f"difference); ΔPPL {m['delta_ppl_pct']:+.3f} % [{m['delta_ppl_ci_pct'][0]:+.3f}, "
            f"{m['delta_ppl_ci_pct'][1]:+.3f}] over {m['test_tokens']} test tokens"
        )
    return "\n".join(lines)


def _agree(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference (all of them when the replies are the same)."""
    diverged = first_divergence(a, b)
    return len(a) if diverged is None else diverged


HOG = "import time\nwhile True: sum(range(10_000))"  # one busy core, like a neighbour on a shared CPU


def _step_in_process(count: int, wait: str, tokens: int) -> float:
    """A bare one-row decode step (ms, wall time: what a neighbour's load costs is the point) in a fresh
    process with `count` threads (decode steps too) and this wait policy (the policy is read once, when
    torch loads, so it needs its own process)."""
    code = (
        "import torch, time; from feedback.core.model import load_model; "
        "from feedback.bench import _raw_step_s; "
        f"torch.set_num_threads({count}); lm = load_model('embedded', dtype='float32'); "
        "_raw_step_s(lm, 1, 4); "
        f"print(min(_raw_step_s(lm, 1, {tokens}, time.perf_counter) for _ in range(2)) * 1e3)"
    )
    env = {**os.environ, "OMP_WAIT_POLICY": wait, threads.ENV: str(count)}  # decode steps too
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


def busy_machine(tokens: int = 16) -> dict:
    """Decode step (ms) for 1 and 2 threads x PASSIVE and ACTIVE waiting, on the machine as it is and
    with a CPU hog beside it (one process spinning on one core)."""
    configs = [(t, w) for t in (1, 2) for w in ("PASSIVE", "ACTIVE")]
    out: dict = {"quiet": {}, "hog": {}}
    for t, w in configs:
        out["quiet"][f"{t}t_{w.lower()}"] = _step_in_process(t, w, tokens)
    hog = subprocess.Popen([sys.executable, "-c", HOG])
    try:
        for t, w in configs:
            out["hog"][f"{t}t_{w.lower()}"] = _step_in_process(t, w, tokens)
    finally:
        hog.kill()
        hog.wait()
    return out


def _verdict(key: str, value: float, targets: dict | None = None) -> str:
    """`value` against its target in `targets` (default: the bench's TARGETS): "<= 1.05  ok"."""
    op, target = (targets or TARGETS)[key]
    ok = value >= target if op == ">=" else value <= target
    return f"{op} {target}  {'ok' if ok else 'MISSED'}"


def _line(report: dict, key: str, note: str) -> str:
    low, high = report["spread"][key]
    return f"{key:32} {report[key]:9.3f}  [{low:.3f}–{high:.3f}]  {note}"


def _concurrency_of(lm: LoadedModel, args) -> dict:
    """`concurrency` at the bench's shape (--quick: fewer and shorter requests), three rounds at most:
    a full round serves 4 x 8 requests of 64 tokens and runs the 8 alone."""
    quick = getattr(args, "quick", False)
    clients, stagger = QUICK_CONCURRENCY if quick else CONCURRENCY
    tokens = min(args.tokens, 16) if quick else args.tokens
    return concurrency(lm, clients, tokens, 1 if quick else min(args.repeats, 3), stagger)  # quick: a round


def _concurrency_text(c: dict) -> str:
    load, n, shape = c["load_average"], c["clients"], f"{c['clients']}x{c['tokens']}"
    lines = [
        f"concurrency: {n} HTTP clients (local API, NDJSON streams), each a {c['tokens']}-token greedy "
        f"baseline + feedback request on its own chat question, all at once and {c['stagger_s']:g} s "
        f"apart; served with the runs decoding together (shared_runs={n}) and one at a time "
        f"(shared_runs=1) in turn over {c['rounds']} rounds; {c['cpu']}, {c['threads']} threads; "
        f"load average {load['before']} before, {load['after']} after",
    ]
    notes = {
        f"shared_{shape}_together_vs_one_by_one": "(CPU ms per generated token, shared / one by one: "
        "{a:.2f} / {b:.2f}; sent at once)",
        f"shared_{shape}_staggered_vs_one_by_one": "(CPU ms per generated token, shared / one by one: "
        "{a:.2f} / {b:.2f}; sent " + f"{c['stagger_s']:g} s apart)",
        f"ttft_mid_run_{shape}_vs_solo": "(the worst request sent while others decode: wall ms to its "
        "first step / its solo prefill + 2 solo steps: {a:.0f} / {b:.0f})",
        f"ttft_mid_run_{shape}_one_by_one_vs_solo": "(the same, served one at a time: {a:.0f} / {b:.0f}; "
        "no target)",
    }
    for key, note in notes.items():
        if key not in c:
            lines.append(f"{key:42} —  (no request was sent while another one decoded)")
            continue
        low, high = c["spread"][key]
        target = _verdict(key, c[key]) if key in TARGETS else ""
        if not target and "one_by_one_vs_solo" not in key:
            target = "(not the target's shape: no target)"
        lines.append(
            f"{key:42} {c[key]:9.3f}  [{low:.3f}–{high:.3f}]  "
            + (f"{target} " if target else "")
            + note.format(**c["sides_ms"][key])
        )
    same, alone = c["tokens_equal_solo"], c["tokens_equal_solo_one_by_one"]
    lines.append(
        f"tokens equal solo: {sum(same)}/{len(same)} (shared), {sum(alone)}/{len(alone)} (one by one)  "
        f"{'ok' if all(same) and all(alone) else 'MISSED'}"
    )
    most = c["most_rows_together"]
    lines.append(
        f"rows decoding together at most: {most['together']} (sent at once), {most['staggered']} "
        f"(staggered); tokens generated per pattern: {c['generated_tokens']['together']}"
    )
    return "\n".join(lines)


def run_bench(args, peers: tuple[Callable[[], dict | None], Callable[[dict], str]] | None = None) -> int:
    """The bench as the command line asks (`args`); `peers`: a measurement of other engines to run
    after the rest, and how to print it (the command line passes llama.cpp's, `feedback.peers`)."""
    if getattr(args, "modes_only", False):
        modes = fast_modes(repeats=max(3, args.repeats))
        print(json.dumps(modes, indent=2) if args.json else _modes_text(modes))
        return 0
    lm = load_model("embedded", dtype=args.dtype)
    if getattr(args, "concurrency_only", False):
        conc = _concurrency_of(lm, args)
        print(json.dumps(conc, indent=2) if args.json else _concurrency_text(conc))
        return 0
    report = measure(args.tokens, args.repeats, lm=lm, quick=getattr(args, "quick", False))
    report["concurrency"] = _concurrency_of(lm, args)
    if getattr(args, "api", False):
        api = api_overhead(lm, args.tokens, args.repeats)
        report |= {**api, "spread": report["spread"] | api["spread"]}
    if getattr(args, "modes", False):
        report["modes"] = fast_modes(repeats=max(3, args.repeats))
    if peers:
        report["peers"] = peers[0]()
    if getattr(args, "hog", False):
        report["busy_machine"] = busy_machine()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    load = report["load_average"]
    print(
        f"model {report['model']} {report['dtype']} on {report['device']} ({report['threads']} threads, "
        f"{report['decode_threads']} for decode steps), "
        f"{report['tokens']} tokens; every ratio: CPU time, the two sides in turn "
        f"over {report['rounds']} rounds, "
        f"median [lowest–highest]; load average {load['before']} before, {load['after']} after"
    )
    print(f"CPU {report['cpu']}; fp32 linear kernels: {report['linear_kernels']}")
    print(f"{'metric':32} {'median':>9}  {'spread':15} target")
    for key in TARGETS:
        if key in report["spread"]:  # --quick measures the scaling ratios on other shapes
            print(_line(report, key, _verdict(key, report[key])))
    for key in sorted(
        k for k in report["spread"] if k.startswith("rows") and k.endswith("_vs_row1") and k not in TARGETS
    ):
        print(_line(report, key, "(--quick shape, no target)"))
    for key in sorted(
        k for k in report["spread"] if k.startswith(("prefill_", "quality_overhead_")) and k not in TARGETS
    ):
        print(
            _line(
                report,
                key,
                "(four rows of different prompts ÷ one)" if "rows4" in key else "(--quick shape, no target)",
            )
        )
    print(
        "  (quality_overhead_<n>: a 64-token baseline + feedback run after an n-token prompt, "
        "with the quality metrics ÷ without)"
    )
    print(
        f"  (quality_overhead: a {report['quality_tokens']}-token baseline + feedback run with self and "
        "prompt perplexity ÷ without)"
    )
    print(_line(report, "two_rows_vs_two_generations", "(< 1 means batching pays)"))
    traces, ctx = report["deepthink_shape"]
    print(
        _line(
            report,
            f"deepthink{traces}_speedup",
            f"({traces} traces of a {ctx}-token prompt, batched ÷ one by "
            f"one, per trace-token; attention: {report['attention']})",
        )
    )
    if "api_stream_vs_engine" in report:
        print(_line(report, "api_stream_vs_engine", "(HTTP API, NDJSON stream, local)"))
        print(_line(report, "api_generate_vs_engine", "(HTTP API, whole result)"))
        print(f"same greedy tokens through the API: {report['api_same_tokens']}")
    print(_concurrency_text(report["concurrency"]))
    print(
        f"{'roofline_fraction':32} {report['roofline_fraction']:9.3f}  "
        f"({report['weights_mb']:.0f} MB weights at "
        f"{report['bandwidth_gbs']:.1f} GB/s ÷ a bare one-row step, {report['raw_step_wall_ms']:.1f} ms wall)"
    )
    print(
        f"{'cold_start_s':32} {report['cold_start_s']:9.3f}  "
        f"{_verdict('cold_start_s', report['cold_start_s'])} (wall time)"
    )
    print(
        "each ratio's sides, CPU ms (A / B; a step, a whole run, or a trace-token): "
        + ", ".join(f"{k} {v['a']:.1f} / {v['b']:.1f}" for k, v in report["sides_cpu_ms"].items())
    )
    print(f"same greedy tokens as model.generate: {report['same_tokens_as_generate']}")
    inv = report["batch_invariance"]
    print(
        f"batch invariance: identical rows bitwise equal {inv['identical_rows_bitwise_equal']}; "
        f"a row in 2 / 16 rows vs alone: max |Δ logit| {inv['rows2_vs_alone_max_abs']:.1e} / "
        f"{inv['rows16_vs_alone_max_abs']:.1e}"
    )
    for where, steps in report.get("busy_machine", {}).items():
        print(f"decode step ms, {where:5}: " + ", ".join(f"{k} {v:.1f}" for k, v in steps.items()))
    if report.get("modes"):
        print(_modes_text(report["modes"]))
    if report.get("peers"):
        print(peers[1](report["peers"]))
    return 0
