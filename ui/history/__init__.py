"""The History tab (`tab`): this browser's Compare runs (stored by `ui.page.history`) listed, edited,
reloaded into Compare and exported."""
