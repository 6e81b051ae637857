"""Real-browser end-to-end tests: headless Chromium drives the running app as a person would.

The app is the real one on the embedded model (the session fixture `app_server`), talked to only on
127.0.0.1. Timings are taken inside the page (click listener + MutationObserver, `performance.now()`)
and written to test-output/e2e-metrics.json; screenshots (1440 px and 390 px, light and dark) go to
test-output/.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(
        f"browser e2e tests need Debian's chromium at {CHROMIUM} (not found)", allow_module_level=True
    )

from playwright.sync_api import Browser, Page, expect  # noqa: E402

from tests.polling import wait_for  # noqa: E402
from ui.page import history  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "test-output"
METRICS = OUT / "e2e-metrics.json"
DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"  # FEEDBACK_SCREENSHOTS=1 writes here
LOAD_TIMEOUT_MS = 30_000
RUN_TIMEOUT_MS = 90_000  # generous: the CPU may be shared with other jobs
# Every answer the page waits for (a column added, a control shown) comes from the server, which the
# suite's other worker shares the CPU with: Playwright's 5 s default was once too short for a column.
expect.set_options(timeout=15_000)
ANSWER_TOKENS = 48

# In-page timers: the moment of a button click and the first DOM state matching a condition.
NEXT_BOARD_JS = """
(column) => {
  // the column's element now: the next run's board replaces it (its first tokens and the next
  // ones can arrive in one update, so the count alone need not drop where anyone sees it)
  window.__flOldColumn = document.getElementById(`${column}-text`);
}
"""

TIMERS_JS = """
() => {
  window.__fl = {clicks: {}, seen: {}};
  for (const id of ["generate", "stop"]) {
    document.addEventListener("click", (e) => {
      if (e.target.closest("#" + id)) window.__fl.clicks[id] = performance.now();
    }, true);
  }
  const watch = (name, check) => {
    const obs = new MutationObserver(() => {
      if (window.__fl.seen[name] === undefined && check()) window.__fl.seen[name] = performance.now();
    });
    obs.observe(document.body, {childList: true, subtree: true, characterData: true});
  };
  watch("first_token", () => document.querySelector("#col1-text .fl-tok") !== null);
  // the tokens a column showed when its Stop was clicked, and column 1's at the main Stop
  document.addEventListener("click", (e) => {
    const stop = e.target.closest && e.target.closest(".fl-col-stop");
    if (stop) window.__fl.column_stop_shown =\
 document.querySelectorAll(`#col${stop.dataset.column}-text .fl-tok`).length;
    if (e.target.closest && e.target.closest("#stop")) window.__fl.stop_shown =\
 document.querySelectorAll("#col1-text .fl-tok").length;
  }, true);
  watch("done", () => (document.querySelector("#status")?.textContent || "").includes("Done"));
  // the chart holding points while the run is still going (a run can end within the time between
  // two of the test's own waits, so the page notes it when it happens)
  new MutationObserver((_, obs) => {
    const points = document.querySelector("#conf-plot .js-plotly-plot")?.data?.[0]?.x?.length || 0;
    const done = (document.querySelector("#status")?.textContent || "").includes("Done");
    if (points > 0 && !done) { window.__fl.seen.chart_while_running = performance.now(); obs.disconnect(); }
  }).observe(document.body, {childList: true, subtree: true, characterData: true, attributes: true});
  // column 1's largest growth in one update: how many tokens one streamed update carries here
  window.__fl.col1 = {last: 0, most: 0};
  new MutationObserver(() => {
    const n = document.querySelectorAll("#col1-text .fl-tok").length, c = window.__fl.col1;
    if (n > c.last) { c.most = Math.max(c.most, n - c.last); c.last = n; }
  }).observe(document.body, {childList: true, subtree: true});
}
"""


# "Error" badges a person can see in the output area (an element with opacity 0 somewhere above it is
# not seen).
SHOWN_ERROR_BADGES = """
() => Array.from(document.querySelectorAll('#columns *, #conf-plot *, #mem-plot *'))
  .filter(e => e.children.length === 0 && e.textContent.trim() === 'Error')
  .filter(e => { for (let x = e; x; x = x.parentElement) {\
 if (getComputedStyle(x).opacity === '0') return false; }
                 return true; }).length
"""


def save_metrics(**values: float) -> dict:
    """Merge `values` into test-output/e2e-metrics.json and print the whole file."""
    OUT.mkdir(exist_ok=True)
    data = json.loads(METRICS.read_text(encoding="utf-8")) if METRICS.exists() else {}
    data.update({k: round(v, 3) for k, v in values.items()})
    METRICS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"\ne2e metrics ({METRICS}): {json.dumps(data, sort_keys=True)}")
    return data


# Screenshots to look at (1440 and 390 px, light and dark) are written to test-output/ only when
# FEEDBACK_SCREENSHOTS is set (with docs/images/compare.png, the README's picture): a full-page
# screenshot takes ~2 s, and nothing in the suite reads them.
SCREENSHOTS = bool(os.environ.get("FEEDBACK_SCREENSHOTS"))


def shot(page: Page, name: str, full: bool = True, element: str | None = None) -> None:
    """A screenshot of the page (or of one element) into test-output/, when FEEDBACK_SCREENSHOTS is set."""
    if not SCREENSHOTS:
        return
    OUT.mkdir(exist_ok=True)
    path = str(OUT / f"e2e-{name}.png")
    if element:
        page.locator(element).screenshot(path=path)
    else:
        page.screenshot(path=path, full_page=full)


def health(url: str) -> dict:
    return httpx.get(f"{url.rstrip('/')}/api/health", timeout=10).json()


def wait_idle(url: str, within_s: float) -> float:
    """Seconds until the model line is free (nothing running, nothing waiting); fails past `within_s`."""
    t0 = time.monotonic()
    while True:
        h = health(url)
        if h["running"] == 0 and h["waiting"] == 0:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within_s, h
        time.sleep(0.2)


def open_app(browser: Browser, url: str, width: int = 1440, scheme: str = "light", touch: bool = False):
    context = browser.new_context(
        viewport={"width": width, "height": 900 if width > 500 else 844},
        color_scheme=scheme,
        has_touch=touch,
        is_mobile=touch,
    )
    pg = context.new_page()
    pg.set_default_timeout(LOAD_TIMEOUT_MS)
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.goto(url)
    expect(pg.locator("#prompt textarea")).to_be_editable(timeout=LOAD_TIMEOUT_MS)
    expect(pg.locator("#generate")).to_be_enabled()
    expect(pg.locator("#stop")).to_be_disabled()
    pg.errors = errors
    return context, pg


@pytest.fixture()
def page(browser: Browser, app_url: str, request) -> Page:
    """A fresh context (own local storage, own Gradio session) with the app loaded; a screenshot of
    the page is saved to test-output/ when the test fails."""
    context, pg = open_app(browser, app_url)
    pg.evaluate(TIMERS_JS)
    failed_before = request.session.testsfailed
    yield pg
    if request.session.testsfailed > failed_before:
        shot(pg, f"failed-{request.node.name}")
        print(f"\nscreenshot of the failed page saved; page errors: {pg.errors}")
    context.close()


def spans(pg: Page, column: str):
    return pg.locator(f"#{column}-text .fl-tok")


def metric_cell(pg: Page, column: str, label: str):
    """One column's value of a metric in the metrics table (a row per metric, a column per column)."""
    row = pg.locator("#metrics tbody tr").filter(has=pg.locator("th", has_text=label)).first
    return row.locator("td").nth(int(column.removeprefix("col")) - 1)


def stop_cell(pg: Page, column: str):
    return metric_cell(pg, column, "stop")


def accordion(pg: Page, title: str) -> None:
    pg.locator("button.label-wrap").filter(has_text=title).click()


def settings(pg: Page, tab: str) -> None:
    """Compare's settings on one of their tabs ("Columns", "Model and sampling", "DeepConf", "System
    prompt and evaluation"), the Settings box opened first if it is closed."""
    tabs = pg.locator("#settings-tabs")
    if not tabs.is_visible():
        pg.locator("#settings button.label-wrap").first.click()
        expect(tabs).to_be_visible()
    tabs.get_by_role("tab", name=tab, exact=True).first.click()


def close_settings(pg: Page) -> None:
    if pg.locator("#settings-tabs").is_visible():
        pg.locator("#settings button.label-wrap").first.click()
        expect(pg.locator("#settings-tabs")).to_be_hidden()


def set_number(pg: Page, elem_id: str, value) -> None:
    """Type a number as a person does. A field that has just appeared (an accordion opening) can
    still be taking its stored value when the first keystrokes land; then it is typed again."""
    field = pg.locator(f"#{elem_id} input").first
    expect(field).to_be_visible()
    for _ in range(4):
        field.fill(str(value))
        field.press("Tab")
        try:
            expect(field).to_have_value(str(value), timeout=2_000)
            # on a loaded machine the field can finish mounting after the check and put its stored
            # value back (the run then used the old one): the typed value must still be there a moment later
            pg.wait_for_timeout(400)
            expect(field).to_have_value(str(value), timeout=100)
            return
        except AssertionError:
            pass
    expect(field).to_have_value(str(value))


def choose(pg: Page, elem_id: str, option: str) -> None:
    """Pick an option of a Gradio dropdown as a person does: open it, click the option."""
    pg.locator(f"#{elem_id} input").click()
    pg.get_by_role("option", name=option, exact=False).first.click()
    expect(pg.locator(f"#{elem_id} input")).to_have_value(option)


def column_settings(pg: Page, n: int) -> None:
    """Column n's settings (its tab under Settings, Columns); waits for its name box."""
    settings(pg, "Columns")
    pg.locator("#column-tabs").get_by_role("tab", name=f"Column {n}", exact=True).click()
    expect(pg.locator(f"#col{n}-name")).to_be_visible()


def radio(pg: Page, elem_id: str, label: str) -> None:
    pg.locator(f"#{elem_id} label").filter(has_text=label).first.click()


