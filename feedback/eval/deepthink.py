"""Deep Think: DeepConf multi-trace answering for both sides, baseline and feedback.

1. Warm-up: `warmup` sampled traces per side, batched in one engine run, never stopped. Each
   trace's lowest group confidence gives the early-stop threshold s = percentile(100 - eta),
   per side or shared (pooled) as asked.
2. Online: `traces` more per side, batched in one engine run, each row stopped as soon as its
   window is full and its group confidence falls below its side's s.
3. Vote per side over the unstopped traces (warm-up ones included): majority, and weighted by
   lowest-group or tail confidence after keeping the top eta%.
Tokens spent count every generated token, stopped traces included. Tokens saved are measured in
`check` mode by finishing every stopped trace (same seed, so the same prefix) and counting the
difference; otherwise they are reported as an upper bound (each stopped trace run to the end).
Baseline and feedback trace i share a seed (common random numbers).
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from feedback.core.budget import Budget, dtype_bytes, generation_memory_mb
from feedback.core.engine import start_run
from feedback.core.model import LoadedModel
from feedback.core.records import DeepConfConfig, RowResult, RowSpec, RunConfig, answer_text
from feedback.core.sampling import SamplingConfig
from feedback.core.sharing import run_events
from feedback.errors import FeedbackError, Stopped
from feedback.eval.voting import (
    Trace,
    answer_matches,
    calibrate_threshold,
    check_eta,
    compile_answer_regex,
    extract_answer,
    vote,
)
from feedback.strategies import build_strategy

MAX_TRACES = 64
SIDES = ("baseline", "feedback")
# What each vote means, for reports and the UI.
VOTE_KINDS = {
    "lowest_group": "DeepConf's answer: the traces kept (top η% by lowest group confidence, stopped ones "
    "excluded) vote with that confidence as weight",
    "majority": "one vote per trace that was not stopped, confidence ignored",
    "tail": "like DeepConf's answer, but weighted by the mean confidence of each trace's last window",
}


@dataclass
class DeepThinkConfig:
    prompt: str
    traces: int = 16
    warmup: int = 8
    eta: float = 10.0
    window: int = 32
    k: int = 20
    max_new_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 0.95
    seed: int = 0
    strategy: str = "residual"
    params: dict = field(default_factory=dict)
    answer_regex: str | None = None
    shared_threshold: bool = False  # one threshold from both sides' warm-up traces
    check: bool = False  # finish stopped traces to measure the tokens saved exactly
    chat_template: bool = True
    expected: str | None = None  # the right answer, if known: traces and votes are marked correct or not

    def validate(self, num_layers: int) -> list[str]:
        """Raise on bad values; return warnings (e.g. a window that can never fill)."""
        if not 1 <= self.traces <= MAX_TRACES:
            raise FeedbackError(f"traces must be in [1, {MAX_TRACES}] per side, got {self.traces}")
        if not 1 <= self.warmup <= MAX_TRACES:
            raise FeedbackError(f"warmup must be in [1, {MAX_TRACES}] per side, got {self.warmup}")
        check_eta(self.eta)
        compile_answer_regex(self.answer_regex)
        build_strategy(self.strategy, self.params, num_layers)
        warnings = []
        if self.window > self.max_new_tokens:
            warnings.append(
                f"window {self.window} > max_new_tokens {self.max_new_tokens}: no trace can fill its "
                "window, so no early stop can happen"
            )
        return warnings


def _rows(cfg: DeepThinkConfig, n: int, offset: int, thresholds: dict[str, float | None]) -> list[RowSpec]:
    rows = []
    for side in SIDES:
        strategy = cfg.strategy if side == "feedback" else None
        params = dict(cfg.params) if side == "feedback" else {}
        rows += [
            RowSpec(
                f"{side}-{offset + i}",
                strategy,
                params,
                seed_offset=offset + i,
                threshold=thresholds.get(side),
            )
            for i in range(n)
        ]
    return rows


def check_budget(lm: LoadedModel, cfg: DeepThinkConfig, budget: Budget, warm_up_only: bool = False) -> None:
    """Refuse, before any work, a Deep Think (or its warm-up alone) the budget does not allow: all
    its traces' tokens, and the memory of its largest batched run."""
    per_side = cfg.warmup if warm_up_only else cfg.warmup + cfg.traces + (cfg.traces if cfg.check else 0)
    budget.check_decoding(
        2 * per_side * cfg.max_new_tokens, f"2 sides x {per_side} traces x {cfg.max_new_tokens} new tokens"
    )
    need, how = memory_need(lm, cfg, warm_up_only)
    budget.check_memory(need, how)


def memory_need(lm: LoadedModel, cfg: DeepThinkConfig, warm_up_only: bool = False) -> tuple[float, str]:
    """MB of its largest batched run's cache, and what that run is."""
    prompt = len(lm.encode(cfg.prompt, cfg.chat_template))
    rows = 2 * (cfg.warmup if warm_up_only else max(cfg.warmup, cfg.traces))
    return (
        generation_memory_mb(lm.model.config, dtype_bytes(lm.dtype), rows, prompt, cfg.max_new_tokens),
        f"{rows} traces at once, {prompt} prompt + {cfg.max_new_tokens} new tokens",
    )


