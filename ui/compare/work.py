"""The Compare tab's model work: a run (a first turn, a follow-up, a branch or one column run
again) streamed from the engine, and Calibrate's warm-up traces. Each says what to show as a view (`ui.compare.view`); the
tab's `show` function, given to the work, turns a view into its components' updates, so a work
never touches a component.

The engine run itself is a `GpuTask` (`CompareTask`, `CalibrateTask`): its checked config, which
ZeroGPU pickles to its GPU worker, where the run is started again on the worker's model. The run
built here (`CompareWork.engine_run`) is the check and the page's frame; it never iterates.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from typing import Callable

from feedback.core import memory
from feedback.core.engine import PrefillEvent, Run, StepEvent, start_run
from feedback.core.records import RowResult, RunConfig, RunResult
from feedback.core.session import keep_shown, merge_rerun
from feedback.eval.deepthink import DeepThinkConfig, warm_up
from feedback.serve.gate import Place
from feedback.serve.gpu_time import GpuWork
from ui import charts, render
from ui.compare.view import CalibrationView, PageView, RunView, Status, confidence_chart, done_text, frame, outputs
from ui.deepconf import traces_gpu_work
from ui.runner import GpuTask, Outcome, Work, ended_text, reporting, waiting_text
from ui.stop_signal import StopSignal

MEMORY_CHART_INTERVAL_S = 1.0  # the memory chart is drawn again at most once a second while a run streams
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

    def ended_early(self, outcome: Outcome, stopped: str, left: str = "Left the line; nothing ran.") -> PageView:
        """The end of a job that has no result to show: why, in the status line."""
        return self.View(busy=False, status=Status(*ended_text(outcome, stopped, left)))


@dataclass
class CompareTask(GpuTask):
    """A Compare run on the GPU: its config, checked here, started there on the worker's model. It
    streams the engine's events (each a step's tokens: small), then the run's result once."""

    model: str
    gpu: GpuWork
    config: RunConfig

    def run(self, lm, stop: StopSignal):
        run = start_run(lm, self.config)  # the budgets were checked here; the device's memory is checked there
        run.stop_event = stop  # the job's stop: Stop, cancel, or a page that went away
        run.prefill_events = True  # a long prompt's reading shows in the status line
        for event in run:
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
    return GpuWork(steps=new, row_tokens=len(rows) * new, scored=prefill + after,
                   how=f"{columns} x {new:,} new tokens after a prompt of up to {longest:,} tokens",
                   fewer="fewer columns, fewer max new tokens or a shorter prompt")


