"""Evaluation texts: the built-in corpus (CPython's Python Language Reference topics, with a fixed
dev/test split by topic name), a .txt file, a JSONL file with a `text` field, or a folder of .txt."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from feedback.errors import FeedbackError

MAX_FILE_BYTES = 50_000_000


@dataclass
class Document:
    name: str
    text: str


def split_of(topic: str) -> str:
    """'dev' or 'test' for a built-in topic: a stable hash of its name, half each way."""
    return "dev" if hashlib.sha256(topic.encode()).digest()[0] % 2 == 0 else "test"


def builtin(split: str) -> list[Document]:
    """Topics of `pydoc_data.topics` (shipped with CPython, so on every machine), loaded at run time."""
    if split not in ("dev", "test"):
        raise FeedbackError(f"built-in corpus split must be dev or test, got {split!r}")
    from pydoc_data.topics import topics

    return [Document(name, text.strip()) for name, text in sorted(topics.items()) if split_of(name) == split]


def _read(path: Path) -> str:
    if path.stat().st_size > MAX_FILE_BYTES:
        raise FeedbackError(f"{path} is larger than {MAX_FILE_BYTES // 1_000_000} MB")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise FeedbackError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def read_jsonl(path: Path, warn=print) -> list[Document]:
    """Documents from the `text` field of each line; bad lines are reported with their number and skipped."""
    docs = []
    for number, line in enumerate(_read(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            warn(f"{path}:{number}: skipped, not valid JSON ({exc.msg})")
            continue
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str) or not text.strip():
            warn(f"{path}:{number}: skipped, no non-empty string field 'text'")
            continue
        docs.append(Document(str(record.get("id", f"line{number}")), text))
    return docs


def load(spec: str, warn=print) -> list[Document]:
    """`builtin:dev`, `builtin:test`, a .txt file, a .jsonl file, or a folder of .txt files."""
    if spec.startswith("builtin:"):
        return builtin(spec.split(":", 1)[1])
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise FeedbackError(f"folder {spec} has no .txt files")
        docs = [Document(f.name, _read(f)) for f in files]
    elif path.is_file():
        docs = read_jsonl(path, warn) if path.suffix == ".jsonl" else [Document(path.name, _read(path))]
    else:
        raise FeedbackError(f"no such file or folder: {spec}")
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise FeedbackError(f"{spec} holds no usable text")
    return docs


def fingerprint(docs: list[Document]) -> str:
    """A short hash of the documents' names and texts, to tell corpora apart in results."""
    h = hashlib.sha256()
    for d in docs:
        h.update(d.name.encode() + b"\0" + d.text.encode() + b"\0")
    return h.hexdigest()[:16]
