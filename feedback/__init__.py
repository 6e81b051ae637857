"""Feedback Lens: compare a baseline decode with an activation-feedback decode of one model."""
from feedback.errors import FeedbackError

__all__ = ["FeedbackError"]
__version__ = "0.1.0"
