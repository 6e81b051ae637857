"""The one exception type for user errors: shown as a one-line message, never a traceback."""


class FeedbackError(ValueError):
    """Bad input or an unusable environment, explained in words a user can act on."""
