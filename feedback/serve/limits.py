"""What a shared server allows one request, declared once for every door.

The page, the Gradio API, the HTTP API and the batch runner read these caps from here: a request
over one is refused the same way wherever it comes in, naming the field. The library's own,
looser limits (a whole run, a local command line) stay beside the config they bound, such as
`records.MAX_NEW_TOKENS_CAP` or `deepthink.MAX_TRACES`; each cap here sits under its limit.
"""
from __future__ import annotations

from feedback.core.bounds import Bound
from feedback.eval.perplexity import BOOTSTRAP, MIN_WINDOW

# A run's length: shared servers bound how long one visitor holds the model.
SERVED_MAX_NEW_TOKENS = 1024
MAX_NEW_TOKENS = Bound("max new tokens", 1, SERVED_MAX_NEW_TOKENS, integer=True)
BOX_MAX_CHARS = 20_000  # a prompt, system prompt or follow-up typed into the page
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
API_MAX_WAITING = 8  # API requests allowed to wait for the model at once; more get 503
API_WAIT_S = 300.0  # the longest an API request waits for the model before a 503
SERVED_MAX_ROWS = 8  # rows of one run (the library allows records.MAX_ROWS)
NAME_MAX_CHARS = 64  # a row's name, a run id
MAX_PARAMS = 32  # strategy parameters of one row or request
SHORT_TEXT_MAX_CHARS = 1000  # one key fact; the text a branch forces
SMALL_SEED = Bound("seed", 0, 2**31, integer=True)  # a row's seed offset; a perplexity request's bootstrap seed
# Perplexity requests: the window, stride and chunk (the model's context caps them anyway) and the
# bootstrap, whose library limit is far above what one request needs.
SERVED_MAX_WINDOW = 1_000_000
PPL_WINDOW = Bound("window", MIN_WINDOW, SERVED_MAX_WINDOW, integer=True)
PPL_STRIDE = Bound("stride", 1, SERVED_MAX_WINDOW, integer=True)
PPL_CHUNK = Bound("chunk", 1, SERVED_MAX_WINDOW, integer=True)
SERVED_MAX_BOOTSTRAP = 10_000
PPL_BOOTSTRAP = BOOTSTRAP.with_hi(SERVED_MAX_BOOTSTRAP)
