"""The Compare tab's model work: a run (a first turn, a follow-up, a branch or one column run
again) streamed from the engine, and Calibrate's warm-up traces. Each says what to show as a view
(`ui.compare.view`); the tab's `show` function, given to the work, turns a view into its components'
updates, so a work never touches a component.

The engine run itself is a `GpuTask` (`CompareTask`, `CalibrateTask`): its checked config, which
ZeroGPU pickles to its GPU worker, where the run is started again on the worker's model. The run
built here (`CompareWork.engine_run`) is the check and the page's frame; it never iterates.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from feedback.core import memory
from feedback.core.engine import PrefillEvent, Run, StepEvent, start_run
from feedback.core.records import RowResult, RunConfig, RunResult
from feedback.core.session import cut_row, keep_shown, merge_rerun
from feedback.core.sharing import run_events
from feedback.eval.deepthink import DeepThinkConfig, memory_need, warm_up
from feedback.serve.gate import Place
from feedback.serve.gpu_time import GpuWork
from ui.compare.stream import BoardDoc, diffs
from ui.compare.view import CalibrationView, PageView, RunView, Status, confidence_chart, done_text, metrics
from ui.page import charts
from ui.page.deepconf import traces_gpu_work
from ui.page.runner import GpuTask, Outcome, Work, ended_text, reporting, waiting_text
from ui.page.stop_signal import StopSignal

STOPPING = "Stopping… the columns keep what the page shows."  # said from Stop's click to the run's end
METRICS_EVERY_S = 1.0  # the metrics table is drawn again at most once a second while a run streams
MEMORY_POINTS = 240


def memory_entry(mem: dict, sample: memory.MemorySample) -> dict:
    """A sample on the chart's time axis (seconds since `mem["origin"]`, a wall-clock time)."""
    return sample.to_dict() | {"t": round(time.time() - mem["origin"], 3)}


class ViewWork(Work):
    """A work whose look on the page is a view: `show(view)` (the tab's) makes the updates.
    Subclasses set `View` and build views in `progress_view` and `finish_view`."""

    View: type[PageView] = PageView

    def __init__(self, show: Callable[[PageView], dict]):
        self.show = show

    def starting(self) -> dict:
        return self.show(self.View(busy=True))

    def waiting(self, place: Place) -> dict:
        return self.show(self.View(busy=True, status=Status(waiting_text(place), "wait")))

    def progress(self, items: list, elapsed: float) -> dict:
        return self.show(self.progress_view(items, elapsed))

    def finish(self, outcome: Outcome) -> dict:
        return self.show(self.finish_view(outcome))

    def progress_view(self, items: list, elapsed: float) -> PageView:
        raise NotImplementedError

    def finish_view(self, outcome: Outcome) -> PageView:
        raise NotImplementedError

    def ended_early(
        self, outcome: Outcome, stopped: str, left: str = "Left the line; nothing ran."
    ) -> PageView:
        """The end of a job that has no result to show: why, in the status line."""
        return self.View(busy=False, status=Status(*ended_text(outcome, stopped, left)))


@dataclass
class CompareTask(GpuTask):
    """A Compare run on the GPU: its config, checked here, started there on the worker's model. It
    streams the engine's events (each a step's tokens: small), then the run's result once."""

    model: str
    gpu: GpuWork
    config: RunConfig
    shared: bool = False  # decodes beside other requests' runs (set by the runner)
    shares_decode = True

    def run(self, lm, stop: StopSignal):
        run = start_run(
            lm, self.config
        )  # the budgets were checked here; the device's memory is checked there
        run.stop_event = stop  # the job's stop: Stop, cancel, or a page that went away
        run.prefill_events = True  # a long prompt's reading shows in the status line
        for event in run_events(run, self.shared):
            yield event
            for row in stop.rows() - run.stopped_rows:  # columns stopped on their own, from the page
                run.stop_row(row)
        yield run.result