def generate(pg: Page, prompt: str, tokens: int = ANSWER_TOKENS) -> None:
    settings(pg, "Model and sampling")
    set_number(pg, "max-new-tokens", tokens)
    close_settings(pg)
    pg.locator("#prompt textarea").fill(prompt)
    pg.locator("#generate").click()
    expect(pg.locator("#status")).to_contain_text("Done in", timeout=RUN_TIMEOUT_MS)


def streamed_bytes(page: Page) -> dict:
    """Bytes the page receives on Gradio's event stream (the streamed updates), counted by the browser."""
    cdp = page.context.new_cdp_session(page)
    cdp.send("Network.enable")
    got, urls = {"bytes": 0}, {}
    cdp.on("Network.responseReceived", lambda e: urls.__setitem__(e["requestId"], e["response"]["url"]))
    cdp.on(
        "Network.dataReceived",
        lambda e: (
            got.__setitem__("bytes", got["bytes"] + e["dataLength"])
            if "queue/data" in urls.get(e["requestId"], "")
            else None
        ),
    )
    return got


# Element ids used more than once in the page (every tab's, hidden or not); Plotly's own style tag
# (one per chart) and Gradio's icon symbols repeat theirs
DUPLICATE_IDS = """() => {
  const seen = {}, theirs = new Set(['', 'symbol', 'plotly.js-style-global']);
  document.querySelectorAll('[id]').forEach((e) => {\
 if (!theirs.has(e.id)) seen[e.id] = (seen[e.id] || 0) + 1; });
  return Object.keys(seen).filter((id) => seen[id] > 1);
}"""


