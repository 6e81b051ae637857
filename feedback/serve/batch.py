"""JSONL batch runner: one task a line in, one result a line out, never losing a finished result.

Each result is appended, flushed and fsynced as soon as its task finishes, so a crash (even
SIGKILL) loses at most the task in flight. Rerunning with the same output skips the ids already
there (a torn last line from a crash is cut off first), so nothing is duplicated. A failing task is
retried up to `retries` times, then recorded as an error line and the run goes on. Malformed input
lines are reported with their line number and recorded as `invalid` lines.

With `parallel` > 1, up to that many tasks run at once in worker threads: compare and Deep Think
tasks decode their rows together in the model's one decode loop (`feedback.core.sharing`: exact,
the same tokens as alone), ppl tasks' forwards take turns with theirs at the model's lock. Results
are then appended in the order the tasks finish (resume and `merge` key by id and line).

Under a launcher (accelerate, torchrun, MPI) each of N processes takes every N-th task and appends
to its own `OUTPUT.partRANK`; `merge` then joins the parts in input order.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from feedback.core import memory
from feedback.core.budget import Budget
from feedback.core.model import LoadedModel
from feedback.errors import FeedbackError, one_line
from feedback.eval import corpus

MODES = ("compare", "ppl", "deepthink")
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
RUN_KEYS = ("max_new_tokens", "seed", "chat_template", "system_prompt", "reference", "key_facts", "quality")
PPL_KEYS = ("bootstrap",)
_COMMON = {"id", "prompt", "mode"}


def task_fields(mode: str) -> set[str]:
    """The fields a task of this mode may have (anything else is a typo or a misunderstanding)."""
    if mode == "compare":
        return _COMMON | {"strategy", "params", "rows", *RUN_KEYS, *SAMPLING_KEYS}
    if mode == "ppl":
        return _COMMON | {"strategy", "params", "ppl_mode", *PPL_KEYS}
    from feedback.eval.deepthink import DeepThinkConfig

    return _COMMON | set(DeepThinkConfig.__dataclass_fields__) - {"prompt"}


def _rows_problem(rows) -> str | None:
    """The shape of a compare task's `rows` (their values are checked when the task runs)."""
    from feedback.core.records import RowSpec

    known = set(RowSpec.__dataclass_fields__)
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        return "rows must be a non-empty list of objects"
    for i, row in enumerate(rows):
        if not isinstance(row.get("name"), str):
            return f"rows[{i}] needs a string field 'name'"
        unknown = sorted(set(row) - known)
        if unknown:
            return (
                f"rows[{i}] has unknown field(s) {', '.join(unknown)}; a row takes {', '.join(sorted(known))}"
            )
    return None


def _problem(task, lenient: bool) -> str | None:
    if not isinstance(task, dict):
        return "a task must be a JSON object"
    mode = task.get("mode", "compare")
    rows = task.get("rows")
    own = (
        mode == "compare"
        and isinstance(rows, list)
        and rows
        and all(isinstance(r, dict) and r.get("prompt") for r in rows)
    )
    if not own and (not isinstance(task.get("prompt"), str) or not task["prompt"].strip()):
        return "needs a non-empty string field 'prompt' (a compare task may instead give every row its own)"
    if mode not in MODES:
        return f"mode must be one of {', '.join(MODES)}"
    if mode == "compare" and "rows" in task and (problem := _rows_problem(rows)):
        return problem
    unknown = sorted(set(task) - task_fields(mode))
    if unknown and not lenient:
        return (
            f"unknown field(s) {', '.join(unknown)} for mode {mode} (--lenient ignores them); it takes "
            f"{', '.join(sorted(task_fields(mode)))}"
        )
    return None


def read_tasks(path: str | Path, lenient: bool = False) -> Iterator[tuple[int, dict | None, str | None]]:
    """(line number, task or None, problem or None) for every non-empty input line. A task whose
    id an earlier line already has is a problem (it would overwrite that result on resume)."""
    path = Path(path)
    if not path.is_file():
        raise FeedbackError(f"no such input file: {path}")
    first_line: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as exc:
                yield number, None, f"not valid JSON ({exc.msg})"
                continue
            problem = _problem(task, lenient)
            if problem is None:
                task_id = str(task.get("id", f"line{number}"))
                if task_id in first_line:
                    problem = f"duplicate id {task_id!r} (first on line {first_line[task_id]})"
                else:
                    first_line[task_id] = number
            if problem is None and lenient:
                task = {k: v for k, v in task.items() if k in task_fields(task.get("mode", "compare"))}
            yield number, (task if problem is None else None), problem


