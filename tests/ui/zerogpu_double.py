"""A test double for Hugging Face's `spaces` package as it behaves on a ZeroGPU Space, on a CPU.

What it keeps of the real one (`spaces` 0.51, `spaces/zero/wrappers.py`):
- `GPU(fn, duration=...)` asks for `duration` seconds per call: an int, or a callable given the
  call's own arguments; the request is checked before the call (too long: "ZeroGPU illegal
  duration", and the function never runs). The decorated function gets a `zerogpu` attribute.
- The function runs in another process, forked from this one at the call (ZeroGPU forks its GPU
  worker from the main process, so the worker has the models the main process loaded): its
  arguments, every value it yields and its return value are pickled across, by the same pickler
  as the real queues (multiprocessing's ForkingPickler, with torch's reducers).
- An exception in the worker reaches the caller as `gr.Error(<its class name>)`, titled "ZeroGPU
  worker error" (a `gr.Error` raised there arrives as itself); a worker that dies mid-call as
  `gr.Error("GPU task aborted")`; closing the caller's generator closes the worker's at its next
  yield.

What it checks, beyond the real one: nothing that crosses may hold a torch tensor. On ZeroGPU the
model's tensors are CUDA tensors (in the worker; the main process holds stand-ins), which cannot be
pickled to a process without CUDA; here they are CPU tensors that would pickle, so the double
refuses every tensor, CUDA or not. A value that cannot be pickled, or holds a tensor, is recorded in
`violations` and ends the call with a `BoundaryError`.

It measures each call: the duration asked for, the bytes of the arguments, of each yield and of
the result. It does not simulate the shared GPU's scheduler (quota, shorter requests first) nor
worker reuse (the real one keeps an idle worker for the next call; this one forks for every call,
so each call sees the main process as it is at the call).
"""

from __future__ import annotations

import functools
import inspect
import io
import multiprocessing
import os
import pickle
import threading
import traceback
import types
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler

import gradio as gr

FORK = multiprocessing.get_context("fork")  # as the real one: the worker inherits the loaded model
DEFAULT_DURATION = 60  # the real client's default request when `duration` is not given


class BoundaryError(AssertionError):
    """Something that may not cross the ZeroGPU process boundary tried to (a test failure)."""


class _BoundaryPickler(ForkingPickler):
    """The real queues' pickler, refusing every tensor (see the module docstring)."""

    def reducer_override(self, obj):
        import torch

        if isinstance(obj, torch.Tensor):
            raise BoundaryError(
                f"a torch.Tensor (shape {tuple(obj.shape)}, {obj.dtype}, on {obj.device}) crossed: "
                "on ZeroGPU the model's tensors live on CUDA and cannot be pickled to the main "
                "process; send plain numbers (.tolist(), .item())"
            )
        return NotImplemented


