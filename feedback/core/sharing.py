"""Requests share the running decode: one loop per loaded model owns the batch of every run on it.

A run handed to `shared_events` (or `SharedDecoder.submit`) yields its events exactly as iterating it
alone would, while its rows decode in the same forwards as every other run's rows. The loop repeats:

1. One decode forward for every live row of every run in the batch (`shared_forward`: each run's
   hooks act on its own rows). Each run then picks its rows' tokens with its own settings (sampling,
   forced tokens, DeepConf window and threshold, max new tokens: `Run._choose`, `Run._record`) and
   its events go to its caller. Rows that finished, and every row of a run that was stopped or whose
   caller hung up, leave the batch; left padding that every remaining row has is cut off.
2. One prefill chunk of the first run waiting to join, on its own cache (a long prompt is read a
   chunk per turn, so the running rows keep streaming). Once its prompt is read its first token is
   chosen and its rows join: the caches are stacked, the side with the shorter sequence left-padded
   so every row ends at one position; each row keeps its own attention mask and position ids, so its
   tokens and logits are the ones it gets alone (to float rounding of the batched kernels).

A run that ends leaves the loop; its caller's own thread then does the work after it (quality
metrics, reference and key-fact scoring: `Run._finish`), whose forwards take turns with the loop's
steps at the model's forward lock, one scoring chunk at a time, so the others' steps wait at most a
chunk. Only models whose run cache is preallocated can stack rows (`kvcache.shareable`; a model
with sliding-window layers cannot): their runs go alone (`shared_events` iterates them as they are).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from feedback.core.engine import DecodeState, PrefillEvent, Run, StepEvent
from feedback.core.forward import shared_forward
from feedback.core.kvcache import shareable, stack_rows
from feedback.core.model import LoadedModel
from feedback.core.sampling import Sampler
from feedback.strategies import BatchView, Phase
from feedback.strategies.base import pad_front

_END = object()  # what a run's event queue holds last


@dataclass(eq=False)
class Member:
    """One run in the loop: its events' queue, its own sampler and batch view, and its rows' state
    (live rows in batch order, their last tokens and their history; the batch holds the cache)."""

    run: Run
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    batch: BatchView | None = None
    sampler: Sampler | None = None
    t0: float = 0.0
    prefill: Iterator[PrefillEvent] | None = None
    own: DecodeState | None = None
    step: int = 0
    step_start: float = 0.0
    last_mem: float = 0.0
    completed: bool = False  # ran to its end (not stopped, no error): the work after it runs
    left: threading.Event = field(default_factory=threading.Event)  # the loop has let go of it

    @property
    def size(self) -> int:
        return len(self.own.live) if self.own is not None else 0


@dataclass
class SharedBatch:
    """The rows of every joined run, run after run in batch order: one KV cache, each row's attention
    mask [B, T] (left padding 0) and the position id of its next token [B]."""

    members: list[Member] = field(default_factory=list)
    cache: Cache | None = None
    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return sum(m.size for m in self.members)


_LOOPS: weakref.WeakSet[SharedDecoder] = weakref.WeakSet()


@atexit.register
def _close_loops() -> None:
    """At exit, every decode loop is stopped and its thread waited for (a step, a few seconds at
    most). A daemon thread still inside PyTorch when the interpreter finalizes is ended mid-call
    (CPython 3.11-3.13 end such threads with pthread_exit), which once aborted a finished batch
    process with "terminate called without an active exception"."""
    for loop in list(_LOOPS):
        loop.close(timeout=5.0)


class SharedDecoder:
    """The decode loop of one model (see the module docstring). `submit` hands it a run; the loop
    runs in a thread of its own, started when work arrives and ended when none is left. With
    `threaded=False` nothing runs until `turn()` is called (tests drive the loop step by step)."""

    def __init__(self, lm: LoadedModel, threaded: bool = True):
        _LOOPS.add(self)
        self.lm = lm
        self.threaded = threaded
        self.batch = SharedBatch()
        self.joining: Member | None = None
        self.joins: deque[tuple[int, int]] = deque(maxlen=64)  # (id of the run, rows beside it) per join
        self._waiting: deque[Member] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    # ---- the callers' side ----
    def submit(self, run: Run) -> Iterator[StepEvent | PrefillEvent]:
        """The run's events, as `iter(run)` gives them; closing the iterator early stops the run."""
        if run._started:
            raise RuntimeError("a Run can be iterated once")
        run._started = True
        return self._events(Member(run, t0=time.perf_counter()))

    def _events(self, member: Member) -> Iterator[StepEvent | PrefillEvent]:
        """The run joins the line when its first event is asked for (as `iter(run)` starts then)."""
        run = member.run
        with self._cond:
            self._waiting.append(member)
            if self.threaded and self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="feedback-lens-decode", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        try:
            while (item := member.out.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            # the caller went away (or failed) first: the loop lets go of the run within a step
            if not member.left.is_set():
                run.stop()
                with self._cond:
                    self._cond.notify_all()
                if not self.threaded:
                    while not member.left.is_set():
                        self.turn()
                member.left.wait()
            cfg = run.config
            run._finish(
                member.t0, with_quality=member.completed and (cfg.quality or cfg.reference is not None)
            )

    def status(self) -> dict:
        """Rows decoding together now, and runs waiting to join (counts only)."""
        with self._cond:
            return {
                "shared_rows": self.batch.rows,
                "shared_runs": len(self.batch.members),
                "joining": len(self._waiting) + (self.joining is not None),
            }

    def close(self, timeout: float) -> None:
        """Stop every run in the loop or waiting for it, and wait up to `timeout` s for the loop's
        thread to end (it ends its runs within a step, then finds nothing to do)."""
        with self._cond:
            members = [*self.batch.members, *self._waiting]
            members += [self.joining] if self.joining is not None else []
            for member in members:
                member.run.stop()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # ---- the loop ----
    def _serve(self) -> None:
        while True:
            with self._cond:
                if not self._busy():
                    self._thread = None
                    return
            try:
                self.turn()
            except BaseException as exc:  # noqa: BLE001 (the loop's own work failed: see `_fail_all`)
                self._fail_all(exc)

    def _fail_all(self, error: BaseException) -> None:
        """Every run in the loop is told of `error` and let go; the loop goes on, empty, for the
        runs still waiting (a failure while stacking caches, say out of memory, ends the runs it
        touched, never the model's loop)."""
        for member in [*self.batch.members, *([self.joining] if self.joining is not None else [])]:
            if not member.left.is_set():
                self._release(member, error)
        self.batch, self.joining = SharedBatch(), None

    def _busy(self) -> bool:
        return bool(self._waiting or self.batch.members or self.joining is not None)

    def turn(self) -> bool:
        """One decode step of the batch and one prefill chunk of the next run to join; False when
        there was nothing to do."""
        with self._cond:
            if self.joining is None and self._waiting:
                self.joining = self._waiting.popleft()
            busy = self._busy()
        with torch.inference_mode():  # entered here: the loop's thread runs every step and chunk
            if self.batch.members:
                self._step()
            with self._cond:  # a run that came during the step starts its prefill now, not a step later
                if self.joining is None and self._waiting:
                    self.joining = self._waiting.popleft()
            if self.joining is not None:
                self._advance(self.joining)
        return busy

    def _release(self, member: Member, error: BaseException | None = None) -> None:
        """The loop is done with `member`: its hooks removed, its caller told how it ended."""
        try:
            member.run._close()
        except BaseException as exc:  # noqa: BLE001 (reported to its caller)
            error = error or exc
        member.completed = error is None and not member.run.stop_event.is_set()
        member.left.set()
        if error is not None:
            member.out.put(error)
        member.out.put(_END)

    # ---- a run joining: its prefill, a chunk per turn, then its first token ----
    def _advance(self, member: Member) -> None:
        run = member.run
        try:
            if member.prefill is None:
                if run.stop_event.is_set():  # stopped before it began
                    self.joining = None
                    run._stopped_before_decoding()
                    self._release(member)
                    return
                member.batch, member.sampler, member.t0 = run._open()
                member.prefill = run._prefill(member.batch, member.sampler.needs_history)
            try:
                event = next(member.prefill)
            except StopIteration as done:
                prefilled = done.value
            else:
                if run.prefill_events:
                    member.out.put(event)
                return
            self.joining = None
            if prefilled is None:  # stopped while reading its prompt
                run._stopped_before_decoding()
                self._release(member)
                return
            run.result.prefill_seconds = time.perf_counter() - member.t0
            member.own, logits = prefilled
            member.step_start = member.last_mem = member.t0
            keep = self._take(member, logits)
        except BaseException as exc:  # noqa: BLE001 (this run fails; the others go on)
            self.joining = None
            self._release(member, exc)
            return
        try:
            if keep is None:
                self._release(member)
                return
            run._drop(member.own, keep, member.sampler)  # its own cache too: it has not joined yet
            self._join(member)
        except BaseException as exc:  # noqa: BLE001 (this run fails; the batch is as it was)
            self._release(member, exc)

    def _join(self, member: Member) -> None:
        """The run's rows enter the batch after the others: caches stacked at one end position, the
        left padding that none of the rows needs cut off. Everything new is built before the batch
        changes, so a failure here (out of memory) leaves the batch as it was."""
        b, own = self.batch, member.own
        n, width = len(own.live), own.cache.get_seq_length()
        device = self.lm.device
        mask = own.mask if own.mask is not None else torch.ones(n, width, dtype=torch.long, device=device)
        positions = own.positions if own.positions is not None else torch.full((n,), width, device=device)
        real = int(positions.max())  # its longest row's tokens: the rest of its width is padding
        old = b.cache.get_seq_length() if b.members else 0
        end = max(old, real)
        shift_old, shift_new = end - old, end - width
        parts = ([(b.cache, shift_old)] if b.members else []) + [(own.cache, shift_new)]
        room = self._room(extra=member)
        cache = stack_rows(parts, room)
        masks = ([pad_front(b.mask, shift_old, 1)] if b.members else []) + [pad_front(mask, shift_new, 1)]
        mask_all = torch.cat(masks)
        positions_all = torch.cat(([b.positions] if b.members else []) + [positions])
        beside = b.rows
        for m in b.members:
            _pad_strategies(m, shift_old)
        _pad_strategies(member, shift_new)
        b.cache, b.mask, b.positions = cache, mask_all, positions_all
        own.cache = own.mask = own.positions = None
        b.members.append(member)
        self.joins.append((id(member.run), beside))

    def _room(self, extra: Member | None = None) -> int:
        """Positions every row (and `extra`'s, about to join) may still need: the most new tokens any
        row has left."""
        members = [*self.batch.members, *([extra] if extra is not None else [])]
        left = (m.run.config.max_new_tokens - len(r.result.token_ids) for m in members for r in m.own.live)
        return 1 + max(left, default=0)

    # ---- a decode step of the whole batch ----
    def _step(self) -> None:
        b = self.batch
        tokens = torch.cat([m.own.tokens for m in b.members])
        for m in b.members:
            if m.own.history is not None:
                m.own.history = torch.cat([m.own.history, m.own.tokens[:, None]], dim=1)
        b.mask = torch.cat([b.mask, b.mask.new_ones(b.mask.shape[0], 1)], dim=1)
        positions, b.positions = b.positions, b.positions + 1
        views, strategies, start = [], [], 0
        for m in b.members:
            m.batch.phase = Phase.DECODE
            m.batch.live_rows = (
                [None] * start + [r.index for r in m.own.live] + [None] * (len(tokens) - start - m.size)
            )
            views.append(m.batch)
            strategies.extend(m.run.strategies.values())
            start += m.size
        try:
            with torch.inference_mode():
                out = shared_forward(
                    self.lm,
                    views,
                    strategies,
                    input_ids=tokens[:, None],
                    cache=b.cache,
                    use_cache=True,
                    attention_mask=b.mask,
                    position_ids=positions[:, None],
                )
                logits = out.logits[:, -1, :].float()
        except BaseException as exc:  # noqa: BLE001 (one forward for all: each of its runs is told)
            for m in b.members:
                self._release(m, exc)
            self.batch = SharedBatch()
            return
        kept, members, start = [], [], 0
        for m in b.members:
            n = m.size
            try:
                keep = self._take(m, logits[start : start + n])
            except BaseException as exc:  # noqa: BLE001 (this run fails; the others go on)
                self._release(m, exc)
                keep = None
            if keep is None:
                if not m.left.is_set():
                    self._release(m)
            else:
                m.run._drop(m.own, keep, m.sampler)
                kept.extend(start + k for k in keep)
                members.append(m)
            start += n
        b.members = members
        if len(kept) < start:
            self._select(kept)

    def _take(self, member: Member, logits: torch.Tensor) -> list[int] | None:
        """The run's step from its rows' logits: tokens chosen, the event sent. Returns the positions
        (among the run's rows) of the rows that go on, or None when the run ends here."""
        run, own = member.run, member.own
        event, member.last_mem = run._step_event(
            member.step, own, logits, member.sampler, member.step_start, member.t0, member.last_mem
        )
        member.out.put(event)
        if run.stop_event.is_set():
            run._mark_stopped(own.live, event, member.step)
            return None
        member.step, member.step_start = member.step + 1, time.perf_counter()
        return run._staying(own, event) or None

    def _select(self, kept: list[int]) -> None:
        """Only the batch rows `kept` stay; then the left padding they all have is cut off."""
        b = self.batch
        if not kept:
            self.batch = SharedBatch()
            return
        idx = torch.tensor(kept, device=self.lm.device)
        b.cache.batch_select_indices(idx)
        b.mask, b.positions = b.mask[idx], b.positions[idx]
        cut = b.mask.shape[1] - int(b.positions.max())  # the longest row's real tokens end the cache
        if cut > 0:
            b.cache = stack_rows([(b.cache, -cut)], self._room())
            b.mask = b.mask[:, cut:]
            for m in b.members:
                _pad_strategies(m, -cut)


def _pad_strategies(member: Member, shift: int) -> None:
    if shift:
        for strategy in member.run.strategies.values():
            strategy.pad_left(shift)


_decoders_lock = threading.Lock()


def decoder_for(lm: LoadedModel) -> SharedDecoder:
    """The one decode loop of a loaded model (kept on it, so it goes when the model does)."""
    with _decoders_lock:
        if lm.decoder is None:
            lm.decoder = SharedDecoder(lm)
        return lm.decoder


def can_share(lm: LoadedModel) -> bool:
    """Whether runs on `lm` decode together (see `kvcache.shareable`)."""
    return shareable(lm.model.config)


def shared_events(run: Run) -> Iterator[StepEvent | PrefillEvent]:
    """The run's events, its rows decoded beside every other run's on its model (see the module
    docstring); alone, as `iter(run)`, on a model whose runs cannot share."""
    return decoder_for(run.lm).submit(run) if can_share(run.lm) else iter(run)


def run_events(run: Run, shared: bool) -> Iterator[StepEvent | PrefillEvent]:
    """The run's events: beside other runs in its model's loop when `shared` (a door admitted it
    there), else alone, as `iter(run)`."""
    return shared_events(run) if shared else iter(run)
