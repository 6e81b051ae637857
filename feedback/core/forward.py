"""A forward with hooks, and the windowed scoring built on it.

`hooked_forward` is the one way model code runs a forward while strategies' hooks are live: the
engine's prefill and decode steps, perplexity windows and the quality metrics all call it. The
window scorers give per-token negative log-likelihoods of a token window three ways (one parallel
pass, a chunked prefill on a KV cache, or token by token as in generation); perplexity and the
quality metrics both score through them.
"""

from __future__ import annotations

import threading

import torch
from transformers import DynamicCache

from feedback.core import threads
from feedback.core.model import LoadedModel
from feedback.errors import check_stop
from feedback.strategies import BatchView, Phase


def attach(lm: LoadedModel, batch: BatchView, strategies: dict) -> None:
    """Each strategy's hooks on its row (`strategies`: row id -> strategy), attached between forwards:
    another thread's forward on this model may be in flight, and its hooks are read as it runs."""
    with lm.forward_lock:
        for row, strategy in strategies.items():
            strategy.attach(lm.model, lm.layers, row, batch)


def detach(lm: LoadedModel, strategies) -> None:
    """Every hook of `strategies` removed, between forwards (as `attach` put them)."""
    with lm.forward_lock:
        for strategy in strategies:
            strategy.detach()


def _tokens(inputs: dict) -> int:
    """Tokens a forward takes in: rows x positions of its ids (or embeddings)."""
    given = inputs.get("input_ids")
    if given is None:
        return int(inputs["inputs_embeds"].shape[:-1].numel())
    return given.numel()


def hooked_forward(lm: LoadedModel, batch: BatchView, strategies, **inputs):
    """One forward pass with `batch`'s hooks active (forwards on a model are serialised, so other
    runs' hooks stay inactive), then each strategy's end-of-forward update. When `batch.stop` is
    set, the forward looks at it before every decoder layer and ends (raising `Stopped`) once it is
    set: long single forwards (a perplexity window) end within a layer, not a window."""
    with lm.forward_lock, threads.decoding(lm.decode_threads, _tokens(inputs)):
        batch.active = True
        checks = (
            [layer.register_forward_pre_hook(lambda *_: batch.check_stop()) for layer in lm.layers]
            if batch.stop is not None
            else []
        )
        try:
            out = lm.model(**inputs)
        finally:
            batch.active = False
            for handle in checks:
                handle.remove()
    for strategy in strategies:
        strategy.end_forward()
    return out


def shared_forward(lm: LoadedModel, views: list[BatchView], strategies, **inputs):
    """One decode forward shared by several runs' rows: each run's `views` entry places its rows in
    the batch (its `live_rows`, None at the others' places), and every view's hooks act at once, on
    their own rows; then each strategy's end-of-forward update."""
    with lm.forward_lock, threads.decoding(lm.decode_threads, _tokens(inputs)):
        for view in views:
            view.together, view.active = views, True
        try:
            out = lm.model(**inputs)
        finally:
            for view in views:
                view.together, view.active = None, False
    for strategy in strategies:
        strategy.end_forward()
    return out


