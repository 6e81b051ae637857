"""What a shared server allows one request, declared once for every door.

The page, the Gradio API, the HTTP API and the batch runner read these caps from here: a request
over one is refused the same way wherever it comes in, naming the field. The library's own,
looser limits (a whole run, a local command line) stay beside the config they bound, such as
`records.MAX_NEW_TOKENS_CAP` or `deepthink.MAX_TRACES`; each cap here sits under its limit.
"""
from __future__ import annotations

from feedback.core.bounds import Bound

# A run's length: shared servers bound how long one visitor holds the model.
SERVED_MAX_NEW_TOKENS = 1024
MAX_NEW_TOKENS = Bound("max new tokens", 1, SERVED_MAX_NEW_TOKENS, integer=True)
# Deep Think and calibration: traces (and warm-up traces) per side, and each trace's length.
SERVED_MAX_TRACES = 16
TRACES = Bound("traces per side", 1, SERVED_MAX_TRACES, integer=True)
WARMUP_TRACES = Bound("warm-up traces", 1, SERVED_MAX_TRACES, integer=True)
SERVED_TRACE_MAX_NEW_TOKENS = 512
TRACE_MAX_NEW_TOKENS = Bound("max new tokens", 1, SERVED_TRACE_MAX_NEW_TOKENS, integer=True)
# Perplexity, sweeps and tuning on the page.
SERVED_TEXT_MAX_CHARS = 200_000  # pasted text (page) and request text (API)
SERVED_MAX_DOCS = 40  # documents per request: a whole built-in split is 39-40
MAX_DOCS = Bound("max documents", 1, SERVED_MAX_DOCS, integer=True)
SERVED_MAX_POINTS = 24  # sweep grid points per request
SERVED_MAX_TRIALS = 24  # tuning trials per request
TRIALS = Bound("trials", 1, SERVED_MAX_TRIALS, integer=True)
UPLOAD_MAX_BYTES = 5_000_000  # a file given to the page; Gradio refuses larger ones before writing them
# The HTTP API.
MAX_MESSAGES = 200  # earlier turns of one row's conversation
MAX_BODY_BYTES = 1_000_000  # a request body; larger ones are refused while they are read
