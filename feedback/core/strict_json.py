"""Values made fit for strict JSON, for every layer that writes results out (the HTTP API, tuning logs)."""

from __future__ import annotations

import math
from typing import Any


def json_safe(value: Any) -> Any:
    """`value` with NaN and infinities (an undefined metric, a bootstrap that did not run) as None,
    through dicts, lists and tuples: strict JSON has no spelling for them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