def _records(path: Path) -> list[dict]:
    """Complete lines of a results file; a torn last line (a crash mid-write) is left out."""
    data = path.read_bytes()
    data = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


def part_path(output: str | Path, rank: int) -> Path:
    """The file rank `rank` of a sharded run appends to, beside the final output."""
    output = Path(output)
    return output.with_name(f"{output.name}.part{rank}")


def part_files(output: str | Path) -> list[Path]:
    """The part files beside `output` (`OUTPUT.part0`, `OUTPUT.part1`, ...), by rank."""
    output = Path(output)
    prefix = output.name + ".part"
    ranks = {p: p.name[len(prefix) :] for p in output.parent.glob(prefix + "*")}
    return sorted((p for p, rank in ranks.items() if rank.isdigit()), key=lambda p: int(ranks[p]))


def finished_ids(out: Path, others: list[Path] = ()) -> set[str]:
    """Ids recorded in `out` or in `others`; a torn last line of `out` (crash mid-write) is cut off first."""
    if out.exists():
        data = out.read_bytes()
        keep = data.rfind(b"\n") + 1  # everything after the last newline is a partial line
        if keep != len(data):
            with out.open("r+b") as f:
                f.truncate(keep)
    return {str(r["id"]) for path in [out, *others] if path.exists() for r in _records(path)}


def _given(task: dict, keys: tuple[str, ...]) -> dict:
    """The config fields a task gives; the others keep their config's defaults, declared beside it."""
    return {k: task[k] for k in keys if k in task}


def run_task(
    lm: LoadedModel,
    task: dict,
    budget: Budget | None = None,
    stop: threading.Event | None = None,
    shared: bool = False,
) -> dict:
    """One task through the same engine, perplexity and Deep Think code as the UI and CLI, within
    `budget` when one is set (FEEDBACK_BUDGET_* variables). Setting `stop` ends it early (a compare
    task's result then says `stopped`; the others raise `Stopped`). `shared`: a compare or Deep
    Think task decodes in the model's one decode loop, beside other threads' runs."""
    mode = task.get("mode", "compare")
    strategy = task.get("strategy", "residual")
    params = task.get("params", {})
    if mode == "compare":
        from feedback.core.engine import start_run
        from feedback.core.records import RowSpec, RunConfig, default_rows
        from feedback.core.sampling import SamplingConfig
        from feedback.core.sharing import run_events

        rows = [RowSpec(**r) for r in task["rows"]] if "rows" in task else default_rows(strategy, params)
        cfg = RunConfig(
            prompt=task.get("prompt", ""),
            model=lm.name,
            rows=rows,
            **_given(task, RUN_KEYS),
            sampling=SamplingConfig(**_given(task, SAMPLING_KEYS)),
        )
        run = start_run(lm, cfg, stop, budget=budget)
        for _ in run_events(run, shared):
            pass
        return run.result.to_dict()
    if mode == "ppl":
        from feedback.eval.perplexity import PPLConfig, evaluate

        return evaluate(
            lm,
            [corpus.Document(str(task.get("id", "text")), task["prompt"])],
            PPLConfig(strategy, params, task.get("ppl_mode"), **_given(task, PPL_KEYS)),
            stop=stop,
            budget=budget,
        )
    from feedback.eval.deepthink import DeepThinkConfig, deep_think

    fields = DeepThinkConfig.__dataclass_fields__
    return deep_think(
        lm,
        DeepThinkConfig(**{k: v for k, v in task.items() if k in fields and k != "mode"}),
        stop=stop,
        budget=budget,
        shared=shared,
    )


def _append(f, record: dict) -> None:
    f.write(json.dumps(record) + "\n")
    f.flush()
    os.fsync(f.fileno())


