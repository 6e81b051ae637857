"""`python -m feedback doctor`: check the machine it runs on and write `doctor.json` plus a table.

The steps (issue 24): the model in fp32, fp16 and bf16, its greedy tokens through the engine
against `model.generate`; 8-bit and 4-bit (bitsandbytes NF4) loading with perplexity against fp16;
the memory sampler's readings against torch's own peak; the engine's decode speed against
`model.generate` and the memory-bandwidth roofline; the static cache with CUDA graphs
(`torch.compile`); every strategy's run, its perplexity and the exactness guarantees (strength 0 =
the baseline, a left-padded batched row = the row alone, scoring is causal); and the app, started and
called through its client.

Each step is timed and recorded as ok, failed (its error; the next step still runs) or skipped
(why: a CUDA-only step on a CPU machine, a missing package, a step left out, the time budget
spent). The report is written after every step, so a run cut short still leaves what it measured.
Sizes depend on the machine (`Plan`): on CUDA those of the issue, about five minutes on one GPU; on
CPU small ones, so the whole report takes well under a minute on two cores.

This module sits between the command line and the bench (`.importlinter`): it never imports the UI
or Gradio. The app step starts `app.py` and the client probe (`ui/probe.py`) in their own processes.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.metadata
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch

from feedback.bench import (
    BENCH_PROMPT,
    SHORT_PROMPT,
    copy_bandwidth_gbs,
    device_clock,
    mean_step_s,
    prompt_of,
    step_marks,
    sync,
    weight_bytes,
)
from feedback.core import gemv
from feedback.core.budget import dtype_bytes, kv_bytes_per_token
from feedback.core.engine import run_to_end, run_with_logits
from feedback.core.model import LoadedModel, load_model, resolve_dtype
from feedback.core.records import RowSpec, RunConfig, first_divergence
from feedback.errors import FeedbackError, one_line

REPORT_VERSION = 1
ROOT = Path(__file__).resolve().parents[1]  # app.py and ui/ sit beside the package in the repository
# Exactness twins of the CPU tests, with the tolerance stated in the report: strength 0 against the
# baseline, and a row batched with others against the same row alone (max |Δ logit| over the run).
ZERO_TOL = 1e-4
BATCH_TOL = 1e-3
# Causality: changing a text's last token may move an earlier token's NLL by float noise only (a
# re-run of layers without the causal mask moved them by ~1e-3 on GPT-2); checked on this many tokens.
CAUSAL_TOL = 1e-4
CAUSAL_TOKENS = 64
CUDA_BUDGET_S = 300.0  # the bound for the whole report on one GPU
_MB = 2**20


class Skip(FeedbackError):
    """Raised by a step that does not apply on this machine; its message is the reason."""


@dataclass
class Outcome:
    """What a step found: a one-line summary (the table's), the numbers behind it, and whether its
    checks held (False: the step ran and found a problem, so it is recorded as failed)."""

    summary: str
    details: dict = field(default_factory=dict)
    ok: bool = True


@dataclass
class StepResult:
    name: str
    title: str
    status: str  # ok | failed | skipped
    seconds: float
    summary: str  # key numbers, the reason it was skipped, or the error
    details: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    run: Callable[[Context], Outcome]


@dataclass(frozen=True)
class Plan:
    """The sizes one machine runs the steps at."""

    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    greedy_tokens: int = 64  # engine vs generate, per dtype
    memory_tokens: int = 128  # the 2-row run the memory sampler watches (long enough for several readings)
    ppl_docs: int | None = None  # built-in test documents scored (None: all 40)
    ppl_tokens: int = 1024  # each cut to its first N tokens
    speed_shapes: tuple[tuple[int, int], ...] = (
        (1, 256),
        (2, 256),
        (16, 256),
        (1, 1024),
        (2, 1024),
        (16, 1024),
    )
    speed_tokens: int = 64  # decode steps timed per shape
    strategy_tokens: int = 32
    app_tokens: int = 16
    app_start_s: float = 180.0  # how long the app may take to answer /api/health


CUDA_PLAN = Plan()
# On CPU, sizes that check every path in about half a minute on two cores (the CPU tests hold the
# exactness guarantees at full size; the speed steps are the bench's job there): 8 greedy tokens a
# dtype (~2.5 s each), the strategies at 6 tokens on one 32-token document (~2 s each).
CPU_PLAN = Plan(
    greedy_tokens=8,
    memory_tokens=16,
    ppl_docs=1,
    ppl_tokens=32,
    speed_shapes=(),
    speed_tokens=0,
    strategy_tokens=6,
    app_tokens=8,
    app_start_s=90.0,
)
# A rehearsal (tests): the CUDA-only steps that can run on a CPU, at the smallest sizes that exercise them.
REHEARSAL_PLAN = dataclasses.replace(
    CPU_PLAN, greedy_tokens=4, speed_shapes=((1, 16), (2, 16)), speed_tokens=4
)


class Context:
    """What the steps share: the model spec, the device, the plan, and the models loaded so far
    (one per dtype, loaded once). `rehearse` runs the CUDA-only steps on a CPU where they can
    (tests of their code paths; their numbers mean nothing there)."""

    def __init__(
        self,
        spec: str = "embedded",
        device: str = "auto",
        plan: Plan | None = None,
        models: dict[str, LoadedModel] | None = None,
        rehearse: bool = False,
    ):
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.spec, self.device = spec, torch.device(device)
        self.plan = plan or (CUDA_PLAN if self.cuda else CPU_PLAN)
        self.rehearse = rehearse
        self._models = dict(models or {})

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def auto_dtype(self) -> str:
        """The dtype a plain load picks here (bf16 on a recent GPU, fp32 on CPU)."""
        return resolve_dtype("auto", self.device)

    def model(self, dtype: str) -> LoadedModel:
        if dtype not in self._models:
            self._models[dtype] = load_model(self.spec, dtype=dtype, device=str(self.device))
        return self._models[dtype]

    def drop(self, dtype: str) -> None:
        """Free a model no later step needs (CPU memory is shared with everything else)."""
        self._models.pop(dtype, None)
        free_memory()

    def require_cuda(self, why: str, rehearsable: bool = True) -> None:
        """Skip the step, saying `why`, unless this is a GPU (or a rehearsal of a step that can run on
        CPU)."""
        if not (self.cuda or (self.rehearse and rehearsable)):
            raise Skip(f"{no_cuda_reason()}: {why}")


def no_cuda_reason() -> str:
    build = f"torch {torch.__version__}"
    return (
        f"no CUDA GPU ({build} is a CPU build)"
        if torch.version.cuda is None
        else f"no CUDA GPU visible ({build})"
    )


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine(ctx: Context) -> dict:
    """What the report was measured on."""
    import transformers

    info = {
        "device": str(ctx.device),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "bitsandbytes": _version("bitsandbytes"),
        "gradio": _version("gradio"),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "model": ctx.spec,
    }
    if not ctx.cuda:  # the CPU's fp32 decode product: the compiled kernel, or why not
        info["fp32_decode_kernel"] = gemv.describe()
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        info |= {
            "gpu": props.name,
            "capability": f"{props.major}.{props.minor}",
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "bf16": torch.cuda.is_bf16_supported(),
            "nvml": _nvml_used_mb(ctx.device) is not None,
        }
    return info


# ---- the runner -------------------------------------------------------------------------------------


def run_step(step: Step, ctx: Context) -> StepResult:
    """One step, timed; whatever it raises is recorded (a Skip as its reason, anything else as a
    failure with its message and the end of its traceback), never passed on."""
    started = time.perf_counter()
    try:
        outcome = step.run(ctx)
        status, summary, details = ("ok" if outcome.ok else "failed"), outcome.summary, outcome.details
    except Skip as exc:
        status, summary, details = "skipped", str(exc), {}
    except Exception as exc:  # a step's failure is a finding of the report, not the end of it
        status, summary = "failed", one_line(exc)
        details = {"traceback": traceback.format_exc().splitlines()[-12:]}
        free_memory()  # after an out-of-memory error the next step starts on a clean allocator
    return StepResult(step.name, step.title, status, time.perf_counter() - started, summary, details)


def skipped(step: Step, reason: str) -> StepResult:
    return StepResult(step.name, step.title, "skipped", 0.0, reason)


def run_steps(
    steps: list[Step],
    ctx: Context,
    out: Path | None = None,
    show: Callable[[str], None] = print,
    budget_s: float | None = None,
    left_out: dict[str, str] | None = None,
) -> dict:
    """Every step in turn into one report, written to `out` after each step and shown as a table
    row as it finishes. A step named in `left_out` is recorded as skipped with that reason; once
    `budget_s` seconds have passed, no further step starts."""
    started = time.perf_counter()
    report = {
        "doctor": REPORT_VERSION,
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": _guarded(lambda: machine(ctx)),
        "plan": asdict(ctx.plan),
        "tolerances": {
            "strength_zero_max_abs_logit": ZERO_TOL,
            "batched_vs_alone_max_abs_logit": BATCH_TOL,
            "causality_max_abs_nll": CAUSAL_TOL,
        },
        "steps": [],
    }
    show(table_header())
    for step in steps:
        elapsed = time.perf_counter() - started
        if left_out and step.name in left_out:
            result = skipped(step, left_out[step.name])
        elif budget_s is not None and elapsed >= budget_s:
            result = skipped(step, f"the time budget ({budget_s:.0f} s) was spent before this step")
        else:
            print(f"doctor: {step.name}: {step.title} …", file=sys.stderr, flush=True)
            result = run_step(step, ctx)
        report["steps"].append(asdict(result))
        report["total_seconds"] = time.perf_counter() - started
        report["failed"] = [s["name"] for s in report["steps"] if s["status"] == "failed"]
        if out is not None:
            out.write_text(json.dumps(report, indent=1, default=str))
        show(table_row(result))
    return report


def _guarded(fn: Callable[[], dict]) -> dict:
    """A part of a step that may fail on its own (one dtype, one shape, one strategy): its result,
    or its error, so the rest of the step still runs."""
    try:
        return fn()
    except Exception as exc:
        free_memory()
        return {"error": one_line(exc)}


def table_header() -> str:
    return f"{'step':<11} {'status':<8} {'seconds':>7}  result\n{'-' * 11} {'-' * 8} {'-' * 7}  {'-' * 40}"


def table_row(r: StepResult) -> str:
    return f"{r.name:<11} {r.status:<8} {r.seconds:>7.1f}  {r.summary}"


# ---- 1. dtypes ----------------------------------------------------------------------------------------


def _short(dtype: str) -> str:
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(dtype, dtype)


def _timed(fn: Callable, device: torch.device):
    """(wall seconds, value) of `fn()`, the GPU drained before and after."""
    sync(device)
    t = time.perf_counter()
    value = fn()
    sync(device)
    return time.perf_counter() - t, value


def engine_greedy(lm: LoadedModel, prompt: str, tokens: int) -> list[int]:
    """The engine's tokens for one plain greedy row (chat template on, as the app runs it)."""
    return (
        run_to_end(
            lm, RunConfig(prompt=prompt, model=lm.name, max_new_tokens=tokens, rows=[RowSpec("baseline")])
        )
        .rows[0]
        .token_ids
    )


def generate_greedy(
    lm: LoadedModel, ids: list[int], tokens: int, rows: int = 1, min_tokens: int | None = None, **kwargs
) -> list[list[int]]:
    """`model.generate`'s greedy tokens for `rows` copies of the prompt `ids`."""
    batch = torch.tensor([ids] * rows, device=lm.device)
    with torch.inference_mode():
        out = lm.model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=tokens,
            min_new_tokens=min_tokens,
            do_sample=False,
            pad_token_id=lm.tokenizer.eos_token_id,
            **kwargs,
        )
    return out[:, batch.shape[1] :].tolist()


