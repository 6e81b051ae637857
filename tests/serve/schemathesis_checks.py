"""A schemathesis check for the HTTP API (loaded with SCHEMATHESIS_HOOKS by tests/serve/test_api.py).

`positive_data_acceptance` lets the POST routes and GET /strategies answer a schema-valid request with
422 (tests/serve/schemathesis.toml says why, route by route): the library refuses what a JSON schema
cannot state, answering `{"error": ...}`. A 422 that carries `details` comes from the request bodies
themselves, the pydantic models the schema is generated from: for a request schemathesis generated
as valid, that is the schema and the server disagreeing, and this check fails it.
"""

from __future__ import annotations

import schemathesis
from schemathesis.generation.meta import REQUEST_SHAPE_PROBES


@schemathesis.check
def schema_valid_request_passes_the_door(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 422:
        return None
    # a case is valid only when each part is: a coverage case may vary a query parameter validly
    # while its body is one drawn invalid
    if not all(component.mode.is_positive for component in meta.components.values()):
        return None
    if getattr(meta.phase.data, "scenario", None) in REQUEST_SHAPE_PROBES:  # malformed on purpose
        return None
    try:
        details = response.json().get("details")
    except (ValueError, AttributeError):
        return None
    if details:
        raise AssertionError(
            "a schema-valid request was refused by the API's request validation: "
            + "; ".join(f"{d.get('field')}: {d.get('message')}" for d in details)
        )
    return None
