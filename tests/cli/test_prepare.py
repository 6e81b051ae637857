"""`prepare` (feedback/cli/prepare.py): the embedded model converted into the cache."""

from __future__ import annotations

from pathlib import Path

from tests.cli.helpers import in_process


def test_prepare_prints_the_cache_folder():
    out = in_process("prepare")
    assert out.returncode == 0 and Path(out.stdout.strip()).joinpath("model.safetensors").is_file()