def dumps(obj, where: str) -> bytes:
    """`obj` pickled as the boundary pickles it; a `BoundaryError` saying `where` if it cannot cross."""
    buf = io.BytesIO()
    try:
        _BoundaryPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    except BoundaryError as exc:
        raise BoundaryError(f"{where}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 (whatever pickle raises: PicklingError, TypeError, AttributeError)
        raise BoundaryError(
            f"{where} cannot be pickled to the other process: {type(exc).__name__}: {exc}"
        ) from None
    return buf.getvalue()


def describe(obj) -> str:
    return type(obj).__qualname__


@dataclass
class Call:
    """One call of a GPU function: what it asked for and what crossed, in pickled bytes."""

    name: str
    duration: float
    arg_bytes: int = 0
    yield_bytes: list[int] = field(default_factory=list)
    yield_types: list[str] = field(default_factory=list)
    result_bytes: int = 0
    ran: bool = False  # the function started in the worker


@dataclass
class ZeroGPU:
    """The double: `module()` is what `import spaces` gives a test (monkeypatch it into sys.modules)."""

    max_duration: float | None = None  # a visitor's longest allowed call; None: any
    abort_after: int | None = None  # kill the worker after this many yields (the GPU went away)
    decorated: int = 0
    calls: list[Call] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def module(self) -> types.ModuleType:
        spaces = types.ModuleType("spaces")
        spaces.GPU = self.GPU
        return spaces

    def GPU(self, task=None, *, duration=None, size=None, **_kwargs):
        if task is None or not callable(task):  # @spaces.GPU(duration=...) / @spaces.GPU(45)
            return functools.partial(self.GPU, duration=task if task is not None else duration, size=size)
        self.decorated += 1
        if not inspect.isgeneratorfunction(task):
            raise NotImplementedError(
                "the double runs generator functions only (the app's one GPU function is one)"
            )

        @functools.wraps(task)
        def gradio_handler(*args, **kwargs):
            yield from self._call(task, duration, args, kwargs)

        gradio_handler.zerogpu = None  # as the real decorator marks its functions
        return gradio_handler

    # ---- one call, in the caller's process ----
    def _call(self, task, duration, args, kwargs):
        seconds = duration(*args, **kwargs) if callable(duration) else (duration or DEFAULT_DURATION)
        call = Call(task.__name__, seconds)
        self.calls.append(call)
        if self.max_duration is not None and seconds > self.max_duration:
            raise gr.Error(
                f"The requested GPU duration ({seconds:.0f}s) is larger than the maximum allowed",
                title="ZeroGPU illegal duration",
                print_exception=False,
            )
        payload = self._crossing(lambda: dumps((args, kwargs), "an argument of the GPU function"))
        call.arg_bytes = len(payload)
        here, there = FORK.Pipe()
        worker = FORK.Process(target=_worker, args=(task, there, self.abort_after), daemon=True)
        worker.start()
        there.close()
        here.send_bytes(payload)
        closed = True
        try:
            while True:
                try:
                    raw = here.recv_bytes()
                except EOFError:  # the worker died without a word
                    raise gr.Error(
                        "GPU task aborted", title="ZeroGPU worker error", print_exception=False
                    ) from None
                kind, value = pickle.loads(raw)
                if kind == "started":
                    call.ran = True
                elif kind == "yield":
                    call.yield_bytes.append(len(raw))
                    call.yield_types.append(describe(value))
                    try:
                        yield value
                    except GeneratorExit:  # the caller closed us: the worker closes its generator
                        _tell_stop(here)
                        raise
                elif kind == "result":
                    call.result_bytes = len(raw)
                    closed = False
                    return
                elif kind == "boundary":
                    self.violations.append(value)
                    raise BoundaryError(value)
                else:  # "error": (class name, traceback, gr.Error or None)
                    name, trace, gradio_error = value
                    if gradio_error is not None:
                        raise gradio_error
                    print(trace)
                    raise gr.Error(name, title="ZeroGPU worker error", print_exception=False)
        finally:
            if closed:  # the caller goes on at once, as with the real one; the worker ends at its next yield
                _tell_stop(here)
                threading.Thread(target=_reap, args=(worker, here), daemon=True).start()
            else:
                _reap(worker, here)

    def _crossing(self, pickle_it):
        try:
            return pickle_it()
        except BoundaryError as exc:
            self.violations.append(str(exc))
            raise

    # ---- reports ----
    def bytes_per_yield(self, name: str | None = None) -> dict:
        """{calls, yields, mean, max} of the bytes each yield pickled, over calls of `name` (all if None)."""
        sizes = [b for c in self.calls if name in (None, c.name) for b in c.yield_bytes]
        return {
            "calls": len(self.calls),
            "yields": len(sizes),
            "mean": sum(sizes) / len(sizes) if sizes else 0,
            "max": max(sizes, default=0),
        }


def _reap(worker, conn) -> None:
    worker.join(30)
    if worker.is_alive():
        worker.kill()
        worker.join()
    conn.close()


def _tell_stop(conn) -> None:
    try:
        conn.send_bytes(b"stop")
    except (BrokenPipeError, OSError):
        pass


# ---- the worker process ----
def _worker(task, conn, abort_after: int | None) -> None:
    """Runs `task` on the arguments it is sent, sending back each yield; a "stop" from the caller
    closes the generator at its next yield (as the real worker's stop event does)."""
    import torch

    # GNU OpenMP's thread pool does not survive fork: measured, the worker's first parallel torch
    # op hangs. On ZeroGPU the worker computes on CUDA, so one CPU thread changes nothing there.
    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the tokenizer's own pool, likewise
    args, kwargs = pickle.loads(conn.recv_bytes())

    def send(kind: str, value, where: str) -> bool:
        try:
            conn.send_bytes(dumps((kind, value), where))
            return True
        except BoundaryError as exc:
            conn.send_bytes(pickle.dumps(("boundary", str(exc))))
            return False

    conn.send_bytes(pickle.dumps(("started", None)))
    gen = task(*args, **kwargs)
    count = 0
    try:
        for item in gen:
            count += 1
            if not send("yield", item, f"yield {count} of the GPU function (a {describe(item)})"):
                return
            if abort_after is not None and count >= abort_after:
                os._exit(1)  # the worker dies: the caller hears nothing more
            if conn.poll() and conn.recv_bytes() == b"stop":
                gen.close()
                return
        send("result", None, "the GPU function's return value")
    except Exception as exc:  # noqa: BLE001 (reported to the caller as the real worker does)
        gradio_error = exc if isinstance(exc, gr.Error) else None
        conn.send_bytes(pickle.dumps(("error", (type(exc).__name__, traceback.format_exc(), gradio_error))))
    finally:
        gen.close()
        conn.close()
