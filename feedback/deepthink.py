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
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from feedback.engine import Engine
from feedback.errors import FeedbackError
from feedback.model import LoadedModel
from feedback.records import DeepConfConfig, RowResult, RowSpec, RunConfig
from feedback.sampling import SamplingConfig
from feedback.strategies import build_strategy
from feedback.voting import Trace, calibrate_threshold, check_eta, compile_answer_regex, extract_answer, vote

MAX_TRACES = 64
SIDES = ("baseline", "feedback")


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
            warnings.append(f"window {self.window} > max_new_tokens {self.max_new_tokens}: no trace can fill its "
                            "window, so no early stop can happen")
        return warnings


def _rows(cfg: DeepThinkConfig, n: int, offset: int, thresholds: dict[str, float | None]) -> list[RowSpec]:
    rows = []
    for side in SIDES:
        strategy = cfg.strategy if side == "feedback" else None
        params = dict(cfg.params) if side == "feedback" else {}
        rows += [RowSpec(f"{side}-{offset + i}", strategy, params, seed_offset=offset + i,
                         threshold=thresholds.get(side)) for i in range(n)]
    return rows


def _run(lm: LoadedModel, cfg: DeepThinkConfig, rows: list[RowSpec]) -> list[RowResult]:
    run_cfg = RunConfig(prompt=cfg.prompt, model=lm.name, chat_template=cfg.chat_template,
                        max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                        sampling=SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p),
                        deepconf=DeepConfConfig(cfg.k, cfg.window, None), rows=rows)
    return Engine(lm).run(run_cfg).rows


def _trace(row: RowResult, pattern, phase: str) -> dict:
    m = row.metrics
    stopped = row.stop_reason == "early_stop"
    return {"name": row.name, "phase": phase, "text": row.text, "answer": extract_answer(row.text, pattern),
            "stopped": stopped, "excluded": stopped, "stop_reason": row.stop_reason, "stop_step": row.stop_step,
            "tokens": len(row.token_ids), "lowest_group": m.get("lowest_group"), "tail": m.get("tail"),
            "mean": m.get("mean"), "bottom10_group": m.get("bottom10_group"),
            "group_confidence": [s.group_confidence for s in row.steps]}


def _as_vote_trace(t: dict) -> Trace:
    nan = math.nan
    return Trace(t["answer"], t["excluded"], t["tokens"], t["lowest_group"] if t["lowest_group"] is not None else nan,
                 t["tail"] if t["tail"] is not None else nan)


def warm_up(lm: LoadedModel, cfg: DeepThinkConfig) -> tuple[dict, dict, dict]:
    """Warm-up traces per side (never stopped), their lowest group confidences, and the thresholds."""
    pattern = compile_answer_regex(cfg.answer_regex)
    warm_rows = _run(lm, cfg, _rows(cfg, cfg.warmup, 0, {}))
    warm = {side: [_trace(r, pattern, "warmup") for r in warm_rows if r.name.startswith(side)] for side in SIDES}
    lows = {side: [t["lowest_group"] for t in warm[side] if t["lowest_group"] is not None] for side in SIDES}
    if cfg.shared_threshold:
        shared = calibrate_threshold(lows["baseline"] + lows["feedback"], cfg.eta)
        thresholds = {side: shared for side in SIDES}
    else:
        thresholds = {side: calibrate_threshold(lows[side], cfg.eta) for side in SIDES}
    return warm, lows, thresholds


