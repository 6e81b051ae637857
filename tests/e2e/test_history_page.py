"""The History tab in a real browser: it says its runs are loading until they come, never "no runs"
while the browser holds some, and Undo after Delete leaves the run chosen, so Reload takes it.

Headless Chromium drives the real app on the embedded model (the session fixture `app_url`). Each
test runs one short Compare run in a fresh context (its own local storage, so its own History); the
run's settings come from a link, so the test does not depend on where the page puts them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(
        f"browser e2e tests need Debian's chromium at {CHROMIUM} (not found)", allow_module_level=True
    )

from playwright.sync_api import Browser, Page, Route, expect  # noqa: E402

from feedback.core.records import RunConfig  # noqa: E402
from ui.compare import link  # noqa: E402
from ui.history.tab import EMPTY, LOADING  # noqa: E402

LOAD_TIMEOUT_MS = 30_000
RUN_TIMEOUT_MS = 90_000  # generous: the CPU may be shared with other jobs
expect.set_options(timeout=15_000)
SHORT_RUN = f"?{link.PARAM}={link.encode(RunConfig(prompt='Name a planet.', max_new_tokens=8).validate())}"
STORAGE_KEY = "feedback-lens-history"  # the page's BrowserState (ui.layout)
# Text shown in the History table after the click, each change seen (a MutationObserver: a state
# that lasts one frame is caught too)
WATCH_TABLE_JS = """() => {
  window.__seen = [];
  const look = () => {
    const el = document.querySelector("#history-table");
    const rows = el ? `${el.querySelectorAll("tr[data-id]").length} rows` : "";
    const text = el ? (el.querySelector(".fl-table-empty")?.textContent || rows) : "";
    if (text && window.__seen[window.__seen.length - 1] !== text) window.__seen.push(text);
  };
  new MutationObserver(look).observe(document.body, {childList: true, subtree: true, characterData: true});
}"""


@pytest.fixture()
def page(browser: Browser, app_url: str) -> Page:
    """A fresh context (own local storage, own Gradio session) with the app opened on SHORT_RUN's settings."""
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(LOAD_TIMEOUT_MS)
    pg.goto(app_url.rstrip("/") + "/" + SHORT_RUN)
    expect(pg.locator("#prompt textarea")).to_have_value("Name a planet.", timeout=LOAD_TIMEOUT_MS)
    expect(pg.locator("#generate")).to_be_enabled()
    yield pg
    context.close()


def run_once(pg: Page) -> None:
    """One Compare run, then its entry in this browser's History (written just after "Done"; the
    stored history changes then: the page stores an empty one when it loads)."""
    before = pg.evaluate("(key) => localStorage.getItem(key)", STORAGE_KEY)
    pg.locator("#generate").click()
    expect(pg.locator("#status")).to_contain_text("Done", timeout=RUN_TIMEOUT_MS)
    pg.wait_for_function("([key, before]) => localStorage.getItem(key) !== before", arg=[STORAGE_KEY, before])


def open_history(pg: Page) -> None:
    pg.get_by_role("tab", name="History").click()


def test_history_says_its_runs_are_loading_until_the_server_has_drawn_them(page: Page):
    run_once(page)
    held: list[Route] = []
    release = {"now": False}

    def hold(route: Route) -> None:
        route.continue_() if release["now"] else held.append(route)

    page.route("**/gradio_api/run/**", hold)  # the server's answers wait (queue=False: one request each)
    page.route("**/gradio_api/queue/join**", hold)
    open_history(page)
    expect(page.locator("#history-table")).to_contain_text(LOADING)
    for _ in range(100):  # until the request that carries the history (to be drawn) is held too
        if any('"created"' in (r.request.post_data or "") for r in held):
            break
        page.wait_for_timeout(100)
    else:
        pytest.fail("opening History sent no request with the history")
    expect(page.locator("#history-table")).to_contain_text(LOADING)  # still: it is waiting for that answer
    expect(page.locator("#history-note")).not_to_contain_text("run(s)")  # no count of runs not drawn yet
    release["now"] = True
    for route in held:
        route.continue_()
    expect(page.locator("#history-table tr[data-id]")).to_have_count(1)
    expect(page.locator("#history-note")).to_contain_text("1 run(s) stored")
    # Opened again with nothing new: the drawn table stays, no "loading" in between
    page.get_by_role("tab", name="Compare").click()
    page.evaluate(WATCH_TABLE_JS)
    open_history(page)
    expect(page.locator("#history-table tr[data-id]")).to_have_count(1)
    page.wait_for_timeout(500)  # the server's table has come by now (drawn again, the same)
    assert page.evaluate("() => window.__seen") in ([], ["1 rows"])


def test_a_new_browser_history_says_no_runs_yet(page: Page):
    page.evaluate(WATCH_TABLE_JS)
    open_history(page)
    expect(page.locator("#history-table")).to_contain_text(EMPTY)
    expect(page.locator("#history-note")).to_contain_text("0 run(s) stored")
    assert set(page.evaluate("() => window.__seen")) <= {EMPTY}  # nothing else on the way (no "loading" left)


def test_undo_after_delete_keeps_the_run_chosen_and_reload_takes_it(page: Page):
    run_once(page)
    open_history(page)
    expect(page.locator("#history-table tr[data-id]")).to_have_count(1)
    page.locator("#history-runs input").click()
    page.get_by_role("option").first.click()
    chosen = page.locator("#history-runs")
    expect(chosen).to_contain_text("Name a planet.")
    expect(page.locator("#history-rate-column input")).not_to_have_value("")  # the run's columns came
    page.locator("#history-delete").click()
    expect(page.locator("#history-status")).to_contain_text("Deleted 1 run")
    expect(page.locator("#history-table")).to_contain_text(EMPTY)
    page.locator("#history-undo").click()
    expect(page.locator("#history-status")).to_contain_text("Restored 1 run, chosen again.")
    expect(chosen).to_contain_text("Name a planet.")
    expect(page.locator("#history-rate-column input")).not_to_have_value("")
    page.locator("#history-reload").click()
    expect(page.get_by_role("tab", name="Compare")).to_have_attribute("aria-selected", "true")
    expect(page.locator("#status")).to_contain_text("Reloaded run")
    assert page.locator(".toast-body").filter(has_text="Error").count() == 0