def greedy_check(lm: LoadedModel, tokens: int, prompt: str = BENCH_PROMPT) -> dict:
    """One dtype: the engine's greedy tokens against `model.generate`'s, each timed."""
    engine_s, ours = _timed(lambda: engine_greedy(lm, prompt, tokens), lm.device)
    generate_s, theirs = _timed(lambda: generate_greedy(lm, lm.encode(prompt), tokens)[0], lm.device)
    return {
        "load_s": round(lm.load_seconds, 2),
        "tokens": len(ours),
        "generate_tokens": len(theirs),
        "same_tokens": ours == theirs,
        "first_difference": first_divergence(ours, theirs),
        "engine_s": round(engine_s, 3),
        "generate_s": round(generate_s, 3),
        "precision": lm.precision,
    }


def step_dtypes(ctx: Context) -> Outcome:
    checks = {}
    for dtype in ctx.plan.dtypes:
        checks[dtype] = _guarded(lambda dtype=dtype: greedy_check(ctx.model(dtype), ctx.plan.greedy_tokens))
        if not ctx.cuda and dtype != "float32":
            ctx.drop(dtype)  # the later steps on CPU use fp32 only
    bad = [d for d, c in checks.items() if "error" in c or not c["same_tokens"]]
    return Outcome(
        "; ".join(_dtype_line(d, c) for d, c in checks.items()),
        {"prompt": BENCH_PROMPT, **checks},
        ok=not bad,
    )