def run_gpu_work(run: Run) -> GpuWork:
    """The GPU work of an engine run: its decode, the prefill of each distinct prompt and, at most,
    the scoring after it (the engine's own count: the quality metrics and the reference answer)."""
    rows, new = run.rows, run.config.max_new_tokens
    prefill = sum(len(ids) for ids in run.groups)
    after = run.scored_after
    longest = max(len(r.prompt_ids) for r in rows)
    columns = f"{len(rows)} column{'s' if len(rows) != 1 else ''}"
    return GpuWork(
        steps=new,
        row_tokens=len(rows) * new,
        scored=prefill + after,
        how=f"{columns} x {new:,} new tokens after a prompt of up to {longest:,} tokens",
        fewer="fewer columns, fewer max new tokens or a shorter prompt",
    )


class CompareWork(ViewWork):
    """One Compare run: the engine streams step events; the page gets the board's token events
    (`ui.compare.stream`), the metrics and the charts."""

    label = "a Compare run"
    View = RunView

    def __init__(self, run: Run, show: Callable[[PageView], dict], what: str = "Generating"):
        super().__init__(show)
        self.engine_run, self.what = run, what
        self.config = cfg = run.config  # what the page shows: its columns
        self.rows = [RowResult(r.name, r.strategy, dict(r.params)) for r in run.result.rows]
        self.slots = list(range(len(self.rows)))  # the page column of each engine row
        self.mem = {"origin": time.time(), "samples": [], "label": "the run began"}
        self.result: RunResult | None = None
        self.last_metrics = 0.0
        self.ui_seconds = 0.0
        self.threshold, self.window = cfg.deepconf.threshold, cfg.deepconf.window
        self.doc: BoardDoc | None = None  # made when the run starts
        self.ended: set[int] = set()  # columns whose end the board has
        self.prefill: PrefillEvent | None = None  # how far a long prompt has been read
        self.shown: int | None = None  # the steps on the page when Stop was pressed there
        self.caps: dict[
            int, int
        ] = {}  # column -> the tokens the page showed when its Stop column was pressed
        self.finished = False  # the page has the final result
        self.task = CompareTask(run.lm.name, run_gpu_work(run), cfg)
        self.need_mb = run.memory_mb

    def shown_at_stop(self, steps: int) -> None:
        """The page's Stop came when it showed `steps` steps: the stopped run keeps those (what the
        decode made past them, the page had not drawn yet, and it is not sent)."""
        self.shown = steps

    def stop_column(self, column: int, shown: int | None = None) -> bool:
        """Stop one column (0-based) at its next step, the others going on; False if it is not
        running. `shown`: the tokens the page showed of it at the click, which is what it keeps,
        even when the decode had already reached the column's end (a busy page draws behind the
        decode; the page's own Stop keeps what it showed the same way)."""
        if column not in self.slots or self.signal is None or self.finished:
            return False
        row = self.rows[column]
        if row.stop_reason is not None:  # decoded to its end: only what the page had not drawn is left
            if shown is None or shown >= len(row.steps):
                return False
        else:
            self.signal.stop_row(self.slots.index(column))  # read by the run, wherever it runs
        self.caps[column] = len(row.steps) if shown is None else shown
        return True

    def _apply(self, event: StepEvent) -> None:
        for i, rec in event.records.items():
            self.rows[self.slots[i]].steps.append(rec)
            self.rows[self.slots[i]].token_ids.append(rec.token_id)
        for i, why in event.finished.items():
            self.rows[self.slots[i]].stop_reason, self.rows[self.slots[i]].stop_step = why, event.step
        if event.memory is not None:
            entry = event.memory.to_dict()  # t: seconds since the run began
            self.mem["samples"] = [*self.mem["samples"], entry][-MEMORY_POINTS:]
            self.doc.memory(entry)

    def _start(self, elapsed: float) -> RunView:
        """The run began `elapsed` seconds ago: the board's document (a re-run's other columns in
        it whole), and charts named for it that the page extends from its events."""
        self.mem["origin"] = time.time() - elapsed
        first = memory_entry(self.mem, memory.sample())
        self.mem["samples"] = [first]
        keys = [k for k, _ in charts.MEMORY_SERIES if k == "rss_mb" or first.get(k) is not None]
        run_id = uuid.uuid4().hex
        self.doc = BoardDoc(run_id, self.config, fresh=list(self.slots), memory_keys=keys)
        for i, row in enumerate(self.rows):
            if i not in self.slots:
                self.doc.replay(i, row)
                self.ended.add(i)
        span = (0, self.config.max_new_tokens - 1)
        chart = charts.confidence_figure(self.rows, self.threshold, None, self.window, feed=run_id, span=span)
        return RunView(
            busy=True,
            confidence=chart,
            mem_state=self.mem,
            memory=charts.memory_figure(self.mem["samples"], feed=run_id),
        )

    def _stream(self, rows: list[RowResult], final: bool = False) -> None:
        """Each decoded column's tokens the board does not have yet, up to what a Stop kept, and
        the end of each column that has ended (with its formatted answer)."""
        for c in self.slots:
            row = rows[c]
            limit = min(
                self.caps.get(c, len(row.steps)), len(row.steps) if self.shown is None else self.shown
            )
            if final:
                limit = len(row.steps)
            self.doc.tokens(c, row.steps[self.doc.shown[c] : limit])
            if c not in self.ended and (final or row.stop_reason is not None):
                if not final and c in self.caps:  # stopped from the page: it ends where the page was,
                    row = cut_row(row, self.caps[c], self.window)  # as `keep_shown` cuts the result
                self.ended.add(c)
                self.doc.end(c, row)
                self.doc.markdown(c, row)

    def progress_view(self, items: list, elapsed: float) -> RunView:
        t = time.perf_counter()
        out = RunView()
        if self.doc is None:
            out = self._start(elapsed)
        for item in items:
            if isinstance(item, StepEvent):
                self._apply(item)
            elif isinstance(item, PrefillEvent):
                self.prefill = item
            elif isinstance(item, RunResult):
                self.result = self.merged(item)
        if self.result is None:
            self._stream(self.rows)
            out |= RunView(board=self.doc.text, status=self._progress_status(elapsed))
            if t - self.last_metrics >= METRICS_EVERY_S:  # a table drawn again: not at every update
                self.last_metrics = t
                out |= metrics(
                    self.rows, [c in self.slots and c not in self.ended for c in range(len(self.rows))]
                )
        self.ui_seconds += time.perf_counter() - t
        return out

    def _progress_status(self, elapsed: float) -> Status:
        """Where the run is; once Stop is pressed, that it is stopping and keeps what the page shows."""
        if self.signal is not None and self.signal.is_set():
            return Status(STOPPING, "stopped")
        return Status(f"{self._where()} ({elapsed:.0f} s)")

    def _where(self) -> str:
        """How far the run is: reading a long prompt (its chunks), then the decode step."""
        step = max((len(r.steps) for r in self.fresh_rows()), default=0)
        if step == 0 and self.prefill is not None:
            p = self.prefill
            return (
                f"{self.what}… reading the prompt: {p.tokens:,} of {p.total:,} tokens "
                f"(chunk {p.chunk} of {p.chunks})"
            )
        return f"{self.what}… step {step} of {self.config.max_new_tokens}"

    def fresh_rows(self) -> list[RowResult]:
        """The columns this run decodes (a re-run decodes one; the others show the run before)."""
        return [self.rows[i] for i in self.slots]

    def finish_view(self, outcome: Outcome) -> RunView:
        if self.result is None:  # the run ended without its final result: keep what streamed, say why
            steps = max((len(r.steps) for r in self.fresh_rows()), default=0)
            kept = RunView()
            if self.doc is not None:
                self._stream(
                    [replace(r, stop_reason=r.stop_reason or "stopped") for r in self.rows], final=True
                )
                self.doc.done()
                kept = RunView(board=self.doc.text) | metrics(self.rows)
            return kept | self.ended_early(
                outcome, f"Stopped after {steps} steps." if steps else "Stopped before the first token."
            )
        t = time.perf_counter()
        self.finished = True  # a column's Stop from now on is too late to change the result
        result = self.kept(self.result, outcome)
        self.mem["samples"] = [*self.mem["samples"], memory_entry(self.mem, memory.sample())][-MEMORY_POINTS:]
        if self.doc is None:  # a run too short for any progress update
            self._start(0.0)
        self._stream(result.rows, final=True)
        for i, html in enumerate(diffs(result.rows)):
            self.doc.diff(i, html)
        self.doc.done()
        out = RunView(busy=False, board=self.doc.text) | metrics(result.rows)
        out |= RunView(
            confidence=confidence_chart(result.rows, self.threshold, self.window),
            memory=charts.memory_figure(self.mem["samples"]),
            mem_state=self.mem,
        )
        self.ui_seconds += time.perf_counter() - t
        data = result.to_dict() | {"ui_seconds": self.ui_seconds}
        return out | RunView(
            result=data,
            status=Status(self.done_text(result), "stopped" if outcome.kind == "stopped" else "info"),
        )

    def kept(self, result: RunResult, outcome: Outcome) -> RunResult:
        """The result as the page showed it: after Stop, the steps on screen at the click; a column
        stopped on its own keeps the tokens the page showed of it."""
        if self.shown is not None and outcome.kind == "stopped":
            result = keep_shown(result, self.shown, self.slots)
        for column, shown in self.caps.items():
            result = keep_shown(result, shown, [column])
        return result

    def merged(self, result: RunResult) -> RunResult:
        """The page's result of the engine's."""
        return result

    def done_text(self, result: RunResult) -> str:
        return done_text(result)


