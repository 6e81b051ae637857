"""The decode loop: all rows of a run in one batched forward per step.

Rows may have their own prompts (a prompt variant, a system prompt, a conversation so far). Rows
whose prompts are the same token for token share one prefill; different prompts are left-padded
into one batch with an attention mask and each row's own position ids, so every step is still one
forward for all rows. Row 0 is usually the baseline; other rows carry a feedback strategy whose hooks
act on their own batch position only. A row may be forced to start its reply with given tokens (a
branch replays its tokens up to a step, then the chosen alternative): forced steps are decoded like
any other, so feedback state evolves exactly as it did, and are marked in the records. A row may
sample with its own temperature, top-p and seed. A row with a prompt-level strategy (`PromptStrategy`) runs
the plain model: its strategy rewrites the row's prompt and may replace the tokens it takes. Rows that
finish (EOS, max tokens, early stop) leave the batch and the KV cache. `start_run` builds a `Run`;
iterating it yields a `StepEvent` per step (with `prefill_events` set, first a `PrefillEvent`
per chunk of a long prompt) and `Run.result` holds the `RunResult`; `run_to_end`
runs one to its end.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from feedback.core import memory, quality
from feedback.core.budget import (
    PREFILL_CHUNK,
    Budget,
    check_fits,
    dtype_bytes,
    generation_memory_mb,
    kv_bytes_per_token,
)
from feedback.core.confidence import GroupWindow, distribution_stats, trace_metrics
from feedback.core.detok import IncrementalDecoder
from feedback.core.forward import attach, detach, hooked_forward
from feedback.core.kvcache import run_cache
from feedback.core.model import LoadedModel
from feedback.core.prefill_scores import PrefillScores
from feedback.core.records import (
    Alternative,
    RowResult,
    RowSpec,
    RunConfig,
    RunResult,
    StepRecord,
    first_divergence,
    tokens_per_second,
)
from feedback.core.sampling import Sampler
from feedback.errors import FeedbackError, Stopped
from feedback.strategies import BatchView, Phase, PromptStrategy, Strategy, build_strategy

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


@dataclass
class PrefillEvent:
    """Progress of a long prompt's prefill (yielded only when `Run.prefill_events` is set): chunks
    of PREFILL_CHUNK tokens done of the total, and prompt tokens read of the longest prompt."""

    chunk: int
    chunks: int
    tokens: int
    total: int


@dataclass(eq=False)
class RowState:
    """What the loop keeps for one row: its prompt, its share of the prefill, its forced tokens,
    its detokeniser and confidence window, and its result so far."""

    index: int
    spec: RowSpec
    result: RowResult
    prompt_ids: list[int]
    group: int  # index of the prefill sequence this row shares with rows of the same prompt
    threshold: float | None
    decoder: IncrementalDecoder
    window: GroupWindow
    span: tuple[int, int] | None  # where the row's prompt text stands in `prompt_ids` (prompt PPL)
    confs: list[float] = field(default_factory=list)
    part: str | None = None  # the part of a prompt-level strategy's reply the last token belongs to

    @property
    def prefix(self) -> list[int]:
        return self.spec.prefix or []


@dataclass
class DecodeState:
    """The batch tensors of live rows, in batch order."""

    live: list[RowState]
    cache: Cache
    mask: torch.Tensor | None  # [B, T] attention mask; None when all rows share one unpadded prompt
    positions: torch.Tensor | None  # [B] position id of each row's next token (with `mask`)
    history: torch.Tensor | None  # [B, T] token ids, for the repetition penalty
    tokens: torch.Tensor | None = None  # [B] the tokens chosen at the last step


def _prompt_level(strategies: dict[int, Strategy]) -> dict[int, PromptStrategy]:
    """The rows whose strategy is prompt-level: the one place the loop tells the two kinds apart.
    Those rows' strategies rewrite the prompt, choose tokens and say where the answer starts."""
    return {i: s for i, s in strategies.items() if isinstance(s, PromptStrategy)}


