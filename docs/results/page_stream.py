"""Does the page keep up with its model? Measured in Chromium on realistic runs, not guessed.

    python docs/results/page_stream.py [--runs 6] [--columns 4] [--tokens 200] [--example 3]

Serves the app in this process (the embedded model) and opens it in headless Chromium (Debian's
/usr/bin/chromium, driven by Playwright). One tab runs Compare `--runs` times: `--columns` columns of
`--tokens` new tokens on an example prompt (3: the story, a long answer). After each run it prints one JSON line:

- `page_lag_s`: from the server's last update of the run (its clock: the app's runner is watched
  here) to the page showing "Done" (the page's clock; same machine);
- `bytes_per_token`: what the page received while the run streamed (Chromium's network events on
  the page's event stream) per token shown, summed over columns;
- `renderer_cpu_ms_per_token` and `server_cpu_ms_per_token`: the tab's renderer process and this
  process (the model and the server), per token shown;
- after a garbage collection: JS heap, DOM nodes, renderer RSS.

Then it stops a run at ~40 tokens shown (`stop_ack_s`: click to "Stopping…" in the status line;
`stop_answer_s`: to the run's end, "stopped") and stops column 2 of another (`column_kept_vs_shown`:
tokens column 2 kept minus those it showed at the click: 0 when it keeps exactly what was shown). A
last line sums it up against the page's targets (page done ≤ 1.5 s after the server, Stop ≤ 1 s,
renderer RSS growth run 1 → last ≤ 150 MB, heap ≤ 80 MB, DOM ≤ 15,000 nodes).

Runs on older versions of the page too (it reads only the status line, the columns' tokens and the
Stop buttons), which is how the README's before/after figures were taken.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import psutil  # noqa: E402
from playwright.sync_api import expect, sync_playwright  # noqa: E402

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
RUN_TIMEOUT_MS = 300_000
TARGETS = {"page_lag_s": 1.5, "stop_ack_s": 1.0, "rss_growth_mb": 150, "heap_mb": 80, "dom_nodes": 15_000}


def serve():
    """The app on the embedded model, in this process; its URL and a list of the times (epoch s)
    at which the runner made each job's last update."""
    import socket

    from feedback.serve.pool import ModelPool
    from ui.layout import FeedbackLensApp
    from ui.page.theme import launch_kwargs

    app = FeedbackLensApp(ModelPool(["embedded"]))
    demo = app.build()
    demo.queue(default_concurrency_limit=1)
    ends: list[float] = []
    drive = app.runner.drive

    def watched(*args, **kwargs):
        for update in drive(*args, **kwargs):
            yield update
            ends.append(time.time())  # the last one made is the job's end

    app.runner.drive = watched
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **launch_kwargs())
    return f"http://127.0.0.1:{port}/", ends


def open_settings(pg, tab: str, legacy_accordion: str) -> None:
    """A settings tab (the page since the board), or the accordion an older page had."""
    if pg.locator("#settings").count():
        if pg.locator("#settings-tabs").is_hidden():
            pg.locator("#settings button.label-wrap").first.click()
        pg.get_by_role("tab", name=tab).click()
    else:
        pg.locator("button.label-wrap").filter(has_text=legacy_accordion).click()


def setup(pg, columns: int, tokens: int, prompt: str) -> None:
    open_settings(pg, "Model and sampling", "Sampling")
    box = pg.locator("#max-new-tokens input").first
    box.fill(str(tokens))
    box.press("Tab")
    open_settings(pg, "Columns", "Sampling")
    for _ in range(columns - 2):
        pg.locator("#add-column").click()
        pg.wait_for_timeout(400)
    pg.locator("#prompt textarea").fill(prompt)


