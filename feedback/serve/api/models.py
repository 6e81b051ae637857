"""GET /health, /models and /strategies: what the server is doing and what it offers."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query

from feedback.serve.api.deps import Pool, require_key
from feedback.serve.api.schemas import ERRORS, StrategyName
from feedback.strategies import REGISTRY, SEP, get_strategy

router = APIRouter()
keyed = {"dependencies": [Depends(require_key)], "responses": ERRORS}


@router.get("/health", summary="liveness and load (no key needed)")
def health(pool: Pool) -> dict:
    """The line's counts (runs holding the model, waiting, the most that may run together and the
    memory they may hold), and per loaded model the rows decoding together now."""
    loaded = pool.loaded()
    decoding = {name: lm.decoder.status() for name, lm in loaded.items() if lm.decoder is not None}
    return {"status": "ok", **pool.gate.status(), "models_loaded": sorted(loaded), "decoding": decoding}


@router.get("/models", summary="the model allowlist", **keyed)
def models(pool: Pool) -> dict:
    loaded = pool.loaded()
    out = []
    for name in pool.allowlist:
        entry: dict = {"name": name, "default": name == pool.default, "loaded": name in loaded}
        if name in loaded:
            lm = loaded[name]
            entry |= {
                "dtype": lm.dtype,
                "device": str(lm.device),
                "layers": lm.num_layers,
                "context_length": lm.context_length,
            }
        out.append(entry)
    return {"default": pool.default, "models": out}


@router.get("/strategies", summary="feedback strategies and parameter schemas", **keyed)
def strategies(
    pool: Pool,
    model: str | None = Query(None, description="layer bounds are this model's; default model if null"),
    stack: StrategyName | None = Query(
        None,
        description="also the schema of this stack (strategies joined by '+', e.g. inner_loop+deep_cache)",
    ),
) -> dict:
    lm = pool.get(model)
    out = {
        "model": lm.name,
        "layers": lm.num_layers,
        "strategies": [cls.schema(lm.num_layers) for cls in REGISTRY.values()],
        "stacking": f"join hidden-state strategies with '{SEP}' to apply them in that order on one row; "
        "the stack's parameters are its members', named <strategy>.<param>",
    }
    if stack is not None:
        out["stack"] = get_strategy(stack).schema(lm.num_layers)
    return out
