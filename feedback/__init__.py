"""Feedback Lens: compare a baseline decode with an activation-feedback decode of one model."""

import os

# libgomp reads its wait policy once, when torch first loads. Its default lets idle threads
# busy-wait, which on a CPU shared with other processes (a Space's free tier, a busy laptop) ran a
# 2-thread decode 3-13x slower than PASSIVE; set OMP_WAIT_POLICY yourself to choose otherwise.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

from feedback.errors import FeedbackError  # noqa: E402

# Data the library and the page read at run time (the example prompts, the built-in questions),
# installed with the package.
ASSETS = Path(__file__).resolve().parent / "assets"

__all__ = ["ASSETS", "FeedbackError"]
__version__ = "0.1.0"
