"""Feedback strategies: one file each, one interface (`base.Strategy`), looked up by name here."""

from __future__ import annotations

import functools
from typing import Any

from feedback.errors import FeedbackError
from feedback.strategies.anchor import AnchorStrategy
from feedback.strategies.base import BatchView, Param, Phase, Preset, PromptStrategy, Strategy
from feedback.strategies.deep_cache import DeepCacheStrategy
from feedback.strategies.inner_loop import InnerLoopStrategy
from feedback.strategies.residual import ResidualStrategy
from feedback.strategies.restate import RestateStrategy
from feedback.strategies.soft_token import SoftTokenStrategy
from feedback.strategies.stack import SEP, StackStrategy, is_stack_name, stack_class

REGISTRY: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        ResidualStrategy,
        SoftTokenStrategy,
        DeepCacheStrategy,
        AnchorStrategy,
        InnerLoopStrategy,
        RestateStrategy,
    )
}


def get_strategy(name: str) -> type[Strategy]:
    """A strategy class by name; `a+b` is the stack of a then b (see `feedback.strategies.stack`)."""
    if not isinstance(name, str):
        raise FeedbackError(f"a strategy is named by text, got {name!r}")
    if is_stack_name(name):
        return _stack(tuple(part.strip() for part in name.split(SEP)))
    try:
        return REGISTRY[name]
    except KeyError:
        raise FeedbackError(
            f"unknown strategy {name!r}; available: {', '.join(sorted(REGISTRY))}, "
            f"or several joined by {SEP!r} (a stack, e.g. inner_loop{SEP}deep_cache)"
        ) from None


@functools.lru_cache(maxsize=64)
def _stack(names: tuple[str, ...]) -> type[StackStrategy]:
    """One class per member list, so a stack's class compares equal across calls."""
    return stack_class([get_strategy(n) if n else _empty_member() for n in names])


def _empty_member():
    raise FeedbackError(f"a stack joins strategy names with {SEP!r}; one of its names is empty")


def build_strategy(name: str, params: dict[str, Any], num_layers: int) -> Strategy:
    return get_strategy(name)(params, num_layers)


# More layers than any model has: a door checks a strategy's name and values with it before the
# model loads (a layer index is checked against the model's own layers once it has), so a bad value
# is refused in a second rather than after the load.
ANY_LAYERS = 10_000


def check_strategy(name: str, params: dict[str, Any]) -> None:
    """`name` and `params` as a model of any depth would take them; FeedbackError where not."""
    build_strategy(name, params, ANY_LAYERS)


__all__ = [
    "BatchView",
    "Param",
    "Phase",
    "Preset",
    "PromptStrategy",
    "Strategy",
    "StackStrategy",
    "REGISTRY",
    "SEP",
    "get_strategy",
    "build_strategy",
    "check_strategy",
    "ANY_LAYERS",
]
