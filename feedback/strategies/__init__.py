"""Feedback strategies: one file each, one interface (`base.Strategy`), looked up by name here."""
from __future__ import annotations

from typing import Any

from feedback.errors import FeedbackError
from feedback.strategies.anchor import AnchorStrategy
from feedback.strategies.base import BatchView, Param, Phase, Preset, PromptStrategy, Strategy
from feedback.strategies.deep_cache import DeepCacheStrategy
from feedback.strategies.inner_loop import InnerLoopStrategy
from feedback.strategies.residual import ResidualStrategy
from feedback.strategies.restate import RestateStrategy
from feedback.strategies.soft_token import SoftTokenStrategy

REGISTRY: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (ResidualStrategy, SoftTokenStrategy, DeepCacheStrategy, AnchorStrategy,
                              InnerLoopStrategy, RestateStrategy)
}


def get_strategy(name: str) -> type[Strategy]:
    if not isinstance(name, str):
        raise FeedbackError(f"a strategy is named by text, got {name!r}")
    try:
        return REGISTRY[name]
    except KeyError:
        raise FeedbackError(f"unknown strategy {name!r}; available: {', '.join(sorted(REGISTRY))}") from None


def build_strategy(name: str, params: dict[str, Any], num_layers: int) -> Strategy:
    return get_strategy(name)(params, num_layers)


__all__ = ["BatchView", "Param", "Phase", "Preset", "PromptStrategy", "Strategy", "REGISTRY", "get_strategy",
           "build_strategy"]
