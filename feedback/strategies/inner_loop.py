"""Inner looping: a block of decoder layers applied to the same token again, damped.

    loop:   z_0 = y,  z_i = (1 - beta) * y + beta * B(z_{i-1}),  i = 1..K;  output z_K
    euler:  each layer f of the block as n = K + 1 sub-steps  h <- h + (f(h) - h) / n,  then
            output (1 - beta) * y + beta * h_euler

B is layers [start_layer, end_layer], y the block's ordinary output (Lys et al., arXiv 2602.14759;
Chen et al., arXiv 2605.23872: re-applying middle layers at inference, interpolated with the plain
state). K = 0 or beta = 0 is the plain model exactly. Every extra pass is causal over the row's own sequence:
pass i attends to pass i's keys and values of the earlier positions, which the strategy keeps in
KV caches of its own (one per pass), so the model's cache never holds a duplicate entry and decoding
token by token equals one parallel pass over a text. Because the prompt's positions are looped too,
the row prefills its prompt on its own. Cost: `extra_layer_passes` per token.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers.cache_utils import Cache

from feedback.errors import FeedbackError
from feedback.strategies.base import (
    LayerCall,
    Param,
    Phase,
    Preset,
    Strategy,
    cache_like,
    layer_signature,
    shift_cache,
)

# Layer kinds whose KV cache a pass of the loop can keep as the model keeps its own.
KV_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


class InnerLoopStrategy(Strategy):
    name = "inner_loop"
    description = (
        "a block of middle layers applied again to the same token, interpolated with the plain state"
    )
    formula = (
        "z_i = (1−β)·y + β·B(z_{i−1}), K times over layers [start_layer, end_layer]; "
        "or each layer as K+1 Euler sub-steps"
    )
    recurrent = False
    edits_prompt = True
    strength_param = "beta"
    # Notes: greedy, 96 tokens, on the 8 example prompts; perplexity in docs/results/RESULTS.md.
    presets = (
        Preset(
            "visible effect",
            {},
            "the defaults (one extra pass over the middle third, half weight): changes all 8 example "
            "answers, first difference after 0–16 tokens; some words come out garbled "
            "(“Rayleigh Scavengeriller's law”)",
        ),
        Preset(
            "tuned for perplexity",
            {
                "start_layer": lambda n: round(0.27 * n),
                "end_layer": lambda n: round(0.47 * n),
                "loops": 2,
                "beta": 0.08451,
            },
            "found by `tune` on dev (26 trials): −0.61 % held-out perplexity (95% CI −0.83 to −0.36), the "
            "lowest of any strategy; changes 5 of the 8 example answers (first difference after 6–56 tokens)",
        ),
        Preset(
            "euler, tuned block",
            {
                "start_layer": lambda n: round(0.27 * n),
                "end_layer": lambda n: round(0.47 * n),
                "loops": 2,
                "beta": 0.08451,
                "mode": "euler",
            },
            "the same block and weight as damped Euler sub-steps (best of its own 20-trial search): −0.19 % "
            "held-out (95% CI −0.31 to −0.07); changes 6 of the 8 example answers",
        ),
        Preset(
            "euler, full weight",
            {"mode": "euler", "loops": 1, "beta": 1.0},
            "each middle layer as two half steps: changes all 8 example answers (first difference after 1–31 "
            "tokens) and keeps them more fluent than the defaults",
        ),
    )
    params = (
        Param("start_layer", int, lambda n: n // 3, "first decoder layer of the looped block", is_layer=True),
        Param(
            "end_layer",
            int,
            lambda n: (2 * n) // 3,
            "last decoder layer of the looped block",
            is_layer=True,
            at_least="start_layer",
        ),
        Param(
            "loops",
            int,
            1,
            "K: extra passes over the block (euler: K + 1 sub-steps per layer)",
            0,
            8,
            search=(1, 4),
        ),
        Param(
            "beta",
            float,
            0.5,
            "weight of the looped state against the plain one",
            0.0,
            1.0,
            search=(0.05, 1.0),
        ),
        Param(
            "mode",
            str,
            "loop",
            "loop: K extra passes of the block; euler: each layer in K + 1 damped sub-steps",
            choices=("loop", "euler"),
            search=("loop", "euler"),
        ),
    )

    @classmethod
    def check(cls, values: dict, num_layers: int) -> None:
        if values["start_layer"] > values["end_layer"]:
            raise FeedbackError(
                f"inner_loop: start_layer {values['start_layer']} is after end_layer {values['end_layer']}"
            )

    def reset(self) -> None:
        self.inputs: torch.Tensor | None = None  # the block's input for this row, this forward [T, H]
        self.calls: dict[int, LayerCall] = {}  # each block layer's own call for this row, this forward
        self.caches: list[Cache] = []  # one per extra pass (loop) or sub-step (euler)

    def check_model(self, model: nn.Module, layers: nn.ModuleList) -> None:
        for layer in self._block_layers():
            layer_signature(layers[layer])
        text = model.config.get_text_config(decoder=True)
        kinds = set(getattr(text, "layer_types", None) or ()) - KV_LAYER_TYPES
        if kinds:
            raise FeedbackError(
                f"inner_loop re-runs decoder layers with KV caches of its own, and this model has "
                f"{', '.join(sorted(kinds))} layers, whose state it cannot keep"
            )

    def pad_left(self, n: int) -> None:
        for cache in self.caches:  # each pass's keys stand where the model's own do
            shift_cache(cache, n)

    def extra_layer_passes(self) -> int:
        if self.values["loops"] == 0 or self.values["beta"] == 0:
            return 0
        k, width = self.values["loops"], len(self._block_layers())
        return (k if self.values["mode"] == "loop" else k + 1) * width

    def _block_layers(self) -> range:
        return range(self.values["start_layer"], self.values["end_layer"] + 1)

    def _register(self, model: nn.Module, layers: nn.ModuleList) -> None:
        for layer in self._block_layers():
            self.watch_call(layer, functools.partial(self._take_call, layer))
        self.edit_output(self.values["end_layer"], self._loop, whole=True)

    def _take_call(self, layer: int, states: torch.Tensor, call: LayerCall) -> None:
        if layer == self.values["start_layer"]:
            self.inputs = states
        self.calls[layer] = call

    def _cache(self, i: int) -> Cache | None:
        """Pass i's own KV cache, of the kind of the model's (None in a pass without one)."""
        model_cache = self.calls[self.values["start_layer"]].cache
        if self.phase == Phase.SEQUENCE or model_cache is None:  # one parallel pass over a text needs none
            return None
        while len(self.caches) <= i:
            self.caches.append(cache_like(model_cache))
        return self.caches[i]

    def _block(self, h: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        for layer in self._block_layers():
            h = self.run_layer(self.calls[layer], h, cache)
        return h

    def _loop(self, y: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        k, beta = self.values["loops"], self.values["beta"]
        if k == 0 or beta == 0 or self.inputs is None:
            return None
        if self.values["mode"] == "loop":
            z = y
            for i in range(k):
                z = (1 - beta) * y + beta * self._block(z, self._cache(i))
            return z
        n, h = k + 1, self.inputs
        for layer in self._block_layers():
            for i in range(n):
                h = h + (self.run_layer(self.calls[layer], h, self._cache(i)) - h) / n
        return (1 - beta) * y + beta * h
