"""What one browser tab keeps alive over many runs: measured in Chromium, not guessed.

    python app.py --port 7861 &            # the app, on the embedded model
    python docs/page_memory.py --url http://127.0.0.1:7861/ --runs 12 [--history]

Opens the page in headless Chromium (Debian's /usr/bin/chromium, driven by Playwright), runs Compare
`--runs` times (8 new tokens, two warm-up runs first), with `--history` opening the History tab
after each run as a person checking their runs would, and after each run (after a garbage
collection) prints: the page's DOM nodes and event listeners (Chromium's counters: attached and
detached alike), the nodes no longer in the page but still reachable (DevTools' detached-node
list), grouped by the element at the top of each detached tree, and the JS heap in use.

A page that frees what it replaces keeps nodes and listeners level from run to run; its heap grows
only by what it stores on purpose (History's runs, up to its cap of 30)."""
from __future__ import annotations

import argparse
import collections
import json

from playwright.sync_api import expect, sync_playwright

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
RUN_TIMEOUT_MS = 120_000


def detached(cdp) -> collections.Counter:
    """Nodes out of the page but alive, counted per the kind of element heading their tree."""
    def size(node: dict) -> int:
        return 1 + sum(size(c) for c in node.get("children", []))

    def label(node: dict) -> str:
        attrs = node.get("attributes", [])
        cls = dict(zip(attrs[::2], attrs[1::2])).get("class", "")
        return f"{node['nodeName'].lower()}" + (f".{cls.split()[0]}" if cls.split() else "")

    kinds: collections.Counter = collections.Counter()
    cdp.send("DOM.enable")  # DevTools' DOM agent keeps alive every node it has listed while it is on
    try:
        for tree in cdp.send("DOM.getDetachedDomNodes")["detachedNodes"]:
            kinds[label(tree["treeNode"])] += size(tree["treeNode"])
    finally:
        cdp.send("DOM.disable")
    return kinds


def sample(cdp) -> dict:
    cdp.send("HeapProfiler.collectGarbage")
    counters = cdp.send("Memory.getDOMCounters")
    metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
    kinds = detached(cdp)
    return {"nodes": counters["nodes"], "listeners": counters["jsEventListeners"],
            "detached": sum(kinds.values()), "detached_by_kind": dict(kinds.most_common(4)),
            "heap_mb": round(metrics["JSHeapUsedSize"] / 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:7861/")
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--history", action="store_true", help="open the History tab after each run")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        page.goto(args.url)
        page.wait_for_selector("#generate")
        cdp = page.context.new_cdp_session(page)
        cdp.send("Performance.enable")
        page.locator("button.label-wrap").filter(has_text="Sampling").click()
        tokens = page.locator("#max-new-tokens input").first
        tokens.fill("8")
        tokens.press("Tab")
        expect(tokens).to_have_value("8")
        page.locator("#prompt textarea").fill("Why is the sky blue?")

        def run() -> None:
            page.locator("#generate").click()
            expect(page.locator("#status")).not_to_contain_text("Done", timeout=RUN_TIMEOUT_MS)
            expect(page.locator("#status")).to_contain_text("Done", timeout=RUN_TIMEOUT_MS)
            page.wait_for_timeout(800)  # the run is written to History just after "Done"
            if args.history:
                page.get_by_role("tab", name="History").click()
                expect(page.locator("#history-note")).to_contain_text("stored in this browser")
                page.wait_for_timeout(1000)
                page.get_by_role("tab", name="Compare").click()

        for _ in range(2):
            run()
        print(json.dumps({"run": "warm-up"} | sample(cdp)))
        for n in range(1, args.runs + 1):
            run()
            print(json.dumps({"run": n} | sample(cdp)))
        browser.close()


if __name__ == "__main__":
    main()
