"""What the Perplexity and Sweep tabs share: where the text comes from, its limits, the mode inputs,
and the per-token surprise view. Every limit is read from where it is declared (`feedback.serve.limits`,
`feedback.eval.perplexity`)."""

from __future__ import annotations

from html import escape
from pathlib import Path

import gradio as gr
import numpy as np

from feedback.errors import FeedbackError
from feedback.eval import corpus
from feedback.eval.figures import DELTA_LEGEND
from feedback.eval.perplexity import PASSES, PPLConfig
from feedback.serve.limits import MAX_DOCS, SERVED_TEXT_MAX_CHARS, UPLOAD_MAX_BYTES
from ui.page import notice, render
from ui.page.controls import bound_number

TEXT_MAX_CHARS = SERVED_TEXT_MAX_CHARS
SOURCES = ["pasted text", "uploaded file", "builtin:dev", "builtin:test"]


def mode_of(mode: str) -> str | None:
    return None if mode == "auto" else mode


def load_documents(source: str, text: str | None, upload: str | None, max_docs: int) -> list[corpus.Document]:
    """The documents a request asks for, with size limits and clear errors."""
    if source == "pasted text":
        if not text or not text.strip():
            raise FeedbackError("paste some text first (or choose another source)")
        if len(text) > TEXT_MAX_CHARS:
            raise FeedbackError(f"pasted text is limited to {TEXT_MAX_CHARS} characters, got {len(text)}")
        return [corpus.Document("pasted text", text)]
    if source == "uploaded file":
        if not upload:
            raise FeedbackError("upload a .txt or .jsonl file first")
        path = Path(upload)
        problem = None
        if path.stat().st_size > UPLOAD_MAX_BYTES:
            problem = (
                f"uploads are limited to {UPLOAD_MAX_BYTES // 1_000_000} MB; "
                f"this file is {path.stat().st_size / 1e6:.1f} MB"
            )
        elif path.suffix not in (".txt", ".jsonl"):
            problem = "upload a .txt file or a .jsonl file with a 'text' field"
        if problem:
            path.unlink(missing_ok=True)  # a refused upload leaves nothing on the server's disk
            raise FeedbackError(problem)
        warnings: list[str] = []
        docs = corpus.load(str(path), warnings.append)
        if warnings:
            notice.warning(
                f"{len(warnings)} line(s) skipped: " + "; ".join(w.split(": ", 1)[1] for w in warnings[:3])
            )
        return docs[:max_docs]
    if source in ("builtin:dev", "builtin:test"):
        return corpus.load(source)[:max_docs]
    raise FeedbackError(f"unknown source {source!r}")


def load_named(values: dict) -> list[corpus.Document]:
    """The documents of a handler's values by name: `source`, `text`, `upload` and `max_docs`."""
    return load_documents(
        values["source"], values["text"], values["upload"], MAX_DOCS.check(values["max_docs"])
    )


def scoring_config(values: dict, strategy: str, params: dict, **settings) -> PPLConfig:
    """The scoring settings of a handler's values by name (`mode`, `passes`), with `settings` the
    tab fixes itself (anything else, such as the bootstrap resamples, is `PPLConfig`'s default). The
    passes are checked whatever the mode: the page always sends the box's value."""
    return PPLConfig(strategy, params, mode_of(values["mode"]), PASSES.check(values["passes"]), **settings)


def source_inputs(prefix: str, start_source: str = "pasted text", start_docs: int = 20):
    """The source radio (starting at `start_source`), the documents box (at `start_docs`), the text
    box and the upload. The Perplexity tab starts on pasted text; the Sweep, whose first Run should
    work as the page opens, on a built-in split with a count that fits the scoring budget."""
    with gr.Row():
        source = gr.Radio(SOURCES, value=start_source, label="Text", elem_id=f"{prefix}-source")
        max_docs = bound_number(MAX_DOCS, start_docs, elem_id=f"{prefix}-max-docs")
    text = gr.Textbox(label="Text to score", lines=6, max_length=TEXT_MAX_CHARS, elem_id=f"{prefix}-text")
    upload = gr.File(
        label=f"or a .txt / .jsonl file (≤ {UPLOAD_MAX_BYTES // 1_000_000} MB)",
        file_types=[".txt", ".jsonl"],
        type="filepath",
        elem_id=f"{prefix}-upload",
    )
    return source, text, upload, max_docs


def mode_inputs(prefix: str):
    mode = gr.Radio(
        ["auto", "exact", "parallel", "jacobi"],
        value="auto",
        label="mode",
        elem_id=f"{prefix}-mode",
        info="auto: parallel when exact in one pass, else jacobi",
    )
    passes = bound_number(PASSES, PPLConfig().passes, elem_id=f"{prefix}-passes")
    return mode, passes


def surprise_color(delta: float, bound: float) -> str:
    """Blue where feedback is less surprised than the baseline (better), orange where more."""
    alpha = min(1.0, abs(delta) / bound) * 0.6 if bound > 0 else 0.0
    return f"rgba(33, 102, 172, {alpha:.2f})" if delta < 0 else f"rgba(224, 130, 20, {alpha:.2f})"


def surprise_html(detail: dict) -> str:
    """The scored text coloured by per-token NLL difference (feedback − baseline), each token with a
    detail card; the first token is shown but not scored (nothing predicts it)."""
    if "feedback_nll" not in detail:
        return ""
    diffs = [f - b for f, b in zip(detail["feedback_nll"], detail["baseline_nll"])]
    bound = float(np.percentile(np.abs(diffs), 95)) if diffs else 0.0
    first = detail.get("first_token", "")
    first_card = [("first token", "not scored: nothing predicts it")]
    spans = (
        [
            f'<span class="fl-tok fl-first" tabindex="0" '
            f"{render.card_attr(render.visible(first), first_card)}>"
            f"{escape(first, quote=True)}</span>"
        ]
        if first
        else []
    )
    for tok, d, b, f in zip(detail["tokens"], diffs, detail["baseline_nll"], detail["feedback_nll"]):
        rows = [
            ("NLL baseline", f"{b:.3f}"),
            ("NLL feedback", f"{f:.3f}"),
            ("Δ (feedback − baseline)", f"{d:+.3f} nats"),
        ]
        spans.append(
            f'<span class="fl-tok" tabindex="-1" style="background-color: {surprise_color(d, bound)}" '
            f"{render.card_attr(render.visible(tok), rows)}>{escape(tok, quote=True)}</span>"
        )
    legend = (
        f'<div class="fl-legend"><span class="fl-swatch" style="background:{surprise_color(-1, 1)}"></span>'
        f'feedback less surprised (better)<span class="fl-swatch" style="background:{surprise_color(1, 1)}">'
        f"</span>more surprised (worse) · full colour at the 95th percentile of |Δ| · first token not scored"
        f"</div>"
    )
    return f'{legend}<div class="fl-text">{"".join(spans)}</div>'


def delta_legend() -> str:
    return f'<div class="fl-legend">Colours: {escape(DELTA_LEGEND)}.</div>'