def _dtype_line(dtype: str, c: dict) -> str:
    if "error" in c:
        return f"{_short(dtype)} {c['error']}"
    same = "= generate" if c["same_tokens"] else f"≠ generate from token {c['first_difference']}"
    return f"{_short(dtype)} {c['tokens']} tok {same}"


# ---- 2. 8-bit and 4-bit ---------------------------------------------------------------------------------


def test_split_ppl(lm: LoadedModel, plan: Plan) -> dict:
    """The baseline perplexity of the built-in test split at the plan's size."""
    from feedback.eval.corpus import builtin
    from feedback.eval.perplexity import PPLConfig, evaluate

    res = evaluate(
        lm,
        builtin("test"),
        PPLConfig(max_docs=plan.ppl_docs, max_tokens_per_doc=plan.ppl_tokens, bootstrap=0),
    )
    return {
        "ppl": res["baseline_ppl"],
        "documents": res["documents"],
        "tokens": res["tokens"],
        "ppl_s": round(res["wall_seconds"], 2),
    }


def _footprint_mb(lm: LoadedModel) -> float:
    """The model's weights and buffers in memory (transformers' own count, quantized sizes included)."""
    return lm.model.get_memory_footprint() / _MB


def quantized_check(ctx: Context, bits: int, reference: dict) -> dict:
    """Load at `bits` (fp16 compute), generate, score the test split; against the fp16 reference."""
    allocated = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
    lm = load_model(ctx.spec, dtype="float16", load_in_8bit=bits == 8, load_in_4bit=bits == 4)
    try:
        grown = (torch.cuda.memory_allocated(ctx.device) - allocated) / _MB if ctx.cuda else None
        decode_s, ids = _timed(lambda: engine_greedy(lm, BENCH_PROMPT, ctx.plan.greedy_tokens), lm.device)
        ppl = test_split_ppl(lm, ctx.plan)
        return {
            "load_s": round(lm.load_seconds, 2),
            "footprint_mb": round(_footprint_mb(lm), 1),
            "cuda_allocated_mb": None if grown is None else round(grown, 1),
            "tokens": len(ids),
            "tokens_per_s": round(len(ids) / decode_s, 1),
            "same_tokens_as_fp16": ids == reference["ids"],
            **ppl,
            "delta_ppl_pct_vs_fp16": round(100.0 * (ppl["ppl"] / reference["ppl"] - 1.0), 3),
        }
    finally:
        lm = None  # the model goes before the allocator is emptied
        free_memory()