class RerunWork(CompareWork):
    """One column run again alone (`feedback.core.session.rerun`), streamed into its place while
    the other columns keep the answers of the run before; the result is that run with the column's
    answer and settings replaced (`merge_rerun`), so Continue, branches and History go on from it."""

    label = "a column's re-run"

    def __init__(self, run: Run, show: Callable[[PageView], dict], before: RunResult, column: int):
        name = run.config.rows[0].name
        super().__init__(run, show, what=f"Re-running {name}")
        self.before, self.column = before, column
        rows = RunConfig.from_dict(before.config).rows
        rows[column] = run.config.rows[0]
        self.config = replace(run.config, rows=rows)
        fresh = self.rows[0]
        self.rows = list(before.rows)
        self.rows[column] = fresh
        self.slots = [column]

    def merged(self, result: RunResult) -> RunResult:
        return merge_rerun(self.before, self.column, result)

    def done_text(self, result: RunResult) -> str:
        return (
            f"Re-ran {result.rows[self.column].name} alone; the other columns are as they were. "
            f"{done_text(result)}"
        )


@dataclass
class CalibrateTask(GpuTask):
    """Calibrate's warm-up traces on the GPU: progress lines, then `Finished` with the thresholds."""

    model: str
    gpu: GpuWork
    cfg: DeepThinkConfig
    shared: bool = False  # its traces decode beside other requests' runs (set by the runner)
    shares_decode = True

    def run(self, lm, stop: StopSignal):
        yield from reporting(
            lambda report, halt: warm_up(lm, self.cfg, halt, report, shared=self.shared), stop
        )


