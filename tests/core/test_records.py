"""The settings a row may have of its own instead of the run's (`ROW_OVERRIDES`): declared once, each
a RowSpec field standing in for a RunConfig setting of the same type, and read from there."""

from __future__ import annotations

from dataclasses import fields, replace

from feedback.core.records import ROW_OVERRIDES, DeepConfConfig, RowSpec, RunConfig
from feedback.core.sampling import SamplingConfig

# RowSpec's fields that default to None without standing in for a setting of the run
NOT_OVERRIDES = {"strategy", "messages", "prefix"}
SETTINGS = {"": RunConfig, "sampling": SamplingConfig, "deepconf": DeepConfConfig}  # a path's dataclass


def _run_field(path: str):
    where, _, name = path.rpartition(".")
    return {f.name: f for f in fields(SETTINGS[where])}[name]  # KeyError: the path names no setting


def test_every_override_is_a_row_field_of_the_run_setting_s_type_that_none_leaves_to_the_run():
    row = {f.name: f for f in fields(RowSpec)}
    names = [name for name, _ in ROW_OVERRIDES]
    assert len(set(names)) == len(names)
    for name, path in ROW_OVERRIDES:
        assert row[name].default is None, name
        run_type = _run_field(path).type  # annotations as text (from __future__ import annotations)
        assert row[name].type == (run_type if run_type.endswith("| None") else f"{run_type} | None"), name


def test_a_new_optional_row_field_is_declared_an_override_or_not():
    optional = {f.name for f in fields(RowSpec) if f.default is None}
    assert optional - NOT_OVERRIDES == {name for name, _ in ROW_OVERRIDES}
    assert NOT_OVERRIDES <= optional


def test_a_row_samples_with_its_own_sampling_overrides_and_the_run_s_other_settings():
    shared = SamplingConfig(temperature=0.7, top_k=40, top_p=0.9, min_p=0.01, repetition_penalty=1.1)
    assert RowSpec("r").sampling(shared) == shared
    own = {"temperature": 0.0, "top_p": 0.5}
    sampled = {path.removeprefix("sampling.") for _, path in ROW_OVERRIDES if path.startswith("sampling.")}
    assert sampled == set(own)  # each is applied below; a new one needs a value here
    assert RowSpec("r", **own).sampling(shared) == replace(shared, **own)


def test_a_row_s_own_seed_replaces_the_run_s_and_keeps_its_offset():
    assert RowSpec("r", seed_offset=2).seed_for(9) == 11
    assert RowSpec("r", seed=5, seed_offset=2).seed_for(9) == 7