def step_quantized(ctx: Context) -> Outcome:
    ctx.require_cuda("bitsandbytes 8-bit and 4-bit weights load on CUDA only", rehearsable=False)
    if _version("bitsandbytes") is None:
        raise Skip("bitsandbytes is not installed (pip install bitsandbytes)")
    fp16 = ctx.model("float16")
    reference = {
        "ids": engine_greedy(fp16, BENCH_PROMPT, ctx.plan.greedy_tokens),
        **test_split_ppl(fp16, ctx.plan),
        "footprint_mb": round(_footprint_mb(fp16), 1),
    }
    checks = {
        f"{bits}bit": _guarded(lambda bits=bits: quantized_check(ctx, bits, reference)) for bits in (8, 4)
    }
    parts = [f"fp16 PPL {reference['ppl']:.3f} ({reference['footprint_mb']:.0f} MB)"]
    for name, c in checks.items():
        parts.append(
            f"{name} {c['error']}"
            if "error" in c
            else f"{name} PPL {c['ppl']:.3f} ({c['delta_ppl_pct_vs_fp16']:+.2f} %, "
            f"{c['footprint_mb']:.0f} MB, {c['tokens_per_s']:.0f} tok/s)"
        )
    reference.pop("ids")
    return Outcome(
        "; ".join(parts), {"fp16": reference, **checks}, ok=not any("error" in c for c in checks.values())
    )


# ---- 3. the memory sampler ---------------------------------------------------------------------------------


def _nvml_used_mb(device: torch.device) -> float | None:
    """The GPU's used memory as NVML sees it (every process, the CUDA context included), or None
    where NVML cannot be read (pynvml missing, no driver library)."""
    try:
        return torch.cuda.device_memory_used(device) / _MB
    except Exception:  # torch raises ModuleNotFoundError without pynvml, others without a driver
        return None


def _two_row_run(lm: LoadedModel, tokens: int):
    rows = [RowSpec("baseline"), RowSpec("feedback", "residual", {})]
    return run_to_end(lm, RunConfig(prompt=BENCH_PROMPT, model=lm.name, max_new_tokens=tokens, rows=rows))