class CalibrateWork(ViewWork):
    """Warm-up traces of the Compare prompt, both rows pooled -> a fixed early-stop threshold."""

    label = "a Calibrate run"
    View = CalibrationView

    def __init__(self, lm, cfg: DeepThinkConfig, note: str, show: Callable[[PageView], dict]):
        super().__init__(show)
        self.lm, self.cfg, self.note = lm, cfg, note
        self.task = CalibrateTask(lm.name, traces_gpu_work(lm, cfg, [2 * cfg.warmup]), cfg)
        self.need_mb = memory_need(lm, cfg, warm_up_only=True)[0]
        self.result = None

    def progress_view(self, items: list, elapsed: float) -> CalibrationView:
        out = CalibrationView(busy=True)
        for item in items:
            if isinstance(item, str):
                out |= CalibrationView(status=Status(f"Calibrating… {item} ({elapsed:.0f} s)"))
            else:
                self.result = item.result
        return out

    def finish_view(self, outcome: Outcome) -> CalibrationView:
        if self.result is None:
            return self.ended_early(outcome, "Calibration stopped.", "Left the line; nothing was calibrated.")
        _, lows, thresholds = self.result
        s = round(thresholds["baseline"], 2)
        note = (
            f"Calibrated from {2 * self.cfg.warmup} warm-up traces (η = {self.cfg.eta:g} % kept): threshold "
            f"**{s:.2f}**, now used for early stop.{self.note}"
        )
        return CalibrationView(
            busy=False,
            status=Status(f"Calibrated: early stop below {s:.2f}."),
            threshold=s,
            note=note,
            histogram=charts.histogram_figure(lows, {"shared": s}),
        )
