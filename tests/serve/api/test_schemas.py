"""What the published schema states agrees with what the library takes, read as schemathesis reads
a schema (jsonschema_rs, its validator)."""

from __future__ import annotations

import itertools
import re
import sys
from dataclasses import MISSING, fields

import jsonschema_rs
import pytest
from pydantic import ValidationError

from feedback.core.records import ROW_OVERRIDES, RUN_ID_PATTERN, RowSpec, _run_id
from feedback.errors import FeedbackError
from feedback.serve.api.schemas import NOT_BLANK, STRATEGY_GRAMMAR, GenerateIn, RowIn
from feedback.strategies import REGISTRY, get_strategy

SPACES = [
    "",
    " ",
    "\t",
    "\n",
    "\x1c",
    "\x85",
    "\u3000",
    "\ufeff",
]  # \x1c and \x85: Python's only; \ufeff: ECMA's only


def _taken(name: str) -> bool:
    try:
        get_strategy(name)
        return True
    except FeedbackError:
        return False


def test_the_strategy_grammar_is_exactly_the_names_the_library_takes():
    grammar = jsonschema_rs.Draft202012Validator({"type": "string", **STRATEGY_GRAMMAR})
    names = [*sorted(REGISTRY), "nope", ""]
    cases = {
        "+".join(f"{a}{n}{b}" for n, a, b in zip(combo, SPACES, reversed(SPACES)))
        for k in (1, 2, 3)
        for combo in itertools.product(names, repeat=k)
    }
    cases |= {"deep_cache+deep_cachex", "inner_loop + deep_cache", "residual+", "+residual", "a++b"}
    assert len(cases) > 500
    assert [c for c in cases if grammar.is_valid(c) != _taken(c)] == []


def test_blank_is_what_str_strip_removes_in_every_reading():
    blank = jsonschema_rs.Draft202012Validator({"type": "string", **NOT_BLANK})
    every_space = "".join(c for c in map(chr, range(sys.maxunicode + 1)) if c.isspace())
    assert not blank.is_valid(every_space) and not blank.is_valid("")
    assert all(blank.is_valid(f" {c} ") for c in ("x", "\ufeff", "\u200b"))  # not whitespace to Python


def test_a_run_id_is_what_the_server_gives():
    assert all(re.fullmatch(RUN_ID_PATTERN.strip("^$"), _run_id()) for _ in range(100))


@pytest.mark.parametrize("value, taken", [(2, True), (2.0, True), (True, False), ("2", False), (2.5, False)])
def test_an_integer_is_what_json_schema_calls_one(value, taken):
    body = {"prompt": "hi", "max_new_tokens": value}
    if taken:
        assert GenerateIn.model_validate(body).max_new_tokens == 2
    else:
        with pytest.raises(ValidationError, match="max_new_tokens"):
            GenerateIn.model_validate(body)


REQUIRED_IN_THE_API = {"name"}  # a request names each row; "baseline" is only the library's default


def test_the_api_row_has_the_library_row_s_fields_and_defaults():
    spec = {f.name: f for f in fields(RowSpec)}
    api = RowIn.model_fields
    assert set(api) == set(spec), (
        f"only in RowIn: {sorted(set(api) - set(spec))}, only in RowSpec: {sorted(set(spec) - set(api))}"
    )
    for name, f in api.items():
        if name in REQUIRED_IN_THE_API:
            assert f.is_required(), name
        else:
            library = (
                spec[name].default_factory()
                if spec[name].default_factory is not MISSING
                else spec[name].default
            )
            assert f.get_default(call_default_factory=True) == library, name
    assert RowSpec(**RowIn(name="r").model_dump()) == RowSpec("r")


def test_each_setting_a_row_may_override_is_null_for_the_run_s():
    for name, path in ROW_OVERRIDES:
        assert getattr(RowIn.model_validate({"name": "r", name: None}), name) is None
        assert RowIn.model_fields[name].description.endswith(f"null: the run's `{path}`"), name