def cuda_memory_check(lm: LoadedModel, tokens: int) -> Outcome:
    """The sampler's readings during a 2-row run against torch.cuda.max_memory_allocated: the
    sampler reads that same counter, so its highest peak reading may lag the true peak (what
    happened after its last reading) but never exceed it."""
    dev = lm.device
    sync(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    result = _two_row_run(lm, tokens)
    sync(dev)
    true_peak = torch.cuda.max_memory_allocated(dev) / _MB
    samples = [s for s in result.memory if s.get("cuda_allocated_mb") is not None]
    if not samples:
        return Outcome(
            "the sampler gave no CUDA readings on a CUDA device", {"samples": result.memory}, ok=False
        )
    seen = {
        key: round(max(s[key] for s in samples), 1)
        for key in ("cuda_allocated_mb", "cuda_reserved_mb", "cuda_peak_mb")
    }
    free, total = torch.cuda.mem_get_info(dev)
    details = {
        "samples": len(samples),
        "tokens": len(result.rows[0].token_ids),
        **seen,
        "max_memory_allocated_mb": round(true_peak, 1),
        "missed_peak_mb": round(true_peak - seen["cuda_peak_mb"], 1),
        "driver_used_mb": round((total - free) / _MB, 1),
        "nvml_used_mb": _nvml_used_mb(dev),
    }
    return Outcome(_cuda_memory_line(details), details, ok=seen["cuda_peak_mb"] <= true_peak + 0.5)


def _cuda_memory_line(d: dict) -> str:
    nvml = (
        "NVML n/a (pynvml not installed)" if d["nvml_used_mb"] is None else f"NVML {d['nvml_used_mb']:.0f} MB"
    )
    return (
        f"{d['samples']} readings: allocated ≤ {d['cuda_allocated_mb']:.0f}, reserved ≤ "
        f"{d['cuda_reserved_mb']:.0f}, peak {d['cuda_peak_mb']:.0f} "
        f"vs torch max {d['max_memory_allocated_mb']:.0f}"
        f" MB; driver {d['driver_used_mb']:.0f} MB; {nvml}"
    )


def rss_memory_check(lm: LoadedModel, tokens: int) -> Outcome:
    """On CPU the sampler reads the process RSS: its readings against the RSS now and the
    process's peak RSS (getrusage), and no CUDA figures."""
    result = _two_row_run(lm, tokens)
    rss = [s["rss_mb"] for s in result.memory]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    import psutil

    now = psutil.Process().memory_info().rss / _MB
    cuda_fields = any(s.get("cuda_allocated_mb") is not None for s in result.memory)
    details = {
        "samples": len(rss),
        "rss_min_mb": round(min(rss), 1),
        "rss_max_mb": round(max(rss), 1),
        "rss_now_mb": round(now, 1),
        "peak_rss_mb": round(peak, 1),
        "cuda_fields": cuda_fields,
    }
    summary = (
        f"{len(rss)} RSS readings {min(rss):.0f}–{max(rss):.0f} MB (now {now:.0f}, process peak "
        f"{peak:.0f} MB); no CUDA figures on CPU"
    )
    return Outcome(summary, details, ok=bool(rss) and not cuda_fields and max(rss) <= peak + 1)


def step_memory(ctx: Context) -> Outcome:
    lm = ctx.model(ctx.auto_dtype)
    if ctx.cuda:
        return cuda_memory_check(lm, ctx.plan.memory_tokens)
    return rss_memory_check(lm, ctx.plan.memory_tokens)


# ---- 4. engine speed and the roofline ----------------------------------------------------------------------


def engine_step_s(lm: LoadedModel, rows: int, prompt: str, tokens: int) -> tuple[float, int]:
    """Mean wall time of the engine's decode steps after the first (which carries the prefill), and
    how many steps it took; the GPU is synchronised at each step's mark."""
    marks = step_marks(
        lm,
        [RowSpec(f"r{i}") for i in range(rows)],
        tokens,
        prompt,
        chat_template=False,
        clock=device_clock(lm.device),
    )
    return mean_step_s(marks), len(marks)


def generate_step_s(lm: LoadedModel, rows: int, prompt: str, tokens: int) -> float:
    """`model.generate`'s decode step at the same batch: a run of `tokens` less a run of one token
    (the prefill), per step."""
    ids = lm.encode(prompt, chat_template=False)
    one, _ = _timed(lambda: generate_greedy(lm, ids, 1, rows), lm.device)
    full, _ = _timed(lambda: generate_greedy(lm, ids, tokens, rows, min_tokens=tokens), lm.device)
    return (full - one) / (tokens - 1)


def speed_check(lm: LoadedModel, rows: int, ctx_tokens: int, tokens: int, bandwidth_gbs: float) -> dict:
    """One shape: the engine's step and tokens/s, generate's, and the step's share of the roofline
    (weights read once a step, plus every row's KV cache at the run's mean length)."""
    prompt = prompt_of(lm, ctx_tokens)
    step, steps = engine_step_s(lm, rows, prompt, tokens)
    gen = generate_step_s(lm, rows, prompt, tokens)
    kv = rows * (ctx_tokens + steps / 2) * kv_bytes_per_token(lm.model.config, dtype_bytes(lm.dtype))
    read = weight_bytes(lm) + kv
    return {
        "rows": rows,
        "prompt_tokens": ctx_tokens,
        "steps": steps,
        "engine_step_ms": round(step * 1e3, 3),
        "engine_tokens_per_s": round(rows / step, 1),
        "generate_step_ms": round(gen * 1e3, 3),
        "generate_tokens_per_s": round(rows / gen, 1),
        "generate_vs_engine": round(gen / step, 3),
        "bytes_read_per_step_mb": round(read / _MB, 1),
        "roofline_fraction": round(read / step / (bandwidth_gbs * 1e9), 4),
    }


def step_speed(ctx: Context) -> Outcome:
    ctx.require_cuda("the CPU bench is `python -m feedback bench`")
    lm = ctx.model(ctx.auto_dtype)
    bandwidth = copy_bandwidth_gbs(lm.device)
    engine_step_s(lm, 2, prompt_of(lm, 64), 4)  # warm-up: kernels, allocator, cuBLAS handles
    shapes = [
        _guarded(
            lambda rows=rows, ctx_tokens=ctx_tokens: speed_check(
                lm, rows, ctx_tokens, ctx.plan.speed_tokens, bandwidth
            )
        )
        | {"shape": f"{rows}x{ctx_tokens}"}
        for rows, ctx_tokens in ctx.plan.speed_shapes
    ]
    good = [s for s in shapes if "error" not in s]
    parts = [
        f"{s['shape']}: {s['error']}"
        if "error" in s
        else f"{s['shape']} {s['engine_step_ms']:.1f} ms ({s['engine_tokens_per_s']:.0f} tok/s, gen "
        f"{s['generate_step_ms']:.1f} ms, {100 * s['roofline_fraction']:.0f} % roofline)"
        for s in shapes
    ]
    details = {
        "dtype": lm.dtype,
        "bandwidth_gbs": round(bandwidth, 1),
        "weights_mb": round(weight_bytes(lm) / _MB, 1),
        "decode_tokens": ctx.plan.speed_tokens,
        "shapes": shapes,
    }
    return Outcome(
        f"{lm.dtype}, copy {bandwidth:.0f} GB/s; " + "; ".join(parts), details, ok=len(good) == len(shapes)
    )


# ---- 5. static cache and compiled decode -------------------------------------------------------------------


def step_compiled(ctx: Context) -> Outcome:
    """`model.generate` with a static cache, which transformers compiles on CUDA (torch.compile,
    mode reduce-overhead: CUDA graphs), against eager generate: same greedy tokens, speedup. The
    engine has no static-cache path (its rows decode on a growing cache, and feedback rows run
    forward hooks), so the plain row is the case hooks allow; the report says so."""
    ctx.require_cuda("the static cache is compiled with CUDA graphs only on a GPU")
    lm = ctx.model(ctx.auto_dtype)
    ids, n = lm.encode(BENCH_PROMPT), ctx.plan.greedy_tokens
    generate_greedy(lm, ids, n)  # warm-up
    eager_s, eager = _timed(lambda: generate_greedy(lm, ids, n, min_tokens=n)[0], lm.device)
    first_s, _ = _timed(
        lambda: generate_greedy(lm, ids, n, min_tokens=n, cache_implementation="static"), lm.device
    )
    static_s, static = _timed(
        lambda: generate_greedy(lm, ids, n, min_tokens=n, cache_implementation="static")[0], lm.device
    )
    compiled = getattr(lm.model, "_compiled_call", None) is not None
    details = {
        "dtype": lm.dtype,
        "tokens": n,
        "eager_s": round(eager_s, 3),
        "static_first_call_s": round(first_s, 2),
        "static_s": round(static_s, 3),
        "speedup": round(eager_s / static_s, 3),
        "compiled": compiled,
        "same_tokens": eager == static,
        "first_difference": first_divergence(eager, static),
        "engine": "no static-cache path: engine rows decode eagerly on a dynamic cache (feedback rows "
        "add forward hooks); measured on model.generate, a plain row",
    }
    same = "same tokens" if eager == static else f"tokens differ from {details['first_difference']}"
    summary = (
        f"{lm.dtype} {n} tok: {same}, {details['speedup']:.2f}x eager "
        f"({'compiled' if compiled else 'not compiled'}, first call {first_s:.1f} s)"
    )
    return Outcome(summary, details, ok=eager == static)


# ---- 6. strategies ---------------------------------------------------------------------------------------


def _max_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max().item() for x, y in zip(a, b)), default=0.0)


