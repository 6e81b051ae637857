"""Shareable links: a Compare configuration (prompts, sampling, seed, DeepConf, evaluation, and the
columns with every column setting of `ui.page.settings`) and the token view (a diff is shared as
a diff) packed into the page URL, and read back when the page opens.

The data is compact JSON, deflated and base64url-encoded (`?cfg=…`). Nothing in a link is trusted:
reading one rebuilds a `RunConfig` and validates it like any request, so a tampered or truncated
link is refused with a message and the page keeps its defaults. Earlier conversation turns and
forced prefixes are not part of a link: it restores the controls of a fresh run.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib

from feedback.core.records import RowSpec, RunConfig
from feedback.errors import FeedbackError
from ui.page.settings import ROW_FIELDS, TOKEN_VIEWS  # ROW_FIELDS: what a link keeps of each row

PARAM = "cfg"
VERSION = 1
MAX_LINK_CHARS = 8_000  # servers and chat apps cut longer URLs; export JSON for bigger setups
MAX_INFLATED = 200_000  # a link can never expand into more than this (deflate bombs)


def _compact(cfg: RunConfig, view: str) -> dict:
    data = cfg.to_dict()
    data["rows"] = [
        {k: v for k, v in row.items() if k in ROW_FIELDS and v not in (None, {})} for row in data["rows"]
    ]
    data.pop("dtype", None)
    packed = {"v": VERSION, "config": data}
    if view != TOKEN_VIEWS[0]:  # the usual view goes without saying (older links have none)
        packed["view"] = view
    return packed


def encode(cfg: RunConfig, view: str = TOKEN_VIEWS[0]) -> str:
    """The link data of a (validated) config and token view; refused when it would make a URL too
    long to share."""
    if view not in TOKEN_VIEWS:
        raise FeedbackError(f"token view must be one of {', '.join(TOKEN_VIEWS)}, got {view!r}")
    raw = json.dumps(_compact(cfg, view), separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text = base64.urlsafe_b64encode(zlib.compress(raw, 9)).decode("ascii").rstrip("=")
    if len(text) > MAX_LINK_CHARS:
        raise FeedbackError(
            f"this setup is too large for a link ({len(text)} characters, at most "
            f"{MAX_LINK_CHARS}); export the run as JSON from History instead"
        )
    return text


def decode(text: str) -> RunConfig:
    """The config in a link, validated; a clear FeedbackError for anything else."""
    return opened(text)[0]


def opened(text: str) -> tuple[RunConfig, str]:
    """The config (validated) and token view in a link; a clear FeedbackError for anything else."""
    if not isinstance(text, str) or not text or len(text) > MAX_LINK_CHARS:
        raise FeedbackError("the link's settings are missing or too long")
    try:
        packed = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        inflater = zlib.decompressobj()
        raw = inflater.decompress(packed, MAX_INFLATED)
        if inflater.unconsumed_tail:
            raise FeedbackError("the link's settings are too large")
        if not inflater.eof or inflater.unused_data:  # cut short, or something appended
            raise ValueError("incomplete")
        data = json.loads(raw.decode("utf-8"))
    except (binascii.Error, ValueError, zlib.error, UnicodeDecodeError):
        raise FeedbackError("the link's settings could not be read (was the link cut or changed?)") from None
    if not isinstance(data, dict) or data.get("v") != VERSION or not isinstance(data.get("config"), dict):
        raise FeedbackError("the link's settings are not from this version of Feedback Lens")
    config = data["config"]
    rows = config.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and set(r) <= set(ROW_FIELDS) for r in rows):
        raise FeedbackError("the link's columns could not be read")
    view = data.get("view", TOKEN_VIEWS[0])
    if view not in TOKEN_VIEWS:
        raise FeedbackError(
            f"the link's token view {str(view)[:40]!r} is not one of {', '.join(TOKEN_VIEWS)}"
        )
    try:
        cfg = RunConfig.from_dict({k: v for k, v in config.items() if k != "rows"})
        cfg.rows = [RowSpec(**r) for r in rows]
        return cfg.validate(), view
    except TypeError as exc:
        raise FeedbackError(f"the link's settings could not be read: {exc}") from None