def test_generate_streams_both_columns_with_charts_cards_and_headings(page: Page, app_url: str):
    assert page.evaluate(DUPLICATE_IDS) == []
    settings(page, "Model and sampling")
    set_number(page, "max-new-tokens", ANSWER_TOKENS)
    close_settings(page)
    page.locator("#prompt textarea").fill("Write a four-line poem about a lighthouse in winter.")
    received = streamed_bytes(page)
    page.locator("#generate").click()

    # Streaming: the first coloured token and the chart's first points show up while the run is
    # still going (the page notes when each happened: a fast run can end between two waits here).
    expect(page.locator("#status")).to_contain_text("Done in", timeout=RUN_TIMEOUT_MS)
    seen = page.evaluate("() => ({...window.__fl.seen, click: window.__fl.clicks.generate})")
    assert seen["click"] < seen["first_token"] < seen["done"], seen
    assert seen["click"] < seen.get("chart_while_running", 0) < seen["done"], seen
    ttft = (seen["first_token"] - seen["click"]) / 1000
    assert 0 < ttft < 30, ttft

    status = page.locator("#status").inner_text()
    assert "UI build" not in status and "ms" not in status  # no developer timings for users
    # at 1440 x 900 the answers are on screen after Generate, without scrolling: 200 px of them at least
    assert page.evaluate("() => window.scrollY") == 0
    assert page.locator("#col1-text").bounding_box()["y"] < 900 - 200, page.locator(
        "#col1-text"
    ).bounding_box()
    # Each update carries the new tokens' events, not every column's text and the whole chart again
    # (4 columns x 128 tokens: 285 kB a step when it did; ~11 kB for 2 x 48 with appended HTML; the
    # events and the run's JSON at its end: ~2.5 kB a step here)
    per_step = received["bytes"] / ANSWER_TOKENS
    save_metrics(streamed_kb_per_step_2x48=per_step / 1000)
    assert per_step < 8_000, per_step
    expect(page.locator("#generate")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()
    for column in ("col1", "col2"):
        expect(spans(page, column).first).to_be_visible()
        expect(page.locator(f"#{column}-text .fl-live")).to_have_count(0)  # finished: no cursor
        expect(metric_cell(page, column, "tokens/s")).not_to_have_text("—")
        expect(stop_cell(page, column)).not_to_have_text("running…")
    # The page starts on the preset that shows a difference, and the headings say what made each column.
    expect(page.locator("#col2-title")).to_contain_text("residual")
    expect(page.locator("#col2-title")).to_contain_text("alpha=0.1")
    expect(page.locator("#col1-title")).to_contain_text("no feedback")
    assert "differ at step" in status
    expect(page.locator("#col1-text .fl-diverge")).to_have_count(1)  # the text marks where they split
    expect(page.locator("#col2-text .fl-diverge")).to_have_count(1)
    n_base = spans(page, "col1").count()
    assert 5 <= n_base <= ANSWER_TOKENS
    expect(metric_cell(page, "col1", "tokens")).to_have_text(str(n_base))
    expect(page.locator("#metrics thead th")).to_have_count(3)  # "metric", then one per column
    expect(page.locator("#confidence-legend")).to_contain_text("very uncertain")

    # Confidence chart: Plotly drew a token-conf and a group-conf trace for each row.
    chart = page.locator("#conf-plot .js-plotly-plot")
    expect(chart).to_be_visible()
    page.wait_for_function(
        "() => document.querySelectorAll('#conf-plot .js-plotly-plot .scatterlayer .trace').length >= 4",
        timeout=10_000,
    )
    legend = " | ".join(chart.locator(".legendtext").all_text_contents())
    for name in ("Baseline token conf", "Baseline group conf", "Feedback token conf", "Feedback group conf"):
        assert name in legend, legend
    expect(page.locator("#mem-plot")).to_contain_text("seconds since the run began")

    # The run's JSON is built when its accordion opens (not kept as a tree after every run).
    expect(page.locator("#run-json-view")).to_have_count(0)
    page.locator("#run-json-box").get_by_text("Run result (JSON)").click()
    expect(page.locator("#run-json-view")).to_contain_text("first_divergence_step")
    page.locator("#run-json-box").get_by_text("Run result (JSON)").click()

    # Hover a token: a styled detail card with the numbers and the top-5 alternatives.
    token = spans(page, "col2").nth(2)
    token.hover()
    card = page.locator("#fl-card.fl-open")
    expect(card).to_be_visible()
    for word in ("probability", "confidence", "entropy", "top-5"):
        expect(card).to_contain_text(word)
    page.mouse.move(5, 5)
    expect(card).to_have_count(0)

    # The plain view: the same text without colours or cards, switched in the page (no server call);
    # then back.
    coloured = {c: "".join(spans(page, c).all_text_contents()) for c in ("col1", "col2")}
    radio(page, "token-view", "plain")
    expect(page.locator(".fl-board.fl-view-plain")).to_have_count(1)
    for column in ("col1", "col2"):
        assert (
            spans(page, column).first.evaluate("(e) => getComputedStyle(e).backgroundColor")
            == "rgba(0, 0, 0, 0)"
        )
        body = page.locator(f"#{column}-text .fl-text").first
        assert body.text_content().replace("differs from here", "") == coloured[column]
    spans(page, "col2").nth(2).hover()
    expect(page.locator("#fl-card.fl-open")).to_have_count(0)  # no cards in the plain view
    radio(page, "token-view", "confidence")
    expect(spans(page, "col1")).to_have_count(n_base, timeout=10_000)
    shot(page, "compare-1440-light")
    assert page.errors == []
    column_settings(page, 2)
    assert help_contrast(page, "#c2-residual-alpha") >= 4.5  # WCAG AA for the help under a control
    save_metrics(click_to_first_token_s=ttft)


HELP_COLOURS = """
(selector) => {
  const info = document.querySelector(selector + ' .info-text');
  let opacity = 1;
  for (let x = info; x; x = x.parentElement) opacity *= parseFloat(getComputedStyle(x).opacity);
  let bg = null;
  for (let x = info; x && !bg; x = x.parentElement) {
    const c = getComputedStyle(x).backgroundColor;
    if (c !== 'rgba(0, 0, 0, 0)' && c !== 'transparent') bg = c;
  }
  return {fg: getComputedStyle(info).color, opacity, bg: bg || 'rgb(255, 255, 255)'};
}
"""


def help_contrast(pg: Page, selector: str) -> float:
    """WCAG contrast ratio of a control's help text against what is behind it."""
    c = pg.evaluate(HELP_COLOURS, selector)

    def rgb(css: str) -> list[float]:
        return [float(x) for x in css[css.index("(") + 1 : css.index(")")].split(",")[:3]]

    fg, bg = rgb(c["fg"]), rgb(c["bg"])
    fg = [c["opacity"] * f + (1 - c["opacity"]) * b for f, b in zip(fg, bg)]

    def luminance(v: list[float]) -> float:
        lin = [x / 255 / 12.92 if x / 255 <= 0.03928 else ((x / 255 + 0.055) / 1.055) ** 2.4 for x in v]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted([luminance(fg), luminance(bg)], reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_stop_ends_a_long_generation(page: Page, app_url: str):
    settings(page, "Model and sampling")
    set_number(page, "max-new-tokens", 1000)
    close_settings(page)
    page.locator("#prompt textarea").fill("Write a very long story about a lighthouse keeper and the sea.")
    page.locator("#generate").click()
    expect(page.locator("#status")).to_contain_text("of 1000", timeout=RUN_TIMEOUT_MS)  # the setting took
    page.wait_for_function(
        "() => document.querySelectorAll('#col1-text .fl-tok').length >= 10", timeout=RUN_TIMEOUT_MS
    )
    expect(page.locator("#stop")).to_be_enabled()
    # Stop one column: column 2 ends within a step, column 1 runs on
    expect(page.locator("#col2-actions .fl-rerun")).to_be_hidden()  # no re-run while a run streams
    page.locator("#col2-actions .fl-col-stop").click()
    expect(stop_cell(page, "col2")).to_contain_text("stopped", timeout=15_000)
    expect(page.locator("#col2-text .fl-text.fl-live")).to_have_count(0)  # its end has come, the run goes on
    col2_final = spans(page, "col2").count()
    # it keeps what the page showed at the click: not one token more
    assert col2_final == page.evaluate("() => window.__fl.column_stop_shown"), col2_final
    expect(stop_cell(page, "col1")).to_have_text("running…")
    before = spans(page, "col1").count()
    page.wait_for_function(
        f"() => document.querySelectorAll('#col1-text .fl-tok').length > {before + 3}", timeout=RUN_TIMEOUT_MS
    )
    assert spans(page, "col2").count() == col2_final  # nothing more in the stopped column
    at_stop = spans(page, "col1").count()
    per_update = page.evaluate("() => window.__fl.col1.most")  # before the stop's own last update
    page.locator("#stop").click()

    expect(page.locator("#status")).to_contain_text("Done (stopped)", timeout=15_000)
    page.wait_for_function(
        "() => window.__fl.seen.done !== undefined && window.__fl.clicks.stop !== undefined"
    )
    stop_to_done = page.evaluate("() => (window.__fl.seen.done - window.__fl.clicks.stop) / 1000")
    assert 0 < stop_to_done < 15, stop_to_done
    for column in ("col1", "col2"):
        expect(stop_cell(page, column)).to_contain_text("stopped")
    expect(page.locator("#generate")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()
    expect(page.locator("#col2-actions .fl-col-stop")).to_be_hidden()
    final = spans(page, "col1").count()
    # The run keeps what the page showed at the click (the page sends it), counted in the page at the
    # click itself (updates may arrive between counting here and clicking)
    assert final == page.evaluate("() => window.__fl.stop_shown") >= at_stop, (at_stop, final, per_update)
    page.wait_for_timeout(1_000)  # nothing may arrive after the run ended
    assert spans(page, "col1").count() == final
    assert health(app_url)["running"] == 0
    save_metrics(
        stop_to_done_s=stop_to_done,
        stop_tokens_at_click=at_stop,
        stop_tokens_final=final,
        stop_tokens_per_update=per_update,
    )


def test_enter_runs_and_an_input_error_leaves_the_previous_run_intact(page: Page, monkeypatch):
    # In the prompt Shift+Enter starts a new line and Enter runs (as in the follow-up box).
    settings(page, "Model and sampling")
    set_number(page, "max-new-tokens", 12)
    close_settings(page)
    # Typing a prompt asks the server nothing: on each key the columns' headings were once asked
    # for, 4 requests a key, and the page was busy for seconds after the typing stopped.
    asked: list[str] = []

    def ask(request) -> None:
        if "/gradio_api/" in request.url and request.method == "POST":
            asked.append(request.url)

    page.on("request", ask)
    box = page.locator("#prompt textarea")
    box.fill("Name three rivers.")
    box.press("End")
    box.press("Shift+Enter")
    box.type("Briefly.")
    expect(box).to_have_value("Name three rivers.\nBriefly.")
    page.wait_for_timeout(300)
    page.remove_listener("request", ask)
    assert asked == []
    expect(page.locator("#stop")).to_be_disabled()  # Shift+Enter did not run
    box.press("Enter")
    expect(page.locator("#status")).to_contain_text("Done in", timeout=RUN_TIMEOUT_MS)
    expect(box).to_have_value("Name three rivers.\nBriefly.")  # Enter ran it and added no line
    # From the prompt, a few Tab presses reach the skip link, and Enter on it lands on the first token.
    box.focus()
    presses = 0
    while presses < 8 and not page.evaluate("() => document.activeElement?.classList.contains('fl-skip')"):
        page.keyboard.press("Tab")
        presses += 1
    assert presses <= 6, presses
    page.keyboard.press("Enter")
    expect(page.locator("#col1-text .fl-tok").first).to_be_focused()
    expect(page.locator("#fl-card.fl-open")).to_be_visible()
    page.keyboard.press("Escape")
    # Copy answer: the column's text, as plain text, on the clipboard
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.locator("#col2-actions button.fl-copy").click()
    expect(page.locator("#col2-actions button.fl-copy")).to_have_text("Copied")
    tokens = "".join(page.locator("#col2-text .fl-tok").all_text_contents())
    assert page.evaluate("() => navigator.clipboard.readText()") == tokens
    before = {c: page.locator(f"#{c}-text .fl-text").first.inner_html() for c in ("col1", "col2")}
    stats = page.locator("#metrics table").inner_text()
    page.locator("#prompt textarea").fill("   ")
    page.locator("#generate").click()
    expect(page.locator(".toast-body.error")).to_contain_text("prompt is empty")  # the toast, and the status
    expect(page.locator("#status")).to_contain_text("Not started: prompt is empty")  # line keeps saying it
    page.wait_for_timeout(500)
    for column, html in before.items():
        assert page.locator(f"#{column}-text .fl-text").first.inner_html() == html
    assert page.locator("#metrics table").inner_text() == stats
    # Gradio draws an "Error" badge over an event's outputs when it fails; none may cover the results
    assert page.evaluate(SHOWN_ERROR_BADGES) == 0
    expect(page.locator("#generate")).to_be_enabled()
    shot(page, "input-error")
    # Another refusal, of a number out of its range: the status line says this one, not the last
    page.locator("#prompt textarea").fill("Name three rivers.")
    settings(page, "Model and sampling")
    set_number(page, "temperature", -5)
    close_settings(page)
    page.locator("#generate").click()
    expect(page.locator("#status")).to_contain_text("Not started: temperature", timeout=10_000)
    expect(page.locator("[data-testid=toast-text]").last).to_contain_text("temperature")
    settings(page, "Model and sampling")
    set_number(page, "temperature", 0.7)
    close_settings(page)
    # Re-run one column with a changed setting: column 2 alone, column 1 keeps its text
    expect(page.locator("#col2-actions .fl-col-stop")).to_be_hidden()  # nothing to stop while idle
    col1_tokens = page.locator("#col1-text .fl-tok").all_text_contents()
    column_settings(page, 2)
    page.locator("#col2-temperature input, #col2-temperature textarea").first.fill("0.9")
    close_settings(page)
    recorded = late_records(monkeypatch)
    page.locator("#col2-actions .fl-rerun").click()
    expect(page.locator("#status")).to_contain_text("Re-ran Feedback alone", timeout=RUN_TIMEOUT_MS)
    assert (
        page.locator("#col1-text .fl-tok").all_text_contents() == col1_tokens
    )  # (its divergence mark may move)
    expect(page.locator("#col2-title")).to_contain_text("temperature 0.9")
    # Rate it at once, before the run's record has reached this browser's History: the rating
    # is kept with the run there
    assert recorded["answered"] == 0
    page.locator("#col2-actions .fl-rate[data-verdict='better']").click()
    expect(page.locator("#status")).to_contain_text("Rated Feedback: better")
    wait_for(lambda: recorded["answered"] == recorded["asked"] == 2, "the run recorded and rated")
    page.get_by_role("tab", name="History").click()
    newest = page.locator("#history-table tr[data-id]").first
    expect(newest).to_contain_text("Feedback: better", timeout=10_000)


def test_waiting_in_line_is_shown_and_stop_leaves_the_line(page: Page, app_server):
    gate = app_server.pool.gate
    held = gate.acquire("api", label="an API generate request")  # another client holds the model
    try:
        page.locator("#prompt textarea").fill("Say hi.")
        page.locator("#generate").click()
        expect(page.locator("#status")).to_contain_text("Waiting for the model: 1st in line", timeout=10_000)
        expect(page.locator("#status")).to_contain_text("behind an API generate request")
        expect(page.locator("#stop")).to_be_enabled()
        shot(page, "waiting-in-line", full=False)
        page.locator("#stop").click()
        expect(page.locator("#status")).to_contain_text("Left the line", timeout=10_000)
        assert gate.status()["waiting"] == 0
        expect(page.locator("#generate")).to_be_enabled()
    finally:
        gate.release(held)


# Every text the status line shows, in order (a wait in line can be shown for a moment only).
STATUS_LOG_JS = """
() => {
  const log = window.__fl_status = [];
  new MutationObserver(() => {
    const text = (document.querySelector('#status')?.textContent || '').trim();
    if (log[log.length - 1] !== text) log.push(text);
  }).observe(document.body, {childList: true, subtree: true, characterData: true});
}
"""
BOARD_JS = """() => ({tokens: document.querySelectorAll('#columns .fl-tok').length,
  done: (document.querySelector('#status')?.textContent || '').includes('Done')})"""


def test_two_tabs_stream_at_the_same_time(page: Page, browser: Browser, app_url: str):
    """Two visitors (two browser contexts) press Run one just after the other: the second joins the
    model's running decode instead of waiting in line, both boards grow together, both end Done."""
    context, other = open_app(browser, app_url)
    try:
        tabs = {"A": page, "B": other}
        for pg, prompt in [
            (page, "Write a long story about a lighthouse keeper and the sea."),
            (other, "Explain step by step how bread is made, in detail."),
        ]:
            settings(pg, "Model and sampling")
            set_number(pg, "max-new-tokens", 64)
            close_settings(pg)
            pg.locator("#prompt textarea").fill(prompt)
            pg.evaluate(STATUS_LOG_JS)
        page.locator("#generate").click()
        other.locator("#generate").click()  # at once: A's run alone takes only a few seconds here
        samples: list[dict] = []  # each poll: both boards' token counts and whether each run is done
        deadline = time.monotonic() + RUN_TIMEOUT_MS / 1000
        while not (samples and all(samples[-1][k]["done"] for k in tabs)):
            assert time.monotonic() < deadline, samples[-3:]
            samples.append({k: pg.evaluate(BOARD_JS) for k, pg in tabs.items()})
            time.sleep(0.25)
        for k, pg in tabs.items():
            shown = pg.evaluate("() => window.__fl_status")
            assert not [s for s in shown if "in line" in s or "Waiting for the model" in s], (k, shown)
            expect(pg.locator("#status")).to_contain_text("Done in")
            assert pg.errors == [], (k, pg.errors)
        # a moment when both boards grew between two polls, neither run done yet
        together = [
            (a, b)
            for a, b in zip(samples, samples[1:])
            if all(b[k]["tokens"] > a[k]["tokens"] and not b[k]["done"] for k in tabs)
        ]
        assert together, [(s["A"]["tokens"], s["B"]["tokens"]) for s in samples]
    finally:
        context.close()


def test_every_model_tab_has_a_stop_that_frees_the_model(page: Page, app_url: str):
    def start_then_stop(prefix: str, run: str, running: str, stopped: str, also: tuple = ()) -> None:
        page.locator(f"#{run}").click()
        expect(page.locator(f"#{prefix}status")).to_contain_text(running, timeout=RUN_TIMEOUT_MS)
        for text in also:  # shown with `running`, in the same status
            expect(page.locator(f"#{prefix}status")).to_contain_text(text)
        page.locator(f"#{prefix}stop").click()
        expect(page.locator(f"#{prefix}status")).to_contain_text(stopped, timeout=15_000)
        wait_idle(app_url, 10)
        expect(page.locator(f"#{run}")).to_be_enabled()

    # Calibrate (Compare tab): 8 warm-up traces per column.
    settings(page, "DeepConf")
    page.locator("#prompt textarea").fill("Tell a long story about the sea.")
    start_then_stop("", "calibrate", "Calibrating", "Calibration stopped")
    # Perplexity and Sweep on the built-in dev split (20 documents; 12 grid points on 3 documents cut
    # to 128 tokens: both within the default scoring budget, both longer than the test waits). The
    # Sweep is stopped once its status shows progress within the first point (one window of 128
    # tokens: a second or two) beside the estimate.
    within_point = ("point 1 of 12: ", "s left", "Estimate: 3 documents, ")
    for tab, prefix, running, docs, also in [
        ("Perplexity", "ppl", "Scoring", 20, ()),
        ("Sweep", "sweep", "tokens scored (document", 3, within_point),
    ]:
        page.get_by_role("tab", name=tab).click()
        radio(page, f"{prefix}-source", "builtin:dev")
        if tab == "Sweep":  # 12 points on 10 whole documents is over the budget: refused at once, saying why
            set_number(page, "sweep-max-tokens", 100_000)
            page.locator("#sweep-run").click()
            expect(page.locator(".toast-body.error").last).to_contain_text("FEEDBACK_BUDGET_SCORED_TOKENS")
            expect(page.locator("#sweep-status")).to_contain_text("Not started")  # stays after the toast goes
            expect(page.locator("#sweep-status")).to_contain_text("FEEDBACK_BUDGET_SCORED_TOKENS")
            expect(page.locator("#sweep-status")).to_contain_text("It fits with max tokens per document")
            set_number(page, "sweep-max-tokens", 128)
        set_number(page, f"{prefix}-max-docs", docs)
        start_then_stop(f"{prefix}-", f"{prefix}-run", running, "Stopped", also)
    # Deep Think: 8 + 4 traces per side.
    page.get_by_role("tab", name="Deep Think").click()
    start_then_stop("dt-", "dt-run", "Running", "Stopped")


def test_the_recall_section_runs_one_prompt_and_draws_its_heatmaps(page: Page, app_url: str):
    """The Perplexity tab's Recall accordion: one fact in a 64-token text, baseline and deep_cache,
    through the model line; its status says what it will run, then Done; three heatmaps drawn."""
    page.get_by_role("tab", name="Perplexity").click()
    accordion(page, "Recall: long-context key facts")
    page.locator("#recall-lengths textarea").fill("64")
    page.locator("#recall-depths textarea").fill("50")
    set_number(page, "recall-items", 1)
    set_number(page, "recall-max-new", 4)
    page.locator("#recall-run").click()
    expect(page.locator("#recall-status")).to_contain_text("Done in", timeout=RUN_TIMEOUT_MS)
    expect(page.locator("#recall-status")).to_contain_text("1 prompt (1 item × 1 length × 1 depth) of ")
    expect(page.locator("#recall-summary")).to_contain_text("McNemar exact p")
    for plot in ("baseline", "strategy", "difference"):
        expect(page.locator(f"#recall-{plot}-plot .heatmaplayer")).to_have_count(1)
    expect(page.locator("#recall-run")).to_be_enabled()
    shot(page, "recall-1440", element="#recall")
    wait_idle(app_url, 10)


def test_closing_the_tab_during_a_sweep_frees_the_model_within_seconds(browser: Browser, app_url: str):
    context, pg = open_app(browser, app_url)
    pg.get_by_role("tab", name="Sweep").click()
    radio(pg, "sweep-source", "builtin:dev")
    set_number(pg, "sweep-max-docs", 3)
    pg.locator("#sweep-run").click()
    expect(pg.locator("#sweep-status")).to_contain_text("Sweeping", timeout=RUN_TIMEOUT_MS)
    assert health(app_url)["running"] == 1
    context.close()  # the person closes the tab; nobody presses Stop
    freed = wait_idle(app_url, 20)
    assert freed < 15, freed
    save_metrics(tab_closed_to_model_free_s=freed)


def test_a_column_temperature_starts_empty_and_shows_in_its_heading(page: Page):
    field = page.locator("#col2-temperature input")
    generate(page, "Say hi.", tokens=3)
    expect(page.locator("#col2-title")).not_to_contain_text("temperature")  # the run was given none ...
    column_settings(page, 2)
    expect(field).to_have_value("")  # ... empty: the shared temperature
    expect(page.locator("#col2-heading")).not_to_contain_text("temperature")
    field.fill("0")
    field.press("Tab")
    expect(page.locator("#col2-heading")).to_contain_text("temperature 0")  # a greedy column
    column_settings(page, 1)
    expect(page.locator("#col1-heading")).not_to_contain_text("temperature")


def test_a_column_stacks_a_second_strategy_after_the_first(page: Page):
    column_settings(page, 2)
    choose(page, "c2-strategy", "inner_loop")
    choose(page, "c2-stack", "deep_cache")
    expect(page.locator("#c2-inner_loop-beta input").first).to_be_visible()  # both sets of controls show
    expect(page.locator("#c2-deep_cache-lam input").first).to_be_visible()
    expect(page.locator("#c2-about")).to_contain_text("applied in this order: inner_loop then deep_cache")
    set_number(page, "c2-deep_cache-lam", 0.05)
    expect(page.locator("#c2-preset input")).to_have_value("custom")
    generate(page, "Name a river.", tokens=6)
    expect(page.locator("#col2-title")).to_contain_text("inner_loop+deep_cache")
    expect(page.locator("#col2-title")).to_contain_text("deep_cache.lam=0.05")
    column_settings(page, 2)
    choose(page, "c2-strategy", "restate")  # prompt-level: nothing to stack it with
    expect(page.locator("#c2-stack")).to_be_hidden()


def test_reload_from_history_restores_every_control(page: Page):
    settings(page, "Model and sampling")
    set_number(page, "temperature", 0.5)
    set_number(page, "seed", 7)
    set_number(page, "max-new-tokens", 8)
    column_settings(page, 2)
    choose(page, "c2-strategy", "deep_cache")
    choose(page, "c2-preset", "tuned for perplexity")
    expect(page.locator("#c2-deep_cache-lam input")).to_have_value("0.02")
    settings(page, "DeepConf")
    set_number(page, "deepconf-window", 12)
    radio(page, "thr-mode", "fixed")
    set_number(page, "threshold", 3.25)
    close_settings(page)
    page.locator("#prompt textarea").fill("Name a planet.")
    page.locator("#generate").click()
    expect(page.locator("#status")).to_contain_text("Done in", timeout=RUN_TIMEOUT_MS)
    heading = page.locator("#col2-title").inner_text()
    assert "deep_cache" in heading and "lam=0.02" in heading and "gate=0.9" in heading
    # ... then the person changes everything
    page.locator("#prompt textarea").fill("Something else entirely.")
    settings(page, "Model and sampling")
    set_number(page, "temperature", 0)
    settings(page, "DeepConf")
    set_number(page, "deepconf-window", 32)
    radio(page, "thr-mode", "off")
    column_settings(page, 2)
    choose(page, "c2-strategy", "anchor")
    # ... and reloads the run from History
    page.get_by_role("tab", name="History").click()
    expect(page.locator("#history-table")).to_contain_text("Name a planet.")
    page.locator("#history-runs input").click()
    page.get_by_role("option").filter(has_text="Name a planet.").first.click()
    page.locator("#history-reload").click()
    expect(page.locator("#status")).to_contain_text("Reloaded run", timeout=10_000)
    expected = {
        "Model and sampling": {"temperature": "0.5", "seed": "7", "max-new-tokens": "8"},
        "DeepConf": {"deepconf-window": "12", "threshold": "3.25"},
        "Column 2": {
            "c2-strategy": "deep_cache",
            "c2-preset": "tuned for perplexity",
            "c2-deep_cache-lam": "0.02",
            "c2-deep_cache-theta": "50",
            "c2-deep_cache-gate": "0.9",
        },
    }
    for tab, values in expected.items():  # each settings tab looked at in turn, as a person would
        column_settings(page, 2) if tab == "Column 2" else settings(page, tab)
        for elem_id, value in values.items():
            expect(page.locator(f"#{elem_id} input").first).to_have_value(value)
        if tab == "DeepConf":
            expect(page.locator("#thr-mode input[value=fixed]")).to_be_checked()
    expect(page.locator("#prompt textarea")).to_have_value("Name a planet.")
    expect(page.locator("#col2-heading")).to_contain_text("lam=0.02")
    expect(page.locator("#col2-title")).to_contain_text("lam=0.02")  # and the board shows the run
    shot(page, "history-reload")
    # Back in History: rate a column, name the run (markup in a name stays text), find it, delete it.
    page.get_by_role("tab", name="History").click()
    # the run picked before Reload is still picked (opening the tab keeps the choice), its columns there
    expect(page.locator("#history-rate-column input")).to_have_value("Baseline")
    choose(page, "history-rate-column", "Feedback")
    radio(page, "history-verdict", "better")
    page.locator("#history-rate-note textarea").fill("more to the point")
    page.locator("#history-rate").click()
    expect(page.locator("#history-table")).to_contain_text("Feedback: better (more to the point)")
    page.locator("#history-name input").fill("planet <b>run</b>")
    page.locator("#history-name-save").click()
    expect(page.locator("#history-status")).to_contain_text("is named “planet <b>run</b>”")
    expect(page.locator("#history-table")).to_contain_text("planet <b>run</b>")
    assert page.locator("#history-table b, #history-status b, #history-runs b").count() == 0
    page.locator("#history-search input").fill("PLANET <B>RUN")
    expect(page.locator("#history-note")).to_contain_text("1 of 1 run(s) match")
    expect(page.locator("#history-runs")).to_contain_text("planet <b>run</b>")  # still chosen, by its id
    page.locator("#history-delete").click()
    expect(page.locator("#history-status")).to_contain_text("Deleted 1 run:")
    page.get_by_role("tab", name="Compare").click()  # opening History again reads what the browser stored
    page.get_by_role("tab", name="History").click()
    expect(page.locator("#history-note")).to_contain_text("0 run(s) stored")


def test_a_phone_shows_one_column_at_a_time_and_tap_and_keys_open_the_card(browser: Browser, app_url: str):
    context, pg = open_app(browser, app_url, width=390, touch=True)
    try:
        generate(pg, "Explain in two sentences why the sky is blue.", 24)
        # one column at a time, the whole width: its tab (or a swipe) shows another
        expect(pg.locator("#col1-text")).to_be_visible()
        expect(pg.locator("#col2-text")).to_be_hidden()
        assert pg.locator("#col1-text").bounding_box()["width"] > 300
        tabs = pg.locator(".fl-board-tab")
        expect(tabs).to_have_count(2)
        expect(tabs.nth(0)).to_have_attribute("aria-selected", "true")
        for name in ("Compare", "Perplexity", "Sweep", "Deep Think", "History"):  # no tab hidden behind "…"
            expect(pg.get_by_role("tab", name=name)).to_be_visible()
        shot(pg, "compare-390-light")
        tabs.nth(1).tap()
        expect(pg.locator("#col2-text")).to_be_visible()
        expect(pg.locator("#col1-text")).to_be_hidden()
        shot(pg, "compare-390-column-2", full=False)
        token = pg.locator("#col2-text .fl-tok").nth(1)
        token.tap()
        card = pg.locator("#fl-card.fl-open")
        expect(card).to_be_visible()
        expect(card).to_contain_text("probability")
        box = card.bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390  # the card fits on the phone's screen
        shot(pg, "card-tap-390", full=False)
        pg.keyboard.press("Escape")
        expect(card).to_have_count(0)
        # keyboard: focus the column's first token, then move with the arrow keys
        tabs.nth(0).tap()
        first = pg.locator("#col1-text .fl-tok").first
        first.focus()
        expect(card).to_be_visible()
        title = pg.locator("#fl-card .fl-card-title").inner_text()
        pg.keyboard.press("ArrowRight")
        expect(pg.locator("#col1-text .fl-tok").nth(1)).to_be_focused()
        expect(pg.locator("#fl-card .fl-card-title")).not_to_have_text(title)
        # the alternatives are reachable by keyboard too (↓ into the card, Enter would branch)
        pg.keyboard.press("ArrowDown")
        expect(pg.locator("#fl-card button.fl-alt").first).to_be_focused()
        pg.keyboard.press("Escape")
        expect(pg.locator("#col1-text .fl-tok").nth(1)).to_be_focused()
    finally:
        context.close()


def test_dark_mode_charts_are_dark_at_both_widths(browser: Browser, app_url: str):
    """One run in a dark page, looked at on a desktop and then on a phone's width."""
    context, pg = open_app(browser, app_url, width=1440, scheme="dark")
    try:
        generate(pg, "Summarise the plot of Romeo and Juliet in three sentences.", 16)
        for width in (1440, 390):
            pg.set_viewport_size({"width": width, "height": 900 if width > 500 else 844})
            pg.wait_for_timeout(500)  # Plotly redraws at the new size
            colours = pg.evaluate("""() => {
              const svg = document.querySelector('#conf-plot .main-svg');
              const text = document.querySelector('#conf-plot .xtitle');
              return {bg: getComputedStyle(svg).backgroundColor, text: getComputedStyle(text).fill,
                      body: getComputedStyle(document.querySelector('.gradio-container')).backgroundColor,
                      dark: document.querySelector('.dark') !== null};
            }""")
            assert colours["dark"], colours
            assert colours["bg"] in ("rgba(0, 0, 0, 0)", "transparent"), (
                colours
            )  # the page's dark shows through

            def lum(css: str) -> float:
                r, g, b = [float(x) for x in css[css.index("(") + 1 : css.index(")")].split(",")[:3]]
                return 0.2126 * r + 0.7152 * g + 0.0722 * b

            assert lum(colours["text"]) > 150 and lum(colours["body"]) < 80, colours
            shot(pg, f"compare-{width}-dark")
            column_settings(pg, 2)
            assert help_contrast(pg, "#c2-residual-alpha") >= 4.5
            close_settings(pg)
    finally:
        context.close()


def test_idle_page_polls_memory_slowly_and_not_while_hidden(page: Page):
    fn_index = page.evaluate("() => window.gradio_config.dependencies.find(d => d.api_name === 'memory').id")
    ticks: list[float] = []

    def on_request(request) -> None:
        if request.method == "POST" and "queue/join" in request.url:
            body = json.loads(request.post_data or "{}")
            if body.get("fn_index") == fn_index:
                ticks.append(time.monotonic())

    page.on("request", on_request)
    set_hidden = (
        "(hidden) => { Object.defineProperty(document, 'hidden', {value: hidden, configurable: true});"
        " document.dispatchEvent(new Event('visibilitychange')); }"
    )
    page.evaluate(set_hidden, True)  # the person switched to another browser tab
    page.wait_for_timeout(500)
    ticks.clear()
    page.wait_for_timeout(6_000)
    assert ticks == []  # no polling while hidden
    page.evaluate(set_hidden, False)
    t0 = time.monotonic()
    page.wait_for_timeout(6_500)
    assert 1 <= len(ticks) <= 2 and ticks[0] - t0 < 6  # back, at one request per 5 s


CHART_COLOURS = """
() => Array.from(new Set(Array.from(document.querySelectorAll('#conf-plot .scatterlayer .trace path.js-line'))
  .map(p => getComputedStyle(p).stroke)))
"""


def answered_late(monkeypatch, owner, name: str, is_late) -> dict:
    """Make the server's `owner.<name>` answer a second and a half late the calls for which
    `is_late(*args)` is true (asked under a lock, in the order they come), as a busy server may;
    returns the counts of calls asked and answered."""
    real, lock, calls = getattr(owner, name), threading.Lock(), {"asked": 0, "answered": 0}

    def late(*args):
        with lock:
            calls["asked"] += 1
            wait = is_late(*args)
        time.sleep(1.5 if wait else 0.0)
        try:
            return real(*args)
        finally:
            with lock:
                calls["answered"] += 1

    monkeypatch.setattr(owner, name, late)
    return calls


def late_records(monkeypatch) -> dict:
    """The server's first write of each new run into a browser's History (the record asked as the
    run ends, or a rating's, whichever is answered first: both add the run through `_with_run`)
    answered late (`answered_late`)."""
    seen: set = set()

    def first(runs, result: dict, *rest) -> bool:
        new = result.get("run_id") not in seen
        seen.add(result.get("run_id"))
        return new

    return answered_late(monkeypatch, history, "_with_run", first)


def late_stale_previews(compare, monkeypatch, column: int, key: str, final) -> dict:
    """Column `column`'s heading previews asked while its setting `key` was not yet `final`
    answered late (`answered_late`), after the later-asked ones."""
    return answered_late(
        monkeypatch,
        compare,
        "preview_heading",
        lambda index, values: index == column and values[key] != final,
    )


def test_a_prompt_session_variants_branch_follow_up_diff_and_link(
    page: Page, browser: Browser, app_server, monkeypatch
):
    """A prompt engineer's session in one page: a third column with its own prompt, a run, a
    branch from an alternative token, a follow-up turn, the diff view, and a link that restores it."""
    settings(page, "Columns")
    page.locator("#add-column").click()
    column_tabs = page.locator("#column-tabs [role=tab]")
    expect(column_tabs.filter(has_text="Column 3")).to_be_visible()
    expect(page.locator("#column-tabs [role=tab]:visible").filter(has_text="Column 4")).to_have_count(0)
    column_settings(page, 3)
    expect(page.locator("#col3-heading")).to_contain_text(
        "deep_cache"
    )  # an added column starts on a strategy
    choose(page, "c3-strategy", "none")  # ... this one is a prompt variant instead
    page.locator("#col3-name textarea").fill("Precise")
    page.locator("#col3-prompt textarea").fill("Name the capital of France. Answer in one precise sentence.")
    expect(page.locator("#col3-heading")).to_contain_text("prompt modified")
    column_settings(page, 2)
    expect(page.locator("#col2-heading")).not_to_contain_text("modified")
    generate(page, "What is the capital of France?", 10)
    for n in (1, 2, 3):
        expect(page.locator(f"#col{n}-text .fl-tok").first).to_be_visible()
        expect(metric_cell(page, f"col{n}", "self-PPL")).not_to_have_text("—")
    expect(page.locator("#col3-title")).to_contain_text("Precise")
    expect(page.locator("#col3-title")).to_contain_text("prompt modified")
    page.wait_for_function(
        "() => document.querySelectorAll('#conf-plot .scatterlayer .trace').length >= 6", timeout=10_000
    )
    assert len(page.evaluate(CHART_COLOURS)) >= 3  # one colour per column
    shot(page, "workbench-3-columns-1440")
    # a column asked its own question shows it from the first turn; the others were asked the shared one
    expect(page.locator("#col3-turns .fl-turn.fl-current")).to_contain_text("precise sentence")
    expect(page.locator("#col1-turns .fl-turn")).to_have_count(0)

    # Branch: click a token of column 2 (the card stays), then one of its alternatives.
    page.locator("#col2-text .fl-tok").nth(3).click()
    alternative = page.locator("#fl-card.fl-open button.fl-alt").first
    expect(alternative).to_be_visible()
    expect(page.locator("#fl-card")).to_contain_text("click an alternative")
    shot(page, "branch-card", full=False)
    alternative.press("Enter")  # from the keyboard: focus comes back to the branched token
    expect(page.locator("#status")).to_contain_text(
        "branched: your token in every column", timeout=RUN_TIMEOUT_MS
    )
    for n in (1, 2, 3):  # every column goes on from column 2's text and the one chosen token
        expect(page.locator(f"#col{n}-text .fl-tok.fl-forced")).to_have_count(1)
        expect(page.locator(f"#col{n}-text .fl-tok.fl-replayed")).to_have_count(3)
        assert "fl-forced" in page.locator(f"#col{n}-text .fl-tok").nth(3).get_attribute("class")
    expect(page.locator("#col2-text .fl-tok[data-step='3']")).to_be_focused()
    heads = [page.locator(f"#col{n}-text .fl-tok").all_inner_texts()[:4] for n in (1, 2, 3)]
    assert heads[0] == heads[1] == heads[2], heads  # the same text and token up to the branch in every column

    # Continue the conversation: every column shows its own history as chat bubbles.
    page.locator("#follow-up textarea").fill("And the capital of Italy?")
    page.locator("#continue").click()
    expect(page.locator("#col1-turns .fl-turn.fl-current")).to_be_visible(timeout=RUN_TIMEOUT_MS)  # it began
    expect(page.locator("#status")).to_contain_text("Done in", timeout=RUN_TIMEOUT_MS)
    for n in (1, 2, 3):
        expect(page.locator(f"#col{n}-turns .fl-turn.fl-user.fl-current")).to_contain_text("Italy")
        expect(page.locator(f"#col{n}-turns .fl-turn.fl-assistant")).to_have_count(1)
    expect(page.locator("#col3-turns .fl-turn.fl-user").first).to_contain_text("precise sentence")
    shot(page, "conversation-1440")

    # Diff view: words of each column against column 1.
    radio(page, "token-view", "diff")
    expect(page.locator("#diff-legend")).to_be_visible()
    for n in (1, 2, 3):
        expect(page.locator(f"#col{n}-text .fl-diff")).to_be_visible()
        expect(page.locator(f"#col{n}-text .fl-text").first).to_be_hidden()  # the tokens wait behind it
    shot(page, "diff-view-1440")
    radio(page, "token-view", "confidence")

    # Copy link: the address holds the setup; a fresh page opened on it has the same controls.
    page.locator("#copy-link").click()
    expect(page.locator("#link-note")).to_contain_text("link copied", ignore_case=True, timeout=10_000)
    page.wait_for_function("() => window.location.search.includes('cfg=')")
    url = page.evaluate("() => window.location.href")
    # Opening the link sets many settings at once, and each change asks for its column's heading
    # with the settings as they stood then; answered late, an early one (column 3 still on
    # deep_cache) comes last, and must not be the heading shown.
    previews = late_stale_previews(app_server.app.compare, monkeypatch, 2, "c3_strategy", "none")
    context, fresh = open_app(browser, url, width=390, scheme="dark")
    try:
        expect(fresh.locator(".fl-board-tab")).to_have_count(3)  # the board shows the link's columns, empty
        expect(fresh.locator("#prompt textarea")).to_have_value("What is the capital of France?")
        expect(fresh.locator("#link-note")).to_contain_text("restored from the link")
        column_settings(fresh, 3)
        wait_for(
            lambda: previews["asked"] > 0 and previews["answered"] == previews["asked"],
            "the link's heading previews answered",
            within_s=30.0,
        )
        expect(fresh.locator("#col3-name textarea")).to_have_value("Precise")
        expect(fresh.locator("#col3-prompt textarea")).to_have_value(
            "Name the capital of France. Answer in one precise sentence."
        )
        expect(fresh.locator("#col3-heading")).to_contain_text("prompt modified")
        expect(fresh.locator("#c3-strategy input")).to_have_value("none")
        settings(fresh, "Model and sampling")
        expect(fresh.locator("#max-new-tokens input")).to_have_value("10")
        shot(fresh, "link-restored-390-dark")
        assert fresh.errors == []
    finally:
        context.close()
    assert page.errors == []


def test_a_tampered_link_keeps_the_defaults_and_says_so(browser: Browser, app_url: str):
    context, pg = open_app(browser, app_url.rstrip("/") + "/?cfg=eJyrVkrLz1eyUkpKLFKqBQAdegQ0")
    try:
        expect(pg.locator("#link-note")).to_contain_text("not applied")
        expect(pg.locator("#prompt textarea")).to_have_value("")
        expect(pg.locator("#col3")).to_have_count(0)  # the default two columns
    finally:
        context.close()


# Names as a stranger's link could carry them: Markdown links, tags with handlers, broken-out attributes.
HOSTILE_NAMES = [
    "[md](javascript:alert(1))",
    '<img src=x onerror="alert(2)">',
    '"><svg onload=alert(3)>',
    "**x** <a href='javascript:alert(4)'>y</a>",
]
# Every link to javascript: and every inline event handler in the document (Gradio's own markup has none).
SCRIPT_SINKS = """
() => {
  const links = [...document.querySelectorAll('a[href]')].filter(a =>\
 /^\\s*javascript:/i.test(a.getAttribute('href')));
  const handlers = [...document.querySelectorAll('*')].flatMap(e => [...e.attributes]
      .filter(a => a.name.toLowerCase().startsWith('on')).map(a => e.tagName + ' ' + a.name));
  return {links: links.map(a => a.outerHTML), handlers};
}
"""


def test_names_from_a_link_are_text_everywhere_they_show(browser: Browser, app_url: str):
    """Column names reach headings from a link a stranger made: each shows as the literal text, and
    no javascript: link, event handler or dialog comes of them, restored or after a run."""
    from feedback.core.records import RowSpec, RunConfig
    from ui.compare import link

    cfg = RunConfig(prompt="Say hi.", max_new_tokens=4, rows=[RowSpec(n) for n in HOSTILE_NAMES])
    context, pg = open_app(browser, f"{app_url.rstrip('/')}/?cfg={link.encode(cfg, 'markdown')}")
    dialogs: list[str] = []
    pg.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    try:
        expect(pg.locator("#link-note")).to_contain_text("restored from the link")
        for n, name in enumerate(HOSTILE_NAMES, start=1):
            expect(pg.locator(f"#col{n}-title h3")).to_have_text(name)  # on the board
            column_settings(pg, n)
            expect(pg.locator(f"#col{n}-heading h3")).to_have_text(name)  # and above its settings
            assert pg.evaluate(SCRIPT_SINKS) == {"links": [], "handlers": []}
        close_settings(pg)
        pg.locator("#generate").click()
        expect(pg.locator("#status")).to_contain_text("Done in", timeout=RUN_TIMEOUT_MS)
        for n, name in enumerate(HOSTILE_NAMES, start=1):
            expect(pg.locator(f"#col{n}-title h3")).to_have_text(name)
        # the link's token view came with it: the answers are formatted as Markdown
        expect(pg.locator("#token-view input[value='markdown']")).to_be_checked()
        expect(pg.locator("#col1-text .fl-markdown")).to_be_visible()
        assert pg.evaluate(SCRIPT_SINKS) == {"links": [], "handlers": []}
        assert dialogs == [] and pg.errors == []
        shot(pg, "hostile-names-restored-1440")
    finally:
        context.close()


# Markup a crafted link carries: an image that calls a URL, a fake login link, a heading, a bare URL
MARKUP = (
    '<img src="/x-injected.png"><a href="https://example.org/login">Session expired</a>'
    "<h1>NOTICE</h1> see https://example.org/bare"
)
SHORT_MARKUP = '<img src="/x-injected.png"><h1>N</h1>'  # within a column name's 64 characters
# Elements that text can turn into (a toast's own close button and icon are not inside its message)
RENDERED = "a, img, h1, h2, h3, h4, h5, h6, iframe, object, embed, video, audio, form, input, table, style"
MESSAGES = "[data-testid=toast-text], #link-note, #status"


def _crafted(field: str, value: str) -> str:
    """A real link (Copy link's data) decoded, one field set to `value`, encoded again."""
    import base64
    import zlib

    from feedback.core.records import RowSpec, RunConfig
    from ui.compare import link

    cfg = RunConfig(
        prompt="Say hi.",
        max_new_tokens=4,
        rows=[RowSpec("Baseline"), RowSpec("Feedback", "residual", {"alpha": 0.1})],
    )
    data = link.encode(cfg)
    packed = json.loads(zlib.decompress(base64.urlsafe_b64decode(data + "=" * (-len(data) % 4))))
    config = packed["config"]
    if field == "view":
        packed["view"] = value
    elif field == "prompt":
        config["prompt"] = value
    elif field == "parameter":
        config["rows"][1]["params"] = {value: 0.1}
    else:  # strategy or name of column 2
        config["rows"][1][field] = value
    raw = zlib.compress(json.dumps(packed).encode("utf-8"), 9)
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


@pytest.mark.parametrize(
    "field, markup, applied",
    [
        ("strategy", MARKUP, False),
        ("parameter", MARKUP, False),
        ("view", MARKUP, False),
        ("name", MARKUP, False),
        ("name", SHORT_MARKUP, True),
        ("prompt", MARKUP, True),
    ],
)
def test_markup_in_a_link_shows_as_text_and_calls_nothing(
    browser: Browser, app_url: str, field: str, markup: str, applied: bool
):
    """A crafted link puts markup in one field: the toast, the link's note and the status line show it
    as the characters it is, no element comes of it (no image, link or heading), and no request
    leaves for the URLs it names."""
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    pg = context.new_page()
    requests: list[str] = []
    pg.on("request", lambda r: requests.append(r.url))
    try:
        pg.goto(f"{app_url.rstrip('/')}/?cfg={_crafted(field, markup)}")
        note = pg.locator("#link-note")
        if applied:
            expect(note).to_contain_text("restored from the link", timeout=LOAD_TIMEOUT_MS)
            if field == "name":
                expect(pg.locator("#col2-title h3")).to_contain_text(markup)
                column_settings(pg, 2)
                expect(pg.locator("#col2-heading h3")).to_contain_text(markup)
            else:
                expect(pg.locator("#prompt textarea")).to_have_value(markup)
        else:
            expect(note).to_contain_text("not applied", timeout=LOAD_TIMEOUT_MS)
            expect(note).to_contain_text(markup[:40])  # the refusal quotes it, cut where it is long
            toast = pg.locator("[data-testid=toast-text]").first
            expect(toast).to_contain_text("This link's settings were not applied")
            expect(toast).to_contain_text('<img src="/x-injected.png">')
        pg.wait_for_timeout(500)  # anything the markup would load has been asked for by now
        assert (
            pg.evaluate(
                f"() => [...document.querySelectorAll({MESSAGES!r})]"
                f".flatMap(m => [...m.querySelectorAll({RENDERED!r})].map(e => e.outerHTML))"
            )
            == []
        )
        assert not [u for u in requests if "x-injected" in u or "example.org" in u]
        shot(pg, f"markup-link-{field}-{'applied' if applied else 'refused'}", full=False)
    finally:
        context.close()


def test_a_link_over_a_limit_is_refused_on_open_naming_the_field(browser: Browser, app_url: str):
    from feedback.core.records import RunConfig
    from ui.compare import link

    data = link.encode(RunConfig(prompt="Say hi.", max_new_tokens=4096))
    context, pg = open_app(browser, f"{app_url.rstrip('/')}/?cfg={data}")
    try:
        expect(pg.locator("#link-note")).to_contain_text("not applied")
        expect(pg.locator("#link-note")).to_contain_text(
            "max new tokens must be between 1 and 1024, got 4096"
        )
        expect(pg.locator("#prompt textarea")).to_have_value("")
    finally:
        context.close()


def set_columns(pg: Page, want: int) -> None:
    """Add or remove columns until `want` show, one click at a time, each one's column seen before
    the next: a click while the last one's update is on its way is dropped (Gradio runs a button's
    event once at a time), and a click read against a stale count can wait on a button the update
    then disables (four columns: no more to add). Both happened on a busy CI machine."""
    settings(pg, "Columns")
    shown = pg.locator("#column-tabs [role=tab]:visible")
    while (have := shown.count()) != want:
        pg.locator("#add-column" if have < want else "#remove-column").click()
        expect(shown).to_have_count(have + (1 if have < want else -1))


def test_four_columns_stream_and_their_first_token_comes_soon(page: Page):
    set_columns(page, 4)
    expect(page.locator("#add-column")).to_be_disabled()
    close_settings(page)
    page.evaluate("""() => {
      const obs = new MutationObserver(() => {
        if (window.__fl.seen.first4 === undefined && document.querySelector('#col4-text .fl-tok'))
          window.__fl.seen.first4 = performance.now();
      });
      obs.observe(document.body, {childList: true, subtree: true});
    }""")
    generate(page, "Give me three tips for better sleep.", 16)
    for n in (1, 2, 3, 4):
        expect(page.locator(f"#col{n}-text .fl-tok").first).to_be_visible()
    ttft4 = page.evaluate("() => (window.__fl.seen.first4 - window.__fl.clicks.generate) / 1000")
    data = save_metrics(click_to_first_token_4_columns_s=ttft4)
    if "click_to_first_token_s" in data:
        save_metrics(first_token_4_vs_2_columns=ttft4 / data["click_to_first_token_s"])
    assert 0 < ttft4 < 60, ttft4
    shot(page, "workbench-4-columns-1440")
    if SCREENSHOTS:  # the README's picture; ordinary runs leave the tracked file alone
        DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(DOCS_IMAGES / "compare.png"), full_page=False)
    # four headings side by side: each wraps rather than being cut, its badges shown
    for n in (1, 2, 3, 4):
        cut = page.locator(f"#col{n}-title h3").evaluate("(h) => h.scrollWidth > h.clientWidth + 1")
        assert not cut, n
        expect(page.locator(f"#col{n}-title")).to_be_visible()
    page.set_viewport_size({"width": 390, "height": 844})
    shot(page, "workbench-4-columns-390")
    settings(page, "Columns")
    page.locator("#remove-column").click()
    expect(page.locator("#column-tabs [role=tab]:visible").filter(has_text="Column 4")).to_have_count(0)
    close_settings(page)


# The page's targets for a realistic session (4 columns x 200 new tokens, run after run in one tab):
# the JS heap and the DOM after a collection, and how much the renderer's memory may grow from the
# first run to the last. Before the board (each update drew whole columns of HTML again) this session
# took the heap to 80-153 MB, the DOM to 30,000-44,000 nodes and the renderer 280 -> 1,292 MB.
SESSION_HEAP_MB, SESSION_DOM_NODES, SESSION_RSS_GROWTH_MB = 80, 15_000, 150
# Page done after the server's last update (target 1.5 s on an idle machine; CI shares its two cores
# with the suite's other worker, so the test allows more, and the benchmark docs/results/page_stream.py
# measures it idle). Before the board: 1.2, 0.9, 3.2, 6.7, 12.6 and 24.8 s over six runs, idle.
SESSION_PAGE_LAG_S = 5.0
REALISTIC_RUNS, REALISTIC_COLUMNS, REALISTIC_TOKENS = 3, 4, 200  # six runs: docs/results/page_stream.py


def detached_nodes(cdp) -> tuple[int, int]:
    """(nodes, Plotly charts) out of the document but still reachable, as Chromium's DevTools lists them."""

    def count(node: dict) -> tuple[int, int]:
        attrs = node.get("attributes", [])
        chart = int(any("js-plotly-plot" in v for k, v in zip(attrs[::2], attrs[1::2]) if k == "class"))
        below = [count(c) for c in node.get("children", [])]
        return 1 + sum(n for n, _ in below), chart + sum(c for _, c in below)

    # DevTools' DOM agent keeps alive every node it has listed while it is on: off again after
    cdp.send("DOM.enable")
    try:
        trees = [count(d["treeNode"]) for d in cdp.send("DOM.getDetachedDomNodes")["detachedNodes"]]
    finally:
        cdp.send("DOM.disable")
    return sum(n for n, _ in trees), sum(c for _, c in trees)


# The moment (Date.now()) the status line first says a run is done, after it has said it is under way:
# until then it holds the last run's "Done in …", which a redraw of the line would match at once.
# (The line is looked up at each change: a tab shown again draws its components anew.)
DONE_AT_JS = """() => {
  window.__flDone = null;
  let running = false;
  new MutationObserver((_, o) => {
    const text = document.querySelector('#status')?.textContent || '';
    if (!running) { running = /step|Waiting/.test(text) && !/Done/.test(text); return; }
    if (/Done|stopped/.test(text)) { window.__flDone = Date.now(); o.disconnect(); }
  }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


def renderer(browser_cdp) -> tuple[float, float]:
    """(CPU seconds so far, RSS MB) of the busiest renderer process: the app's tab."""
    import psutil

    info = browser_cdp.send("SystemInfo.getProcessInfo")["processInfo"]
    r = max((p for p in info if p["type"] == "renderer"), key=lambda p: p["cpuTime"])
    return r["cpuTime"], psutil.Process(r["id"]).memory_info().rss / 1e6


# Click column `column`'s Stop in the same moment the page shows `shown` of its tokens, if the run
# still runs then: "clicked"; "ended" when the run's end reached the page first (a busy page can
# draw the tokens of many updates at once, the last among them); null while neither. The column is
# this run's, not the last one's: the column Stops show as soon as the page's Stop is enabled, so
# neither says the new run is on the board; the column's element replaced does.
STOP_COLUMN_AT_JS = """
([column, shown]) => {
  if (window.__flOldColumn?.isConnected) return null;
  if (document.querySelector("#stop")?.disabled) return "ended";
  if (document.querySelectorAll(`#col${column}-text .fl-tok`).length < shown) return null;
  document.querySelector(`#col${column}-actions .fl-col-stop`).click();
  return "clicked";
}
"""


def stop_a_column_at(pg: Page, column: int, shown: int, tries: int = 3) -> int:
    """Generate, and stop column `column` once the page shows `shown` of its tokens; a run that
    reached its end before the page showed them (every column at its token limit, end of text or a
    DeepConf early stop) is run again, up to `tries` runs. Returns the runs started."""
    for run in range(1, tries + 1):
        pg.evaluate(NEXT_BOARD_JS, f"col{column}")
        pg.locator("#generate").click()
        said = pg.wait_for_function(STOP_COLUMN_AT_JS, arg=[column, shown], timeout=RUN_TIMEOUT_MS)
        if said.json_value() == "clicked":
            return run
        expect(pg.locator("#status")).to_contain_text("Done", timeout=RUN_TIMEOUT_MS)
        ends = [stop_cell(pg, f"col{n}").inner_text() for n in range(1, REALISTIC_COLUMNS + 1)]
        status = pg.locator("#status").inner_text()
        print(f"the run ended before column {column} showed {shown} tokens: {ends}; {status}")
        assert all(e.startswith(("max_tokens", "eos", "early_stop")) for e in ends), (ends, status)
    pytest.fail(f"{tries} runs ended before the page showed {shown} tokens of column {column}")


def test_a_long_session_of_realistic_runs_keeps_the_page_with_its_model(browser: Browser, app_server):
    """One tab, the sizes people use: three runs of 4 columns x 200 new tokens (the story example);
    then a Stop at ~40 tokens shown, a column's Stop, a follow-up, a branch, a column re-run, a Deep
    Think and a Sweep. After each run the page is done soon after the server's last update; the heap,
    the DOM and the renderer's memory stay under their bounds; a tab click is answered in under a
    second or so; what a job replaced is freed; Stop keeps what the page showed. Figures saved."""
    runner = app_server.app.runner
    ends: list[float] = []
    drive = runner.drive

    def watched(*args, **kwargs):  # the server's clock at each job's last update
        for update in drive(*args, **kwargs):
            yield update
            ends.append(time.time())

    runner.drive = watched
    context, pg = open_app(browser, app_server.url)
    cdp = context.new_cdp_session(pg)
    browser_cdp = browser.new_browser_cdp_session()
    heap, nodes, rss, lags, cpu, clicks = [], [], [], [], [], []
    detached: list[
        tuple[int, int]
    ] = []  # (nodes, charts) no longer in the page but kept alive, after each job
    runs = 0

    def settle() -> None:
        cdp.send("HeapProfiler.collectGarbage")
        metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
        heap.append(metrics["JSHeapUsedSize"] / 1e6)
        nodes.append(cdp.send("Memory.getDOMCounters")["nodes"])
        rss.append(renderer(browser_cdp)[1])
        left = detached_nodes(cdp)
        if left[1]:  # a chart just replaced can still have a redraw queued: released once it has run
            pg.wait_for_timeout(1_500)
            cdp.send("HeapProfiler.collectGarbage")
            left = detached_nodes(cdp)
        detached.append(left)

    def history_click() -> None:
        """From the click to the History tab showing this many runs, timed in the page."""
        pg.wait_for_timeout(500)  # the run is written to History ~0.2 s after "Done" (measured)
        pg.evaluate(
            """(want) => {
          window.__flClick = {t0: null, t1: null};
          document.addEventListener("click", () => {\
 if (window.__flClick.t0 === null) window.__flClick.t0 = performance.now(); },
                                    {capture: true, once: true});
          const obs = new MutationObserver(() => {
            if (window.__flClick.t0 !== null &&\
 (document.querySelector("#history-note")?.textContent || "").includes(want)) {
              window.__flClick.t1 = performance.now(); obs.disconnect();
            }
          });
          window.__flObs?.disconnect();
          window.__flObs = obs;
          obs.observe(document.body, {childList: true, subtree: true, characterData: true});
        }""",
            f"{runs} run(s)",
        )
        pg.get_by_role("tab", name="History").click()
        expect(pg.locator("#history-note")).to_contain_text(f"{runs} run(s)")
        clicks.append(
            pg.evaluate("() => ((window.__flClick.t1 ?? performance.now()) - window.__flClick.t0) / 1000")
        )
        pg.get_by_role("tab", name="Compare").click()

    def done(status: str, start) -> None:
        """`start()`, then wait for that job's end (the status loses the last job's "Done" first)."""
        start()
        expect(pg.locator(status)).not_to_contain_text("Done", timeout=RUN_TIMEOUT_MS)
        expect(pg.locator(status)).to_contain_text("Done", timeout=RUN_TIMEOUT_MS)

    try:
        cdp.send("Performance.enable")
        settings(pg, "Model and sampling")
        set_number(pg, "max-new-tokens", REALISTIC_TOKENS)
        set_columns(pg, REALISTIC_COLUMNS)
        close_settings(pg)
        pg.locator("#examples input").click()  # the story example (a long answer), picked as a person does
        pg.get_by_role("option", name="Write a short story", exact=False).first.click()
        expect(pg.locator("#prompt textarea")).to_have_value(
            "Write a short story about a lighthouse keeper who finds a message in a bottle."
        )
        for _ in range(REALISTIC_RUNS):
            before, cpu0 = len(ends), renderer(browser_cdp)[0]
            pg.evaluate(DONE_AT_JS)
            done("#status", pg.locator("#generate").click)
            pg.wait_for_function("() => window.__flDone !== null")
            lags.append(pg.evaluate("() => window.__flDone") / 1000 - ends[-1])
            assert len(ends) > before
            shown = sum(spans(pg, f"col{n}").count() for n in range(1, REALISTIC_COLUMNS + 1))
            cpu.append(1000 * (renderer(browser_cdp)[0] - cpu0) / shown)
            runs += 1
            settle()
            history_click()
        shot(pg, "session-4x200-1440", full=False)
        print("page lag s after each realistic run:", [round(x, 2) for x in lags])  # shown on a failure too
        # Stop at ~40 tokens shown: answered at once, and the run keeps what the page showed
        pg.locator("#generate").click()
        pg.wait_for_function(
            "() => document.querySelectorAll('#col1-text .fl-tok').length >= 40", timeout=RUN_TIMEOUT_MS
        )
        clicked = time.monotonic()
        pg.locator("#stop").click()
        expect(pg.locator("#status")).to_contain_text("Done (stopped)", timeout=RUN_TIMEOUT_MS)
        stop_s = time.monotonic() - clicked  # to the run's end in the status line (polled: ~0.1 s more)
        shown_at_stop = spans(pg, "col1").count()
        pg.wait_for_timeout(1_000)
        assert spans(pg, "col1").count() == shown_at_stop  # nothing arrives after
        runs += 1
        # a column's Stop, at ~40 tokens: that column keeps exactly what the page showed of it
        pg.evaluate(TIMERS_JS)  # records the column's count at the click
        runs += stop_a_column_at(pg, 2, 40)
        clicked = time.monotonic()
        # on a busy machine the page can draw well behind the decode: the column's end comes when
        # the page has drawn up to it (the decode may have reached 200 tokens; the column keeps 40)
        expect(stop_cell(pg, "col2")).to_contain_text("stopped", timeout=RUN_TIMEOUT_MS)
        print(f"column 2 shown stopped {time.monotonic() - clicked:.1f} s after its Stop")
        # the others need not run on to 200 tokens here (if the run is still running by now)
        pg.evaluate(
            "() => { const stop = document.querySelector('#stop'); if (!stop.disabled) stop.click(); }"
        )
        expect(pg.locator("#status")).to_contain_text("Done", timeout=RUN_TIMEOUT_MS)
        assert spans(pg, "col2").count() == pg.evaluate("() => window.__fl.column_stop_shown")
        settle()
        # the rest of a session, shorter: a follow-up, a branch, one column again, a Deep Think, a Sweep
        settings(pg, "Model and sampling")
        set_number(pg, "max-new-tokens", 24)
        close_settings(pg)
        pg.locator("#follow-up textarea").fill("Say it again, shorter.")
        done("#status", lambda: pg.locator("#follow-up textarea").press("Enter"))
        runs += 1
        pg.locator("#col2-text .fl-tok").nth(2).click()  # a branch from an alternative
        done("#status", pg.locator("#fl-card button.fl-alt").nth(1).click)
        runs += 1
        done("#status", pg.locator("#col2-actions .fl-rerun").click)  # one column again
        runs += 1
        settle()
        history_click()
        pg.get_by_role("tab", name="Deep Think").click()
        set_number(pg, "dt-traces", 16)
        set_number(pg, "dt-warmup", 1)
        set_number(pg, "dt-max-new", 8)
        done("#dt-status", pg.locator("#dt-run").click)
        pg.get_by_role("tab", name="Sweep").click()
        radio(pg, "sweep-source", "pasted text")
        pg.locator("#sweep-text textarea").fill(
            "Rivers carry water to the sea. The sea gives it back as rain. " * 3
        )
        pg.locator("#sweep-grid-x textarea").fill("lam=0,0.05")
        pg.locator("#sweep-grid-y textarea").fill("")
        done("#sweep-status", pg.locator("#sweep-run").click)
        # the best point (lam=0.05: lam=0 is the baseline) beats the baseline on this text and goes to
        # column 3, the first on deep_cache
        pg.locator("#sweep-send").click()
        expect(pg.get_by_role("tab", name="Compare")).to_have_attribute("aria-selected", "true")
        column_settings(pg, 3)
        expect(pg.locator("#col3-heading")).to_contain_text("Sweep best · deep_cache")
        expect(pg.locator("#col3-heading")).to_contain_text("lam=0.05")
        close_settings(pg)
        settle()
        save_metrics(
            session_page_lag_s_max=max(lags),
            session_heap_mb_max=max(heap),
            session_dom_nodes_max=max(nodes),
            session_rss_growth_mb=rss[REALISTIC_RUNS - 1] - rss[0],
            session_click_s_max=max(clicks),
            session_stop_s=stop_s,
            session_renderer_cpu_ms_per_token=sum(cpu) / len(cpu),
        )
        print(
            "page lag s:",
            [round(x, 2) for x in lags],
            "heap MB:",
            [round(h, 1) for h in heap],
            "DOM:",
            nodes,
            "renderer RSS MB:",
            [round(r) for r in rss],
            "renderer CPU ms/token:",
            [round(c, 2) for c in cpu],
            "clicks s:",
            [round(c, 2) for c in clicks],
            "stop s:",
            round(stop_s, 2),
        )
        assert max(lags) < SESSION_PAGE_LAG_S, lags
        assert max(heap) < SESSION_HEAP_MB, heap
        # the Compare session's DOM (the last count has the Deep Think and Sweep tabs' charts and tables)
        assert max(nodes[:-1]) < SESSION_DOM_NODES, nodes
        assert rss[REALISTIC_RUNS - 1] - rss[0] < SESSION_RSS_GROWTH_MB, rss
        assert stop_s < SESSION_PAGE_LAG_S, stop_s
        # What a job replaced must not stay alive (Gradio's Plot once kept every replaced chart; its
        # Dataframe every row it drew). A few hundred small nodes come and go. The last count has the
        # Deep Think tab's table, out of the page while its tab is hidden and back when it is shown.
        print("detached DOM nodes, charts after each job:", detached)
        assert all(charts == 0 for _, charts in detached), detached
        assert max(n for n, _ in detached[:-1]) < 1_000, detached
        # 1.5 s: CI's two cores are shared by the suite's other worker, this server and the browser
        assert max(clicks) < 1.5, clicks
        assert not pg.errors, pg.errors
        assert pg.evaluate(DUPLICATE_IDS) == []  # every tab has been drawn by now
    finally:
        runner.drive = drive
        context.close()