def strategy_ppl(lm: LoadedModel, name: str, plan: Plan) -> dict:
    """Baseline and strategy perplexity on the built-in test split (its default mode: parallel, or
    Jacobi passes for a recurrent strategy)."""
    from feedback.eval.corpus import builtin
    from feedback.eval.perplexity import PPLConfig, evaluate

    res = evaluate(
        lm,
        builtin("test"),
        PPLConfig(name, {}, max_docs=plan.ppl_docs, max_tokens_per_doc=plan.ppl_tokens, bootstrap=0),
    )
    return {
        "mode": res["mode"],
        "ppl_tokens": res["tokens"],
        "baseline_ppl": res["baseline_ppl"],
        "feedback_ppl": res["feedback_ppl"],
        "delta_ppl_pct": round(res["delta_pct"], 3),
    }


def causality_gap(lm: LoadedModel, name: str, plan: Plan) -> float:
    """The most an earlier token's NLL under the strategy changes when a text's last token is
    changed (0 where scoring is causal: a later token never changes an earlier NLL)."""
    from feedback.eval.corpus import builtin
    from feedback.eval.perplexity import PPLConfig, token_nlls

    ids = lm.tokenizer(builtin("test")[0].text)["input_ids"][: min(plan.ppl_tokens, CAUSAL_TOKENS)]
    other = ids[:-1] + [(ids[-1] + 1) % lm.vocab_size]
    cfg = PPLConfig(name, {}, bootstrap=0)
    (_, fb), (_, fb2) = token_nlls(lm, ids, cfg), token_nlls(lm, other, cfg)
    return float(abs(fb[:-1] - fb2[:-1]).max())


