"""Real-browser end-to-end tests: headless Chromium drives the Compare tab of the running app.

The app is the real one on the embedded model (the session fixture `app_url`), talked to only on
127.0.0.1. Timings are taken inside the page (click listener + MutationObserver, `performance.now()`),
so they measure what a user sees, and are written to test-output/e2e-metrics.json.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(f"browser e2e tests need Debian's chromium at {CHROMIUM} (not found)", allow_module_level=True)

from playwright.sync_api import Browser, Page, expect, sync_playwright  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "test-output"
METRICS = OUT / "e2e-metrics.json"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
LOAD_TIMEOUT_MS = 30_000
RUN_TIMEOUT_MS = 90_000  # generous: the CPU may be shared with other jobs
ANSWER_TOKENS = 64  # enough for two sentences, and keeps the run short on a slow CPU

# In-page timers: the moment of a button click and the first DOM state matching a condition.
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
  watch("first_token", () => document.querySelector("#baseline-text .fl-tok") !== null);
  watch("done", () => (document.querySelector("#status")?.textContent || "").includes("Done"));
}
"""


def save_metrics(**values: float) -> dict:
    """Merge `values` into test-output/e2e-metrics.json and print the whole file."""
    OUT.mkdir(exist_ok=True)
    data = json.loads(METRICS.read_text(encoding="utf-8")) if METRICS.exists() else {}
    data.update({k: round(v, 3) for k, v in values.items()})
    METRICS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"\ne2e metrics ({METRICS}): {json.dumps(data, sort_keys=True)}")
    return data


@pytest.fixture(scope="module")
def browser() -> Browser:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser: Browser, app_url: str, request) -> Page:
    """A fresh context (own local storage, own Gradio session) with the app loaded; a screenshot of
    the page is saved to test-output/ when the test fails."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(LOAD_TIMEOUT_MS)
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    assert app_url.startswith("http://127.0.0.1:")
    pg.goto(app_url)
    expect(pg.locator("#prompt textarea")).to_be_editable(timeout=LOAD_TIMEOUT_MS)
    expect(pg.locator("#generate")).to_be_enabled()
    expect(pg.locator("#stop")).to_be_disabled()
    expect(pg.locator("#baseline-text .fl-text")).to_be_visible()
    pg.evaluate(TIMERS_JS)
    failed_before = request.session.testsfailed
    yield pg
    if request.session.testsfailed > failed_before:
        OUT.mkdir(exist_ok=True)
        shot = OUT / f"e2e-failed-{request.node.name}.png"
        pg.screenshot(path=str(shot), full_page=True)
        print(f"\nscreenshot of the failed page: {shot}; page errors: {errors}")
    context.close()


def spans(pg: Page, column: str):
    return pg.locator(f"#{column}-text .fl-tok")


def stop_cell(pg: Page, column: str):
    """The stats table's "stop" value of one column."""
    return pg.locator(f"#{column}-stats tr").filter(has=pg.locator("th", has_text="stop")).locator("td")


def set_max_new_tokens(pg: Page, n: int) -> None:
    """Open the (closed by default) Sampling accordion and type a max-new-tokens value."""
    pg.locator("button.label-wrap").filter(has_text="Sampling").click()
    field = pg.locator("#max-new-tokens input")
    expect(field).to_be_visible()
    field.fill(str(n))
    field.press("Tab")
    expect(field).to_have_value(str(n))