def run_batch(
    lm: LoadedModel,
    input_path: str | Path,
    output_path: str | Path,
    retries: int = 1,
    shard: tuple[int, int] = (0, 1),
    warn: Callable[[str], None] = print,
    progress: Callable[[int, int, float], None] | None = None,
    lenient: bool = False,
    budget: Budget | None = None,
    parallel: int = 1,
) -> dict:
    """Run every task of this shard not yet in the output; return a summary. Unknown task fields
    make a line invalid unless `lenient`; tasks over `budget` fail with its message. `parallel`:
    how many tasks run at once (worker threads; see the module docstring). `progress(finished,
    total, seconds)` hears of every line written (from a worker thread when `parallel` > 1)."""
    if retries < 0:
        raise FeedbackError(f"retries must be >= 0, got {retries}")
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise FeedbackError(f"parallel must be a whole number >= 1, got {parallel!r}")
    rank, world = shard
    final = Path(output_path)
    out = part_path(final, rank) if world > 1 else final
    out.parent.mkdir(parents=True, exist_ok=True)
    # Ids finished by any earlier run, sharded or not and whatever its process count, are skipped.
    done = finished_ids(out, [p for p in [final, *part_files(final)] if p != out])
    tasks = [(n, t, p) for i, (n, t, p) in enumerate(read_tasks(input_path, lenient)) if i % world == rank]
    todo = [(n, t, p) for n, t, p in tasks if str((t or {}).get("id", f"line{n}")) not in done]
    summary = {"tasks": len(tasks), "skipped": len(tasks) - len(todo), "ok": 0, "error": 0, "invalid": 0}
    started = time.perf_counter()
    with out.open("a", encoding="utf-8") as f:
        batch = _Batch(lm, f, input_path, summary, len(todo), retries, warn, progress, budget, parallel)
        if parallel == 1:
            for item in todo:
                batch.finish(batch.do(*item))
        else:
            batch.run_all(todo)
    summary["seconds"] = time.perf_counter() - started
    summary["output"] = str(out)
    return summary