def strategy_check(lm: LoadedModel, name: str, plan: Plan) -> dict:
    """One strategy: baseline + the strategy at its defaults (+ at strength 0, for a hidden-state
    strategy) in one batched run beside a longer prompt (so they are left-padded), the strategy's
    row alone, whether its scoring is causal, and its perplexity."""
    from feedback.strategies import REGISTRY, PromptStrategy

    cls = REGISTRY[name]
    hidden = not issubclass(cls, PromptStrategy)
    rows = [RowSpec("padding", prompt=BENCH_PROMPT), RowSpec("baseline"), RowSpec(name, name, {})]
    if hidden:  # a prompt-level strategy at strength 0 still adds its markers: no baseline to match
        rows.append(RowSpec("zero", name, {cls.strength_param: 0.0}))
    cfg = RunConfig(prompt=SHORT_PROMPT, model=lm.name, max_new_tokens=plan.strategy_tokens, rows=rows)
    batched, logits = run_with_logits(lm, cfg)
    alone, alone_logits = run_with_logits(lm, dataclasses.replace(cfg, rows=[rows[2]]))
    base, own = batched.rows[1], batched.rows[2]
    out = {
        "tokens": len(own.token_ids),
        "tokens_per_s": round(own.tokens_per_s, 1),
        "first_difference_from_baseline": first_divergence(base.token_ids, own.token_ids),
        "padded_batched_same_tokens_as_alone": own.token_ids == alone.rows[0].token_ids,
        "padded_batched_vs_alone_max_abs": _max_gap(logits[2], alone_logits[0]),
    }
    if hidden:
        out |= {
            "zero_same_tokens_as_baseline": batched.rows[3].token_ids == base.token_ids,
            "zero_vs_baseline_max_abs": _max_gap(logits[3], logits[1]),
            "causality_max_abs_nll": causality_gap(lm, name, plan),
        }
        out |= _guarded(lambda: strategy_ppl(lm, name, plan))
    else:
        out["ppl"] = "n/a: a prompt-level strategy changes the prompt, not the model"
    out["exact"] = _exact(out, hidden)
    return out


def _exact(c: dict, hidden: bool) -> bool:
    batched = c["padded_batched_same_tokens_as_alone"] and c["padded_batched_vs_alone_max_abs"] <= BATCH_TOL
    zero = not hidden or (
        c["zero_same_tokens_as_baseline"]
        and c["zero_vs_baseline_max_abs"] <= ZERO_TOL
        and c["causality_max_abs_nll"] <= CAUSAL_TOL
    )
    return batched and zero


def _strategy_line(name: str, c: dict) -> str:
    if "error" in c and "tokens" not in c:
        return f"{name} {c['error']}"
    ppl = f"ΔPPL {c['delta_ppl_pct']:+.2f} %" if "delta_ppl_pct" in c else c.get("error", "PPL n/a")
    return f"{name} {'exact' if c['exact'] else 'NOT exact'}, {ppl}"


def step_strategies(ctx: Context) -> Outcome:
    from feedback.strategies import REGISTRY

    lm = ctx.model("float32")  # the exactness guarantees are stated for fp32
    checks = {
        name: _guarded(lambda name=name: strategy_check(lm, name, ctx.plan)) for name in sorted(REGISTRY)
    }
    ok = all(c.get("exact") and "error" not in c for c in checks.values())
    details = {
        "dtype": lm.dtype,
        "prompt": SHORT_PROMPT,
        "tokens": ctx.plan.strategy_tokens,
        "tolerances": {"strength_zero": ZERO_TOL, "batched_vs_alone": BATCH_TOL, "causality": CAUSAL_TOL},
        **checks,
    }
    return Outcome("; ".join(_strategy_line(n, c) for n, c in checks.items()), details, ok=ok)


# ---- 7. the app -----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def wait_for_health(url: str, process: subprocess.Popen, limit_s: float) -> float:
    """Seconds until GET /api/health answers; a FeedbackError if the app exits or takes too long."""
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        if process.poll() is not None:
            raise FeedbackError(f"the app exited with status {process.returncode} before it answered")
        try:
            get_json(f"{url}/api/health", timeout=2.0)
            return time.perf_counter() - started
        except OSError:  # not listening yet
            time.sleep(0.25)
    raise FeedbackError(f"the app did not answer /api/health within {limit_s:.0f} s")