def deep_think(lm: LoadedModel, cfg: DeepThinkConfig, progress=None) -> dict:
    """Warm-up, calibrate, run online with early stop, vote; a JSON-serialisable report per side.
    `progress(message)` is told when each phase starts."""
    warnings = cfg.validate(lm.num_layers)
    pattern = compile_answer_regex(cfg.answer_regex)
    started = time.perf_counter()
    if progress:
        progress(f"warm-up: {cfg.warmup} traces per side")
    warm, lows, thresholds = warm_up(lm, cfg)
    if progress:
        progress(f"online: {cfg.traces} traces per side, thresholds "
                 + ", ".join(f"{side} {thresholds[side]:.3f}" for side in SIDES))
    online_rows = _run(lm, cfg, _rows(cfg, cfg.traces, cfg.warmup, thresholds))
    online = {side: [_trace(r, pattern, "online") for r in online_rows if r.name.startswith(side)] for side in SIDES}

    full_lengths: dict[str, int] = {}
    if cfg.check:  # same seeds, no threshold: the stopped traces' full lengths
        if progress:
            progress("check: finishing the stopped traces")
        stopped = [r for r in _rows(cfg, cfg.traces, cfg.warmup, {})
                   if any(t["name"] == r.name and t["stopped"] for side in SIDES for t in online[side])]
        if stopped:
            full_lengths = {r.name: len(r.token_ids) for r in _run(lm, cfg, stopped)}

    report = {"config": asdict(cfg), "model": lm.name, "dtype": lm.dtype, "warnings": warnings,
              "thresholds": thresholds, "sides": {}}
    for side in SIDES:
        # warm-up traces below the threshold would have been stopped: they do not vote either
        warm_votes = [t | {"excluded": t["lowest_group"] is not None and t["lowest_group"] < thresholds[side]}
                      for t in warm[side]]
        voters = [_as_vote_trace(t) for t in warm_votes + online[side]]
        votes = {"majority": vote(voters), "lowest_group": vote(voters, "lowest_group", cfg.eta),
                 "tail": vote(voters, "tail", cfg.eta)}
        spent = sum(t["tokens"] for t in warm[side] + online[side])
        stopped = [t for t in online[side] if t["stopped"]]
        if cfg.check:
            saved = sum(full_lengths[t["name"]] - t["tokens"] for t in stopped)
            saved_method = "measured: stopped traces finished in check mode"
        else:
            saved = sum(cfg.max_new_tokens - t["tokens"] for t in stopped)
            saved_method = "upper bound: each stopped trace counted as running to max_new_tokens"
        report["sides"][side] = {
            "answer": votes["lowest_group"].answer, "share": votes["lowest_group"].share,
            "votes": {name: asdict(v) for name, v in votes.items()},
            "single_trace_answer": online[side][0]["answer"] if online[side] else None,
            "warmup_lowest_groups": lows[side], "threshold": thresholds[side],
            "tokens_spent": spent, "tokens_saved": saved, "tokens_saved_method": saved_method,
            "stopped": len(stopped), "traces": warm_votes + online[side],
        }
    report["wall_seconds"] = time.perf_counter() - started
    return report


def load_questions(path: str | Path) -> list[dict]:
    """JSONL of {"question": ..., "answer": ...}; bad lines are refused with their line number."""
    questions = []
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
    from feedback.voting import normalise

    tallies = {side: {"single": 0, "majority": 0, "deepconf": 0, "tokens_spent": 0, "tokens_saved": 0}
               for side in SIDES}
    items = []
    for i, q in enumerate(questions):
        cfg = DeepThinkConfig(**{**asdict(base), "prompt": q["question"]})
        rep = deep_think(lm, cfg)
        gold = normalise(str(q["answer"]))
        item = {"question": q["question"], "gold": gold}
        for side in SIDES:
            s = rep["sides"][side]
            got = {"single": s["single_trace_answer"], "majority": s["votes"]["majority"]["answer"],
                   "deepconf": s["votes"]["lowest_group"]["answer"]}
            for method, answer in got.items():
                tallies[side][method] += int(answer == gold)
            tallies[side]["tokens_spent"] += s["tokens_spent"]
            tallies[side]["tokens_saved"] += s["tokens_saved"]
            item[side] = got
        items.append(item)
        if progress:
            progress(i + 1, len(questions), q["question"])
    n = len(questions)
    summary = {side: {k: (v / n if k in ("single", "majority", "deepconf") else v) for k, v in t.items()}
               for side, t in tallies.items()}
    return {"questions": n, "accuracy": summary, "items": items, "config": asdict(base)}
