"""The page: the Gradio Blocks with its tabs (Compare, Perplexity, Sweep, Deep Think, History) on
one model pool. `app.py` launches it (flags, server, HTTP API); this module only lays it out.

Every handler that runs the model goes through one `ModelRunner` (the shared model line, the
ZeroGPU function, Stop, closed tabs, errors); the tabs only turn library results into HTML and figures.
"""

from __future__ import annotations

import gradio as gr

from feedback.core.budget import Budget
from feedback.serve.pool import ModelPool
from ui.compare.tab import CompareTab
from ui.deepthink.tab import DeepThinkTab
from ui.history.tab import HistoryTab
from ui.page.checked import CheckedBlocks
from ui.page.runner import ModelRunner
from ui.perplexity.tab import PerplexityTab
from ui.sweep.tab import SweepTab

INTRO = (
    "# Feedback Lens\nOne model, one prompt, decodes streamed side by side: a plain **baseline** and "
    "**activation-feedback** decodes, which feed the model's own deep hidden states back into it while it "
    "generates (no training), and prompt variants in up to four columns. Token colours show the model's "
    "confidence (DeepConf); the charts show where confidence dips, where each column would stop early, and "
    "where the columns first differ. Continue a conversation, branch from any token, share a link."
)


class FeedbackLensApp:
    """Holds the model pool and the runner; `build()` returns the Blocks."""

    def __init__(self, pool: ModelPool, gpu=None, budget: Budget | None = None):
        self.pool = pool
        self.runner = ModelRunner(pool, gpu=gpu, budget=budget)
        self.compare = CompareTab(pool, self.runner)
        self.perplexity = PerplexityTab(pool, self.runner)
        self.sweep = SweepTab(pool, self.runner, self.compare)  # its best points go to Compare
        self.deepthink = DeepThinkTab(pool, self.runner)
        self.history = HistoryTab(self.compare)

    def closed(self, request: gr.Request = None) -> None:
        """The browser tab closed (or reloaded): stop its jobs, waiting or running."""
        session = getattr(request, "session_hash", None)
        if session:
            self.runner.jobs.stop(session)

    def build(self) -> CheckedBlocks:
        layers = self.pool.get().num_layers
        # Gradio's cache of uploaded and returned files: anything older than an hour is removed, hourly.
        with CheckedBlocks(title="Feedback Lens", delete_cache=(3600, 3600)) as demo:
            gr.Markdown(INTRO, elem_id="intro")
            hist = gr.BrowserState([], storage_key="feedback-lens-history")
            with gr.Tabs(overflow_behavior="wrap") as tabs:  # every tab reachable on a phone
                self.compare.build(layers, hist)
                self.perplexity.build(layers)
                self.sweep.build(layers, tabs)
                self.deepthink.build(layers)
                self.history.build(hist, tabs)
            demo.load(
                self.history.view, hist, self.history.view_outputs, api_name=False, show_progress="hidden"
            )
            demo.load(
                self.compare.open_link,
                None,
                self.compare.restore_outputs(),
                api_name=False,
                show_progress="hidden",
            )
            demo.unload(self.closed)
        return demo


def build_app(pool: ModelPool | None = None) -> gr.Blocks:
    from feedback.serve.pool import allowlist_from_env

    return FeedbackLensApp(pool or ModelPool(allowlist_from_env())).build()