COUNT_JS = "(n) => Array.from({length: n}, (_, i) => document.querySelectorAll(`#col${i + 1}-text .fl-tok`).length)"
# the first "Done" or "stopped" in the status line after it has said the run is under way
DONE_WATCH_JS = """() => {
  window.__done = null;
  let running = false;
  const obs = new MutationObserver(() => {
    const t = document.querySelector('#status')?.textContent || '';
    if (!running) { running = /step|Waiting|line/.test(t) && !/Done/.test(t); return; }
    if (window.__done === null && /Done|[Ss]topped/.test(t)) { window.__done = Date.now(); obs.disconnect(); }
  });
  obs.observe(document.body, {childList: true, subtree: true, characterData: true});
}"""


# the first "Stopping" in the status line: Stop taken (the run's end comes a moment later)
ACK_WATCH_JS = """() => {
  window.__ack = null;
  const obs = new MutationObserver(() => {
    if (/Stopping/.test(document.querySelector('#status')?.textContent || '')) { window.__ack = Date.now(); obs.disconnect(); }
  });
  obs.observe(document.body, {childList: true, subtree: true, characterData: true});
}"""


class Meter:
    """The tab's renderer (CPU time, RSS) and what the page receives, read through DevTools."""

    def __init__(self, browser, page):
        self.browser_cdp = browser.new_browser_cdp_session()
        self.cdp = page.context.new_cdp_session(page)
        self.cdp.send("Performance.enable")
        self.cdp.send("Network.enable")
        self.bytes, self.urls = 0, {}
        self.cdp.on("Network.requestWillBeSent", lambda e: self.urls.__setitem__(e["requestId"], e["request"]["url"]))
        self.cdp.on("Network.dataReceived", self._data)
        self.me = psutil.Process()

    def _data(self, e) -> None:
        if "/queue/data" in self.urls.get(e["requestId"], ""):
            self.bytes += e["dataLength"]

    def renderer(self) -> tuple[float, float]:
        """(CPU seconds so far, RSS MB) of the busiest renderer (the app's tab)."""
        info = self.browser_cdp.send("SystemInfo.getProcessInfo")["processInfo"]
        r = max((p for p in info if p["type"] == "renderer"), key=lambda p: p["cpuTime"])
        return r["cpuTime"], psutil.Process(r["id"]).memory_info().rss / 1e6

    def server_cpu(self) -> float:
        t = self.me.cpu_times()
        return t.user + t.system

    def settled(self) -> dict:
        self.cdp.send("HeapProfiler.collectGarbage")
        metrics = {m["name"]: m["value"] for m in self.cdp.send("Performance.getMetrics")["metrics"]}
        nodes = self.cdp.send("Memory.getDOMCounters")["nodes"]
        return {"heap_mb": round(metrics["JSHeapUsedSize"] / 1e6, 1), "dom_nodes": nodes,
                "renderer_rss_mb": round(self.renderer()[1])}


def one_run(pg, meter: Meter, ends: list, columns: int) -> dict:
    pg.evaluate(DONE_WATCH_JS)
    cpu0, _ = meter.renderer()
    server0, bytes0, n_ends = meter.server_cpu(), meter.bytes, len(ends)
    pg.locator("#generate").click()
    pg.wait_for_function("() => window.__done !== null", timeout=RUN_TIMEOUT_MS)
    page_done = pg.evaluate("() => window.__done") / 1000
    pg.wait_for_timeout(300)
    shown = sum(pg.evaluate(COUNT_JS, columns))
    cpu1, _ = meter.renderer()
    server_done = ends[-1] if len(ends) > n_ends else float("nan")
    tokens = max(1, shown)
    return {"tokens": shown, "page_lag_s": round(page_done - server_done, 2),
            "bytes_per_token": round((meter.bytes - bytes0) / tokens),
            "renderer_cpu_ms_per_token": round(1000 * (cpu1 - cpu0) / tokens, 2),
            "server_cpu_ms_per_token": round(1000 * (meter.server_cpu() - server0) / tokens, 2),
            **meter.settled()}


