"""What the other tabs hand to Compare, typed here so that no tab imports another (tabs import only
`ui.page`; the page's layout, `ui.layout`, gives each tab the Compare tab it sends to).

The Sweep tab sends its best point into a Compare column ("Send best to Compare") and the History
tab reloads a stored run into Compare; both then switch the page's tabs to Compare's (`COMPARE_TAB`)."""

from __future__ import annotations

from typing import Any, Protocol

COMPARE_TAB = "compare"  # the Compare tab's id among the page's tabs


class CompareTarget(Protocol):
    """The Compare tab as the tabs that hand it something see it (`ui.compare.tab.CompareTab`)."""

    # its components (`ui.compare.layout.CompareControls`): the columns, settings, status line, outputs
    ui: Any

    def show_strategy(self, column: int, strategy: str, params: dict, name: str) -> dict:
        """Column `column` (0-based) on `strategy` with `params`, named `name`: the updates, by component."""
        ...

    def restore(self, data: dict, view: str | None = None) -> dict:
        """Every control and output as the stored run `data` had them: the updates, by component."""
        ...

    def restore_outputs(self) -> list:
        """Everything `restore` may update."""
        ...
