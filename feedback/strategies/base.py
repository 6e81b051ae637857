"""The one interface every feedback strategy implements, plus the hook plumbing they share.

A strategy instance owns one engine row. It registers forward hooks (capture) and forward
pre-hooks (inject) on decoder layers, acts only on its own row's batch position (looked up through
the engine's `BatchView` at every call, so rows may leave the batch), keeps per-row state between
steps, and removes every hook on `detach`.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from feedback.errors import FeedbackError, check_stop


@dataclass
class BatchView:
    """What hooks may read about the forward pass in flight; written only by the engine."""

    # "prefill": the shared prompt, batch of 1; "decode": one new token per live row;
    # "sequence": teacher-forced full sequences, one per live row (perplexity passes)
    phase: str = "prefill"
    live_rows: list[int] = field(default_factory=list)  # row ids in batch order while decoding
    # Prefill: prompts are left-padded into one batch and prefilled in chunks. `offset` is the padded
    # position of this forward's first token, `pads` each batch row's left padding, `groups` which
    # batch row holds each row's prompt (rows with the same prompt share one).
    offset: int = 0
    pads: dict[int, int] = field(default_factory=dict)
    groups: dict[int, int] = field(default_factory=dict)
    # True only while this run's own forward is in flight (the engine serialises forwards per model),
    # so hooks of one run never touch another run's forward on the same model.
    active: bool = False
    # A caller's stop signal that a forward in flight honours between decoder layers and inside long
    # strategy loops (a perplexity window's single forward can take seconds); None: not looked at.
    stop: Any = None

    def check_stop(self) -> None:
        """Raise `Stopped` (out of the forward in flight) once the caller's stop is set."""
        check_stop(self.stop, "the forward pass")

    def index_of(self, row_id: int) -> int | None:
        """Batch position of a row in the current forward, or None if it is not in it."""
        if not self.active:
            return None
        if self.phase == "prefill":
            return self.groups.get(row_id, 0)  # the batch row of this row's prompt
        try:
            return self.live_rows.index(row_id)
        except ValueError:
            return None

    def real_start(self, b: int) -> int:
        """Index, in this forward, of batch row `b`'s first real (not padding) token."""
        return max(0, self.pads.get(b, 0) - self.offset) if self.phase == "prefill" else 0

    def real_before(self, b: int) -> int:
        """Real tokens of batch row `b` that earlier forwards of the prefill already took."""
        return max(0, self.offset - self.pads.get(b, 0)) if self.phase == "prefill" else 0

    def after_sink(self, b: int) -> int:
        """Index, in this forward, of row `b`'s first real token that is not its attention sink (the
        first real token of a sequence, which no strategy reads or changes)."""
        return self.real_start(b) + (1 if self.real_before(b) == 0 else 0)