def stop_checks(pg, columns: int) -> dict:
    """Stop at ~40 tokens shown: click to "stopped"; then a column's Stop: what it kept vs showed."""
    pg.evaluate(DONE_WATCH_JS)
    pg.evaluate(ACK_WATCH_JS)
    pg.locator("#generate").click()
    pg.wait_for_function("() => (document.querySelectorAll('#col1-text .fl-tok').length >= 40)", timeout=RUN_TIMEOUT_MS)
    clicked = pg.evaluate("() => Date.now()")
    pg.locator("#stop").click()
    pg.wait_for_function("() => window.__done !== null", timeout=RUN_TIMEOUT_MS)
    stop_answer = (pg.evaluate("() => window.__done") - clicked) / 1000
    acked = pg.evaluate("() => window.__ack")
    stop_ack = (acked - clicked) / 1000 if acked else stop_answer  # an older page says nothing until the end
    pg.wait_for_timeout(500)
    pg.evaluate(DONE_WATCH_JS)
    pg.locator("#generate").click()
    pg.wait_for_function("() => (document.querySelectorAll('#col2-text .fl-tok').length >= 40)", timeout=RUN_TIMEOUT_MS)
    pg.evaluate("""() => document.addEventListener("click", (e) => {  // the count at the click itself
      if (e.target.closest && e.target.closest(".fl-col-stop"))
        window.__shown = document.querySelectorAll('#col2-text .fl-tok').length;
    }, {capture: true, once: true})""")
    pg.locator("#col2-actions .fl-col-stop").click()
    shown = pg.evaluate("() => window.__shown")
    pg.wait_for_function("() => window.__done !== null", timeout=RUN_TIMEOUT_MS)
    pg.wait_for_timeout(500)
    kept = pg.evaluate("() => document.querySelectorAll('#col2-text .fl-tok').length")
    stop_cell = pg.locator("#metrics tbody tr").filter(has_text="stop").first.inner_text()
    return {"stop_ack_s": round(stop_ack, 2), "stop_answer_s": round(stop_answer, 2),
            "column_shown_at_click": shown, "column_kept": kept,
            "column_kept_vs_shown": kept - shown, "stop_row": " ".join(stop_cell.split())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--columns", type=int, default=4, choices=[2, 3, 4])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--example", type=int, default=3, help="index in assets/examples.json (3: the story)")
    args = ap.parse_args()
    prompt = json.loads(Path("assets/examples.json").read_text(encoding="utf-8"))[args.example]["prompt"]
    url, ends = serve()
    print(json.dumps({"cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
                      "cores": os.cpu_count(), "columns": args.columns, "tokens": args.tokens, "prompt": prompt}),
          flush=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1440, "height": 900})
        pg.goto(url)
        pg.wait_for_selector("#generate")
        expect(pg.locator("#generate")).to_be_enabled()
        setup(pg, args.columns, args.tokens, prompt)
        meter = Meter(browser, pg)
        runs = []
        pg.screenshot(path="/tmp/page_stream_setup.png")
        for n in range(args.runs):
            runs.append(one_run(pg, meter, ends, args.columns) | {"run": n + 1})
            print(json.dumps(runs[-1]), flush=True)
        stops = stop_checks(pg, args.columns)
        print(json.dumps(stops), flush=True)
        browser.close()
    summary = {"page_lag_s_max": max(r["page_lag_s"] for r in runs), "stop_ack_s": stops["stop_ack_s"],
               "stop_answer_s": stops["stop_answer_s"],
               "rss_growth_mb": runs[-1]["renderer_rss_mb"] - runs[0]["renderer_rss_mb"],
               "heap_mb_max": max(r["heap_mb"] for r in runs), "dom_nodes_max": max(r["dom_nodes"] for r in runs),
               "bytes_per_token_mean": round(sum(r["bytes_per_token"] for r in runs) / len(runs)),
               "renderer_cpu_ms_per_token_mean": round(sum(r["renderer_cpu_ms_per_token"] for r in runs) / len(runs), 2),
               "column_kept_vs_shown": stops["column_kept_vs_shown"]}
    print(json.dumps({"summary": summary, "targets": TARGETS}))
    os._exit(0)  # the app's server threads would keep the process alive


if __name__ == "__main__":
    main()