def _run(
    lm: LoadedModel,
    cfg: DeepThinkConfig,
    rows: list[RowSpec],
    stop: threading.Event | None = None,
    progress=None,
    phase: str = "",
    shared: bool = False,
) -> list[RowResult]:
    """One batched engine run of these traces (`shared`: beside other requests' runs, in the model's
    decode loop); `progress(message)` hears of every decode step. Raises `Stopped` when `stop` is
    set (within one decode step)."""
    run_cfg = RunConfig(
        prompt=cfg.prompt,
        model=lm.name,
        chat_template=cfg.chat_template,
        max_new_tokens=cfg.max_new_tokens,
        seed=cfg.seed,
        sampling=SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p),
        deepconf=DeepConfConfig(cfg.k, cfg.window, None),
        rows=rows,
    )
    run = start_run(lm, run_cfg, stop_event=stop)
    for event in run_events(run, shared):
        if progress:
            live = len(rows) - sum(r.stop_reason is not None for r in run.result.rows)
            progress(
                f"{phase}: step {event.step + 1} of {cfg.max_new_tokens}, "
                f"{live} of {len(rows)} traces running"
            )
    if stop is not None and stop.is_set():
        raise Stopped(f"Deep Think was stopped during the {phase or 'run'}")
    return run.result.rows


def _trace(row: RowResult, pattern, phase: str, cfg: DeepThinkConfig) -> dict:
    m = row.metrics
    stopped = row.stop_reason == "early_stop"
    answer = extract_answer(answer_text(row), pattern, cfg.prompt)  # a restate trace: after its restatement
    return {
        "name": row.name,
        "phase": phase,
        "text": row.text,
        "answer": answer,
        "correct": answer_matches(answer, cfg.expected),
        "stopped": stopped,
        "excluded": stopped,
        "stop_reason": row.stop_reason,
        "stop_step": row.stop_step,
        "tokens": len(row.token_ids),
        "lowest_group": m.get("lowest_group"),
        "tail": m.get("tail"),
        "mean": m.get("mean"),
        "bottom10_group": m.get("bottom10_group"),
        "group_confidence": [s.group_confidence for s in row.steps],
    }


def _as_vote_trace(t: dict) -> Trace:
    nan = math.nan
    return Trace(
        t["answer"],
        t["excluded"],
        t["tokens"],
        t["lowest_group"] if t["lowest_group"] is not None else nan,
        t["tail"] if t["tail"] is not None else nan,
    )


def warm_up(
    lm: LoadedModel,
    cfg: DeepThinkConfig,
    stop: threading.Event | None = None,
    progress=None,
    budget: Budget | None = None,
    shared: bool = False,
) -> tuple[dict, dict, dict]:
    """Warm-up traces per side (never stopped), their lowest group confidences, and the thresholds
    (`shared`: see `deep_think`)."""
    pattern = compile_answer_regex(cfg.answer_regex)
    if budget is not None:
        check_budget(lm, cfg, budget, warm_up_only=True)
    warm_rows = _run(lm, cfg, _rows(cfg, cfg.warmup, 0, {}), stop, progress, "warm-up", shared)
    warm = {
        side: [_trace(r, pattern, "warmup", cfg) for r in warm_rows if r.name.startswith(side)]
        for side in SIDES
    }
    lows = {side: [t["lowest_group"] for t in warm[side] if t["lowest_group"] is not None] for side in SIDES}
    if cfg.shared_threshold:
        shared = calibrate_threshold(lows["baseline"] + lows["feedback"], cfg.eta)
        thresholds = {side: shared for side in SIDES}
    else:
        thresholds = {side: calibrate_threshold(lows[side], cfg.eta) for side in SIDES}
    return warm, lows, thresholds