class CompareWork(ViewWork):
    """One Compare run: the engine streams step events; the page gets columns, stats and charts."""

    label = "a Compare run"
    View = RunView

    def __init__(self, run: Run, view: str, show: Callable[[PageView], dict], what: str = "Generating"):
        super().__init__(show)
        self.engine_run, self.view, self.what = run, view, what
        self.config = cfg = run.config  # what the page shows: its columns
        self.rows = [RowResult(r.name, r.strategy, dict(r.params)) for r in run.result.rows]
        self.slots = list(range(len(self.rows)))  # the page column of each engine row
        self.caches = [render.SpanCache() for _ in self.rows]  # each column's rendered tokens, reused
        self.mem = {"origin": time.time(), "samples": [], "label": "the run began"}
        self.result: RunResult | None = None
        self.last_chart = 0.0
        self.feed_id = uuid.uuid4().hex
        self.feed = charts.feed_start(self.feed_id)  # the live confidence chart's points, only growing
        self.fed = [0] * len(self.rows)  # steps of each row already in the feed
        self.ui_seconds = 0.0
        self.threshold, self.window = cfg.deepconf.threshold, cfg.deepconf.window
        self.started = False
        self.prefill: PrefillEvent | None = None  # how far a long prompt has been read
        self.shown: int | None = None  # the steps on the page when Stop was pressed there
        self.task = CompareTask(run.lm.name, run_gpu_work(run), cfg)

    def shown_at_stop(self, steps: int) -> None:
        """The page's Stop came when it showed `steps` steps: the stopped run keeps those (what the
        decode made past them, the page had not drawn yet)."""
        self.shown = steps

    def stop_column(self, column: int) -> bool:
        """Stop one column (0-based) at its next step, the others going on; False if it is not running."""
        if column not in self.slots or self.rows[column].stop_reason is not None or self.signal is None:
            return False
        self.signal.stop_row(self.slots.index(column))  # read by the run, wherever it runs
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

    def _charts(self, rows: list[RowResult], live: bool) -> RunView:
        return RunView(confidence=confidence_chart(rows, self.threshold, self.window, live=live),
                       memory=charts.memory_figure(self.mem["samples"]), mem_state=self.mem)

    def _live_chart(self) -> RunView:
        """The confidence chart a run starts from: every row's curves, empty, named for the feed."""
        span = (0, self.config.max_new_tokens - 1)
        return RunView(confidence=charts.confidence_figure(self.rows, self.threshold, None, self.window,
                                                           feed=self.feed_id, span=span))

    def _fed(self) -> RunView:
        """The feed with every row's steps not yet in it."""
        for i, row in enumerate(self.rows):
            self.feed += charts.feed_lines(i, row.steps[self.fed[i]:])
            self.fed[i] = len(row.steps)
        return RunView(feed=self.feed)

    def progress_view(self, items: list, elapsed: float) -> RunView:
        t = time.perf_counter()
        out = RunView()
        if not self.started:  # the run began `elapsed` seconds ago: the memory chart's time origin
            self.started = True
            self.mem["origin"] = time.time() - elapsed
            self.last_chart = t  # the first tokens go out alone; drawing charts would hold them back
            out = RunView(busy=True) | frame(self.config) | self._live_chart()
        for item in items:
            if isinstance(item, StepEvent):
                self._apply(item)
            elif isinstance(item, PrefillEvent):
                self.prefill = item
            elif isinstance(item, RunResult):
                self.result = self.merged(item)
        if self.result is None:
            out |= outputs(self.rows, self.view, live=True, caches=self.caches)
            out |= RunView(status=Status(f"{self._where()} ({elapsed:.0f} s)"))
            out |= self._fed()
            if t - self.last_chart >= MEMORY_CHART_INTERVAL_S:
                self.last_chart = t
                out |= RunView(memory=charts.memory_figure(self.mem["samples"]), mem_state=self.mem)
        self.ui_seconds += time.perf_counter() - t
        return out

    def _where(self) -> str:
        """How far the run is: reading a long prompt (its chunks), then the decode step."""
        step = max((len(r.steps) for r in self.fresh_rows()), default=0)
        if step == 0 and self.prefill is not None:
            p = self.prefill
            return (f"{self.what}… reading the prompt: {p.tokens:,} of {p.total:,} tokens "
                    f"(chunk {p.chunk} of {p.chunks})")
        return f"{self.what}… step {step} of {self.config.max_new_tokens}"

    def fresh_rows(self) -> list[RowResult]:
        """The columns this run decodes (a re-run decodes one; the others show the run before)."""
        return [self.rows[i] for i in self.slots]

    def finish_view(self, outcome: Outcome) -> RunView:
        if self.result is None:  # the run ended without its final result: keep what streamed, say why
            steps = max((len(r.steps) for r in self.fresh_rows()), default=0)
            kept = outputs(self.rows, self.view, live=False, caches=self.caches) if steps else RunView()
            return kept | RunView(feed="") | self.ended_early(outcome, f"Stopped after {steps} steps." if steps
                                           else "Stopped before the first token.")
        t = time.perf_counter()
        result = self.result
        if self.shown is not None and outcome.kind == "stopped":
            result = keep_shown(result, self.shown, self.slots)
        self.mem["samples"] = [*self.mem["samples"], memory_entry(self.mem, memory.sample())][-MEMORY_POINTS:]
        out = RunView(busy=False) | frame(self.config)  # the final update stands on its own
        out |= outputs(result.rows, self.view, live=False, caches=self.caches) | self._charts(result.rows, live=False)
        out |= RunView(feed="")  # the finished chart is drawn whole; the feed is done with
        self.ui_seconds += time.perf_counter() - t
        data = result.to_dict() | {"ui_seconds": self.ui_seconds}
        return out | RunView(result=data, status=Status(self.done_text(result),
                                                        "stopped" if outcome.kind == "stopped" else "info"))

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

    def __init__(self, run: Run, view: str, show: Callable[[PageView], dict], before: RunResult, column: int):
        name = run.config.rows[0].name
        super().__init__(run, view, show, what=f"Re-running {name}")
        self.before, self.column = before, column
        rows = RunConfig.from_dict(before.config).rows
        rows[column] = run.config.rows[0]
        self.config = replace(run.config, rows=rows)
        fresh = self.rows[0]
        self.rows = list(before.rows)
        self.rows[column] = fresh
        self.slots = [column]
        self.caches = [render.SpanCache() for _ in self.rows]
        self.fed = [0] * len(self.rows)

    def merged(self, result: RunResult) -> RunResult:
        return merge_rerun(self.before, self.column, result)

    def done_text(self, result: RunResult) -> str:
        return (f"Re-ran {result.rows[self.column].name} alone; the other columns are as they were. "
                f"{done_text(result)}")


@dataclass
class CalibrateTask(GpuTask):
    """Calibrate's warm-up traces on the GPU: progress lines, then `Finished` with the thresholds."""

    model: str
    gpu: GpuWork
    cfg: DeepThinkConfig

    def run(self, lm, stop: StopSignal):
        yield from reporting(lambda report, halt: warm_up(lm, self.cfg, halt, report), stop)


class CalibrateWork(ViewWork):
    """Warm-up traces of the Compare prompt, both rows pooled -> a fixed early-stop threshold."""

    label = "a Calibrate run"
    View = CalibrationView

    def __init__(self, lm, cfg: DeepThinkConfig, note: str, show: Callable[[PageView], dict]):
        super().__init__(show)
        self.lm, self.cfg, self.note = lm, cfg, note
        self.task = CalibrateTask(lm.name, traces_gpu_work(lm, cfg, [2 * cfg.warmup]), cfg)
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
        note = (f"Calibrated from {2 * self.cfg.warmup} warm-up traces (η = {self.cfg.eta:g} % kept): threshold "
                f"**{s:.2f}**, now used for early stop.{self.note}")
        return CalibrationView(busy=False, status=Status(f"Calibrated: early stop below {s:.2f}."), threshold=s,
                               note=note, histogram=charts.histogram_figure(lows, {"shared": s}))
