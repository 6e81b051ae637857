"""The import contract (.importlinter) covers the whole library: `lint-imports`, run by the test
command, checks that layers import downward only and that no layer has a cycle; these tests check
that no package or top-level module of the library sits outside that contract."""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _contract() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    return config


def _lines(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip()]


def test_every_part_of_the_library_is_in_a_layer():
    layers = _lines(_contract()["importlinter:contract:layers"]["layers"])
    parts = {
        f"feedback.{p.stem}"
        for p in (ROOT / "feedback").glob("*.py")
        if p.stem not in ("__init__", "__main__")
    }
    parts |= {f"feedback.{p.parent.name}" for p in (ROOT / "feedback").glob("*/__init__.py")}
    assert parts - set(layers) == set(), "add it to a layer in .importlinter"
    assert layers[0] == "ui" and layers[-1] == "feedback.errors"


def test_every_package_with_modules_is_checked_for_cycles():
    ancestors = set(_lines(_contract()["importlinter:contract:acyclic"]["ancestors"]))
    packages = {f"feedback.{p.parent.name}" for p in (ROOT / "feedback").glob("*/__init__.py")} | {"ui"}
    packages |= {f"ui.{p.parent.name}" for p in (ROOT / "ui").glob("*/__init__.py")}
    assert packages - ancestors == set()


def test_every_ui_package_is_a_tab_or_the_page_and_tabs_import_no_other_tab():
    """The UI's contract: the layout over the tabs, each tab a package no other tab imports
    (independent siblings, `|`), over `ui.page`, what they share."""
    layers = _lines(_contract()["importlinter:contract:ui-tabs"]["layers"])
    assert (
        _lines(_contract()["importlinter:contract:ui-tabs"]["containers"]) == ["ui"] and layers[-1] == "page"
    )
    tabs = {name.strip() for name in layers[-2].split("|")}
    assert {p.parent.name for p in (ROOT / "ui").glob("*/__init__.py")} == tabs | {"page"}


def test_the_library_may_not_import_gradio():
    forbidden = _contract()["importlinter:contract:no-gradio"]
    assert _lines(forbidden["source_modules"]) == ["feedback"]
    assert {"gradio", "gradio_client"} <= set(_lines(forbidden["forbidden_modules"]))


def test_the_test_command_runs_the_contract():
    assert "lint-imports" in (ROOT / "tasks.py").read_text()