def deep_think(
    lm: LoadedModel,
    cfg: DeepThinkConfig,
    progress=None,
    stop: threading.Event | None = None,
    budget: Budget | None = None,
    shared: bool = False,
) -> dict:
    """Warm-up, calibrate, run online with early stop, vote; a JSON-serialisable report per side.
    `progress(message)` hears of each phase and decode step; setting `stop` ends it (raising
    `Stopped`) within one decode step. With `budget`, a run it does not allow is refused first.
    `shared`: its traces decode beside other requests' runs, in the model's one decode loop
    (`feedback.core.sharing`; a served request admitted beside them)."""
    warnings = cfg.validate(lm.num_layers)
    if budget is not None:
        check_budget(lm, cfg, budget)
    pattern = compile_answer_regex(cfg.answer_regex)
    started = time.perf_counter()
    warm, lows, thresholds = warm_up(lm, cfg, stop, progress, shared=shared)
    phase = "online (thresholds " + ", ".join(f"{side} {thresholds[side]:.2f}" for side in SIDES) + ")"
    online_rows = _run(lm, cfg, _rows(cfg, cfg.traces, cfg.warmup, thresholds), stop, progress, phase, shared)
    online = {
        side: [_trace(r, pattern, "online", cfg) for r in online_rows if r.name.startswith(side)]
        for side in SIDES
    }

    full_lengths: dict[str, int] = {}
    if cfg.check:  # same seeds, no threshold: the stopped traces' full lengths
        stopped = [
            r
            for r in _rows(cfg, cfg.traces, cfg.warmup, {})
            if any(t["name"] == r.name and t["stopped"] for side in SIDES for t in online[side])
        ]
        if stopped:
            full_lengths = {
                r.name: len(r.token_ids)
                for r in _run(lm, cfg, stopped, stop, progress, "check: finishing the stopped traces", shared)
            }

    report = {
        "config": asdict(cfg),
        "model": lm.name,
        "dtype": lm.dtype,
        "warnings": warnings,
        "thresholds": thresholds,
        "sides": {},
    }
    for side in SIDES:
        # warm-up traces below the threshold would have been stopped: they do not vote either
        warm_votes = [
            t | {"excluded": t["lowest_group"] is not None and t["lowest_group"] < thresholds[side]}
            for t in warm[side]
        ]
        voters = [_as_vote_trace(t) for t in warm_votes + online[side]]
        votes = {
            "lowest_group": vote(voters, "lowest_group", cfg.eta),
            "majority": vote(voters),
            "tail": vote(voters, "tail", cfg.eta),
        }
        spent = sum(t["tokens"] for t in warm[side] + online[side])
        stopped = [t for t in online[side] if t["stopped"]]
        if cfg.check:
            saved = sum(full_lengths[t["name"]] - t["tokens"] for t in stopped)
            saved_method = "measured: stopped traces finished in check mode"
        else:
            saved = sum(cfg.max_new_tokens - t["tokens"] for t in stopped)
            saved_method = "upper bound: each stopped trace counted as running to max_new_tokens"
        report["sides"][side] = {
            "answer": votes["lowest_group"].answer,
            "share": votes["lowest_group"].share,
            "correct": answer_matches(votes["lowest_group"].answer, cfg.expected),
            "votes": {
                name: asdict(v)
                | {"correct": answer_matches(v.answer, cfg.expected), "meaning": VOTE_KINDS[name]}
                for name, v in votes.items()
            },
            "single_trace_answer": online[side][0]["answer"] if online[side] else None,
            "warmup_lowest_groups": lows[side],
            "threshold": thresholds[side],
            "tokens_spent": spent,
            "tokens_saved": saved,
            "tokens_saved_method": saved_method,
            "stopped": len(stopped),
            "traces": warm_votes + online[side],
        }
    report["wall_seconds"] = time.perf_counter() - started
    return report


def load_questions(path: str | Path) -> list[dict]:
    """JSONL of {"question": ..., "answer": ...}; bad lines are refused with their line number."""
    questions = []
    if not Path(path).is_file():
        raise FeedbackError(f"{path}: no such question file")
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise FeedbackError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("question"), str) or "answer" not in item:
            raise FeedbackError(f"{path}:{number}: needs a string 'question' and an 'answer'")
        questions.append(item)
    if not questions:
        raise FeedbackError(f"{path} has no questions")
    return questions


def accuracy(lm: LoadedModel, questions: list[dict], base: DeepThinkConfig, progress=None) -> dict:
    """Per side: accuracy of the single first trace, the majority vote and DeepConf's weighted vote,
    with tokens spent and saved, over a question set with gold answers."""
    tallies = {
        side: {"single": 0, "majority": 0, "deepconf": 0, "tokens_spent": 0, "tokens_saved": 0}
        for side in SIDES
    }
    items = []
    for i, q in enumerate(questions):
        gold = str(q["answer"])
        cfg = DeepThinkConfig(**{**asdict(base), "prompt": q["question"], "expected": gold})
        rep = deep_think(lm, cfg)
        item = {"question": q["question"], "gold": gold}
        for side in SIDES:
            s = rep["sides"][side]
            got = {
                "single": s["single_trace_answer"],
                "majority": s["votes"]["majority"]["answer"],
                "deepconf": s["votes"]["lowest_group"]["answer"],
            }
            for method, answer in got.items():
                tallies[side][method] += int(bool(answer_matches(answer, gold)))
            tallies[side]["tokens_spent"] += s["tokens_spent"]
            tallies[side]["tokens_saved"] += s["tokens_saved"]
            item[side] = got
        items.append(item)
        if progress:
            progress(i + 1, len(questions), q["question"])
    n = len(questions)
    summary = {
        side: {k: (v / n if k in ("single", "majority", "deepconf") else v) for k, v in t.items()}
        for side, t in tallies.items()
    }
    return {"questions": n, "accuracy": summary, "items": items, "config": asdict(base)}
