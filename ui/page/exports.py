"""Files the page offers for download (history and sweep exports): one folder of this app, a
readable name per file, and nothing kept longer than an hour."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

EXPORTS = Path(tempfile.gettempdir()) / "feedback-lens-exports"
KEEP_S = 3600


def export_file(name: str, text: str) -> str:
    """Write `text` as `name` (each export in its own subfolder, so names stay readable and never
    collide); exports older than KEEP_S seconds are removed on the way. Returns the path."""
    EXPORTS.mkdir(exist_ok=True)
    cutoff = time.time() - KEEP_S
    for old in EXPORTS.glob("*/*"):
        try:
            if old.stat().st_mtime < cutoff:
                old.unlink()
                old.parent.rmdir()
        except OSError:  # another request removed it first, or the folder holds something else
            pass
    out = Path(tempfile.mkdtemp(dir=EXPORTS)) / name
    out.write_text(text, encoding="utf-8")
    return str(out)


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
