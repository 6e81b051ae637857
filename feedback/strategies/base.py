"""The one interface every feedback strategy implements, and the plumbing they share.

A strategy instance owns one engine row. It says where it reads and where it writes:
`watch_output`/`watch_input` (read a module's output or input), `edit_output`/`edit_input` (replace
it). The base does the rest: it finds the row in the batch at every call (the row may have left),
drops left padding and the attention sink (a sequence's first token, which no strategy reads or
changes), hands the function only this row's states `[T, H]` in fp32 on one device with their
absolute positions `[T]`, and writes the returned states back in the module's dtype and device
(tuple outputs, args or kwargs repacked). Per-row state lives on the strategy between forwards;
`detach` removes every hook. A prompt-level strategy (`PromptStrategy`) reads and writes no state:
it changes the row's prompt and the tokens its reply takes, through the methods the engine calls.
"""

from __future__ import annotations

import functools
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)

from feedback.errors import FeedbackError, check_stop


class Phase(str, Enum):
    """What kind of forward is in flight (a str, so it prints and compares as its value)."""

    PREFILL = "prefill"  # the prompts, left-padded into one batch, possibly in chunks
    DECODE = "decode"  # one new token per live row, on the KV cache
    SEQUENCE = "sequence"  # teacher-forced whole sequences (perplexity passes), each from position 0


@dataclass
class BatchView:
    """What hooks may read about the forward pass in flight; written only by the engine."""

    phase: Phase = Phase.PREFILL
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
    # Requests sharing one decode step: every view of the forward in flight (this one among them), so
    # a strategy re-running a layer on its own row silences all of their hooks, not only its own run's.
    together: list[BatchView] | None = None

    def __post_init__(self) -> None:
        self.phase = Phase(self.phase)

    def check_stop(self) -> None:
        """Raise `Stopped` (out of the forward in flight) once the caller's stop is set."""
        check_stop(self.stop, "the forward pass")

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No hook of this forward's views acts inside the block (a layer re-run on one row)."""
        views = self.together or [self]
        was = [v.active for v in views]
        for v in views:
            v.active = False
        try:
            yield
        finally:
            for v, on in zip(views, was):
                v.active = on

    def index_of(self, row_id: int) -> int | None:
        """Batch position of a row in the current forward, or None if it is not in it."""
        if not self.active:
            return None
        if self.phase == Phase.PREFILL:
            return self.groups.get(row_id, 0)  # the batch row of this row's prompt
        try:
            return self.live_rows.index(row_id)
        except ValueError:
            return None

    def real_start(self, b: int) -> int:
        """Index, in this forward, of batch row `b`'s first real (not padding) token."""
        return max(0, self.pads.get(b, 0) - self.offset) if self.phase == Phase.PREFILL else 0


@dataclass(frozen=True)
class Span:
    """Where one row sits in the forward in flight: batch index, index of its first real token in
    this forward, that token's absolute position in the row's sequence, the forward's length."""

    b: int
    first: int
    position: int
    width: int


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
    # Another parameter this one may not be below (a block's last layer after its first): the
    # tuner searches from that parameter's value up, so it never proposes a refused pair.
    at_least: str | None = None

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
            raise FeedbackError(
                f"parameter {self.name} must be {self.kind.__name__}, got {value!r}"
            ) from None
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
            "name": self.name,
            "type": self.kind.__name__,
            "default": self.default_for(num_layers),
            "minimum": lo,
            "maximum": hi,
            "choices": list(self.choices) if self.choices else None,
            "help": self.help,
            "is_layer": self.is_layer,
            "perplexity_only": self.perplexity_only,
            "search": list(self.search_range(num_layers)) if self.tunable else None,
            "log": self.log,
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


# The names transformers' decoder layers take their KV cache by (GPT-NeoX, Falcon and BLOOM say layer_past).
CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
# Arguments laid out [batch x heads, ...] (BLOOM's and Falcon's ALiBi biases): a row's slice is its block
# of heads.
HEAD_MAJOR_ARGS = frozenset({"alibi"})


