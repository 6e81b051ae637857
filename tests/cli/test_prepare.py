"""`prepare` (feedback/cli/prepare.py): the embedded model converted into the cache, and the fp32
decode kernel built there where the machine can build it."""

from __future__ import annotations

from pathlib import Path

from feedback.core import gemv
from tests.cli.helpers import in_process


def test_prepare_prints_the_cache_folder_and_says_which_decode_kernel():
    out = in_process("prepare")
    assert out.returncode == 0 and Path(out.stdout.strip()).joinpath("model.safetensors").is_file()
    said = "gemv" if gemv.available() else f"oneDNN (gemv: {gemv.why_not()})"
    assert f"fp32 decode kernel: {said}" in out.stderr