def nll_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position negative log-likelihood of `targets` [T] under `logits` [T, V] (fp32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -logp.gather(1, targets[:, None])[:, 0]


def window_logits_parallel(
    lm: LoadedModel, ids: torch.Tensor, strategy, passes: int, stop: threading.Event | None = None
) -> torch.Tensor:
    """The logits that predict ids[1:] after `passes` full-sequence forwards (the strategy, if any,
    on row 0); `stop` is checked before each pass and, inside one, between layers."""
    batch = BatchView(Phase.SEQUENCE, [0], stop=stop)
    strategies = [strategy] if strategy else []
    attach(lm, batch, dict(enumerate(strategies)))
    try:
        with torch.inference_mode():
            for _ in range(passes):
                check_stop(stop, "the perplexity evaluation")
                out = hooked_forward(lm, batch, strategies, input_ids=ids[None], use_cache=False)
            return out.logits[0, :-1]
    finally:
        detach(lm, strategies)


def window_nll_parallel(
    lm: LoadedModel, ids: torch.Tensor, strategy, passes: int, stop: threading.Event | None = None
) -> torch.Tensor:
    """NLL of ids[1:] from `passes` full-sequence forwards (`window_logits_parallel`)."""
    return nll_of(window_logits_parallel(lm, ids, strategy, passes, stop), ids[1:])


def window_nll_chunked(
    lm: LoadedModel, ids: torch.Tensor, chunk: int, stop: threading.Event | None = None
) -> torch.Tensor:
    """Baseline NLL of ids[1:] with a chunked prefill: `chunk` tokens per forward on a growing KV
    cache, so peak memory for logits is [chunk, V] rather than [window, V]; `stop` is checked
    before each chunk and between its layers."""
    batch = BatchView(Phase.SEQUENCE, [], stop=stop)
    nll = []
    with torch.inference_mode():
        cache = DynamicCache(config=lm.model.config)
        for start in range(0, ids.shape[0] - 1, chunk):
            check_stop(stop, "the perplexity evaluation")
            piece = ids[start : start + chunk]
            out = hooked_forward(lm, batch, [], input_ids=piece[None], cache=cache, use_cache=True)
            targets = ids[start + 1 : start + 1 + piece.shape[0]]
            nll.append(nll_of(out.logits[0, : targets.shape[0]], targets))
    return torch.cat(nll)


def continuation_nll(
    lm: LoadedModel,
    cache,
    last_logits: torch.Tensor,
    ids: torch.Tensor,
    chunk: int,
    stop: threading.Event | None = None,
) -> torch.Tensor:
    """Baseline NLL of every token of `ids` [T] read after a prompt already in `cache` (one row),
    whose last position's logits are `last_logits` [V]: the first token is scored by those, the
    rest by forwards of `chunk` tokens on the cache; `stop` is checked before each chunk and between
    its layers."""
    batch = BatchView(Phase.SEQUENCE, [], stop=stop)
    nll = [nll_of(last_logits[None], ids[:1])]
    with torch.inference_mode():
        for start in range(0, ids.shape[0] - 1, chunk):
            check_stop(stop, "the self-perplexity")
            piece = ids[
                start : min(start + chunk, ids.shape[0] - 1)
            ]  # the last token predicts nothing scored
            out = hooked_forward(lm, batch, [], input_ids=piece[None], cache=cache, use_cache=True)
            targets = ids[start + 1 : start + 1 + piece.shape[0]]
            nll.append(nll_of(out.logits[0, : targets.shape[0]], targets))
    return torch.cat(nll)


def window_logits_exact(
    lm: LoadedModel, ids: torch.Tensor, strategy, stop: threading.Event | None = None
) -> torch.Tensor:
    """The logits that predict ids[1:], decoding token by token with the KV cache, exactly as in
    generation; checks `stop` at every token (this mode is slow, ~1 forward per token)."""
    batch = BatchView(Phase.PREFILL, [0])
    attach(lm, batch, {0: strategy})
    try:
        with torch.inference_mode():
            cache = DynamicCache(config=lm.model.config)
            out = hooked_forward(lm, batch, [strategy], input_ids=ids[None, :1], cache=cache, use_cache=True)
            logits = [out.logits[0, -1]]
            batch.phase = Phase.DECODE
            for t in range(1, ids.shape[0] - 1):
                check_stop(stop, "the perplexity evaluation")
                out = hooked_forward(
                    lm, batch, [strategy], input_ids=ids[None, t : t + 1], cache=cache, use_cache=True
                )
                logits.append(out.logits[0, -1])
            return torch.stack(logits)
    finally:
        detach(lm, [strategy])


def window_nll_exact(
    lm: LoadedModel, ids: torch.Tensor, strategy, stop: threading.Event | None = None
) -> torch.Tensor:
    """NLL of ids[1:] decoding token by token (`window_logits_exact`)."""
    return nll_of(window_logits_exact(lm, ids, strategy, stop), ids[1:])
