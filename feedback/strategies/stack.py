"""Several hidden-state strategies on one row, applied in a declared order: `inner_loop+deep_cache`.

A stack is itself a `Strategy`, so every door that takes a strategy name (page, API, CLI, batch,
tune, lm-eval, recall) takes a stack's name too. Its parameters are its members', each named
`<member>.<param>` (`inner_loop.beta`, `deep_cache.lam`), with the members' own types, bounds and
search ranges, so validation, controls and the tuner (a joint search) come from the same schema.

Order: members attach in the order named, and PyTorch runs hooks on one module in registration
order, so where two members act on the same module the later one sees the earlier one's edit.
Each member is a full strategy instance with its own state and its own view of the row; the stack
only forwards the engine's calls. Prompt-level strategies change the prompt rather than the states
and cannot be stacked.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

from torch import nn

from feedback.errors import FeedbackError
from feedback.strategies.base import BatchView, Param, Preset, PromptStrategy, Strategy

SEP = "+"  # between member names: "inner_loop+deep_cache"
DOT = "."  # between a member's name and its parameter's: "deep_cache.lam"


def is_stack_name(name: str) -> bool:
    return SEP in name


def split_params(values: dict[str, Any], members: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """{"a.x": 1, "b.y": 2} -> {"a": {"x": 1}, "b": {"y": 2}}; a name without a known member refused."""
    out: dict[str, dict[str, Any]] = {m: {} for m in members}
    for key, value in values.items():
        member, dot, param = key.partition(DOT)
        if not dot or member not in out:
            raise FeedbackError(
                f"a stack's parameters are named <strategy>.<parameter> with a strategy of the "
                f"stack ({', '.join(members)}), got {key!r}"
            )
        out[member][param] = value
    return out


def join_params(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The inverse of `split_params`."""
    return {f"{member}{DOT}{k}": v for member, values in parts.items() for k, v in values.items()}


def _prefixed(member: str, p: Param) -> Param:
    return replace(
        p, name=f"{member}{DOT}{p.name}", at_least=f"{member}{DOT}{p.at_least}" if p.at_least else None
    )


def _shared_presets(members: tuple[type[Strategy], ...]) -> tuple[Preset, ...]:
    """Presets every member has under the same name (each member at its own preset of that name)."""
    names = [
        p.name for p in members[0].presets if all(p.name in {q.name for q in m.presets} for m in members[1:])
    ]
    presets = []
    for name in names:
        values = {
            f"{m.name}{DOT}{k}": v
            for m in members
            for k, v in next(p for p in m.presets if p.name == name).values.items()
        }
        notes = "; ".join(f"{m.name}: {next(p for p in m.presets if p.name == name).note}" for m in members)
        presets.append(
            Preset(
                name,
                values,
                f"each member at its own “{name}” preset, measured alone, not as a stack ({notes})",
            )
        )
    return tuple(presets)


class StackStrategy(Strategy):
    """Members' hooks on one row; built per member list by `stack_class`."""

    members: ClassVar[tuple[type[Strategy], ...]] = ()
    strength_param: ClassVar[str] = ""  # each member has its own; `switched_off` asks them all

    def __init__(self, values: dict[str, Any], num_layers: int):
        super().__init__(values, num_layers)
        parts = split_params(self.values, self.member_names())
        self.parts = [cls(parts[cls.name], num_layers) for cls in self.members]

    @classmethod
    def member_names(cls) -> tuple[str, ...]:
        return tuple(m.name for m in cls.members)

    @classmethod
    def validate(cls, values: dict[str, Any], num_layers: int) -> dict[str, Any]:
        parts = split_params(values, cls.member_names())
        out = {}
        for m in cls.members:
            try:
                out[m.name] = m.validate(parts[m.name], num_layers)
            except FeedbackError as exc:  # the member's message names its own parameter: say whose it is
                raise FeedbackError(f"stack {cls.name}, member {m.name}: {exc}") from None
        return join_params(out)

    @classmethod
    def schema(cls, num_layers: int) -> dict:
        return super().schema(num_layers) | {"members": list(cls.member_names())}

    @classmethod
    def switched_off(cls, values: dict[str, Any]) -> bool:
        parts = split_params(values, cls.member_names())
        return all(m.switched_off(parts[m.name]) for m in cls.members)

    @classmethod
    def off_settings(cls) -> str:
        return " and ".join(f"{m.name}{DOT}{m.off_settings()}" for m in cls.members)

    # ---- the engine's calls, forwarded to every member in order ----
    def attach(self, model: nn.Module, layers: nn.ModuleList, row_id: int, batch: BatchView) -> None:
        self.row_id, self.batch = row_id, batch
        try:
            for part in self.parts:
                part.attach(model, layers, row_id, batch)
        except BaseException:
            self.detach()
            raise

    def check_model(self, model: nn.Module, layers: nn.ModuleList) -> None:
        for part in self.parts:
            part.check_model(model, layers)

    def detach(self) -> None:
        for part in self.parts:
            part.detach()

    @property
    def attached(self) -> bool:
        return any(part.attached for part in self.parts)

    def end_forward(self) -> None:
        for part in self.parts:
            part.end_forward()

    def extra_layer_passes(self) -> int:
        return sum(part.extra_layer_passes() for part in self.parts)

    def pad_left(self, n: int) -> None:
        for part in self.parts:
            part.pad_left(n)

    def report(self) -> dict[str, Any]:
        """The members' reports: extra layer passes summed, every other fact under its member's name."""
        out: dict[str, Any] = {}
        for part in self.parts:
            for key, value in part.report().items():
                out[key if key == "extra_layer_passes" else f"{part.name}{DOT}{key}"] = value
        extra = self.extra_layer_passes()
        return out | ({"extra_layer_passes": extra} if extra else {})

    def _register(self, model: nn.Module, layers: nn.ModuleList) -> None:
        """The members register their own hooks (see `attach`)."""

    def reset(self) -> None:
        """The members keep their own state."""


def stack_class(members: list[type[Strategy]]) -> type[StackStrategy]:
    """The stack of `members` (at least two, each once, none prompt-level) as a strategy class."""
    names = [m.name for m in members]
    if len(members) < 2:
        raise FeedbackError(
            f"a stack needs at least two strategies joined by {SEP!r}, got {SEP.join(names)!r}"
        )
    if len(set(names)) != len(names):
        raise FeedbackError(f"a stack names each strategy once, got {SEP.join(names)!r}")
    prompt_level = [m.name for m in members if issubclass(m, PromptStrategy)]
    if prompt_level:
        raise FeedbackError(
            f"{', '.join(prompt_level)} is prompt-level (it changes the prompt, not the hidden "
            "states) and cannot be stacked; stack hidden-state strategies"
        )
    name = SEP.join(names)
    return type(
        f"Stack_{'_'.join(names)}",
        (StackStrategy,),
        {
            "name": name,
            "members": tuple(members),
            "description": " then ".join(m.description for m in members),
            "formula": " ; then ".join(f"{m.name}: {m.formula}" for m in members),
            "params": tuple(_prefixed(m.name, p) for m in members for p in m.params),
            "presets": _shared_presets(tuple(members)),
            "recurrent": any(m.recurrent for m in members),
            "edits_prompt": any(m.edits_prompt for m in members),
        },
    )