class _Batch:
    """One `run_batch` call's tasks: each done with its retries (`do`), its line written and counted
    (`finish`); `run_all` spreads them over worker threads, and stops them all if it is interrupted."""

    def __init__(self, lm, f, input_path, summary, total, retries, warn, progress, budget, parallel):
        self.lm, self.f, self.input_path, self.summary = lm, f, input_path, summary
        self.total, self.retries, self.warn, self.progress = total, retries, warn, progress
        self.budget, self.parallel = budget, parallel
        self.started = time.perf_counter()
        self.finished = 0
        self.lock = threading.Lock()  # one line written, counted and reported at a time
        self.halt = threading.Event()  # the batch is ending early: no task starts, every one stops
        self.running: set[threading.Event] = set()  # the stop event of every task running now

    def do(self, number: int, task: dict | None, problem: str | None) -> dict | None:
        """The task's line (None when the batch was halted before it finished: it is not recorded,
        so a resume runs it)."""
        task_id = str((task or {}).get("id", f"line{number}"))
        if problem:
            with self.lock:
                self.warn(f"{self.input_path}:{number}: {problem}")
            return {"id": task_id, "line": number, "status": "invalid", "error": problem}
        record = {"id": task_id, "line": number, "mode": task.get("mode", "compare")}
        for attempt in range(1, self.retries + 2):
            stop = threading.Event()
            with self.lock:
                if self.halt.is_set():
                    return None
                self.running.add(stop)
            t0 = time.perf_counter()
            try:
                result, error = run_task(self.lm, task, self.budget, stop, shared=self.parallel > 1), None
            except Exception as exc:  # recorded, retried, never fatal for the batch
                error = exc
            finally:
                with self.lock:
                    self.running.discard(stop)
            if self.halt.is_set():  # stopped part-way: neither a result nor a failure
                return None
            if error is not None:
                record |= {"status": "error", "error": one_line(error), "attempts": attempt}
                continue
            record |= {"status": "ok", "attempts": attempt, "result": result}
            record.pop("error", None)
            break
        record |= {"seconds": time.perf_counter() - t0, "peak_rss_mb": memory.sample().rss_mb}
        return record

    def finish(self, record: dict | None) -> None:
        """Append the line (flushed and fsynced), count it and report progress."""
        if record is None:
            return
        with self.lock:
            _append(self.f, record)
            self.summary[record["status"]] += 1
            self.finished += 1
            if self.progress:
                self.progress(self.finished, self.total, time.perf_counter() - self.started)

    def stop_all(self) -> None:
        with self.lock:
            self.halt.set()
            for stop in self.running:
                stop.set()

    def run_all(self, todo: list) -> None:
        """Up to `parallel` tasks at once. An error in a worker (writing a line, the progress
        callback) or in this thread (KeyboardInterrupt) stops every task, waits for the workers
        to end (each stops within a decode step or a forward), then is raised here."""
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        for item in todo:
            jobs.put(item)
        failures: list[BaseException] = []
        count = min(self.parallel, len(todo))
        ended = [threading.Event() for _ in range(count)]

        def work(i: int) -> None:
            try:
                while not self.halt.is_set():
                    try:
                        item = jobs.get_nowait()
                    except queue.Empty:
                        return
                    self.finish(self.do(*item))
            except BaseException as exc:  # noqa: BLE001 (handed to the calling thread)
                failures.append(exc)
                self.stop_all()
            finally:
                ended[i].set()

        workers = [
            threading.Thread(target=work, args=(i,), name=f"feedback-lens-batch-{i}", daemon=True)
            for i in range(count)
        ]

        def wait() -> None:
            # Each worker's own event, not Thread.join: a KeyboardInterrupt landing inside join()
            # can mark a running thread as stopped on Python < 3.13 (bpo-45274's fix releases the
            # lock the running thread holds), and later joins then return at once.
            for worker, done in zip(workers, ended):
                asked = time.monotonic()
                while not done.wait(0.1):
                    if worker.is_alive() or _launching(worker, asked):
                        continue
                    break  # never launched: the interrupt came before its start()
                else:
                    worker.join()

        try:
            for worker in workers:
                worker.start()
            wait()
        except BaseException:
            self.stop_all()  # a task not started yet never starts; the running ones stop
            wait()
            raise
        if failures:
            raise failures[0]


def _launching(worker: threading.Thread, since: float) -> bool:
    """Whether a thread not yet alive will still run. An interrupt landing inside `start()` can
    leave one launched but not yet begun: it is listed by `threading.enumerate` and runs soon. One
    interrupted before it was launched is not listed (or, if the interrupt came between the two,
    is listed for ever and never runs: hence the few seconds' bound)."""
    return worker in threading.enumerate() and time.monotonic() - since < 5


def merge(output: str | Path) -> dict:
    """Join `output` and its part files into `output`, in input-line order, one record per id.

    Where a task appears twice (a rerun with another process count), a success beats an error.
    Written to a temporary file and renamed, so a crash leaves the parts intact; parts are then removed.
    With no parts (the run had one process) the output is left as it is."""
    final = Path(output)
    parts = part_files(final)
    if not parts:
        if final.exists():  # an unsharded run (one process) already wrote the whole output
            return {"records": len(_records(final)), "parts": 0, "duplicates": 0, "output": str(final)}
        raise FeedbackError(f"neither {final} nor its part files ({final.name}.part0, ...) exist")
    best: dict[str, dict] = {}
    seen = 0
    for path in [final, *parts] if final.exists() else parts:
        for record in _records(path):
            seen += 1
            key = str(record["id"])
            if key not in best or (best[key].get("status") != "ok" and record.get("status") == "ok"):
                best[key] = record
    records = sorted(best.values(), key=lambda r: (r.get("line", 0), str(r["id"])))
    tmp = final.with_name(final.name + ".merging")
    with tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    for path in parts:
        path.unlink()
    return {
        "records": len(records),
        "parts": len(parts),
        "duplicates": seen - len(records),
        "output": str(final),
    }


def summary_line(summary: dict) -> str:
    return (
        f"{summary['tasks']} tasks: {summary['ok']} ok, {summary['error']} failed, {summary['invalid']} "
        f"invalid, {summary['skipped']} already done ({summary['seconds']:.1f} s)"
    )
