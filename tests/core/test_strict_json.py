"""Values made fit for strict JSON: undefined numbers become null, everything else is kept."""

from __future__ import annotations

import json
import math

from feedback.core.strict_json import json_safe


def test_nan_and_infinities_become_null_at_any_depth():
    value = {
        "ppl": math.nan,
        "ci95": (-math.inf, 1.5),
        "rows": [{"m": math.inf, "n": 2, "ok": True}],
        "s": "nan",
    }
    safe = json_safe(value)
    assert safe == {"ppl": None, "ci95": [None, 1.5], "rows": [{"m": None, "n": 2, "ok": True}], "s": "nan"}
    json.dumps(safe, allow_nan=False)  # strict JSON accepts it
    assert json_safe(0.25) == 0.25 and json_safe(None) is None
