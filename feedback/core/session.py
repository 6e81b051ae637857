"""A prompt-engineering session on top of runs: the next turn of a conversation, a branch from
any token ("what if it had picked that one?"), and one row run again (after its settings changed).

Each builds a new `RunConfig` from a finished `RunResult`; the engine runs it like any other, so the
UI, CLI, API and batch runner share them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace

from feedback.core import quality
from feedback.core.confidence import DEFAULT_WINDOW, trace_metrics
from feedback.core.records import (
    RowResult,
    RowSpec,
    RunConfig,
    RunResult,
    first_divergence,
    tokens_per_second,
)
from feedback.errors import FeedbackError


def _config_of(result: RunResult) -> RunConfig:
    """The config a result ran with (the resolved dtype included, so the next run matches it)."""
    return RunConfig.from_dict(result.config).validate()


def _row_index(result: RunResult, row: str | int) -> int:
    if isinstance(row, int) and not isinstance(row, bool):
        if 0 <= row < len(result.rows):
            return row
        raise FeedbackError(f"row {row} does not exist: the run has {len(result.rows)} rows")
    names = [r.name for r in result.rows]
    if row not in names:
        raise FeedbackError(f"unknown row {row!r}: the run's rows are {', '.join(names)}")
    return names.index(row)


def conversation(cfg: RunConfig, spec: RowSpec, answer: RowResult) -> list[dict[str, str]]:
    """A row's conversation after its turn: its earlier turns, its prompt, its own answer."""
    prompt = spec.prompt if spec.prompt is not None else cfg.prompt
    return list(spec.messages or []) + [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": answer.text},
    ]


def continue_run(result: RunResult, user_message: str) -> RunConfig:
    """The next turn: every row gets `user_message` after its own history (its own previous answer),
    so the rows' conversations diverge as their answers did. The answers are re-tokenised through the
    chat template, as a chat client would send them; the system prompt and settings carry over."""
    if not isinstance(user_message, str) or not user_message.strip():
        raise FeedbackError("the next message is empty")
    cfg = _config_of(result)
    if not cfg.chat_template:
        raise FeedbackError("a conversation needs the chat template; this run had it off")
    if [r.name for r in result.rows] != [r.name for r in cfg.rows]:
        raise FeedbackError("the result's rows do not match its config's rows")
    rows = [
        replace(spec, prompt=None, prefix=None, chosen=0, messages=conversation(cfg, spec, answer))
        for spec, answer in zip(cfg.rows, result.rows)
    ]
    return replace(cfg, prompt=user_message, rows=rows).validate()


def branch(
    result: RunResult,
    row: str | int,
    step: int,
    tokens: int | list[int],
    all_rows: bool = True,
    matching_only: bool = False,
) -> RunConfig:
    """A branch is "this text so far, then this token": `row`'s answer up to `step` is replayed,
    then `tokens` (one id or several, the person's choice) are forced, then decoding goes on.

    With `all_rows` (the default) every row continues from that same text and choice, so the rows
    compare what each does from one point. With `matching_only` only rows whose own answer matched
    `row`'s up to `step` are branched; the others are replayed whole and end where they ended (left
    as they were). Without `all_rows` only `row` is branched and the others run afresh. A branched
    row's spec says how many of its forced tokens were chosen (`chosen`), the rest being replay."""
    cfg = _config_of(result)
    target = _row_index(result, row)
    ids = [tokens] if isinstance(tokens, int) and not isinstance(tokens, bool) else list(tokens)
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise FeedbackError(f"the branch needs one or more token ids, got {tokens!r}")
    own = result.rows[target].token_ids
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < len(own):
        raise FeedbackError(
            f"step {step!r} is outside row {result.rows[target].name}'s answer (steps 0 to {len(own) - 1})"
        )
    text = own[:step]
    rows = []
    for i, (spec, answer) in enumerate(zip(cfg.rows, result.rows)):
        branched = i == target or (all_rows and (not matching_only or answer.token_ids[:step] == text))
        if branched:
            rows.append(replace(spec, prefix=text + ids, chosen=len(ids)))
        elif all_rows:  # left as it was: its own answer, replayed
            rows.append(replace(spec, prefix=list(answer.token_ids), chosen=0))
        else:
            rows.append(replace(spec, prefix=None, chosen=0))
    return replace(cfg, rows=rows).validate()


