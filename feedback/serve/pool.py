"""The models a server offers: an allowlist, loaded on first use, and the one line to the model.

The page, the Gradio API and the HTTP API share one pool per process, so each model is loaded once
and every run, whichever door it came through, waits in the same line (`ModelPool.gate`)."""

from __future__ import annotations

import os
import threading

from feedback.core import embedded
from feedback.core.budget import memory_cap_mb
from feedback.core.model import DTYPES, LoadedModel, load_model
from feedback.core.sharing import can_share
from feedback.errors import FeedbackError
from feedback.serve.gate import Gate
from feedback.serve.limits import MAX_WAITING, shared_runs_setting


class ModelPool:
    """Loaded models by name, restricted to an allowlist; keeps at most `capacity` in memory.

    Shared by the UI and API so one process loads each model once. Loading is serialised; runs
    take a slot of `gate` first."""

    def __init__(
        self,
        allowlist: list[str],
        capacity: int = 1,
        max_waiting: int | None = MAX_WAITING,
        shared_runs: int | None = None,
        **load_kwargs,
    ):
        if not allowlist:
            raise FeedbackError("the model allowlist is empty")
        # One line for all model work of this process, page and API alike; `max_waiting` requests
        # from any door may wait in it at once. Engine runs decode together (`shares`), up to
        # `shared_runs` (FEEDBACK_SHARED_RUNS) while their memory fits the cap measured once the
        # model is in memory; other work runs alone, as forwards are serialised anyway.
        self.shared_runs = shared_runs if shared_runs is not None else shared_runs_setting()
        self.gate = Gate(self.shared_runs, max_waiting=max_waiting)
        self.allowlist = list(dict.fromkeys(allowlist))
        self.capacity = max(1, capacity)
        self.load_kwargs = load_kwargs
        self._models: dict[str, LoadedModel] = {}
        self._lock = threading.Lock()

    @classmethod
    def serving(cls, lm: LoadedModel, shared_runs: int | None = None) -> ModelPool:
        """A pool whose allowlist is one model that is already loaded (tests, benchmarks)."""
        pool = cls([lm.name], shared_runs=shared_runs)
        pool._models[lm.name] = lm
        pool._room(lm)
        return pool

    @property
    def default(self) -> str:
        return self.allowlist[0]

    def get(self, name: str | None = None) -> LoadedModel:
        name = name or self.default
        if name not in self.allowlist:
            raise FeedbackError(f"model {name!r} is not in the allowlist: {', '.join(self.allowlist)}")
        with self._lock:
            if name not in self._models:
                while len(self._models) >= self.capacity:
                    self._models.pop(next(iter(self._models)))
                self._models[name] = load_model(name, **self.load_kwargs)
                self._room(self._models[name])
            return self._models[name]

    def _room(self, lm: LoadedModel) -> None:
        """The memory that runs decoding together may hold: the run memory cap, measured with the
        model in memory and nothing running (each run is refused alone over it when it is built)."""
        self.gate.room_mb = memory_cap_mb(lm.device)

    def shares(self, lm: LoadedModel) -> bool:
        """Whether runs on `lm` decode together here (`core.sharing.can_share`, and more than one
        run allowed at once)."""
        return self.shared_runs > 1 and can_share(lm)

    def resident(self, name: str) -> LoadedModel:
        """The model `name` as it is in memory, read without the pool's lock, else `get(name)`. For
        the GPU function: on ZeroGPU it runs in a process forked from this one, where a lock that
        another thread held at the fork stays held for good."""
        lm = self._models.get(name)
        return lm if lm is not None else self.get(name)

    def loaded(self) -> dict[str, LoadedModel]:
        """The models in memory now, by name."""
        with self._lock:
            return dict(self._models)


def allowlist_from_env(default: str = embedded.EMBEDDED_NAME) -> list[str]:
    """`FEEDBACK_MODELS` (comma-separated names), else just the embedded model."""
    names = [n.strip() for n in os.environ.get("FEEDBACK_MODELS", "").split(",") if n.strip()]
    return names or [default]


DTYPE_ENV = "FEEDBACK_DTYPE"
QUANTIZE_ENV = "FEEDBACK_QUANTIZE"
# bitsandbytes weights, for a GPU too small for the model in 16-bit (on a CPU: the int4 and int8
# fast modes of feedback/core/linear.py).
QUANTIZE = {"none": {}, "4bit": {"load_in_4bit": True}, "8bit": {"load_in_8bit": True}}


def load_options_from_env() -> dict:
    """How a server loads its models, as `load_model` keyword arguments: `FEEDBACK_DTYPE` (auto,
    float32, bfloat16, float16; unset: auto) and `FEEDBACK_QUANTIZE` (none, 4bit, 8bit; unset: none).
    A server has no command line of its own on a Space, so these variables are its only way to
    choose; a bad value is refused here, at startup, naming the variable and the choices."""
    dtype = os.environ.get(DTYPE_ENV, "").strip().lower() or "auto"
    if dtype != "auto" and dtype not in DTYPES:
        raise FeedbackError(f"{DTYPE_ENV} must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    quantize = os.environ.get(QUANTIZE_ENV, "").strip().lower() or "none"
    if quantize not in QUANTIZE:
        raise FeedbackError(f"{QUANTIZE_ENV} must be one of {', '.join(QUANTIZE)}; got {quantize!r}")
    return {"dtype": dtype, **QUANTIZE[quantize]}
