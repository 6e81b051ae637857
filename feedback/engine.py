"""The decode loop: all rows of a run in one batched forward per step, sharing one prompt prefill.

Row 0 is usually the baseline; other rows carry a feedback strategy whose hooks act on their own
batch position only. Rows that finish (EOS, max tokens, early stop) leave the batch and the KV
cache. Iterating a `Run` yields a `StepEvent` per step; `Run.result` holds the `RunResult`.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from transformers import DynamicCache

from feedback import memory
from feedback.budget import PREFILL_CHUNK, Budget, dtype_bytes, generation_memory_mb
from feedback.confidence import GroupWindow, distribution_stats, trace_metrics
from feedback.detok import IncrementalDecoder
from feedback.errors import FeedbackError
from feedback.model import LoadedModel
from feedback.records import Alternative, RowResult, RunConfig, RunResult, StepRecord, first_divergence
from feedback.sampling import Sampler
from feedback.strategies import BatchView, Strategy, build_strategy

N_TOP = 5
MEMORY_SAMPLE_EVERY_S = 0.25

# Called after every forward with (step, row ids in batch order, raw logits [B, V]); for analysis.
LogitsObserver = Callable[[int, list[int], torch.Tensor], None]


@dataclass
class StepEvent:
    """One decode step: a record per live row, and the rows that finished at this step."""

    step: int
    records: dict[int, StepRecord]
    finished: dict[int, str] = field(default_factory=dict)  # row index -> stop reason
    memory: memory.MemorySample | None = None


class Run:
    """One generation run. Iterate it (in any single thread) for events; `stop()` from any thread
    ends it within one step; `result` is complete once iteration ends."""

    def __init__(self, lm: LoadedModel, config: RunConfig, stop_event: threading.Event | None = None,
                 observer: LogitsObserver | None = None, budget: Budget | None = None):
        self.lm = lm
        self.config = config.validate()
        if config.model not in (lm.name, None, ""):
            raise FeedbackError(f"this run asks for model {config.model!r} but the engine holds {lm.name!r}")
        self.stop_event = stop_event or threading.Event()
        self.observer = observer
        self.prompt_ids = lm.encode(config.prompt, config.chat_template, config.system_prompt)
        limit = lm.context_length
        if len(self.prompt_ids) + config.max_new_tokens > limit:
            raise FeedbackError(
                f"prompt is {len(self.prompt_ids)} tokens; with max_new_tokens={config.max_new_tokens} "
                f"it exceeds the model context of {limit} tokens"
            )
        if budget is not None:  # a served request: refused before any work if it is too big
            rows, new = len(config.rows), config.max_new_tokens
            budget.check_decoding(rows * new, f"{rows} rows x {new} new tokens")
            budget.check_memory(
                generation_memory_mb(lm.model.config, dtype_bytes(lm.dtype), rows, len(self.prompt_ids), new),
                f"{len(self.prompt_ids)} prompt + {new} new tokens, {rows} rows")
        # Build (and so validate) every strategy before any hook touches the model.
        self.strategies: dict[int, Strategy] = {
            i: build_strategy(row.strategy, row.params, lm.num_layers)
            for i, row in enumerate(config.rows) if row.strategy
        }
        self.result = RunResult(
            config={**config.to_dict(), "model": lm.name, "dtype": lm.dtype},
            rows=[RowResult(r.name, r.strategy, self.strategies[i].values if i in self.strategies else {})
                  for i, r in enumerate(config.rows)],
            prompt_tokens=len(self.prompt_ids),
        )
        self._started = False

    def stop(self) -> None:
        self.stop_event.set()

    def __iter__(self) -> Iterator[StepEvent]:
        if self._started:
            raise RuntimeError("a Run can be iterated once")
        self._started = True
        return self._loop()

    def _loop(self) -> Iterator[StepEvent]:
        cfg, lm = self.config, self.lm
        model, device, n_rows = lm.model, lm.device, len(cfg.rows)
        tok = lm.tokenizer
        eos = set(lm.eos_token_ids)
        k, window = cfg.deepconf.k, cfg.deepconf.window
        thresholds = [r.threshold if r.threshold is not None else cfg.deepconf.threshold for r in cfg.rows]
        rows = self.result.rows
        decoders = [IncrementalDecoder(tok) for _ in range(n_rows)]
        windows = [GroupWindow(window) for _ in range(n_rows)]
        confs: list[list[float]] = [[] for _ in range(n_rows)]
        alt_text: dict[int, str] = {}
        batch = BatchView("prefill", list(range(n_rows)))
        sampler = Sampler(cfg.sampling, [cfg.seed + r.seed_offset for r in cfg.rows], device)
        t0 = time.perf_counter()
        last_mem = t0
        self.result.memory.append(memory.sample(t0, device).to_dict())
        cache = None
        try:
            for i, strategy in self.strategies.items():
                strategy.attach(model, lm.layers, i, batch)
            # inference_mode is thread-local and a generator may resume on another thread (Gradio
            # workers do), so it is entered per block, never held across a yield.
            with torch.inference_mode():
                prompt = torch.tensor([self.prompt_ids], device=device)
                cache = DynamicCache(config=model.config)
                out = self._prefill(batch, prompt, cache)
                if out is None:  # stopped while prefilling a long prompt
                    for row in rows:
                        row.stop_reason = "stopped"
                    return
                logits = out.logits[:, -1, :].float().expand(n_rows, -1)
                if n_rows > 1:
                    cache.batch_repeat_interleave(n_rows)
                history = prompt.expand(n_rows, -1) if sampler.needs_history else None
            self.result.prefill_seconds = time.perf_counter() - t0
            batch.phase = "decode"
            live = list(range(n_rows))
            step = 0
            step_start = t0
            while live:
                if self.observer is not None:
                    self.observer(step, list(live), logits)
                with torch.inference_mode():
                    stats = distribution_stats(logits, k, N_TOP)
                    tokens = sampler(history, logits.clone() if sampler.processors else logits)
                    chosen = stats.logprobs.gather(1, tokens[:, None])[:, 0]
                    # One device->host transfer per step for everything the records need.
                    tok_l, chosen_l, conf_l, ent_l = (t.tolist() for t in (tokens, chosen, stats.confidence,
                                                                          stats.entropy))
                    top_lp = stats.top_logprobs[:, :N_TOP].exp().tolist()
                    top_ids = stats.top_ids[:, :N_TOP].tolist()
                now = time.perf_counter()
                step_ms = (now - step_start) * 1000.0
                event = StepEvent(step, {})
                for pos, r in enumerate(live):
                    tid = tok_l[pos]
                    group = windows[r].push(conf_l[pos])
                    confs[r].append(conf_l[pos])
                    alts = []
                    for aid, ap in zip(top_ids[pos], top_lp[pos]):
                        if aid not in alt_text:
                            alt_text[aid] = tok.decode([aid])
                        alts.append(Alternative(aid, alt_text[aid], ap))
                    rec = StepRecord(step, tid, decoders[r].push(tid), chosen_l[pos],
                                     math.exp(chosen_l[pos]), conf_l[pos], ent_l[pos],
                                     group, alts, step_ms)
                    row = rows[r]
                    row.steps.append(rec)
                    row.token_ids.append(tid)
                    event.records[r] = rec
                    reason = None
                    if tid in eos:
                        reason = "eos"
                    elif windows[r].should_stop(thresholds[r]):
                        reason = "early_stop"
                    elif len(row.token_ids) >= cfg.max_new_tokens:
                        reason = "max_tokens"
                    if reason:
                        event.finished[r] = reason
                        row.stop_reason, row.stop_step = reason, step
                if now - last_mem >= MEMORY_SAMPLE_EVERY_S:
                    last_mem = now
                    event.memory = memory.sample(t0, device)
                    self.result.memory.append(event.memory.to_dict())
                yield event
                if self.stop_event.is_set():
                    for r in live:
                        if r not in event.finished:
                            rows[r].stop_reason, rows[r].stop_step = "stopped", step
                    break
                with torch.inference_mode():
                    if event.finished:
                        keep = [pos for pos, r in enumerate(live) if r not in event.finished]
                        live = [live[pos] for pos in keep]
                        if not live:
                            break
                        idx = torch.tensor(keep, device=device)
                        cache.batch_select_indices(idx)
                        tokens = tokens[idx]
                        sampler.select_rows(keep)
                        if history is not None:
                            history = history[idx]
                        batch.live_rows = list(live)
                    if history is not None:
                        history = torch.cat([history, tokens[:, None]], dim=1)
                    step += 1
                    step_start = time.perf_counter()
                    out = self._forward(batch, input_ids=tokens[:, None], cache=cache, use_cache=True)
                    logits = out.logits[:, -1, :].float()
        finally:
            for strategy in self.strategies.values():
                strategy.detach()
            del cache
            self._finish(decoders, confs, t0)

    def _prefill(self, batch: BatchView, prompt: torch.Tensor, cache: DynamicCache):
        """The shared prompt, PREFILL_CHUNK tokens per forward on the cache, so a long prompt's
        attention scratch stays bounded and Stop is seen between chunks (None when stopped).
        A prompt within one chunk takes one forward, exactly as before chunking existed."""
        out = None
        for start in range(0, prompt.shape[1], PREFILL_CHUNK):
            if start and self.stop_event.is_set():
                return None
            batch.offset = start
            out = self._forward(batch, input_ids=prompt[:, start:start + PREFILL_CHUNK], cache=cache,
                                use_cache=True, logits_to_keep=1)
        batch.offset = 0
        return out

    def _forward(self, batch: BatchView, **inputs):
        return hooked_forward(self.lm, batch, self.strategies.values(), **inputs)

    def _finish(self, decoders: list[IncrementalDecoder], confs: list[list[float]], t0: float) -> None:
        res = self.result
        window = self.config.deepconf.window
        for r, row in enumerate(res.rows):
            tail = decoders[r].flush()
            if tail and row.steps:
                row.steps[-1].text += tail
            row.text = "".join(s.text for s in row.steps)
            if row.stop_reason is None and row.steps:
                row.stop_reason, row.stop_step = "stopped", row.steps[-1].step
            # Step 0's time is the prefill (time to first token); decode speed counts the steps after it.
            row.decode_seconds = sum(s.time_ms for s in row.steps[1:]) / 1000.0
            row.tokens_per_s = (len(row.steps) - 1) / row.decode_seconds if row.decode_seconds > 0 else 0.0
            row.metrics = trace_metrics(confs[r], window).to_dict()
        res.wall_seconds = time.perf_counter() - t0
        res.memory.append(memory.sample(t0, self.lm.device).to_dict())
        if len(res.rows) >= 2:
            res.first_divergence_step = first_divergence(res.rows[0].token_ids, res.rows[1].token_ids)


def hooked_forward(lm: LoadedModel, batch: BatchView, strategies, **inputs):
    """One forward pass with `batch`'s hooks active (forwards on a model are serialised, so other
    runs' hooks stay inactive), then each strategy's end-of-forward update."""
    with lm.forward_lock:
        batch.active = True
        try:
            out = lm.model(**inputs)
        finally:
            batch.active = False
    for strategy in strategies:
        strategy.end_forward()
    return out


class Engine:
    """Runs generation configs on one loaded model."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm

    def start(self, config: RunConfig, stop_event: threading.Event | None = None,
              observer: LogitsObserver | None = None, budget: Budget | None = None) -> Run:
        return Run(self.lm, config, stop_event, observer, budget)

    def run(self, config: RunConfig, stop_event: threading.Event | None = None,
            observer: LogitsObserver | None = None) -> RunResult:
        run = self.start(config, stop_event, observer)
        for _ in run:
            pass
        return run.result