def rerun(result: RunResult, row: str | int, spec: RowSpec | None = None) -> RunConfig:
    """One row of a finished run, run again alone: the run's shared settings, that row's own
    conversation and forced start, and its settings as `spec` has them (name, strategy, parameters,
    prompt, sampling; None: as it was). A row's tokens do not depend on the rows beside it, so the
    new row can stand beside the others' answers (`merge_rerun`); its name must stay unique."""
    cfg = _config_of(result)
    index = _row_index(result, row)
    old = cfg.rows[index]
    new = (
        old
        if spec is None
        else replace(
            spec,
            messages=old.messages,
            prefix=old.prefix,
            chosen=old.chosen,
            seed_offset=old.seed_offset,
            threshold=old.threshold,
        )
    )
    others = [r.name for i, r in enumerate(cfg.rows) if i != index]
    if new.name in others:
        raise FeedbackError(f"row names must be different: another row is already called {new.name!r}")
    return replace(cfg, rows=[new]).validate()


def merge_rerun(result: RunResult, row: str | int, again: RunResult) -> RunResult:
    """`result` with one row replaced by the row of `again` (a `rerun` of it): its answer and its
    settings in the config. The run's time and memory are the rerun's; the others' rows as they were."""
    index = _row_index(result, row)
    if len(again.rows) != 1 or len(again.config.get("rows") or []) != 1:
        raise FeedbackError("a rerun holds exactly one row")
    rows = list(result.rows)
    # its speed was measured with one row a step, the others' with every row of their run: said beside it
    rows[index] = replace(again.rows[0], metrics=again.rows[0].metrics | {"rerun_alone": True})
    config = dict(result.config)
    config["rows"] = [
        again.config["rows"][0] if i == index else r for i, r in enumerate(result.config["rows"])
    ]
    div = first_divergence(rows[0].token_ids, rows[1].token_ids) if len(rows) > 1 else None
    return replace(
        again, config=config, rows=rows, prompt_tokens=result.prompt_tokens, first_divergence_step=div
    )


def keep_shown(result: RunResult, steps: int, rows: list[int] | None = None) -> RunResult:
    """A stopped run as a person saw it when they pressed Stop: `rows` (default every row) keep
    their first `steps` steps, and a row cut short ends there, "stopped". The steps a streaming
    page had not drawn yet (a decode runs ahead of a busy page) are dropped, and the metrics that
    count the answer are counted again on what is kept."""
    cfg = result.config
    window = (cfg.get("deepconf") or {}).get("window", DEFAULT_WINDOW)
    out = replace(result, rows=list(result.rows))
    cut = [i for i in (rows if rows is not None else range(len(out.rows))) if len(out.rows[i].steps) > steps]
    for i in cut:
        out.rows[i] = cut_row(out.rows[i], steps, window)
    facts = cfg.get("key_facts") or []
    if cut and facts:
        found = quality.key_fact_metrics([r.text for r in out.rows], facts)
        for i in cut:
            out.rows[i].metrics |= found[i]
    if len(out.rows) >= 2:
        out.first_divergence_step = first_divergence(out.rows[0].token_ids, out.rows[1].token_ids)
    return out


def cut_row(row: RowResult, steps: int, window: int) -> RowResult:
    """`row` stopped after its first `steps` steps, its answer's metrics counted again on them."""
    kept = row.steps[:steps]
    ids = row.token_ids[:steps]
    counted = trace_metrics([s.confidence for s in kept], window).to_dict() | quality.text_metrics(ids)
    return replace(
        row,
        steps=kept,
        token_ids=ids,
        text="".join(s.text for s in kept),
        stop_reason="stopped",
        stop_step=kept[-1].step if kept else None,
        tokens_per_s=tokens_per_second(kept) or 0.0,
        decode_seconds=sum(s.time_ms for s in kept[1:]) / 1000.0,
        metrics=row.metrics | counted,
    )


def answers_only(result: RunResult) -> RunResult:
    """What a follow-up needs of a result (config, each row's tokens and text), without the
    per-step records that make a result large."""
    rows = [
        RowResult(r.name, r.strategy, dict(r.params), list(r.token_ids), r.text, r.stop_reason, r.stop_step)
        for r in result.rows
    ]
    return RunResult(
        config=result.config, rows=rows, prompt_tokens=result.prompt_tokens, run_id=result.run_id
    )


class RecentRuns:
    """The last `capacity` results a server produced, by run id, so a client can continue or branch
    one by its id. Only what a follow-up needs is kept (see `answers_only`)."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._runs: OrderedDict[str, RunResult] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, result: RunResult) -> None:
        with self._lock:
            self._runs[result.run_id] = answers_only(result)
            self._runs.move_to_end(result.run_id)
            while len(self._runs) > self.capacity:
                self._runs.popitem(last=False)

    def get(self, run_id: str) -> RunResult:
        with self._lock:
            if run_id not in self._runs:
                raise FeedbackError(
                    f"no recent run {run_id!r} on this server (it keeps the last {self.capacity}); "
                    "send the run itself instead"
                )
            return self._runs[run_id]