def probe_compare(url: str, tokens: int, limit_s: float) -> dict:
    """One /compare through gradio_client, in its own process (`ui/probe.py`): the library never
    imports Gradio."""
    out = subprocess.run(
        [sys.executable, "-m", "ui.probe", url, "--max-new-tokens", str(tokens)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=limit_s,
    )
    if out.returncode != 0:
        raise FeedbackError(f"the /compare probe failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _log_tail(path: Path, lines: int = 8) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []


def step_app(ctx: Context) -> Outcome:
    """`app.py` on a free local port in its own process: how long until /api/health answers, one
    /compare through gradio_client, and /api/health after it. A failure keeps the end of the app's
    log, where its own error is."""
    if not (ROOT / "app.py").exists() or not (ROOT / "ui" / "probe.py").exists():
        raise Skip(
            f"app.py and ui/ are not beside the package here ({ROOT}): an installed library has no app"
        )
    url = f"http://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "app.log"
        with log.open("w") as sink:
            app = subprocess.Popen(
                [
                    sys.executable,
                    "app.py",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    url.rsplit(":", 1)[1],
                    "--models",
                    ctx.spec,
                ],
                cwd=ROOT,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=_app_env(ctx),
            )
        try:
            return _app_checks(ctx, url, app)
        except Exception as exc:  # the app's own error is in its log, not in the exception seen here
            return Outcome(one_line(exc), {"app_log_tail": _log_tail(log, 20)}, ok=False)
        finally:
            _stop(app)


def _app_env(ctx: Context) -> dict:
    """The app's environment: no analytics calls, and no GPU when the report is a CPU one."""
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
    if not ctx.cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _app_checks(ctx: Context, url: str, app: subprocess.Popen) -> Outcome:
    start_s = wait_for_health(url, app, ctx.plan.app_start_s)
    compare = probe_compare(url, ctx.plan.app_tokens, ctx.plan.app_start_s)
    health = get_json(f"{url}/api/health")
    ok = health.get("status") == "ok" and all(r["tokens"] > 0 for r in compare["rows"])
    summary = (
        f"up in {start_s:.1f} s; /compare {compare['seconds']:.1f} s, "
        f"{len(compare['rows'])} columns × {[r['tokens'] for r in compare['rows']]} tokens; "
        f"/api/health {health.get('status')}, models {health.get('models_loaded')}"
    )
    return Outcome(summary, {"start_s": round(start_s, 2), "compare": compare, "health": health}, ok=ok)


def _stop(process: subprocess.Popen) -> None:
    """End the app we started (it stops its jobs on the way out), killing it if it lingers."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ---- the command ---------------------------------------------------------------------------------------

STEPS: tuple[Step, ...] = (
    Step("dtypes", "fp32 / fp16 / bf16: engine greedy = model.generate", step_dtypes),
    Step("quantized", "8-bit and 4-bit (NF4): load, generate, test-split PPL vs fp16", step_quantized),
    Step("memory", "the memory sampler during a 2-row run vs torch's own counters", step_memory),
    Step("speed", "engine decode step vs model.generate, share of the bandwidth roofline", step_speed),
    Step("compiled", "static cache + CUDA graphs (torch.compile) vs eager", step_compiled),
    Step(
        "strategies",
        "each strategy: a run beside a longer prompt, PPL, strength 0 = baseline, padded batch = alone, "
        "causal scoring",
        step_strategies,
    ),
    Step("app", "app.py: /api/health, one /compare through gradio_client", step_app),
)
STEP_NAMES = tuple(s.name for s in STEPS)


def check_names(names: list[str], flag: str) -> list[str]:
    unknown = [n for n in names if n not in STEP_NAMES]
    if unknown:
        raise FeedbackError(f"{flag}: unknown step {', '.join(unknown)}; steps: {', '.join(STEP_NAMES)}")
    return names


def left_out(only: list[str] | None, skip: list[str]) -> dict[str, str]:
    """Steps not to run, each with the reason the report gives."""
    out = {n: "left out (--skip)" for n in check_names(skip, "--skip")}
    if only:
        out |= {n: "left out (not in --only)" for n in STEP_NAMES if n not in check_names(only, "--only")}
    return out


def run_doctor(
    out: str | Path = "doctor.json",
    spec: str | None = None,
    only: list[str] | None = None,
    skip: list[str] = (),
    budget_s: float | None = None,
    device: str = "auto",
    show: Callable[[str], None] = print,
) -> int:
    """The whole report: 0 when no step failed, 1 when one did (the report is complete either way)."""
    omitted = left_out(only, list(skip))
    if device == "cuda" and not torch.cuda.is_available():
        raise FeedbackError(f"--device cuda: {no_cuda_reason()}")
    ctx = Context(spec or "embedded", device)
    if budget_s is None and ctx.cuda:
        budget_s = CUDA_BUDGET_S
    path = Path(out)
    report = run_steps(list(STEPS), ctx, path, show, budget_s, omitted)
    show(f"total {report['total_seconds']:.1f} s on {report['machine'].get('gpu', ctx.device)}; wrote {path}")
    return 1 if report["failed"] else 0