def _row_prompt_ids(
    lm: LoadedModel, cfg: RunConfig, row: RowSpec, strategy: PromptStrategy | None
) -> tuple[list[int], tuple[int, int] | None]:
    """The row's input ids, and where its prompt text stands in them (what prompt PPL scores)."""
    text = row.prompt if row.prompt is not None else cfg.prompt
    asked = strategy.rewrite_prompt(text) if strategy is not None else text
    system = row.system_prompt if row.system_prompt is not None else cfg.system_prompt
    # the span is looked for only where prompt PPL will read it (it renders the template again)
    ids, span = lm.encode_with_span(
        asked, text if cfg.quality else None, cfg.chat_template, system, row.messages
    )
    if not ids:
        raise FeedbackError(f"row {row.name}: the prompt has no tokens")
    return ids, span


class Run:
    """One generation run. Iterate it (in any single thread) for events; `stop()` from any thread
    ends it within one step (or one prefill chunk); `result` is complete once iteration ends."""

    def __init__(
        self,
        lm: LoadedModel,
        config: RunConfig,
        stop_event: threading.Event | None = None,
        observer: LogitsObserver | None = None,
        budget: Budget | None = None,
    ):
        self.lm = lm
        self.config = config.validate()
        if config.model not in (lm.name, None, ""):
            raise FeedbackError(f"this run asks for model {config.model!r} but the engine holds {lm.name!r}")
        self.stop_event = stop_event or threading.Event()
        self.stopped_rows: set[int] = set()  # rows asked to stop on their own (`stop_row`); the others go on
        self.prefill_events = (
            False  # also yield a PrefillEvent per chunk of a long prompt (a door showing progress)
        )
        self.observer = observer
        # Build (and so validate) every strategy before any hook touches the model.
        self.strategies: dict[int, Strategy] = {
            i: build_strategy(row.strategy, row.params, lm.num_layers)
            for i, row in enumerate(config.rows)
            if row.strategy
        }
        for strategy in self.strategies.values():  # a model a strategy cannot serve exactly: refused now
            strategy.check_model(lm.model, lm.layers)
        self.prompt_strategies = _prompt_level(self.strategies)
        inputs = [
            _row_prompt_ids(lm, config, row, self.prompt_strategies.get(i))
            for i, row in enumerate(config.rows)
        ]
        row_ids = [ids for ids, _ in inputs]
        self._check_rows(row_ids)
        self.reference_ids = (
            lm.tokenizer(config.reference, add_special_tokens=False)["input_ids"]
            if config.reference
            else None
        )
        # Rows with the same prompt, token for token, share one prefill sequence, unless a row's
        # strategy changes the prompt's own states: that row prefills on its own.
        keys = [
            (tuple(ids), i if i in self.strategies and self.strategies[i].edits_prompt else -1)
            for i, ids in enumerate(row_ids)
        ]
        group_of: dict[tuple, int] = {}
        for key in keys:
            group_of.setdefault(key, len(group_of))
        self.groups: list[list[int]] = [list(key[0]) for key in group_of]
        # the plain prefill sequence with a row's tokens (None: only a strategy-edited one has them)
        plain = {key[0]: g for key, g in group_of.items() if key[1] == -1}
        self.plain_group = [plain.get(key[0]) for key in keys]
        self.scores = self._plan_scores([span for _, span in inputs]) if config.quality else None
        self.prompt_ids = row_ids[0]  # the first row's: what `prompt_tokens` reports
        # The cache is sized before the run starts: refused now if it cannot fit (a served request's
        # budget first, then every run's memory cap).
        rows, new = len(config.rows), config.max_new_tokens
        longest = max(len(ids) for ids in row_ids)
        need = generation_memory_mb(lm.model.config, dtype_bytes(lm.dtype), rows, longest, new)
        if self.scores is not None:
            need += self.scores.memory_mb(
                kv_bytes_per_token(lm.model.config, dtype_bytes(lm.dtype)), lm.vocab_size
            )
        how = f"{longest} prompt + {new} new tokens, {rows} rows"
        # token-forwards scored after decoding, at most; also refuses a reference that cannot fit the context
        self.scored_after = scored = self._scoring_after(row_ids)
        if budget is not None:
            budget.check_decoding(rows * new, f"{rows} rows x {new} new tokens")
            budget.check_memory(need, how)
            if scored:
                budget.check_scoring(
                    scored, "the quality metrics and the reference answer, scored after the run"
                )
        check_fits(need, how, lm.device)
        self.memory_mb = need  # what a shared decode admits it by
        self.result = RunResult(
            config={**config.to_dict(), "model": lm.name, "dtype": lm.dtype, "precision": lm.precision},
            rows=[
                RowResult(r.name, r.strategy, self.strategies[i].values if i in self.strategies else {})
                for i, r in enumerate(config.rows)
            ],
            prompt_tokens=len(self.prompt_ids),
        )
        thresholds = [
            r.threshold if r.threshold is not None else config.deepconf.threshold for r in config.rows
        ]
        self.rows = [
            RowState(
                i,
                spec,
                self.result.rows[i],
                ids,
                group_of[key],
                thresholds[i],
                IncrementalDecoder(lm.tokenizer),
                GroupWindow(config.deepconf.window),
                span,
            )
            for i, (spec, (ids, span), key) in enumerate(zip(config.rows, inputs, keys))
        ]
        self._alt_text: dict[int, str] = {}
        self._started = False

    def _rescored(self, index: int) -> bool:
        """Whether the row's answer is read again by the plain model for its self-PPL: a plain row
        scored it while decoding (each step's log-probability), others did not."""
        return self.config.rows[index].strategy is not None

    def _plan_scores(self, spans: list[tuple[int, int] | None]) -> PrefillScores:
        """What the prefill scores for prompt PPL and keeps for the feedback rows' self-PPL."""
        wanted = [
            (g, span, self._rescored(i))
            for i, (g, span) in enumerate(zip(self.plain_group, spans))
            if g is not None
        ]
        return PrefillScores.plan([len(ids) for ids in self.groups], wanted)

    def _check_rows(self, row_ids: list[list[int]]) -> None:
        """Every row fits the context and its forced tokens are in the vocabulary."""
        limit, vocab = self.lm.context_length, self.lm.vocab_size
        for row, ids in zip(self.config.rows, row_ids):
            if len(ids) + self.config.max_new_tokens > limit:
                who = f"row {row.name}: prompt" if row.prompt is not None or row.messages else "prompt"
                raise FeedbackError(
                    f"{who} is {len(ids)} tokens; with max_new_tokens={self.config.max_new_tokens} "
                    f"it exceeds the model context of {limit} tokens"
                )
            bad = [t for t in row.prefix or [] if t >= vocab]
            if bad:
                raise FeedbackError(
                    f"row {row.name}: prefix token id {bad[0]} is outside the vocabulary (0 to {vocab - 1})"
                )

    def _reference_context(self, index: int, prompt_ids: list[int]) -> int:
        """The most tokens row `index` scores its reference after: its prompt, and a prompt-level
        row's whole reply at most (the reference follows its restatement)."""
        return len(prompt_ids) + (self.config.max_new_tokens if index in self.prompt_strategies else 0)

    def _scoring_after(self, row_ids: list[list[int]]) -> int:
        """Token-forwards the run scores after decoding, at most (the budget's unit): each distinct
        prompt (prompt PPL), each strategy row's prompt and answer (self PPL; a plain row's comes
        from its decode), and each row's context and reference. A reference that would not fit the
        model's context after a row's prompt is refused here, before the run waits for the model."""
        cfg, new, cost = self.config, self.config.max_new_tokens, 0
        if cfg.quality:  # the prefill scores the prompts; a row without a plain prompt sequence reads its own
            cost += sum(len(ids) for i, ids in enumerate(row_ids) if self.plain_group[i] is None)
            cost += sum(
                new + (len(ids) if self.plain_group[i] is None else 0)
                for i, ids in enumerate(row_ids)
                if self._rescored(i)
            )
        if self.reference_ids is not None:
            limit = self.lm.context_length
            for i, (row, ids) in enumerate(zip(cfg.rows, row_ids)):
                context = self._reference_context(i, ids)
                if context + len(self.reference_ids) > limit:
                    raise FeedbackError(
                        f"reference is {len(self.reference_ids)} tokens; after row {row.name}'s "
                        f"{context}-token "
                        f"{'prompt and reply' if i in self.prompt_strategies else 'prompt'} it "
                        f"exceeds the model context of {limit} tokens: shorten the reference"
                    )
                cost += context + len(self.reference_ids)
        return cost

    def stop(self) -> None:
        self.stop_event.set()

    def stop_row(self, index: int) -> None:
        """Stop one row at its next step (it leaves the batch, stop reason "stopped"); the other rows
        go on. Safe from another thread."""
        if not 0 <= index < len(self.rows):
            raise FeedbackError(f"row {index} is not in this run (it has {len(self.rows)} rows)")
        self.stopped_rows.add(index)

    def __iter__(self) -> Iterator[StepEvent]:
        if self._started:
            raise RuntimeError("a Run can be iterated once")
        self._started = True
        return self._loop()

    # ---- the loop: prefill, then one step at a time until every row has finished ----
    def _loop(self) -> Iterator[StepEvent]:
        cfg = self.config
        completed, prefilled, t0 = False, None, time.perf_counter()
        try:
            batch, sampler, t0 = self._open()
            # inference_mode is thread-local and a generator may resume on another thread (Gradio
            # workers do), so it is entered per block (the helpers below), never held across a yield.
            prefilled = yield from self._reported(self._prefill(batch, sampler.needs_history))
            if prefilled is None:  # stopped while prefilling a long prompt
                self._stopped_before_decoding()
                return
            self.result.prefill_seconds = time.perf_counter() - t0
            yield from self._decode(batch, sampler, t0, *prefilled)
            completed = not self.stop_event.is_set()
        finally:
            self._close()
            prefilled = None  # the KV cache goes before the quality passes run
            self._finish(t0, with_quality=completed and (cfg.quality or cfg.reference is not None))

    def _open(self) -> tuple[BatchView, Sampler, float]:
        """The run's batch view and sampler, its strategies attached (between forwards: forwards of
        other runs on this model may be in flight in other threads), and its start time."""
        cfg, lm = self.config, self.lm
        batch = BatchView(Phase.PREFILL, [r.index for r in self.rows])
        sampler = Sampler(
            cfg.sampling,
            [r.spec.seed_for(cfg.seed) for r in self.rows],
            lm.device,
            [r.spec.sampling(cfg.sampling) for r in self.rows],
        )
        t0 = time.perf_counter()
        self.result.memory.append(memory.sample(t0, lm.device).to_dict())
        attach(lm, batch, self.strategies)
        for strategy in self.prompt_strategies.values():  # after attach: it resets their state
            strategy.begin(lm.tokenizer, lm.eos_token_ids)
        return batch, sampler, t0

    def _close(self) -> None:
        """Every hook of the run removed (between forwards, as `_open` attached them)."""
        detach(self.lm, self.strategies.values())

    def _reported(self, prefill: Iterator[PrefillEvent]):
        """The prefill to its end, its progress passed on when the run reports it (`prefill_events`);
        returns what the prefill returns."""
        while True:
            try:
                event = next(prefill)
            except StopIteration as done:
                return done.value
            if self.prefill_events:
                yield event

    def _decode(
        self, batch: BatchView, sampler: Sampler, t0: float, state: DecodeState, logits: torch.Tensor
    ) -> Iterator[StepEvent]:
        """Step after step until every row has finished or the run is stopped."""
        batch.phase, batch.live_rows = Phase.DECODE, [r.index for r in state.live]
        step, step_start, last_mem = 0, t0, t0
        while True:
            event, last_mem = self._step_event(step, state, logits, sampler, step_start, t0, last_mem)
            yield event
            if self.stop_event.is_set():
                self._mark_stopped(state.live, event, step)
                return
            if event.finished:
                self._drop(state, self._staying(state, event), sampler)
                batch.live_rows = [r.index for r in state.live]
                if not state.live:
                    return
            step, step_start = step + 1, time.perf_counter()
            logits = self._step_forward(batch, state)

    def _step_event(
        self,
        step: int,
        state: DecodeState,
        logits: torch.Tensor,
        sampler: Sampler,
        step_start: float,
        t0: float,
        last_mem: float,
    ) -> tuple[StepEvent, float]:
        """The step's event from the live rows' logits: the observer told, each row's token chosen
        and recorded, a memory sample when MEMORY_SAMPLE_EVERY_S have passed since the last one
        (`last_mem`); and when the last sample was taken."""
        if self.observer is not None:
            self.observer(step, [r.index for r in state.live], logits)
        state.tokens, values = self._choose(step, state, logits, sampler)
        now = time.perf_counter()
        event = self._record(step, state.live, values, (now - step_start) * 1000.0)
        if now - last_mem >= MEMORY_SAMPLE_EVERY_S:
            last_mem = now
            event.memory = memory.sample(t0, self.lm.device)
            self.result.memory.append(event.memory.to_dict())
        return event, last_mem

    def _stopped_before_decoding(self) -> None:
        """Stopped before its first token (while waiting or reading its prompt): every row says so."""
        for row in self.rows:
            row.result.stop_reason = "stopped"

    def _prefill(self, batch: BatchView, needs_history: bool):
        """Every distinct prompt once, left-padded into one batch, PREFILL_CHUNK tokens per forward on
        the cache (a long prompt's attention scratch stays bounded, and Stop is seen between chunks
        and, inside a chunk's forward, between decoder layers). Then each row takes its sequence's
        cache and last logits. One prompt shared by all rows takes one unpadded forward, exactly as
        before rows had prompts. A generator: it yields a `PrefillEvent` after each chunk of a prompt
        longer than one chunk (a shared decode steps its other rows there); it returns (state,
        logits), or None when stopped."""
        setup = self._prefill_inputs()
        ids, mask, positions, cache = setup
        width = ids.shape[1]
        chunks = -(-width // PREFILL_CHUNK)
        # A chunk of 512 tokens takes seconds on a CPU: its forward looks at Stop between layers. A
        # decode step is short, so decoding looks only between steps (no per-layer hooks there).
        out = None
        for n, start in enumerate(range(0, width, PREFILL_CHUNK), start=1):
            if start and self.stop_event.is_set():
                return None
            out = self._prefill_chunk(batch, setup, start)
            if out is None:
                return None
            if chunks > 1:
                yield PrefillEvent(n, chunks, min(start + PREFILL_CHUNK, width), width)
        return self._prefill_done(batch, out, cache, mask, needs_history)

    @torch.inference_mode()
    def _prefill_inputs(self):
        """(ids, mask, positions, cache) of the prefill batch: every distinct prompt, left-padded."""
        device = self.lm.device
        lengths = [len(ids) for ids in self.groups]
        width = max(lengths)
        pad_id = self.lm.tokenizer.pad_token_id if self.lm.tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad_id] * (width - len(g)) + g for g in self.groups], device=device)
        padded = len(set(lengths)) > 1
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], device=device) if padded else None
        positions = (mask.cumsum(dim=1) - 1).clamp_min(0) if padded else None
        # sized once for the whole run: a step writes in place instead of copying the cache
        cache = run_cache(self.lm.model.config, width + self.config.max_new_tokens)
        return ids, mask, positions, cache

    @torch.inference_mode()
    def _prefill_chunk(self, batch: BatchView, setup, start: int):
        """One chunk's forward on the cache; None when Stop came inside it."""
        ids, mask, positions, cache = setup
        batch.pads = {g: ids.shape[1] - len(group) for g, group in enumerate(self.groups)}
        batch.groups = {r.index: r.group for r in self.rows}
        batch.stop, batch.offset = self.stop_event, start
        end = min(start + PREFILL_CHUNK, ids.shape[1])
        # the logits the quality metrics score (prompt PPL), else only the next token's
        kept = self.scores.positions(start, end) if self.scores is not None and self.scores.spans else None
        keep = torch.tensor([p - start for p in kept], device=ids.device) if kept else 1
        inputs = dict(input_ids=ids[:, start:end], cache=cache, use_cache=True, logits_to_keep=keep)
        if mask is not None:
            inputs |= dict(attention_mask=mask[:, :end], position_ids=positions[:, start:end])
        try:
            out = self._forward(batch, **inputs)
        except Stopped:
            return None
        finally:
            batch.stop = None
        if kept:
            self.scores.record(out.logits, kept, ids)
        return out

    @torch.inference_mode()
    def _prefill_done(
        self, batch: BatchView, out, cache, mask, needs_history: bool
    ) -> tuple[DecodeState, torch.Tensor]:
        """Each row takes its prompt's cache (copied per row) and last logits."""
        device = self.lm.device
        lengths = [len(ids) for ids in self.groups]
        width = max(lengths)
        batch.offset, batch.pads, batch.groups = 0, {}, {}
        take = torch.tensor([r.group for r in self.rows], device=device)
        if self.scores is not None:  # the plain prompts a feedback row's self-PPL reads after
            self.scores.keep(cache, out.logits[:, -1, :])
        cache.batch_select_indices(take)  # rows sharing a prompt share its cache (copied per row)
        history = None
        if needs_history:  # padding repeats the row's first token: penalising it twice is the same penalty
            history = torch.tensor([[g[0]] * (width - len(g)) + g for g in self.groups], device=device)[take]
        state = DecodeState(
            list(self.rows),
            cache,
            mask[take] if mask is not None else None,
            torch.tensor(lengths, device=device)[take] if mask is not None else None,
            history,
        )
        return state, out.logits[:, -1, :].float()[take]

    @torch.inference_mode()
    def _choose(self, step: int, state: DecodeState, logits: torch.Tensor, sampler: Sampler):
        """The next token of every live row (forced where a row's prefix says so), and everything its
        record needs, fetched from the device in one transfer."""
        stats = distribution_stats(logits, self.config.deepconf.k, N_TOP)
        tokens = sampler(state.history, logits.clone() if sampler.edits_logits else logits)
        forced = [r.prefix[step] if step < len(r.prefix) else -1 for r in state.live]
        tokens = self._steer(step, state.live, tokens, forced)
        if any(t >= 0 for t in forced):  # the draw still happened, so later draws stay aligned
            given = torch.tensor(forced, device=tokens.device)
            tokens = torch.where(given >= 0, given, tokens)
        chosen = stats.logprobs.gather(1, tokens[:, None])
        values = torch.cat(
            [
                tokens[:, None].double(),
                chosen.double(),
                stats.confidence[:, None].double(),
                stats.entropy[:, None].double(),
                stats.top_logprobs[:, :N_TOP].exp().double(),
                stats.top_ids[:, :N_TOP].double(),
            ],
            dim=1,
        )
        return tokens, values.tolist()  # the one device->host transfer of the step

    def _steer(
        self, step: int, live: list[RowState], tokens: torch.Tensor, forced: list[int]
    ) -> torch.Tensor:
        """Prompt-level strategies see each sampled token and may replace it (their markers). A
        user's forced token still wins, and the strategy moves on as if its own had been taken."""
        steered = [
            (pos, self.prompt_strategies[r.index])
            for pos, r in enumerate(live)
            if r.index in self.prompt_strategies
        ]
        if not steered:
            return tokens
        ids = tokens.tolist()
        for pos, strategy in steered:
            ids[pos], live[pos].part = strategy.choose(step, ids[pos])
        return torch.tensor(ids, device=tokens.device, dtype=tokens.dtype)

    def _record(
        self, step: int, live: list[RowState], values: list[list[float]], step_ms: float
    ) -> StepEvent:
        """Step records for the live rows, and which of them finished at this step."""
        cfg, eos = self.config, set(self.lm.eos_token_ids)
        event = StepEvent(step, {})
        for row, v in zip(live, values):
            tid, logprob, conf, ent = int(v[0]), v[1], v[2], v[3]
            alts = [
                Alternative(int(aid), self._alt(int(aid)), p)
                for p, aid in zip(v[4 : 4 + N_TOP], v[4 + N_TOP :])
            ]
            rec = StepRecord(
                step,
                tid,
                row.decoder.push(tid),
                logprob,
                math.exp(logprob),
                conf,
                ent,
                row.window.push(conf),
                alts,
                step_ms,
                forced=step < len(row.prefix),
                part=row.part,
                chosen=len(row.prefix) - row.spec.chosen <= step < len(row.prefix),
            )
            row.confs.append(conf)
            row.result.steps.append(rec)
            row.result.token_ids.append(tid)
            event.records[row.index] = rec
            reason = None
            # Forced tokens end a row like chosen ones: a replayed answer stops where it stopped, and
            # forcing the end-of-sequence token ends the reply there.
            if tid in eos:
                reason = "eos"
            elif row.window.should_stop(row.threshold):
                reason = "early_stop"
            elif len(row.result.token_ids) >= cfg.max_new_tokens:
                reason = "max_tokens"
            elif row.index in self.stopped_rows:
                reason = "stopped"
            if reason:
                event.finished[row.index] = reason
                row.result.stop_reason, row.result.stop_step = reason, step
        return event

    def _alt(self, token_id: int) -> str:
        if token_id not in self._alt_text:
            self._alt_text[token_id] = self.lm.tokenizer.decode([token_id])
        return self._alt_text[token_id]

    @staticmethod
    def _mark_stopped(live: list[RowState], event: StepEvent, step: int) -> None:
        for row in live:
            if row.index not in event.finished:
                row.result.stop_reason, row.result.stop_step = "stopped", step

    @staticmethod
    def _staying(state: DecodeState, event: StepEvent) -> list[int]:
        """Batch positions of the live rows that did not finish at this step."""
        return [pos for pos, r in enumerate(state.live) if r.index not in event.finished]

    @torch.inference_mode()
    def _drop(self, state: DecodeState, keep: list[int], sampler: Sampler) -> None:
        """Only the live rows at batch positions `keep` stay: in the batch, the cache (where the state
        holds one: a shared decode holds its rows' cache itself) and every per-row tensor."""
        if len(keep) == len(state.live):
            return
        state.live = [state.live[pos] for pos in keep]
        if not state.live:
            return
        idx = torch.tensor(keep, device=self.lm.device)
        if state.cache is not None:
            state.cache.batch_select_indices(idx)
        state.tokens = state.tokens[idx]
        sampler.select_rows(keep)
        for name in ("mask", "positions", "history"):
            if getattr(state, name) is not None:
                setattr(state, name, getattr(state, name)[idx])

    @torch.inference_mode()
    def _step_forward(self, batch: BatchView, state: DecodeState) -> torch.Tensor:
        """One forward of the tokens just chosen; returns the next logits [B, V] in fp32."""
        if state.history is not None:
            state.history = torch.cat([state.history, state.tokens[:, None]], dim=1)
        inputs = dict(input_ids=state.tokens[:, None], cache=state.cache, use_cache=True)
        if state.mask is not None:
            state.mask = torch.cat([state.mask, state.mask.new_ones(state.mask.shape[0], 1)], dim=1)
            inputs |= dict(attention_mask=state.mask, position_ids=state.positions[:, None])
            state.positions = state.positions + 1
        return self._forward(batch, **inputs).logits[:, -1, :].float()

    def _forward(self, batch: BatchView, **inputs):
        return hooked_forward(self.lm, batch, self.strategies.values(), **inputs)

    # ---- the end ----
    def _finish(self, t0: float, with_quality: bool) -> None:
        res = self.result
        cfg = self.config
        for row in self.rows:
            r = row.result
            tail = row.decoder.flush()
            if tail and r.steps:
                r.steps[-1].text += tail
            r.text = "".join(s.text for s in r.steps)
            if r.stop_reason is None and r.steps:
                r.stop_reason, r.stop_step = "stopped", r.steps[-1].step
            r.tokens_per_s = tokens_per_second(r.steps) or 0.0
            r.decode_seconds = sum(s.time_ms for s in r.steps[1:]) / 1000.0
            r.metrics = trace_metrics(row.confs, cfg.deepconf.window).to_dict() | quality.text_metrics(
                r.token_ids
            )
            if row.index in self.strategies:  # what the row's strategy cost and did
                r.metrics |= self.strategies[row.index].report()
        facts = quality.key_fact_metrics(
            [row.result.text for row in self.rows], cfg.key_facts, self.stop_event
        )
        for row, found in zip(self.rows, facts):
            row.result.metrics |= found
        if with_quality:
            try:
                self._quality()
            except Stopped:  # Stop or a hang-up while scoring: the run ends now, without those metrics
                pass
        if self.scores is not None:
            self.scores.release()  # the kept prompt caches go with the scoring, not with the run's result
        res.wall_seconds = time.perf_counter() - t0
        res.memory.append(memory.sample(t0, self.lm.device).to_dict())
        if len(res.rows) >= 2:
            res.first_divergence_step = first_divergence(res.rows[0].token_ids, res.rows[1].token_ids)

    def _quality(self) -> None:
        """The quality metrics that take forward passes (see feedback/core/quality.py). Each pass
        looks at the run's stop between chunks and between decoder layers (raising `Stopped`)."""
        cfg = self.config
        for row in self.rows:
            r = row.result
            if cfg.quality:
                r.metrics |= {"self_ppl": self._self_ppl(row), "prompt_ppl": self._prompt_ppl(row)}
            if self.reference_ids is not None:
                r.metrics |= self._reference_ppl(row, self.reference_ids)

    def _reference_ppl(self, row: RowState, reference: list[int]) -> dict:
        """A prompt-level row scores the reference after its own reply's lead-in (the restatement),
        as it would follow there, with the plain model: that is its strategy. Others as
        `quality.reference_ppl` does."""
        strategy, r = self.prompt_strategies.get(row.index), row.result
        if strategy is not None:
            context = row.prompt_ids + strategy.context_tokens(r.token_ids)
            text = strategy.reference_text(self.config.reference)
            ids = self.lm.tokenizer(text, add_special_tokens=False)["input_ids"]
            if (
                len(context) + len(ids) > self.lm.context_length
            ):  # a reply longer than sized for (its markers)
                return {"reference_ppl": None, "reference_ppl_with_strategy": True}
            return quality.reference_ppl(self.lm, context, ids, None, {}, self.stop_event) | {
                "reference_ppl_with_strategy": True
            }
        return quality.reference_ppl(
            self.lm, row.prompt_ids, reference, r.strategy, r.params, self.stop_event
        )

    def _self_ppl(self, row: RowState) -> float | None:
        """A plain row already scored its own answer while decoding: each step records the chosen
        (or forced) token's log-probability under the raw distribution after the same input, so its
        self-perplexity needs no second pass (it agrees with one to float rounding). A row with a
        strategy is scored again by the plain model: its answer read after the plain prompt the
        prefill kept, or (no plain prefill of its prompt) prompt and answer read again."""
        r = row.result
        if not self._rescored(row.index) and len(r.steps) == len(r.token_ids):
            return quality.ppl_from_logprobs([s.logprob for s in r.steps])
        group = self.plain_group[row.index]
        if group is not None and r.token_ids:
            return self.scores.self_ppl(self.lm, group, r.token_ids, self.stop_event)
        return quality.self_ppl(self.lm, row.prompt_ids, r.token_ids, self.stop_event)

    def _prompt_ppl(self, row: RowState) -> float | None:
        """The row's prompt text scored where it stands in its input, from the prefill's logits; a
        row without a plain prefill of its prompt reads it again. A prompt text the input does not
        show as typed (a template that rewrites it) is scored on its own."""
        if row.span is None:
            text = row.spec.prompt if row.spec.prompt is not None else self.config.prompt
            return quality.text_ppl(self.lm, text, self.stop_event) if text.strip() else None
        group = self.plain_group[row.index]
        if group is not None:
            return self.scores.prompt_ppl(group, row.span)
        return quality.span_ppl(self.lm, row.prompt_ids, row.span, self.stop_event)


def start_run(
    lm: LoadedModel,
    config: RunConfig,
    stop_event: threading.Event | None = None,
    observer: LogitsObserver | None = None,
    budget: Budget | None = None,
) -> Run:
    """A validated run of `config` on `lm`, not started: iterate it for its events."""
    return Run(lm, config, stop_event, observer, budget)


def run_to_end(
    lm: LoadedModel,
    config: RunConfig,
    stop_event: threading.Event | None = None,
    observer: LogitsObserver | None = None,
) -> RunResult:
    """Run `config` on `lm` until every row has finished (or `stop_event` is set); its result."""
    run = start_run(lm, config, stop_event, observer)
    for _ in run:
        pass
    return run.result


def run_with_logits(lm: LoadedModel, config: RunConfig) -> tuple[RunResult, dict[int, list[torch.Tensor]]]:
    """`run_to_end`, and each row's raw logits at every step it decoded (row index -> [V] per step;
    rows leave the batch as they finish): what exactness checks compare row by row."""
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(config.rows))}

    def keep(step: int, live: list[int], logits: torch.Tensor) -> None:
        for pos, index in enumerate(live):
            seen[index].append(logits[pos].clone())

    return run_to_end(lm, config, observer=keep), seen