def test_generate_streams_both_columns_with_charts_and_token_views(page: Page):
    set_max_new_tokens(page, ANSWER_TOKENS)
    page.locator("#prompt textarea").fill("Explain why the sky is blue in two sentences.")
    page.locator("#generate").click()

    # Streaming: the first coloured token shows up while the run is still going.
    expect(spans(page, "baseline").first).to_be_visible(timeout=RUN_TIMEOUT_MS)
    page.wait_for_function("() => window.__fl.seen.first_token !== undefined")
    ttft = page.evaluate("() => (window.__fl.seen.first_token - window.__fl.clicks.generate) / 1000")
    assert 0 < ttft < 30, ttft

    expect(page.locator("#status")).to_contain_text("Done in", timeout=RUN_TIMEOUT_MS)
    print("\nstatus:", page.locator("#status").inner_text().strip())
    expect(page.locator("#generate")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()
    for column in ("baseline", "feedback"):
        expect(spans(page, column).first).to_be_visible()
        expect(page.locator(f"#{column}-text .fl-caret")).to_have_count(0)  # finished: no cursor
        expect(page.locator(f"#{column}-stats")).to_contain_text("tokens/s")
        expect(stop_cell(page, column)).not_to_have_text("running…")
    n_base, n_fb = spans(page, "baseline").count(), spans(page, "feedback").count()
    assert 5 <= n_base <= ANSWER_TOKENS and 5 <= n_fb <= ANSWER_TOKENS, (n_base, n_fb)
    expect(page.locator("#baseline-stats tr").first).to_contain_text(str(n_base))

    # Confidence chart: Plotly drew a token-conf and a group-conf trace for each row.
    chart = page.locator("#conf-plot .js-plotly-plot")
    expect(chart).to_be_visible()
    page.wait_for_function(
        "() => document.querySelectorAll('#conf-plot .js-plotly-plot .scatterlayer .trace').length >= 4",
        timeout=10_000)
    legend = " | ".join(chart.locator(".legendtext").all_text_contents())
    for name in ("baseline token conf", "baseline group conf", "feedback token conf", "feedback group conf"):
        assert name in legend, legend
    assert chart.locator(".scatterlayer .trace path.js-line").count() >= 4  # lines, not empty traces

    # Hover details on a token.
    token = spans(page, "feedback").nth(min(2, n_fb - 1))
    token.hover()
    title = token.get_attribute("title") or ""
    assert "confidence" in title and "top-5" in title and "entropy" in title, title

    # The confidence view's text, then the plain view: no spans, the same text.
    coloured = {c: "".join(spans(page, c).all_text_contents()) for c in ("baseline", "feedback")}
    assert all(t.strip() for t in coloured.values()), coloured
    page.locator("#token-view label").filter(has_text="plain").click()
    for column in ("baseline", "feedback"):
        expect(spans(page, column)).to_have_count(0, timeout=10_000)
        body = page.locator(f"#{column}-text .fl-text")
        expect(body).to_be_visible()
        assert body.text_content() == coloured[column]
    page.locator("#token-view label").filter(has_text="confidence").click()
    expect(spans(page, "baseline")).to_have_count(n_base, timeout=10_000)

    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / "e2e-compare.png"), full_page=True)
    save_metrics(click_to_first_token_s=ttft)


def test_stop_ends_a_long_generation(page: Page):
    set_max_new_tokens(page, 1000)

    page.locator("#prompt textarea").fill("Write a very long story about a lighthouse keeper and the sea.")
    page.locator("#generate").click()
    expect(page.locator("#status")).to_contain_text("/ 1000", timeout=RUN_TIMEOUT_MS)  # the setting took
    page.wait_for_function("() => document.querySelectorAll('#baseline-text .fl-tok').length >= 10",
                           timeout=RUN_TIMEOUT_MS)
    expect(page.locator("#stop")).to_be_enabled()
    at_stop = spans(page, "baseline").count()
    page.locator("#stop").click()

    expect(page.locator("#status")).to_contain_text("Done", timeout=15_000)
    page.wait_for_function("() => window.__fl.seen.done !== undefined && window.__fl.clicks.stop !== undefined")
    stop_to_done = page.evaluate("() => (window.__fl.seen.done - window.__fl.clicks.stop) / 1000")
    assert 0 < stop_to_done < 15, stop_to_done

    for column in ("baseline", "feedback"):
        expect(stop_cell(page, column)).to_contain_text("stopped")
    expect(page.locator("#generate")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()
    final = spans(page, "baseline").count()
    assert at_stop <= final < 250, (at_stop, final)
    page.wait_for_timeout(2_000)  # nothing may arrive after the run ended
    assert spans(page, "baseline").count() == final
    expect(page.locator("#status")).to_contain_text("Done")

    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / "e2e-stop.png"), full_page=True)
    save_metrics(stop_to_done_s=stop_to_done, stop_tokens_at_click=at_stop, stop_tokens_final=final)
