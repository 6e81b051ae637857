"""Every message the page shows in a toast, as plain text, and what kind of answer it is.

Gradio renders a toast's message as HTML: it strips scripts and `on*` handlers but keeps images,
links and headings, so a refusal that quotes a value from a link, a saved run or an upload (a
strategy name, a column name) could draw whatever that value holds. Every toast therefore goes
through this module, which escapes its text: what a caller sent is shown as the characters it
sent, never as markup.

The toast's title also says what kind of answer it is, for the routes that answer with an HTTP
status (`/gradio_api/run/...`, see `ui.page.server.DirectCalls`): a refusal of the caller's input is
`REFUSED` (422), a full line `BUSY` (503 with Retry-After), anything else a failure (500).
"""

from __future__ import annotations

import logging

import gradio as gr

from feedback.serve.gate import Busy

log = logging.getLogger("feedback_lens.ui")

REFUSED = "Not accepted"
BUSY = "Busy"
FAILED = "Error"  # Gradio's own title: what a crash or an unexpected exception gets


def plain(text) -> str:
    """`text` as HTML that shows exactly its characters. Only `&` and `<` are escaped: without them
    no tag or entity can start in element text, and a program reading the same message (a Gradio
    API client gets it as it is) still reads "top_p must be > 0" as written."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;")


def refusal(message) -> gr.Error:
    """A refused request: the message as plain text, one line in the log, no traceback. A full
    model line (`Busy`) is titled so that its HTTP answer is a 503 with Retry-After."""
    log.info("refused: %s", message)
    return gr.Error(
        plain(message), title=BUSY if isinstance(message, Busy) else REFUSED, print_exception=False
    )


def failure(message) -> gr.Error:
    """Work that failed on the server's side (logged with its traceback where it happened)."""
    return gr.Error(plain(message), title=FAILED, print_exception=False)


def warning(message) -> None:
    """A warning toast (the request went on, or the page kept what it had). Gradio delivers toasts
    through its queue: an event wired with queue=False would only log it."""
    gr.Warning(plain(message))


def info(message) -> None:
    """A passing note, for what the status line cannot say because a running job is writing it."""
    gr.Info(plain(message))