@dataclass(frozen=True)
class Param:
    """One strategy parameter: type, default (a value or a function of the layer count), bounds."""

    name: str
    kind: type
    default: Any
    help: str = ""
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple | None = None
    is_layer: bool = False  # a decoder-layer index: bounded by the model's layer count
    perplexity_only: bool = False  # only teacher-forced scoring reads it (generation ignores it)
    # Where the tuner searches: (low, high) for numbers, the choices for a choice; None: not tuned
    # (layer indices are always tuned over every layer). Narrower than the valid range where most of
    # it is known to break the model; `log` asks for a log-scale search (positive ranges only).
    search: tuple | None = None
    log: bool = False

    def default_for(self, num_layers: int) -> Any:
        return self.default(num_layers) if callable(self.default) else self.default

    def coerce(self, value: Any, num_layers: int) -> Any:
        """Parse (from a string too) and validate one value, with a message naming the parameter."""
        try:
            if self.kind is bool and isinstance(value, str):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(value)
                value = value.lower() in ("1", "true", "yes", "on")
            elif self.kind is int and isinstance(value, float):
                if not value.is_integer():
                    raise ValueError(value)
                value = int(value)
            elif self.kind is int and isinstance(value, bool):
                raise ValueError(value)
            value = self.kind(value)
        except (TypeError, ValueError):
            raise FeedbackError(f"parameter {self.name} must be {self.kind.__name__}, got {value!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise FeedbackError(f"parameter {self.name} must be finite, got {value!r}")
        lo, hi = self.minimum, self.maximum
        if self.is_layer:
            lo, hi = 0, num_layers - 1
        if lo is not None and value < lo or hi is not None and value > hi:
            raise FeedbackError(f"parameter {self.name}={value!r} is out of range [{lo}, {hi}]")
        if self.choices is not None and value not in self.choices:
            raise FeedbackError(f"parameter {self.name}={value!r} must be one of {list(self.choices)}")
        return value

    def schema(self, num_layers: int) -> dict:
        lo, hi = (0, num_layers - 1) if self.is_layer else (self.minimum, self.maximum)
        return {
            "name": self.name, "type": self.kind.__name__, "default": self.default_for(num_layers),
            "minimum": lo, "maximum": hi, "choices": list(self.choices) if self.choices else None,
            "help": self.help, "perplexity_only": self.perplexity_only,
            "search": list(self.search_range(num_layers)) if self.tunable else None, "log": self.log,
        }

    @property
    def tunable(self) -> bool:
        return self.is_layer or self.search is not None

    def search_range(self, num_layers: int) -> tuple:
        """The tuner's range: every layer for a layer index, else `search`."""
        return (0, num_layers - 1) if self.is_layer else tuple(self.search or ())


@dataclass(frozen=True)
class Preset:
    """A named setting of a strategy's parameters and what it is for (unnamed ones keep defaults)."""

    name: str
    values: dict[str, Any]
    note: str


def rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Root-mean-square over the last (hidden) dimension, kept as a trailing size-1 dim."""
    return x.pow(2).mean(dim=-1, keepdim=True).add(eps).sqrt()


def layer_output(output: Any) -> torch.Tensor:
    """A decoder layer's hidden-state output: a tensor in transformers 5, a tuple in older code."""
    return output[0] if isinstance(output, tuple) else output


class Strategy(ABC):
    """Base class: parameters, validation, hook bookkeeping. Subclasses add the maths.

    `recurrent` strategies feed position t-1's (already fed-back) state into position t, so one
    parallel pass over a text is not exact: perplexity needs token-by-token decoding (`exact`) or
    several Jacobi passes. Non-recurrent ones are exact in one parallel pass."""

    name: ClassVar[str]
    description: ClassVar[str]
    formula: ClassVar[str] = ""  # the update, in plain text, for help texts
    params: ClassVar[tuple[Param, ...]]
    # Named settings, the first being the one a new page starts on; measured, not guessed (the notes say where).
    presets: ClassVar[tuple[Preset, ...]] = ()
    recurrent: ClassVar[bool] = True
    strength_param: ClassVar[str] = "alpha"  # the parameter that is 0 for "no feedback"

    def __init__(self, values: dict[str, Any], num_layers: int):
        self.values = self.validate(values, num_layers)
        self.num_layers = num_layers
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self.row_id: int | None = None
        self.batch: BatchView | None = None

    @classmethod
    def validate(cls, values: dict[str, Any], num_layers: int) -> dict[str, Any]:
        """Defaults filled in, every value parsed and range-checked; unknown names refused."""
        known = {p.name: p for p in cls.params}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise FeedbackError(
                f"unknown parameter(s) {', '.join(unknown)} for strategy {cls.name}; "
                f"it takes {', '.join(known) or 'none'}"
            )
        out = {p.name: p.coerce(p.default_for(num_layers), num_layers) for p in cls.params}
        for key, value in values.items():
            out[key] = known[key].coerce(value, num_layers)
        cls.check(out, num_layers)
        return out

    @classmethod
    def check(cls, values: dict[str, Any], num_layers: int) -> None:
        """Cross-parameter checks; override where parameters constrain each other."""

    @classmethod
    def schema(cls, num_layers: int) -> dict:
        return {
            "name": cls.name, "description": cls.description, "formula": cls.formula,
            "recurrent": cls.recurrent, "strength_param": cls.strength_param,
            "params": [p.schema(num_layers) for p in cls.params],
            "presets": [{"name": p.name, "params": cls.preset_values(p.name, num_layers), "note": p.note}
                        for p in cls.presets],
        }

    @classmethod
    def preset_values(cls, name: str, num_layers: int) -> dict[str, Any]:
        """Every parameter's value under a named preset (defaults for the ones it does not name)."""
        preset = next((p for p in cls.presets if p.name == name), None)
        if preset is None:
            known = ", ".join(p.name for p in cls.presets) or "none"
            raise FeedbackError(f"unknown preset {name!r} for strategy {cls.name}; it has {known}")
        return cls.validate({k: v(num_layers) if callable(v) else v for k, v in preset.values.items()}, num_layers)

    def attach(self, model: nn.Module, layers: nn.ModuleList, row_id: int, batch: BatchView) -> None:
        """Register this strategy's hooks for one row; state starts fresh."""
        if self._handles:
            raise RuntimeError(f"strategy {self.name} is already attached")
        self.row_id, self.batch = row_id, batch
        self.reset()
        try:
            self._register(model, layers)
        except BaseException:
            self.detach()
            raise

    def _add_forward_hook(self, module: nn.Module, fn: Callable) -> None:
        self._handles.append(module.register_forward_hook(fn))

    def _add_pre_hook(self, module: nn.Module, fn: Callable) -> None:
        self._handles.append(module.register_forward_pre_hook(fn, with_kwargs=True))

    def detach(self) -> None:
        """Remove every hook this strategy registered (safe to call more than once)."""
        while self._handles:
            self._handles.pop().remove()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def my_index(self) -> int | None:
        return self.batch.index_of(self.row_id) if self.batch is not None else None

    @abstractmethod
    def _register(self, model: nn.Module, layers: nn.ModuleList) -> None:
        """Register hooks with `_add_forward_hook` / `_add_pre_hook`."""

    @abstractmethod
    def reset(self) -> None:
        """Forget all per-row state (called on attach)."""

    def end_forward(self) -> None:
        """Called by the engine after every forward pass (prefill and each decode step)."""