def _batch_row(value: Any, b: int, rows: int, head_major: bool = False) -> Any:
    """Batch row `b` of a layer call's argument, kept as a batch of one (broadcast ones as they are;
    `head_major`: laid out [rows x heads, ...], the row's block of heads)."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and rows > 1:
        if value.shape[0] == rows:
            return value[b : b + 1]
        if head_major and value.shape[0] % rows == 0:
            heads = value.shape[0] // rows
            return value[b * heads : (b + 1) * heads]
    if isinstance(value, tuple):
        return tuple(_batch_row(v, b, rows) for v in value)
    return value


@dataclass(frozen=True)
class LayerSignature:
    """How a decoder layer is called: its named parameters in order, the one its hidden states come
    in by, and the one it takes its KV cache by."""

    params: tuple[str, ...]
    states: str
    cache: str


@functools.cache
def _signature_of(layer_type: type) -> LayerSignature | str:
    """The layer class's call signature, or why a layer of it cannot be re-run (text)."""
    params = inspect.signature(layer_type.forward).parameters
    names = [n for n, p in params.items() if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    cache = next((n for n in CACHE_ARGS if n in names), None)
    if not names:
        return f"{layer_type.__name__}.forward takes no hidden states by name"
    if cache is None:
        return (
            f"{layer_type.__name__}.forward takes no KV-cache argument this project knows "
            f"({', '.join(CACHE_ARGS)})"
        )
    return LayerSignature(tuple(names), names[0], cache)


def layer_signature(layer: nn.Module) -> LayerSignature:
    """`_signature_of` the layer's class; a layer it cannot re-run refused (FeedbackError)."""
    found = _signature_of(type(layer))
    if isinstance(found, str):
        raise FeedbackError(f"this model's decoder layers cannot be re-run exactly: {found}")
    return found


@dataclass
class LayerCall:
    """One decoder layer's call as the model made it in the forward in flight, cut to one row:
    every argument by name (positional ones named from the layer's signature, as GPT-2's cache and
    mask come), the hidden states left out. Each layer's own call, so a sliding-window layer keeps
    its own mask and position embeddings."""

    layer: nn.Module
    signature: LayerSignature
    arguments: dict[str, Any]

    @property
    def cache(self) -> Any:
        """The model's own KV cache in this call (None in a pass without one)."""
        return self.arguments.get(self.signature.cache)

    def bound(self, states: torch.Tensor, cache: Any) -> dict[str, Any]:
        """The call's arguments with other hidden states and another KV cache (None: no cache)."""
        out = {**self.arguments, self.signature.states: states, self.signature.cache: cache}
        if "use_cache" in self.signature.params or "use_cache" in out:  # else the layer has no such switch
            out["use_cache"] = cache is not None
        return out


def _call_arguments(sig: LayerSignature, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A layer call's positional and keyword arguments, all by name."""
    named = dict(zip(sig.params, args))
    named.update(kwargs)
    return named


def cache_like(cache: Cache | None) -> Cache | None:
    """An empty KV cache whose layers keep as many keys as `cache`'s do (a sliding-window layer its
    window, any other every key), so the mask the model built for its own cache fits it too; None
    for None. A cache of another kind (static, quantised, recurrent state) is refused by name."""
    if cache is None:
        return None
    layers = []
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            layers.append(DynamicSlidingWindowLayer(layer.sliding_window))
        elif isinstance(layer, DynamicLayer) and not isinstance(layer, LinearAttentionCacheLayerMixin):
            layers.append(DynamicLayer())
        else:
            raise FeedbackError(
                f"a strategy that re-runs layers keeps a KV cache like the model's, and the "
                f"model's cache holds a {type(layer).__name__}, which it cannot copy"
            )
    return Cache(layers=layers)


def pad_front(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """`x` with `n` zero positions in front along `dim` (left padding, which an attention mask
    hides); n < 0 drops its first -n positions, which must be padding."""
    if n > 0:
        shape = list(x.shape)
        shape[dim] = n
        return torch.cat([x.new_zeros(shape), x], dim=dim)
    return x.narrow(dim, -n, x.shape[dim] + n) if n < 0 else x


def shift_cache(cache: Cache, n: int) -> None:
    """Move every layer of a strategy's own cache (`cache_like`'s: dynamic layers, one row) `n`
    positions to the right (`pad_front`; n < 0: its first -n dropped). A sliding-window layer's keys
    are the window's last positions whatever the padding: it is left as it is."""
    for layer in cache.layers:
        if layer.is_initialized and not isinstance(layer, DynamicSlidingWindowLayer):
            layer.keys, layer.values = pad_front(layer.keys, n, -2), pad_front(layer.values, n, -2)


def unit(d: torch.Tensor) -> torch.Tensor:
    """d / rms(d) along the last dim; zero where d is (numerically) zero: no direction to push."""
    scale = rms(d)
    return torch.where(scale > 1e-4, d / scale, torch.zeros_like(d))


def causal_mean(states: torch.Tensor) -> torch.Tensor:
    """Row t: the mean of states[0..t] ([T, H] -> [T, H])."""
    counts = torch.arange(1, states.shape[0] + 1, device=states.device, dtype=states.dtype)[:, None]
    return states.cumsum(dim=0) / counts


class RunningMean:
    """The mean of every state added so far ([H]), updated chunk by chunk or token by token."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.count = 0

    def add(self, states: torch.Tensor) -> torch.Tensor:
        """Add states [N, H]; returns the new mean."""
        n = states.shape[0]
        if n:
            chunk = states.mean(dim=0) if n > 1 else states[0]
            self.value = (
                chunk.clone()
                if self.value is None
                else self.value + (chunk - self.value) * n / (self.count + n)
            )
            self.count += n
        return self.value


class Strategy(ABC):
    """Base class: parameters, validation, hook bookkeeping. Subclasses add the maths.

    `recurrent` strategies feed position t-1's (already fed-back) state into position t, so one
    parallel pass over a text is not exact: perplexity needs token-by-token decoding (`exact`) or
    several Jacobi passes. Non-recurrent ones are exact in one parallel pass."""

    name: ClassVar[str]
    description: ClassVar[str]
    formula: ClassVar[str] = ""  # the update, in plain text, for help texts
    params: ClassVar[tuple[Param, ...]]
    # Named settings, the first being the one a new page starts on; measured, not guessed (the notes say
    # where).
    presets: ClassVar[tuple[Preset, ...]] = ()
    recurrent: ClassVar[bool] = True
    strength_param: ClassVar[str] = "alpha"  # the parameter that is 0 for "no feedback"
    # A strategy that changes the prompt's own states (not only what follows it) needs its own prefill
    # sequence: the engine then never shares the prompt's prefill between this row and another.
    edits_prompt: ClassVar[bool] = False

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
            "name": cls.name,
            "description": cls.description,
            "formula": cls.formula,
            "recurrent": cls.recurrent,
            "prompt_level": issubclass(cls, PromptStrategy),
            "strength_param": cls.strength_param,
            "params": [p.schema(num_layers) for p in cls.params],
            "presets": [
                {"name": p.name, "params": cls.preset_values(p.name, num_layers), "note": p.note}
                for p in cls.presets
            ],
        }

    @classmethod
    def switched_off(cls, values: dict[str, Any]) -> bool:
        """Whether these (possibly partial) settings switch the strategy off (its strength is 0): the
        row is then the baseline again."""
        return values.get(cls.strength_param) == 0

    @classmethod
    def off_settings(cls) -> str:
        """The setting that switches it off, as text ("alpha=0")."""
        return f"{cls.strength_param}=0"

    @classmethod
    def preset_values(cls, name: str, num_layers: int) -> dict[str, Any]:
        """Every parameter's value under a named preset (defaults for the ones it does not name)."""
        preset = next((p for p in cls.presets if p.name == name), None)
        if preset is None:
            known = ", ".join(p.name for p in cls.presets) or "none"
            raise FeedbackError(f"unknown preset {name!r} for strategy {cls.name}; it has {known}")
        return cls.validate(
            {k: v(num_layers) if callable(v) else v for k, v in preset.values.items()}, num_layers
        )

    def attach(self, model: nn.Module, layers: nn.ModuleList, row_id: int, batch: BatchView) -> None:
        """Register this strategy's hooks for one row; state starts fresh."""
        if self._handles:
            raise RuntimeError(f"strategy {self.name} is already attached")
        self.row_id, self.batch = row_id, batch
        self.model, self.layers = model, layers
        self.device = model.get_input_embeddings().weight.device  # where per-row state lives
        self._seen = 0  # this row's real tokens before the forward in flight
        self._span: Span | None = None  # the forward in flight, found at its first hook
        self.reset()
        self.check_model(model, layers)
        try:
            self._register(model, layers)
        except BaseException:
            self.detach()
            raise

    @property
    def phase(self) -> Phase:
        return self.batch.phase

    # ---- where a strategy reads and writes; `where` is a decoder-layer index or a module ----
    def watch_output(self, where: int | nn.Module, fn: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Call `fn(states, positions)` with this row's slice of the module's output."""

        def hook(module, args, output):
            view = self._view(layer_output(output))
            if view is not None:
                fn(*view[1:])

        self._handles.append(self._module(where).register_forward_hook(hook))

    def watch_input(self, where: int | nn.Module, fn: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Call `fn(values, positions)` with this row's slice of the module's first input."""

        def hook(module, args, kwargs):
            view = self._view(args[0] if args else next(iter(kwargs.values())))
            if view is not None:
                fn(*view[1:])

        self._handles.append(self._module(where).register_forward_pre_hook(hook, with_kwargs=True))

    def edit_output(
        self,
        where: int | nn.Module,
        fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None],
        whole: bool = False,
    ) -> None:
        """Replace this row's slice of the module's output by `fn(states, positions)` (None: keep).
        `whole`: `fn` sees the row's whole slice, padding and sink included (positions below 0 and
        0), as a re-run of layers needs; only its real, non-sink part is written back."""

        def hook(module, args, output):
            new = self._edit(layer_output(output), fn, whole)
            if new is None:
                return None
            return (new, *output[1:]) if isinstance(output, tuple) else new

        self._handles.append(self._module(where).register_forward_hook(hook))

    def edit_input(
        self, where: int | nn.Module, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
    ) -> None:
        """Replace this row's slice of the module's hidden-state input by `fn(states, positions)`."""

        def hook(module, args, kwargs):
            new = self._edit(args[0] if args else kwargs["hidden_states"], fn)
            if new is None:
                return None
            return ((new, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": new})

        self._handles.append(self._module(where).register_forward_pre_hook(hook, with_kwargs=True))

    def watch_call(self, where: int | nn.Module, fn: Callable[[torch.Tensor, LayerCall], None]) -> None:
        """Call `fn(states, call)` with this row's whole slice of a decoder layer's hidden-state input
        (fp32, padding and sink included) and the layer's call cut to this row (`LayerCall`: its
        mask, position embeddings and ids, cache, every argument it was given), so the strategy can
        run the layer again on its row alone (`run_layer`). A layer whose call it cannot re-run is
        refused here, when the strategy attaches, before any forward."""
        module = self._module(where)
        sig = layer_signature(module)

        def hook(module, args, kwargs):
            named = _call_arguments(sig, args, kwargs)
            x = named.pop(sig.states)
            sp = self.span(x.shape[1])
            if sp is not None:
                rows = x.shape[0]
                cut = {k: _batch_row(v, sp.b, rows, k in HEAD_MAJOR_ARGS) for k, v in named.items()}
                fn(x[sp.b].to(self.device).float(), LayerCall(module, sig, cut))

        self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def run_layer(self, call: LayerCall, states: torch.Tensor, cache: Any = None) -> torch.Tensor:
        """A decoder layer applied again to this row's whole states [T, H] (fp32 in and out, the
        layer's own dtype inside), with its call from `watch_call` and the strategy's own KV cache
        (`cache_like` the model's; None: a parallel pass that needs none). No hook of any strategy
        acts meanwhile, so the model's own cache and the other rows are untouched."""
        self.batch.check_stop()
        dtype = next(call.layer.parameters()).dtype
        with self.batch.paused():
            out = call.layer(**call.bound(states[None].to(dtype), cache))
        return layer_output(out)[0].float()

    def check_model(self, model: nn.Module, layers: nn.ModuleList) -> None:
        """Refuse a model this strategy cannot serve exactly (`FeedbackError`, naming why); called
        when a run is built, before it starts, and again on attach. Every model passes by default."""

    def extra_layer_passes(self) -> int:
        """Decoder-layer applications per token beyond the model's own (its cost, reported)."""
        return 0

    def pad_left(self, n: int) -> None:
        """The row's place in the model's KV cache gained `n` positions of left padding (n < 0: lost
        -n of them), as when requests join or leave a shared decode: state kept per cache position
        (a KV cache of the strategy's own) moves with it (`shift_cache`). Other state is kept per
        real token and does not move."""

    def report(self) -> dict[str, Any]:
        """Facts about this row's run that go into its metrics (what it cost, what it did)."""
        extra = self.extra_layer_passes()
        return {"extra_layer_passes": extra} if extra else {}

    def _module(self, where: int | nn.Module) -> nn.Module:
        return self.layers[where] if isinstance(where, int) else where

    def span(self, width: int) -> Span | None:
        """This row's place in the forward in flight (found once per forward), or None if absent."""
        if self.batch is None or not self.batch.active:
            return None
        if self._span is None:
            b = self.batch.index_of(self.row_id)
            if b is None:
                return None
            first = self.batch.real_start(b)
            position = 0 if self.phase == Phase.SEQUENCE else self._seen
            self._span = Span(b, first, position, width)
        return self._span

    def _view(self, x: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """(start index in x, this row's real non-sink values, their absolute positions), or None.
        `x` may hold only the forward's last positions (logits kept for the last token only)."""
        sp = self.span(x.shape[1])
        if sp is None:
            return None
        lo = max(sp.first, sp.width - x.shape[1])  # forward index of the first value kept
        position = sp.position + lo - sp.first
        if position == 0:  # the attention sink
            lo, position = lo + 1, 1
        if lo >= sp.width:
            return None
        start = lo - (sp.width - x.shape[1])
        values = x[sp.b, start:].to(self.device)
        if values.is_floating_point():
            values = values.float()
        return start, values, torch.arange(position, position + values.shape[0], device=self.device)

    def _edit(self, x: torch.Tensor, fn, whole: bool = False) -> torch.Tensor | None:
        if whole:
            return self._edit_whole(x, fn)
        view = self._view(x)
        if view is None:
            return None
        start, states, positions = view
        new = fn(states, positions)
        if new is None:
            return None
        out = x.clone()
        out[self._span.b, start:] = new.to(device=out.device, dtype=out.dtype)
        return out

    def _edit_whole(self, x: torch.Tensor, fn) -> torch.Tensor | None:
        """`fn` sees every position of the row (called even when none of them may be written: a
        strategy that keeps its own caches must see the sink and the padding too)."""
        sp = self.span(x.shape[1])
        if sp is None:
            return None
        offset = sp.width - x.shape[1]  # x may hold only the forward's last positions
        positions = torch.arange(offset - sp.first, sp.width - sp.first, device=self.device) + sp.position
        new = fn(x[sp.b].to(self.device).float(), positions)
        keep = positions >= 1  # never the padding or the attention sink
        if new is None or not bool(keep.any()):
            return None
        start = int(keep.nonzero()[0])
        out = x.clone()
        out[sp.b, start:] = new[start:].to(device=out.device, dtype=out.dtype)
        return out

    def detach(self) -> None:
        """Remove every hook this strategy registered (safe to call more than once)."""
        while self._handles:
            self._handles.pop().remove()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def end_forward(self) -> None:
        """Called by the engine after every forward pass: the row's position moves on, then the
        strategy's own `after_forward`."""
        if self._span is not None and self.phase != Phase.SEQUENCE:
            self._seen += max(0, self._span.width - self._span.first)
        self._span = None
        self.after_forward()

    @abstractmethod
    def _register(self, model: nn.Module, layers: nn.ModuleList) -> None:
        """Say where the strategy reads and writes (`watch_*`, `edit_*`)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget all per-row state (called on attach)."""

    def after_forward(self) -> None:
        """Per-row bookkeeping once a forward (prefill chunk, decode step or sequence pass) ends."""


class PromptStrategy(Strategy):
    """Base class of prompt-level strategies: they change what the model is asked and which tokens
    the reply takes, never a hidden state (the model runs unchanged, so they register no hooks).

    The engine calls, for a row with one: `rewrite_prompt` when it encodes the row's prompt, `begin`
    once the row's tokenizer is known, `choose` at every decode step, and `context_tokens` with
    `reference_text` when it scores a reference answer. Each default leaves the row as a plain row
    would be, so a strategy overrides only what it changes. A reply may be split into named parts
    (`choose` says which part each token belongs to); the steps carry them and the part "restate"
    is left out of the answer's text (`feedback.core.records.answer_text`)."""

    recurrent: ClassVar[bool] = False  # the model is unchanged: nothing feeds from token to token

    def _register(self, model: nn.Module, layers: nn.ModuleList) -> None:
        """No hooks: the model runs unchanged."""

    def reset(self) -> None:
        """No per-row state by default."""

    def rewrite_prompt(self, prompt: str) -> str:
        """The row's newest user message as the model is asked it (by default unchanged)."""
        return prompt

    def begin(self, tokenizer: Any, eos_ids: list[int]) -> None:
        """Called once the row's tokenizer and end-of-turn token ids are known, before the first step
        (to tokenise markers the strategy forces)."""

    def choose(self, step: int, token: int) -> tuple[int, str | None]:
        """The token this row takes at decode `step` given the sampler's `token`, and the part of the
        reply it belongs to (None: the reply has no parts). By default the sampler's token, no part.
        A token the user forces still wins over the one returned; the strategy moves on as if its own
        had been taken."""
        return token, None

    def context_tokens(self, token_ids: list[int]) -> list[int]:
        """The reply's tokens (`token_ids`, the whole reply) that come before its answer: a reference
        answer is scored after the prompt and these. By default none: the whole reply is the answer."""
        return []

    def reference_text(self, reference: str) -> str:
        """A reference answer as it would follow `context_tokens` in a reply (the lead-in's spacing);
        by default as given."""
        return reference
